"""A mixture of experts' shared experts (`model.n_shared_experts`), ungated (DeepSeek's) and gated per token
(`model.shared_expert_gate`, Qwen2-MoE's), against their formula written out here in numpy: the routed experts'
weighted SwiGLUs plus one SwiGLU n_shared_experts · d_expert wide that every token passes, weighed by
sigmoid(x · w) where gated. transformers' Qwen2-MoE checks the gated one too: test_hf_moe.py."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshpar.errors import InputError
from models.transformer import MoE, TransformerConfig

CFG = TransformerConfig(d_model=16, n_heads=2, n_kv_heads=2, n_experts=4, experts_per_token=2, d_expert=8,
                        n_shared_experts=1)


def silu(x):
    return x / (1 + np.exp(-x))


def swiglu(x_nD, w_gate_DF, w_up_DF, w_down_FD):
    return (silu(x_nD @ w_gate_DF) * (x_nD @ w_up_DF)) @ w_down_FD


def moe_by_formula(x_nD, w: dict, cfg: TransformerConfig) -> tuple[np.ndarray, np.ndarray]:
    """(the layer's output, its shared experts' part) for tokens x [n, D], in float64: each token's top-k
    experts by the router's softmax, weighed by their probabilities (renormalised over the k, as cfg says)."""
    logits_nE = x_nD @ w["w_router_DE"]
    probs_nE = np.exp(logits_nE - logits_nE.max(-1, keepdims=True))
    probs_nE /= probs_nE.sum(-1, keepdims=True)
    top_nk = np.argsort(-probs_nE, axis=-1)[:, :cfg.experts_per_token]
    weights_nk = np.take_along_axis(probs_nE, top_nk, -1)
    if cfg.norm_topk_prob:
        weights_nk /= weights_nk.sum(-1, keepdims=True)
    routed_nD = np.stack([sum(weight * swiglu(x_D, w["w_gate_EDF"][e], w["w_up_EDF"][e], w["w_down_EFD"][e])
                              for e, weight in zip(top_nk[i], weights_nk[i])) for i, x_D in enumerate(x_nD)])
    shared_nD = swiglu(x_nD, w["w_gate_DF"], w["w_up_DF"], w["w_down_FD"])
    if cfg.shared_expert_gate:
        shared_nD = shared_nD / (1 + np.exp(-(x_nD @ w["w_shared_gate_D1"])))
    return routed_nD + shared_nD, shared_nD


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, n_shared_experts=2, shared_expert_gate=True,
                                                          norm_topk_prob=False)], ids=["ungated", "gated"])
def test_shared_experts_are_their_formula(cfg):
    with nnx.use_eager_sharding(False):  # one device: no mesh to lay the parameters out on
        layer = MoE(cfg, jnp.float32, nnx.Rngs(0))
    x_BTD = np.random.default_rng(0).standard_normal((2, 8, cfg.d_model)).astype(np.float32)
    y_BTD, _ = nnx.jit(lambda layer, x_BTD: layer(x_BTD))(layer, jnp.asarray(x_BTD))
    weights = {path[-1]: np.asarray(v.get_value(), np.float64) for path, v in nnx.to_flat_state(nnx.state(layer))}
    assert weights["w_gate_DF"].shape == (cfg.d_model, cfg.n_shared_experts * cfg.d_expert)
    expected, shared = moe_by_formula(x_BTD.reshape(-1, cfg.d_model).astype(np.float64), weights, cfg)
    assert np.abs(shared).max() > 0.1 * np.abs(expected).max()  # the shared experts weigh in: the check can fail
    np.testing.assert_allclose(np.asarray(y_BTD).reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)


def test_a_gate_without_shared_experts_is_refused():
    with pytest.raises(InputError, match=r"model.shared_expert_gate = true gates the shared experts: it needs "
                                         r"model.n_experts and model.n_shared_experts > 0 \(they are 4 and 0\)"):
        dataclasses.replace(CFG, n_shared_experts=0, shared_expert_gate=True)
