"""DeepSeek-V3's architecture from Hugging Face (`deepseek_v3`) ↔ meshpar: latent attention (a low-rank query,
the kv latent, a rotary key shared by the heads in DeepSeek's interleaved layout, YaRN with mscale), sigmoid
routing limited to groups with the selection bias and the routed scaling, an ungated shared expert, and a
dense first layer (`layer_prefix`); and GLM-4.5's (`glm4_moe`: that mixture with GQA attention, q/k/v biases,
q/k norms and rotary positions on half of each head). Imported weights give transformers' logits on one
device and on an expert × FSDP × tensor mesh, DeepSeek's also under ring context parallelism with tensor
parallelism (float32, relative 1e-5); greedy generation through the latent cache, absorbed, gives
transformers' tokens; the exports hold the tensors they read and load in transformers with the same logits.

Measured here (max |meshpar − transformers| / max |transformers|, printed by the tests): deepseek_v3 1.9e-6 on one
device and on expert=2,fsdp=2,model=2, 2.2e-6 on sequence=2,model=2 (ring); glm4_moe 7.3e-7 / 9.9e-7; the
exports' tensors are the imported ones bit for bit. Trained 20 steps from the same weights on the same batches as
the PyTorch AdamW loop, worst relative loss difference 3.2e-7 on expert=2,fsdp=2,model=2 and 3.5e-7 on GPipe
stage=2,expert=2 (the dense first layer before the pipeline: `meshpar.layers`)."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from hf_reference import SMALL, call
from models import hf
from meshpar.errors import InputError
from models.transformer import LayerKind, Transformer, TransformerConfig
from meshpar import generate, rules as rules_lib
from test_hf import RULES, TOKENS_BT, build_mesh, hf_logits, meshpar_logits, relative_error
from test_hf_training import STEPS, SETTINGS, TRAIN, batches, meshpar_losses

# 3 layers, the first dense; 8 experts in 4 groups, a token's 2 chosen among the best 2 groups; heads of 16 + 8
# (rope) query/key dims and 12 value dims; YaRN over an original context of 16 with mscale_all_dim ≠ mscale,
# so the rotary factor and the softmax scale both differ from 1
DEEPSEEK = {**SMALL, "num_hidden_layers": 3, "num_key_value_heads": 4, "first_k_dense_replace": 1,
            "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
            "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "mscale": 0.8,
                                "mscale_all_dim": 0.6, "original_max_position_embeddings": 16}}


# GLM-4.5's: that mixture (2 groups, the best one's experts), GQA with q/k/v biases, q/k norms, half of each
# 32-wide head rotating
GLM4_MOE = {**SMALL, "num_hidden_layers": 3, "head_dim": 32, "first_k_dense_replace": 1, "n_routed_experts": 8,
            "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "n_shared_experts": 1, "routed_scaling_factor": 1.5, "attention_bias": True, "use_qk_norm": True}
CONFIGS = {"deepseek_v3": DEEPSEEK, "glm4_moe": GLM4_MOE}


def checkpoint(factory, model_type: str) -> tuple[str, np.ndarray]:
    """(checkpoint directory, transformers' logits) of a small random `model_type` model."""
    directory = str(factory.mktemp(model_type))
    call("save_random", directory, model_type, CONFIGS[model_type], 0)
    return directory, hf_logits(directory)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return checkpoint(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    return checkpoint(tmp_path_factory, request.param)


def test_config_reads_deepseeks_architecture(deepseek):
    cfg = hf.load_config(deepseek[0])
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.head_size, cfg.v_head_dim) == (16, 24, 24, 12)
    assert (cfg.router_score, cfg.selection_bias, cfg.expert_groups, cfg.topk_groups) == ("sigmoid", True, 4, 2)
    assert (cfg.routed_scaling, cfg.n_shared_experts, cfg.shared_expert_gate) == (2.5, 1, False)
    assert [k.dense for k in cfg.layer_prefix] == [True] and cfg.periods == 2
    mscale = lambda m: 0.1 * m * np.log(4.0) + 1  # YaRN's, for factor 4
    assert cfg.rope_scaling.attention_factor == pytest.approx(mscale(0.8) / mscale(0.6))
    assert cfg.query_scale == pytest.approx(24 / mscale(0.6) ** 4)


def test_config_reads_glm_4_5s_architecture(tmp_path):
    cfg = hf.config_from_hf(call("hf_config", "glm4_moe", GLM4_MOE))
    assert (cfg.kv_lora_rank, cfg.qkv_bias, cfg.qk_norm, cfg.rotary_dims) == (0, True, True, 16)
    assert (cfg.router_score, cfg.selection_bias, cfg.expert_groups, cfg.topk_groups) == ("sigmoid", True, 2, 1)
    assert [k.dense for k in cfg.layer_prefix] == [True] and hf.config_from_hf(hf.config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("spec", ["", "expert=2,fsdp=2,model=2"], ids=["one-device", "expert+fsdp+tp"])
def test_imported_logits_match_transformers(family, spec):
    error, params, cfg = imported_error(*family, spec)
    assert error < 1e-5
    if not spec and cfg.rotary_dims:  # GLM: half of each head rotates; all of it is far off
        assert relative_error(meshpar_logits(params, dataclasses.replace(cfg, rotary_dims=0), build_mesh("")),
                              family[1]) > 1e-3


def imported_error(directory: str, reference: np.ndarray, spec: str):
    """(the relative error of the logits meshpar computes on `spec` with the weights in `directory`, those
    weights, their config)."""
    mesh, cfg = build_mesh(spec), hf.load_config(directory)
    params = hf.import_params(directory, cfg, mesh, RULES)
    error = relative_error(meshpar_logits(params, cfg, mesh), reference)
    print(f"{json.loads((Path(directory) / 'config.json').read_text())['model_type']} on {spec or 'one device'}: "
          f"max relative logits difference {error:.2e}")
    return error, params, cfg


def test_ring_attention_with_tensor_parallelism_matches_transformers(deepseek):
    assert imported_error(*deepseek, "sequence=2,model=2")[0] < 1e-5


def test_what_shapes_deepseeks_logits(deepseek):
    """The rope layout, the softmax's mscale, the groups, the routed scaling and the selection bias: each
    changed, the logits are far off."""
    directory, reference = deepseek
    _, params, cfg = imported_error(directory, reference, "")
    mesh = build_mesh("")
    flat = params["blocks"]["attn"]["wkv_a_DA"]
    saved = flat[...]
    flat.set_value(jnp.concatenate([saved[..., :16], saved[..., 16:].reshape(*saved.shape[:-1], 2, 4)
                                    .swapaxes(-1, -2).reshape(saved.shape[:-1] + (8,))], -1))
    assert relative_error(meshpar_logits(params, cfg, mesh), reference) > 1e-3  # pairs left interleaved
    flat.set_value(saved)
    for change in ({"query_scale": 0.0}, {"topk_groups": 4}, {"routed_scaling": 1.0}):
        assert relative_error(meshpar_logits(params, dataclasses.replace(cfg, **change), mesh),
                              reference) > 1e-3, change
    bias = params["blocks"]["mlp"]["selection_bias_E"]
    bias.set_value(jnp.zeros_like(bias[...]))
    assert relative_error(meshpar_logits(params, cfg, mesh), reference) > 1e-3


def test_greedy_generation_through_the_latent_cache(deepseek):
    """The cache holds a latent and a rotary key per token (not heads × widths), and decoding with the
    up-projections absorbed continues prompts token for token as transformers' greedy generate."""
    directory, _ = deepseek
    mesh, cfg = build_mesh("expert=2,model=2"), hf.load_config(directory)
    model = nnx.merge(Transformer.abstract(cfg)[0], hf.import_params(directory, cfg, mesh, RULES))
    (_, k_LBSKH), (_, v_LBSKH) = model.init_cache(2, 18)  # the dense prefix's, the stack's
    assert k_LBSKH.shape == (2, 2, 18, 1, 16) and v_LBSKH.shape == (2, 2, 18, 1, 8)
    prompt_BT = TOKENS_BT[:2, :6]
    expected = call("greedy", directory, prompt_BT.tolist(), 12)
    np.testing.assert_array_equal(generate.generate(model, prompt_BT, 12, mesh, RULES), expected)


def test_export_loads_in_transformers_with_the_same_logits(family, tmp_path):
    directory, reference = family
    mesh, cfg = build_mesh(""), hf.load_config(directory)
    hf.export(hf.import_params(directory, cfg, mesh, RULES), cfg, tmp_path)
    theirs, ours = load_file(Path(directory) / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in theirs:  # the rope rows interleaved again, the fused latent and kv expansions as they were
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    written, read = (json.loads((Path(d) / "config.json").read_text()) for d in (tmp_path, directory))
    assert [written[k] for k in ("model_type", "first_k_dense_replace", "n_group")] == \
        [read[k] for k in ("model_type", "first_k_dense_replace", "n_group")]
    assert hf.load_config(tmp_path) == cfg
    assert relative_error(hf_logits(tmp_path), reference) == 0.0


def test_fp8_block_weights_are_dequantised_on_import(tmp_path):
    """DeepSeek's FP8 checkpoint (e4m3 weights, one scale per 16 × 16 block here, ragged at the edges): each
    device reads its blocks, dequantised to exactly transformers' weights, and the logits are transformers'
    on an expert × FSDP × tensor mesh."""
    directory, quantised = str(tmp_path / "float32"), str(tmp_path / "fp8")
    call("save_random", directory, "deepseek_v3", DEEPSEEK, 1)
    call("save_fp8_blocks", directory, quantised, 16)
    mesh, cfg = build_mesh("expert=2,fsdp=2,model=2"), hf.load_config(quantised)
    assert cfg == hf.load_config(directory)
    ours, theirs = (hf.import_params(d, cfg, mesh, RULES) for d in (quantised, directory))
    for (path, a), (_, b) in zip(nnx.to_flat_state(ours), nnx.to_flat_state(theirs)):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    assert relative_error(meshpar_logits(ours, cfg, mesh), hf_logits(directory)) < 1e-5


# transformers trains DeepSeek-V3 with no balancing loss and its selection bias fixed (a buffer): so does meshpar here
DEEPSEEK_TRAIN = dataclasses.replace(TRAIN, router_aux_loss_coef=0.0, router_bias_update_rate=0.0)


@pytest.mark.slow  # 20-step PyTorch training comparisons: `make test-slow`, as test_hf_training.py's
@pytest.mark.parametrize(("spec", "parallel"), [
    pytest.param("expert=2,fsdp=2,model=2", rules_lib.ParallelConfig(), id="expert+fsdp+tp"),
    pytest.param("stage=2,expert=2", rules_lib.ParallelConfig(microbatches=2), id="gpipe+expert"),
])
def test_training_matches_transformers_step_for_step(deepseek, spec, parallel):
    """STEPS steps of the imported DeepSeek-V3 (latent attention, grouped sigmoid routing, the dense first layer)
    trained by meshpar and by the PyTorch AdamW loop on the same batches: the same loss at every step."""
    directory, _ = deepseek
    tokens = batches(DEEPSEEK["vocab_size"])
    reference = np.asarray(call("train_losses", directory, tokens.tolist(), SETTINGS))
    losses = meshpar_losses(directory, tokens, spec, parallel, cfg=DEEPSEEK_TRAIN)
    relative = np.abs(losses - reference) / np.abs(reference)
    print(f"deepseek_v3 on {spec}: loss {reference[0]:.4f} → {reference[-1]:.4f} over {STEPS} steps; worst relative "
          f"difference {relative.max():.2e} (step {int(np.argmax(relative))})")
    assert reference[-1] < reference[0] - 0.5
    assert relative.max() < 1e-5, (losses, reference)


def test_a_dense_prefix_in_the_families_that_list_dense_layers():
    """Outside DeepSeek's families a dense `layer_prefix` is written as those layers' numbers (Qwen3-MoE's
    `mlp_only_layers`, the prefix first in the checkpoint's order) and read back as the layers' kinds; a family
    with experts in every layer refuses it by name."""
    moe = TransformerConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, qk_norm=True,
                            n_experts=4, d_expert=16, layer_prefix=(LayerKind(dense=True),))
    written = hf.config_to_hf(moe)
    assert (written["model_type"], written["mlp_only_layers"]) == ("qwen3_moe", [0])
    read = hf.config_from_hf(written)
    assert [k.dense for k in read.kinds] * read.periods == [True, False, False]
    with pytest.raises(InputError, match=r"model\.layer_prefix\[0\]\.dense = true: a mixtral checkpoint"):
        hf.config_to_hf(dataclasses.replace(moe, qk_norm=False), "mixtral")
