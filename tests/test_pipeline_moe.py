"""A mixture of experts under every pipeline schedule, its router losses pooled per microbatch
(`train.router_loss_scope = microbatch`, what 1F1B takes).

The reference is one device without any pipeline and with the router losses pooled over its whole batch
(the default scope): run on each microbatch's rows alone (rows m, M + m, …) and averaged over the
microbatches, it is the loss the pipelines must give, the cross-entropy being a mean over equal rows. Every
schedule runs on `stage=2,expert=2,data=2`: the experts split over `expert`, a microbatch's rows over
`data` and `expert`, so a microbatch's pool spans devices."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import require_devices
from layouts import max_relative_error, shared_run
from meshpar import context, pipeline, rules as rules_lib, train
from meshpar.errors import InputError
from meshpar.moe import routing
from meshpar.pipeline import one_f_one_b
from test_moe import MOE, TOLERANCE, TRAIN

MODEL = dataclasses.replace(MOE, n_layers=4)  # P·R = 4 chunks of one layer
PER_MICROBATCH = dataclasses.replace(TRAIN, router_loss_scope="microbatch")
MESH = "stage=2,expert=2,data=2"


def reference(tokens: np.ndarray, M: int, accumulation: int = 1, model=MODEL) -> tuple[float, nnx.State]:
    """One device's loss and gradients on each pool of rows (accumulation microbatch a: the a-th block of
    rows; pipeline microbatch m of it: rows m, M + m, …), its router losses pooled over them alone, averaged
    over the pools; computed once for the cases that share it."""
    return _reference(np.asarray(tokens, np.int32).tobytes(), tokens.shape, M, accumulation, model)


@functools.cache
def _reference(rows: bytes, shape: tuple[int, int], M: int, accumulation: int, model) -> tuple[float, nnx.State]:
    tokens = np.frombuffer(rows, np.int32).reshape(shape)
    A, B = accumulation, tokens.shape[0]
    cfg = dataclasses.replace(TRAIN, global_batch=B // (A * M))
    single = shared_run("single", cfg, model)
    step = train.loss_and_grads(single.sharded, single.tokens_sharding, cfg)
    blocks = [tokens[a * B // A:(a + 1) * B // A] for a in range(A)]
    outs = [step(single.state, jax.device_put(block[m::M], single.tokens_sharding)) for block in blocks
            for m in range(M)]
    mean = lambda *xs: np.mean([np.asarray(x) for x in xs], axis=0)
    return float(mean(*(loss for loss, _ in outs))), jax.tree.map(mean, *(grads for _, grads in outs))


# (schedule, R, M, mesh, settings): GPipe, the circular schedule, 1F1B, interleaved 1F1B with M = P and 2P;
# interleaved with ring attention (zigzag: a microbatch's pool then spans its positions' devices too), with
# FSDP, and with TP + SP inside each expert. `make test` runs interleaved 1F1B; the slow tier the rest (GPipe
# and zero-bubble with experts also run in `make test`: test_moe's gpipe2-ep2, test_split_backward's moe cases).
FAST = [("1f1b", 2, 4, MESH, {})]
SLOW = [("gpipe", 2, 4, MESH, {}), ("zero_bubble", 2, 4, MESH, {}),
        ("gpipe", 1, 2, MESH, {}), ("1f1b", 1, 2, MESH, {}), ("1f1b", 2, 2, MESH, {}),
        ("1f1b", 2, 2, "stage=2,sequence=2,expert=2", {}),
        ("1f1b", 2, 2, "stage=2,fsdp=2,expert=2", {}),
        ("1f1b", 2, 2, "stage=2,expert=2,model=2", {"sequence_parallel": True}),
        ("zero_bubble", 1, 2, MESH, {}), ("zero_bubble", 2, 2, "stage=2,sequence=2,expert=2", {})]
CASES = [pytest.param(*case, id=f"{case[0]}-R{case[1]}-M{case[2]}-{case[3]}" + "-sp" * bool(case[4]),
                      marks=[pytest.mark.slow] if case in SLOW else []) for case in FAST + SLOW]


@pytest.mark.parametrize("kind,R,M,spec,settings", CASES)
def test_schedules_equal_one_device_pooling_each_microbatch(kind, R, M, spec, settings):
    """Loss and every gradient within 1e-5 of the reference; 1F1B called with its bubbles fed NaN (none reaches
    the loss or a gradient); pooling the whole batch instead is measurably another loss."""
    require_devices(8)
    layout = shared_run(spec, PER_MICROBATCH, MODEL, rules_lib.ParallelConfig(
        microbatches=M, pipeline_schedule=kind, pipeline_repeats=R, **settings))
    tokens = np.asarray(layout.batch(0))
    ref_loss, ref_grads = reference(tokens, M)
    if kind == "gpipe":
        loss, grads = layout.loss_and_grads()
    else:
        def run(state, tokens_BT):
            with context.use(train.compute_context(layout.sharded, PER_MICROBATCH)):
                model = nnx.merge(layout.sharded.graphdef, state).model
                return one_f_one_b.model_loss_and_grads(
                    model, tokens_BT, mesh=layout.mesh, stages=2, microbatches=M, repeats=R, remat="none",
                    aux_coef=TRAIN.router_aux_loss_coef, z_coef=TRAIN.router_z_loss_coef, poison_bubbles=True,
                    zero_bubble=kind == "zero_bubble")[:2]

        loss, grads = jax.jit(run)(layout.state, layout.batch(0))
        loss, grads = float(loss), jax.device_get(pipeline.to_layers(grads, layout.mesh, R))
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(grads))
    assert abs(loss - ref_loss) / ref_loss < TOLERANCE
    assert max_relative_error(grads, ref_grads) < TOLERANCE
    whole_loss, whole_grads = shared_run("single", TRAIN, MODEL).loss_and_grads()
    assert max_relative_error(whole_grads, ref_grads) > 100 * TOLERANCE


@pytest.mark.slow  # 20 s of compiles: `make test-slow`
def test_training_step_with_accumulation_reports_the_pools():
    """Interleaved 1F1B through the training step, `router_loss_scope` left to `auto` (microbatch under 1F1B),
    two accumulation microbatches around it: the loss and gradients of the reference with its pools (the
    accumulation microbatch takes the same block of every batch shard's rows: one device gets them in
    that order), and the step's router metrics are the mean of the pools' losses."""
    require_devices(8)
    cfg, M = dataclasses.replace(TRAIN, grad_accum=2), 2
    layout = shared_run(MESH, cfg, MODEL, rules_lib.ParallelConfig(microbatches=M, pipeline_schedule="1f1b",
                                                                 pipeline_repeats=2))
    shards, A, B = 4, cfg.grad_accum, cfg.global_batch  # data × expert
    b = B // (shards * A)
    order = [s * (B // shards) + a * b + i for a in range(A) for s in range(shards) for i in range(b)]
    ref_loss, ref_grads = reference(np.asarray(layout.batch(0))[order], M, A)
    loss, grads = layout.loss_and_grads()
    assert abs(loss - ref_loss) / ref_loss < TOLERANCE
    assert max_relative_error(grads, ref_grads) < TOLERANCE
    _, metrics = layout.compiled_step[0](jax.tree.map(lambda x: x.copy(), layout.state), layout.batch(0))
    single = shared_run("single", TRAIN, MODEL)
    model = nnx.merge(single.sharded.graphdef, single.state).model
    ordered = np.asarray(layout.batch(0))[order]
    # pipeline microbatch m of each accumulation microbatch (rows m, M + m, … of its block), summed over them
    stats = model.routed_hidden_states(jax.numpy.asarray(ordered[:, :-1]))[1].grouped(M)
    assert float(metrics["router_aux_loss"]) == pytest.approx(float(routing.losses(stats)[0]), rel=1e-5)
    assert float(metrics["router_aux_loss"]) != pytest.approx(float(routing.losses(stats.grouped(1))[0]), rel=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pooling_the_batch_under_1f1b_or_zero_bubble_is_refused(schedule):
    require_devices(8)
    cfg = dataclasses.replace(TRAIN, router_loss_scope="batch")
    layout = shared_run("stage=2,data=4", cfg, MOE, rules_lib.ParallelConfig(pipeline_schedule=schedule))
    with pytest.raises(InputError, match=rf"train.router_loss_scope = batch pools .* over the whole batch, and "
                                         rf"parallel.pipeline_schedule = {schedule} runs a microbatch's backward pass "
                                         rf"before the last one's forward pass: use router_loss_scope=microbatch"):
        layout.loss_and_grads()
    with pytest.raises(InputError, match="train.router_loss_scope = 'layer' is not one of auto, batch, microbatch"):
        train.TrainConfig(router_loss_scope="layer")
