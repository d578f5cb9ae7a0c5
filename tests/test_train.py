"""DP, FSDP and hybrid layouts against the one-device run: same init, loss, gradients and losses over
10 steps (TP, SP, CP and PP meshes too, and bfloat16 on a mesh against bfloat16 on one device); the state
really sharded; the collectives each layout compiles to."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import require_devices
from layouts import MODEL, MeshRun, TRAIN, max_relative_error, param_bytes, shared_run
from meshpar import rules, train

MESHES = ["data=8", "fsdp=8", "data=2,fsdp=4"]


@pytest.fixture(scope="module")
def single():
    return shared_run("single")


@pytest.mark.parametrize("spec", MESHES)
def test_layout_matches_one_device(single, spec):
    require_devices(8)
    layout = shared_run(spec)
    # the same seed gives the same initial weights on every mesh, made there (MeshRun shares one device's)
    born = train.init_state(layout.make_model, layout.tx, layout.sharded, layout.cfg.seed)
    for a, b in zip(jax.tree.leaves(born), jax.tree.leaves(single.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    loss, grads = layout.loss_and_grads()
    ref_loss, ref_grads = single.loss_and_grads()
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    assert max_relative_error(grads, ref_grads) < 1e-5
    np.testing.assert_allclose(layout.losses(10), single.losses(10), rtol=1e-4)


@pytest.mark.parametrize(("spec", "parallel"), [
    ("model=8", rules.ParallelConfig()),
    ("data=2,model=4", rules.ParallelConfig(sequence_parallel=True)),
    ("data=2,sequence=4", rules.ParallelConfig(context_attention="ring")),
    ("stage=2,data=4", rules.ParallelConfig(microbatches=4)),
], ids=["tp", "tp+sp", "cp-ring", "pp"])
def test_ten_steps_match_one_device(single, spec, parallel):
    require_devices(8)
    np.testing.assert_allclose(shared_run(spec, parallel=parallel).losses(10), single.losses(10), rtol=1e-4)


def test_bfloat16_on_a_mesh_matches_bfloat16_on_one_device():
    """The same bf16 program split over data × fsdp × model: only the order of the reductions differs."""
    require_devices(8)
    cfg = dataclasses.replace(TRAIN, compute_dtype="bfloat16")
    one, mesh = shared_run("single", cfg=cfg).losses(10), shared_run("data=2,fsdp=2,model=2", cfg=cfg).losses(10)
    np.testing.assert_allclose(mesh, one, rtol=2e-3)


def test_losses_fall(single):
    losses = single.losses(10)
    assert losses[-1] < losses[0] - 1.0


@pytest.fixture(scope="module")
def compiled_steps():
    require_devices(8)
    layouts = {spec: shared_run(spec) for spec in ("data=8", "fsdp=8")}
    return {spec: (layout, layout.report()) for spec, layout in layouts.items()}


def test_fsdp_state_is_sharded(compiled_steps):
    layout, _ = compiled_steps["fsdp=8"]
    w_gate = layout.state["model"]["blocks"]["mlp"]["w_gate_DF"][...]  # [L, D, F], D over fsdp
    assert w_gate.sharding.shard_shape(w_gate.shape) == (2, 64 // 8, 128)
    assert {shard.data.shape for shard in w_gate.addressable_shards} == {(2, 8, 128)}
    mu = layout.state["opt"]["opt_state"][1][0].mu["blocks"]["mlp"]["w_gate_DF"][...]
    assert mu.sharding.shard_shape(mu.shape) == (2, 8, 128)
    dp_layout, _ = compiled_steps["data=8"]
    dp_w_gate = dp_layout.state["model"]["blocks"]["mlp"]["w_gate_DF"][...]
    assert dp_w_gate.sharding.is_fully_replicated


def test_fsdp_without_remat_keeps_no_gathered_weights_and_no_checkpoint(compiled_steps):
    """remat none, fsdp=8. float32: the weights reach the matmuls as they are (the partitioner gathers
    them), so the layer scan runs with no checkpoint (whose saved values JAX rounds with `reduce-precision`
    ops that XLA:CPU keeps). bfloat16: `sharding.gathered` casts, then gathers, and the policy drops the
    gathered copies. Either way no buffer holds a stack of whole [L, D, F] weights."""
    L, D, F = MODEL.n_layers, MODEL.d_model, MODEL.d_ff
    stacks = [f"{dtype}[{L},{a},{b}]" for dtype in ("f32", "bf16") for a, b in ((D, F), (F, D))]
    f32 = compiled_steps["fsdp=8"][0].step_hlo()
    bf16 = shared_run("fsdp=8", cfg=dataclasses.replace(TRAIN, compute_dtype="bfloat16")).step_hlo()
    assert "/checkpoint/" not in f32 and "reduce-precision" not in f32 and "/checkpoint/" in bf16
    assert not [stack for stack in stacks if stack in f32 or stack in bf16]


def test_fsdp_argument_bytes_are_an_eighth_of_dp(compiled_steps):
    dp = compiled_steps["data=8"][1]["memory_per_device"]["arguments_bytes"]
    fsdp = compiled_steps["fsdp=8"][1]["memory_per_device"]["arguments_bytes"]
    assert abs(fsdp - dp / 8) / (dp / 8) < 0.05


def test_dp_all_reduces_gradients_and_gathers_no_parameters(compiled_steps):
    layout, report = compiled_steps["data=8"]
    collectives = report["collectives"]
    assert "all-gather" not in collectives
    # every gradient is summed over the 8 replicas: at least the parameters' bytes go through all-reduce
    assert collectives["all-reduce"]["bytes"] >= param_bytes(layout)


def test_fsdp_gathers_parameters(compiled_steps):
    layout, report = compiled_steps["fsdp=8"]
    layer_params = nnx.state(layout.state["model"]["blocks"], nnx.Param)
    one_layer_bytes = sum(x.nbytes for x in jax.tree.leaves(layer_params)) // MODEL.n_layers
    gathers = report["collectives"]["all-gather"]
    # each layer's weights are gathered in the forward pass (and again for the backward pass)
    assert gathers["count"] >= MODEL.n_layers
    assert gathers["bytes"] >= MODEL.n_layers * one_layer_bytes


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_clipping_matches_optax(scale):
    """`train.clip_by_global_norm` is optax's: the gradients as they are under the threshold, rescaled to
    norm `max_norm` above it (to rounding)."""
    grads = {"a": np.arange(1.0, 7.0, dtype=np.float32).reshape(2, 3), "b": np.full(4, -0.5, np.float32)}
    max_norm = scale * float(np.sqrt(sum(np.sum(g * g) for g in grads.values())))
    ours, _ = train.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
    theirs, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
    for name in grads:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-6)
    if scale > 1:
        assert all(np.array_equal(ours[name], grads[name]) for name in grads)


def test_clipping_costs_no_pass_over_the_gradients(compiled_steps, monkeypatch):
    """data=8: clipping by a multiply with `clip_scale` fuses into AdamW's update; with optax's select the
    compiler writes the clipped gradients out and reads them back: twice the parameters' bytes at least."""
    layout, _ = compiled_steps["data=8"]
    monkeypatch.setattr(train, "clip_by_global_norm", optax.clip_by_global_norm)
    with_optax = MeshRun("data=8")  # built under the monkeypatch: not the shared one
    bytes_accessed = lambda lay: lay.compiled_step[0].cost_analysis()["bytes accessed"]
    assert bytes_accessed(with_optax) - bytes_accessed(layout) >= 2 * param_bytes(layout)
