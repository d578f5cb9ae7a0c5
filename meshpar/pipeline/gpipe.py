"""Pipeline parallelism, GPipe and circular: the stacked layers split into P stages over the `stage` axis.

Letters: P stages (a multiple of p, the mesh's stage size), M microbatches, R repeats, J = L/(P·R)
layers per stage and repeat, Z batch shards (data × fsdp), b = B/M rows of a microbatch.

What is sharded. The `[L, ...]` layer stack is viewed as `[R, P, J, ...]` and its stage dimension lives on
the `stage` mesh axis: the devices of stage q hold the layers it runs, (r·P + q)·J … (r·P + q + 1)·J − 1
in repeat r (R > 1 is the circular, "interleaved" schedule: each stage holds R chunks of layers and every
microbatch goes round the ring of stages R times). The stack is kept at rest in the order that makes
this view local (`meshpar.pipeline.order`). The batch `[B, T, D]` is split into M microbatches
`[M, b, T, D]`; microbatch m is the rows m, M + m, 2M + m, … so that every microbatch stays split over the
batch mesh axes (data × fsdp) exactly as the batch was, with no movement.

The schedule. One `lax.scan` over n = `schedule.iterations(P, M, R)` iterations. In each, every stage runs
its J layers on the microbatch in front of it — the vmaps over stages and batch shards of
`meshpar.pipeline.stages` — and then the P outputs move one stage on, q → q+1 mod P: ONE
collective-permute (`stages.shift`; its transpose in the backward pass is one too). Stage 0 takes the next
microbatch from an input/output buffer kept on its own devices; what comes round from stage P−1 is
written into the same buffer: the input of the next repeat, and after the last repeat the result. The
backward pass is the scan differentiated (no hand-written backward): the same permutes run in reverse.

Why vmap for the compute and not one shard_map over `stage`: the model's layers are written for GSPMD
(`sharding.constrain`, `sharding.gathered`, Auto axes). Under a vmap with `spmd_axis_name` they run
unchanged — each hint gets `stage` prepended, and batch → (data, fsdp), heads/mlp → model do not clash
with it — so data, FSDP and tensor parallelism compose with the pipeline without manual collectives.
Inside a shard_map `stage` would be manual in every layer and each hint would have to be valid on a
partially manual mesh. Only the shift is manual.

Collectives per step (per device; a = b/Z · T/sequence · D · bytes, one microbatch's activations on one
device; w = one device's share of a weight: the stack / stage / model):

| what                                    | collective                        | count           | bytes each |
|-----------------------------------------|-----------------------------------|-----------------|------------|
| shift between stages, forward           | collective-permute                | n               | a          |
| shift between stages, backward          | collective-permute                | n               | a          |
| result leaves stage 0; x's gradient     | all-reduce over stage             | 1 + 1           | M·a        |
| FSDP: stage weights gathered            | all-gather over fsdp              | 1 / weight      | w          |
| weight gradients over data and fsdp     | all-reduce (CPU) / reduce-scatter | 1 / weight      | w          |
| tensor parallelism, inside the layers   | all-reduce over model             | 4·n·J (*)       | a          |

(*) Megatron's 2 forward + 2 backward per layer (2 more with remat's recompute), in every iteration:
bubble iterations compute, and communicate, too. XLA combines the per-weight all-reduces (and the two
over stage) into one tuple all-reduce each, so the compiled step shows 2 all-reduces without TP.

With FSDP the stage weights are gathered ONCE per step, not once per microbatch: before the scan they
are constrained to their compute layout (split over `stage` and `model`, whole over `fsdp`), so the loop
reads loop-invariant gathered weights, and (per shard) their gradients are reduced once after it. The
price is memory: a stage's weights stay whole over `fsdp` for the step (1/stage of the layers, /model
under TP), and so does their gradient accumulator. Under `parallel.offload = optimizer+params` they are
fetched from host memory at the same place, once per step.

The bubble. Each stage works R·M of the n iterations; the rest it idles (computes on a bubble):
`schedule.bubble_fraction`, (P − 1)/(R·M + P − 1). Naive model parallelism (layers split over devices,
the whole batch at once) is M = 1: (P − 1)/P. Bubble iterations compute on zeros and their outputs are
discarded by selects; `poison_bubbles=True` fills every bubble slot with NaN instead, so a test proves
that no bubble value reaches the result or the gradients. As every iteration computes, a device's matmul
FLOPs are n iterations × J layers on one microbatch, and the bubble shows in the compiled program as
1 − (the unpipelined FLOPs / devices) / (one device's FLOPs) = 1 − R·M/n (the tests measure it).

Memory. The scan stores, per iteration, what the backward pass of one stage step needs: with
`remat="full"` only the stage input (one microbatch per iteration, n in all: the GPipe activation
stash), with `"dots"` also the projections' outputs (`"offload"`: in host memory), with `"none"` every
intermediate. The remat wraps the stage compute only: the bookkeeping around it (slices, selects, the
permute) is linear and stores nothing, so the I/O buffer is never saved per iteration.

With context parallelism. A layer that opens its own `jax.shard_map` — meshpar's attention does when the
sequence is split over `sequence` — runs under these vmaps because the active `Compute` lists the
vmapped mesh axes (`vmapped`): the shard_map is made manual over them too.

When it is worth it. Pipelining sends only a microbatch's activations point to point (b·s·h values per
stage boundary per microbatch, 2 bytes each in bf16) while a stage computes ≈ 24·b·s·h²·J FLOPs on them
(≈ 12h² weights per layer): compute-bound when 12·h·J > FLOP/s ÷ link bandwidth (H100 over 50 GB/s
InfiniBand: ≈ 2·10⁴, so h·J ≳ 1700 — any large model). So it is the strategy for the slowest links
(across nodes), where FSDP's weight gathers and TP's per-layer all-reduces would not hide, and for models
whose layers do not fit one node's memory. Its costs are the bubble (buy it down with M, which costs
activation memory, or with R, which costs R× the permutes) and the microbatch: b rows must still fill the
data-parallel axes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshpar import context, offload, remat as remat_lib
from meshpar.errors import InputError
from meshpar.pipeline import schedule, stages as stages_lib
from meshpar.pipeline.stages import U, constrain


def pipeline(stack: nnx.Module, x_BTD: jax.Array, *args: jax.Array, mesh: Mesh, stages: int, microbatches: int,
             repeats: int = 1, remat: str = "none", poison_bubbles: bool = False) -> jax.Array:
    """Apply the L stacked layers of `stack` to `x_BTD` in order, as a pipeline over the `stage` axis.

    The stack's variables are in the order at rest for this mesh and R (`order.to_rest`; layer order when
    R = 1). The same result as `meshpar.layers.scan` on the layers in order; `args` (e.g. the positions
    `[T]`) go to every layer, those of the batch's rows (`stages.row_args`: packed documents' positions
    and ids [B, T]) as the rows of the microbatch a stage runs, the others unchanged. `stages` P (a multiple of
    the mesh's stage size), `microbatches` M (B/M rows each, divisible by the batch mesh axes), `repeats` R
    (circular schedule; L divisible by P·R), `remat` the per-iteration rematerialisation (`meshpar.remat`:
    none, dots, full or offload). `poison_bubbles=True` fills bubble slots with NaN (a test aid: a leak
    shows as NaN).
    """
    return run(stack, x_BTD, *args, mesh=mesh, stages=stages, microbatches=microbatches, repeats=repeats,
               remat=remat, poison_bubbles=poison_bubbles)[0]


def run(stack: nnx.Module, x_BTD: jax.Array, *args: jax.Array, mesh: Mesh, stages: int, microbatches: int,
        repeats: int = 1, remat: str = "none", poison_bubbles: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`pipeline`, also returning the buffers after the last iteration (a test's view of the bubbles): the
    stage buffer `[P, b, T, D]` and the input/output buffer `[P, M, b, T, D]`.

    `x_BTD` may be a tuple of arrays with the rows first, what a mixture of experts' layers carry (the
    residual stream and its router statistics): every part moves with its rows."""
    graphdef, stacked = nnx.split(stack)
    leaves = jax.tree.leaves(stacked)
    if not leaves:
        raise InputError("pipeline: the stack has no variables")
    batch = stages_lib.batch_axes(mesh)
    B = jax.tree.leaves(x_BTD)[0].shape[0]
    stages_lib.check(leaves[0].shape[0], B, mesh.shape, stages=stages, microbatches=microbatches,
                     repeats=repeats, batch=batch)
    remat_lib.check(remat)
    lanes = stages_lib.lane_axes(batch)
    Z = math.prod(mesh.shape[axis] for axis in lanes)
    weights = jax.tree.map(lambda v: _stage_view(v, mesh, stages, repeats, Z, lanes or None), stacked,
                           is_leaf=lambda v: isinstance(v, nnx.Variable))
    all_stages = _all_stages(graphdef, args, remat, repeats, Z, lanes or None, batch)
    rows = stages_lib.row_args(args, B)
    return _schedule(all_stages, weights, x_BTD, rows, mesh, stages, microbatches, repeats, batch or None,
                     poison_bubbles)


def _stage_view(variable: nnx.Variable, mesh: Mesh, P: int, R: int, Z: int, lanes: tuple[str, ...] | None):
    """A stacked weight [L, ...] as the stages use it: [Z, R, P, J, ...] with P on `stage`, gathered over
    fsdp here, ONCE per step, then one copy per batch shard (Z over the `lanes`: still one copy per
    device), so that each shard accumulates its own weight gradients over the iterations and they are
    reduced once, after."""
    compute, p = context.active(), mesh.shape["stage"]
    rest = stages_lib.weight_spec(variable, mesh, stacked=True)
    value = variable[...]
    J = value.shape[0] // (P * R)
    if compute is not None and offload.weights_offloaded(compute.rules.parallel):
        value = offload.to_device(value)  # fetched from host memory once per step, like the gather
    value = constrain(value, mesh, "stage", *rest)  # gather over fsdp in the at-rest layout
    # At rest stage group g holds its R chunks in turn (`order.to_rest`): [p, R, P/p, J] → [R, P, J] is local.
    value = value.reshape(p, R, P // p, J, *value.shape[1:])
    value = constrain(value, mesh, "stage", None, None, None, *rest).swapaxes(0, 1)
    value = constrain(value.reshape(R, P, J, *value.shape[4:]), mesh, None, "stage", None, *rest)
    value = jnp.broadcast_to(value, (Z, *value.shape))
    return variable.replace(constrain(value, mesh, lanes, None, "stage", None, *rest))


def _all_stages(graphdef: nnx.GraphDef, args: tuple, remat: str, R: int, Z: int, lanes: tuple[str, ...] | None,
                batch: tuple[str, ...]) -> Callable:
    """`(weights [Z, R, P, J, ...], repeat_P, x [P, b, T, D], rows [P, b, ...]) → [P, b, T, D]`: every stage's
    J layers of its repeat on its microbatch (with its rows of the per-row `args`), vmapped over stages and
    (inside) over batch shards."""
    local = stages_lib.lane_context(lanes, batch)

    def one_shard(weights_RJ: nnx.State, repeat: jax.Array, x_bTD: jax.Array, rows: tuple) -> jax.Array:
        """One stage step on one batch shard: the stage's J layers of `repeat` on its rows of a microbatch."""
        chunk = jax.tree.map(lambda w: w[0] if R == 1 else jax.lax.dynamic_index_in_dim(w, repeat, 0, False),
                             weights_RJ)

        def one_layer(x, layer):
            return nnx.merge(graphdef, layer)(x, *stages_lib.lane_args(args, rows)), None

        if remat != "none":  # the stage's recompute in the backward pass keeps layer inputs, not intermediates
            one_layer = jax.checkpoint(one_layer, policy=remat_lib.policy(remat, vmapped=True), prevent_cse=False)
        with context.use(local) if local is not None else contextlib.nullcontext():
            return jax.lax.scan(one_layer, x_bTD, chunk)[0]

    def one_stage(weights_ZRJ: nnx.State, repeat: jax.Array, x_bTD: jax.Array, rows: tuple) -> jax.Array:
        shards = lambda a: a.reshape(Z, a.shape[0] // Z, *a.shape[1:])  # local: the microbatch is split over the lanes
        y_ZbTD = jax.vmap(one_shard, in_axes=(0, None, 0, 0), spmd_axis_name=lanes)(
            weights_ZRJ, repeat, jax.tree.map(shards, x_bTD), jax.tree.map(shards, rows))
        return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), y_ZbTD)

    all_stages = jax.vmap(one_stage, in_axes=(2, 0, 0, 0), spmd_axis_name="stage")
    if remat != "none":
        all_stages = jax.checkpoint(all_stages, policy=remat_lib.policy(remat, vmapped=True), prevent_cse=False)
    return all_stages


def _schedule(all_stages: Callable, weights: nnx.State, x_BTD: jax.Array, rows: tuple, mesh: Mesh, P: int, M: int,
              R: int, batch: tuple[str, ...] | None, poison_bubbles: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The scan over the schedule's iterations (module docstring): (y [B, T, D], stage buffer, I/O buffer), each
    a tuple where x is (`run`)."""
    B = jax.tree.leaves(x_BTD)[0].shape[0]
    b = B // M
    period = max(M, P)  # stage 0 starts microbatch m of repeat r at iteration r·period + m
    fill = jnp.nan if poison_bubbles else 0.0
    # Microbatch m = rows m, M + m, …: a local reshape when the batch is split over data × fsdp.
    microbatched = lambda a: constrain(a.reshape(b, M, *a.shape[1:]).swapaxes(0, 1), mesh, None, batch,
                                       *(U,) * (a.ndim - 1))
    x_MbTD, rows_Mb = jax.tree.map(microbatched, x_BTD), jax.tree.map(microbatched, rows)
    stage_P = jnp.arange(P)
    per_stage = lambda mask_P, a: mask_P.reshape(P, *(1,) * (a.ndim - 1))  # [P] against a buffer [P, ...]
    at_stages = lambda a: constrain(a, mesh, "stage", batch, *(U,) * (a.ndim - 2))  # [P, b, ...]
    in_io = lambda a: constrain(a, mesh, "stage", None, batch, *(U,) * (a.ndim - 3))  # [P, M, b, ...]
    first = stage_P == 0
    io = jax.tree.map(lambda a: jnp.broadcast_to(a, (P, *a.shape)), x_MbTD)  # only stage 0's copy is read
    if poison_bubbles:
        io = jax.tree.map(lambda a: jnp.where(per_stage(first, a), a, jnp.nan), io)
    io = jax.tree.map(in_io, io)
    state = jax.tree.map(lambda a: at_stages(jnp.full((P, *a.shape[1:]), fill, a.dtype)), x_MbTD)

    def slot(j: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Item j (= iteration − stage) of a stage's work: its repeat, its microbatch, whether it is real."""
        j0 = jnp.maximum(j, 0)
        repeat, m = j0 // period, j0 % period
        return jnp.minimum(repeat, R - 1), jnp.minimum(m, M - 1), (j >= 0) & (repeat < R) & (m < M)

    def iteration(carry, i):
        state, io = carry
        repeat_P, m_P, real_P = slot(i - stage_P)
        _, m_in, _ = slot(i)
        taken = lambda a_io, s: jnp.where(per_stage(first, s), jax.lax.dynamic_index_in_dim(a_io, m_in, 1, False), s)
        stage_in = jax.tree.map(taken, io, state)  # stage 0 takes microbatch m_in, the others what came round
        rows_Pb = jax.tree.map(lambda a: at_stages(a[m_P]), rows_Mb)
        out = all_stages(weights, repeat_P, jax.tree.map(lambda a: jnp.where(per_stage(real_P, a), a, 0.0), stage_in),
                         rows_Pb)  # bubbles compute on zeros
        if poison_bubbles:
            out = jax.tree.map(lambda a: jnp.where(per_stage(real_P, a), a, jnp.nan), out)
        out = jax.tree.map(at_stages, out)
        state = jax.tree.map(lambda a: at_stages(stages_lib.shift(a, mesh)), out)  # q → q+1: collective-permute
        # state[0] now holds what stage P−1 finished: the next repeat's input, or the result.
        _, m_out, real_out = slot(i - (P - 1))

        def write(a_io, s):
            keep = jax.lax.dynamic_index_in_dim(a_io, m_out, 1, False)
            written = jnp.where(per_stage(first & real_out, s), s, keep)
            return in_io(jax.lax.dynamic_update_index_in_dim(a_io, written, m_out, 1))

        return (state, jax.tree.map(write, io, state)), None

    (state, io), _ = jax.lax.scan(iteration, (state, io), jnp.arange(schedule.iterations(P, M, R)))
    y = jax.tree.map(lambda a: constrain(a[0], mesh, None, batch, *(U,) * (a.ndim - 3)), io)
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(B, *a.shape[2:]), y), state, io
