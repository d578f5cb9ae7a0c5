"""Your own model through the public API: a GPT-2-style NNX model (learned positions, LayerNorm, GELU, its own
causal mask, called as `model(tokens)`), nothing of meshpar's transformer, trained with its own optimizer
on DP, FSDP, TP and CP meshes with the same losses and gradients as on one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import require_devices
from layouts import CORPUS, max_relative_error, tokens
from meshpar import mesh as mesh_lib, rules, sharding, train
from meshpar.run import Outputs, run

V, D, N, F, T = 256, 64, 8, 256, 32
CFG = train.TrainConfig(steps=4, global_batch=16, seq_len=T, lr=1e-3, warmup_steps=1)


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...], scale: float = 0.02) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape), out_sharding=names)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        for ln in (self.ln1, self.ln2):  # logical names for the norms' parameters too
            ln.scale.set_metadata(out_sharding=("embed",))
            ln.bias.set_metadata(out_sharding=("embed",))
        self.qkv = param(rngs, (D, 3, N, D // N), ("embed", None, "heads", None))
        self.out = param(rngs, (N, D // N, D), ("heads", None, "embed"))
        self.fc = param(rngs, (D, F), ("embed", "mlp"))
        self.proj = param(rngs, (F, D), ("mlp", "embed"))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        q_BTNH, k_BTNH, v_BTNH = jnp.unstack(jnp.einsum("btd,dcnh->cbtnh", self.ln1(x_BTD), self.qkv[...]))
        scores_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BTNH) / jnp.sqrt(D // N)
        T_ = x_BTD.shape[1]
        causal_TS = jnp.tril(jnp.ones((T_, T_), bool))
        probs_BNTS = jax.nn.softmax(jnp.where(causal_TS, scores_BNTS, -1e30), axis=-1)
        x_BTD = x_BTD + jnp.einsum("bnts,bsnh,nhd->btd", probs_BNTS, v_BTNH, self.out[...])
        return x_BTD + jax.nn.gelu(self.ln2(x_BTD) @ self.fc[...]) @ self.proj[...]


class GPT(nnx.Module):
    """Called as `model(tokens)`: it makes its own positions, so meshpar never reorders its sequence."""

    def __init__(self, rngs: nnx.Rngs):
        self.wte = param(rngs, (V, D), ("vocab", "embed"))
        self.wpe = param(rngs, (T, D), (None, "embed"))
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = param(rngs, (D, V), ("embed", "vocab"))

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        x_BTD = self.wte[...][tokens_BT] + self.wpe[...][: tokens_BT.shape[1]]
        x_BTD = sharding.constrain(x_BTD, ("batch", "seq", "embed"))
        for block in self.blocks:
            x_BTD = block(x_BTD)
        return x_BTD @ self.head[...]


def make_model(rngs: nnx.Rngs) -> GPT:
    return GPT(rngs)


def loss_and_grads(spec: str, parallel: rules.ParallelConfig = rules.ParallelConfig()):
    m = mesh_lib.build(mesh_lib.parse("" if spec == "single" else spec), jax.devices()[:1] if spec == "single" else None)
    r = rules.make(parallel)
    sharded = train.sharded_abstract(make_model, optax.adam(1e-3), m, r)
    state = train.init_state(make_model, optax.adam(1e-3), sharded)
    token_sharding = sharding.batch_sharding(m, r, (CFG.global_batch, T + 1))
    batch = jax.device_put(tokens(0, CFG), token_sharding)
    loss, grads = train.loss_and_grads(sharded, token_sharding, CFG)(state, batch)
    return float(loss), jax.tree.map(np.asarray, grads), sharded


MESHES = {"dp": ("data=8", rules.ParallelConfig()), "fsdp": ("fsdp=8", rules.ParallelConfig()),
          "tp": ("data=2,model=4", rules.ParallelConfig()),
          "cp": ("sequence=2,fsdp=4", rules.ParallelConfig(context_attention="ring"))}


@pytest.fixture(scope="module")
def one_device():
    loss, grads, _ = loss_and_grads("single")
    losses = [r["loss"] for r in run(make_model, CFG, CORPUS, mesh_lib.build(mesh_lib.parse(""), jax.devices()[:1]),
                                     rules.make(), tx=optax.adam(1e-3), outputs=Outputs(progress=False)).records]
    return loss, grads, losses


@pytest.mark.parametrize("name", MESHES)
def test_own_model_matches_one_device(one_device, name):
    require_devices(8)
    spec, parallel = MESHES[name]
    loss, grads, sharded = loss_and_grads(spec, parallel)
    assert abs(loss - one_device[0]) / one_device[0] < 1e-5
    assert max_relative_error(grads, one_device[1]) < 1e-5
    if name == "fsdp":  # its weights are really split: `embed` over fsdp
        assert sharded.shardings["model"]["wte"].get_value().shard_shape((V, D)) == (V, D // 8)
    if name == "tp":  # and its heads, MLP and vocabulary over model
        assert sharded.shardings["model"]["blocks"][0]["qkv"].get_value().shard_shape((D, 3, N, D // N)) == (D, 3, N // 4, D // N)
        assert sharded.shardings["model"]["head"].get_value().shard_shape((D, V)) == (D, V // 4)
    result = run(make_model, CFG, CORPUS, mesh_lib.build(mesh_lib.parse(spec)), rules.make(parallel),
                 tx=optax.adam(1e-3), outputs=Outputs(progress=False))
    np.testing.assert_allclose([r["loss"] for r in result.records], one_device[2], rtol=1e-5)
    assert "lr" not in result.records[0]  # its own optimizer: meshpar does not know its learning rate


def test_a_loss_hook_replaces_cross_entropy():
    """`loss(model, tokens)` is what the step differentiates: twice the default loss gives twice the loss and
    gradients."""
    require_devices(8)
    from meshpar.loss import next_token_loss

    m, r = mesh_lib.build(mesh_lib.parse("fsdp=8")), rules.make()
    sharded = train.sharded_abstract(make_model, optax.adam(1e-3), m, r)
    state = train.init_state(make_model, optax.adam(1e-3), sharded)
    token_sharding = sharding.batch_sharding(m, r, (CFG.global_batch, T + 1))
    batch = jax.device_put(tokens(0, CFG), token_sharding)
    base_loss, base_grads = train.loss_and_grads(sharded, token_sharding, CFG)(state, batch)
    doubled = lambda model, tokens_BT: 2 * next_token_loss(model, tokens_BT)
    loss, grads = train.loss_and_grads(sharded, token_sharding, dataclasses.replace(CFG), loss=doubled)(state, batch)
    assert float(loss) == pytest.approx(2 * float(base_loss), rel=1e-6)
    assert max_relative_error(jax.tree.map(lambda g: g / 2, grads), base_grads) < 1e-6


def test_a_pipeline_needs_stacked_layers():
    require_devices(8)
    with pytest.raises(ValueError, match="mesh axis stage = 2 pipelines a stack of layers, and this model names no "
                                         "'layers' axis"):
        train.sharded_abstract(make_model, optax.adam(1e-3), mesh_lib.build(mesh_lib.parse("stage=2,data=4")), rules.make())
