"""DP, FSDP and hybrid layouts against the one-device run: same init, loss, gradients and losses over
10 steps; the state really sharded; the collectives each layout compiles to."""

import jax
import numpy as np
import pytest
from flax import nnx

from meshpar import analysis, mesh as mesh_lib, rules, sharding, train
from meshpar.data import stdlib_tokens
from models.transformer import Transformer, TransformerConfig
from conftest import require_devices

MODEL = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=128)
TRAIN = train.TrainConfig(steps=10, global_batch=16, seq_len=32, lr=3e-3, warmup_steps=2)
MESHES = ["data=8", "fsdp=8", "data=2,fsdp=4"]
CORPUS = stdlib_tokens(max_bytes=200_000)


def make_model(rngs, model=MODEL, dtype=TRAIN.dtype):
    return Transformer(model, dtype=dtype, rngs=rngs)


class Layout:
    """One mesh: its plan, initial state, token sharding and compiled functions."""

    def __init__(self, spec: str, make=make_model, cfg=TRAIN, table=rules.default()):
        devices = jax.devices()[:1] if spec == "single" else None
        self.mesh = mesh_lib.build(mesh_lib.parse("" if spec == "single" else spec), devices)
        self.tx = train.optimizer(cfg)
        self.plan = train.plan_state(make, self.tx, self.mesh, table)
        self.state = train.init_state(make, self.tx, self.plan)
        self.tokens_sharding = sharding.batch_sharding(self.mesh, table, (cfg.global_batch, cfg.seq_len + 1))

    def tokens(self, step: int) -> jax.Array:
        starts = np.random.default_rng(step).integers(0, len(CORPUS) - TRAIN.seq_len - 1, TRAIN.global_batch)
        rows = np.stack([CORPUS[s:s + TRAIN.seq_len + 1] for s in starts]).astype(np.int32)
        return jax.device_put(rows, self.tokens_sharding)

    def loss_and_grads(self):
        loss, grads = train.loss_and_grads(self.plan, self.tokens_sharding)(self.state, self.tokens(0))
        return float(loss), jax.tree.map(np.asarray, grads)

    def losses(self, steps: int) -> list[float]:
        step = train.make_step(self.plan, self.tokens_sharding)
        state, out = jax.tree.map(lambda x: x.copy(), self.state), []
        for i in range(steps):
            state, metrics = step(state, self.tokens(i))
            out.append(float(metrics["loss"]))
        return out


@pytest.fixture(scope="module")
def single():
    return Layout("single")


def max_relative_error(tree, reference) -> float:
    errors = jax.tree.map(lambda a, b: np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30), tree, reference)
    return max(jax.tree.leaves(errors))


@pytest.mark.parametrize("spec", MESHES)
def test_layout_matches_one_device(single, spec):
    require_devices(8)
    layout = Layout(spec)
    # the same seed gives the same initial weights on every mesh
    for a, b in zip(jax.tree.leaves(layout.state), jax.tree.leaves(single.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    loss, grads = layout.loss_and_grads()
    ref_loss, ref_grads = single.loss_and_grads()
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    assert max_relative_error(grads, ref_grads) < 1e-5
    np.testing.assert_allclose(layout.losses(10), single.losses(10), rtol=1e-4)


def test_losses_fall(single):
    losses = single.losses(10)
    assert losses[-1] < losses[0] - 1.0


@pytest.fixture(scope="module")
def compiled_steps():
    require_devices(8)
    out = {}
    for spec in ("data=8", "fsdp=8"):
        layout = Layout(spec)
        step = train.make_step(layout.plan, layout.tokens_sharding)
        out[spec] = (layout, *analysis.compile_report(step, layout.state, layout.tokens(0)))
    return out


def test_fsdp_state_is_sharded(compiled_steps):
    layout, _, _ = compiled_steps["fsdp=8"]
    w_gate = layout.state["model"]["blocks"]["mlp"]["w_gate_DF"][...]  # [L, D, F], D over fsdp
    assert w_gate.sharding.shard_shape(w_gate.shape) == (2, 64 // 8, 128)
    assert {shard.data.shape for shard in w_gate.addressable_shards} == {(2, 8, 128)}
    mu = layout.state["opt"]["opt_state"][1][0].mu["blocks"]["mlp"]["w_gate_DF"][...]
    assert mu.sharding.shard_shape(mu.shape) == (2, 8, 128)
    dp_layout, _, _ = compiled_steps["data=8"]
    dp_w_gate = dp_layout.state["model"]["blocks"]["mlp"]["w_gate_DF"][...]
    assert dp_w_gate.sharding.is_fully_replicated


def test_fsdp_argument_bytes_are_an_eighth_of_dp(compiled_steps):
    dp = compiled_steps["data=8"][2]["memory_per_device"]["arguments_bytes"]
    fsdp = compiled_steps["fsdp=8"][2]["memory_per_device"]["arguments_bytes"]
    assert abs(fsdp - dp / 8) / (dp / 8) < 0.05


def test_dp_all_reduces_gradients_and_gathers_no_parameters(compiled_steps):
    layout, _, report = compiled_steps["data=8"]
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(layout.state["model"], nnx.Param)))
    collectives = report["collectives"]
    assert "all-gather" not in collectives
    # every gradient is summed over the 8 replicas: at least the parameters' bytes go through all-reduce
    assert collectives["all-reduce"]["bytes"] >= params_bytes


def test_fsdp_gathers_parameters(compiled_steps):
    layout, _, report = compiled_steps["fsdp=8"]
    layer_params = nnx.state(layout.state["model"]["blocks"], nnx.Param)
    one_layer_bytes = sum(x.nbytes for x in jax.tree.leaves(layer_params)) // MODEL.n_layers
    gathers = report["collectives"]["all-gather"]
    # each layer's weights are gathered in the forward pass (and again for the backward pass)
    assert gathers["count"] >= MODEL.n_layers
    assert gathers["bytes"] >= MODEL.n_layers * one_layer_bytes
