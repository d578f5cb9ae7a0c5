"""Pipeline parallelism: the stacked layers split into S stages over the `stage` mesh axis (GPipe, circular).

What is sharded. The `[L, ...]` layer stack is viewed as `[R, S, L/(R·S), ...]` and its stage dimension
lives on the `stage` mesh axis: the devices of stage s hold the layers it runs, (r·S + s)·L/(R·S) …
(r·S + s + 1)·L/(R·S) − 1 in repeat r (R > 1 is the circular, "interleaved" schedule: each stage holds R
chunks of layers and every microbatch goes round the ring of stages R times). At rest the stack is split
over `stage` in contiguous blocks, and with R > 1 it is kept in the order that puts each stage group's R
chunks in its own block (`to_rest`: block g holds chunk r of group g, r = 0 … R−1, in turn), so the
interleaved view is a local reshape: no weight, and no gradient, crosses stages in a step. Init and
restore put the layers in that order; checkpoints hold them in layer order (`to_layers`, one
all-to-all over `stage` per stacked array at each save, into a copy that lives until the save has it on
the host), so any layout resumes any other. The batch `[B, T, D]` is split into M microbatches
`[M, B/M, T, D]`; microbatch m is the rows m, M + m, 2M + m, … so that every microbatch stays split over
the batch mesh axes (data × fsdp) exactly as the batch was, with no movement.

The schedule. One `lax.scan` over n = (R−1)·max(M, S) + M + S − 1 iterations (= R·M + S − 1 whenever
M ≥ S or R = 1). In each, every stage runs its L/(R·S) layers on the microbatch in front of it — one
`jax.vmap` over the stage dimension with `spmd_axis_name="stage"`, so the compiler runs stage s on the
devices of stage s — and then the S outputs move one stage on, s → s+1 mod S: a `ppermute` over `stage`
in a small `shard_map` whose only manual axis is `stage`, i.e. ONE collective-permute (its transpose in
the backward pass is one too). Stage 0 takes the next microbatch from an input/output buffer kept on its
own devices; what comes round from stage S−1 is written into the same buffer: the input of the next
repeat, and after the last repeat the result. The backward pass is the scan differentiated (no
hand-written backward): the same permutes run in reverse.

Why vmap for the compute and not one shard_map over `stage`: the model's layers are written for GSPMD
(`sharding.constrain`, `sharding.gathered`, Auto axes). Under a vmap with `spmd_axis_name` they run
unchanged — each hint gets `stage` prepended, and batch → (data, fsdp), heads/mlp → model do not clash
with it — so data, FSDP and tensor parallelism compose with the pipeline without manual collectives.
Inside a shard_map `stage` would be manual in every layer and each hint would have to be valid on a
partially manual mesh. Only the shift is manual: as a roll of the stage-sharded buffer the partitioner
also emits a collective-permute forward, but splits the transposed roll into two (the ring's wrap edge
apart) in the backward pass; the explicit ppermute is one each way, whatever the compiler's patterns.

Inside a stage a second vmap runs over the K = data·fsdp batch shards (`spmd_axis_name` = those axes;
a microbatch's rows are already split that way, so nothing moves), with one copy of the stage weights
per shard: each shard accumulates its own weight gradients across the iterations, and the compiler has
nothing to reduce inside the loop. Left to itself it all-reduces every layer's gradient over data × fsdp
in every iteration, n times per step instead of once (the trick of `train`'s gradient accumulation).
The K copies are one per device: the gathered stage weights.

Collectives per step (per device; a = (B/M)/(data·fsdp) · T/sequence · D · bytes, one microbatch's
activations on one device; w = one device's share of a weight: the stack / stage / model):

| what                                    | collective                        | count           | bytes each |
|-----------------------------------------|-----------------------------------|-----------------|------------|
| shift between stages, forward           | collective-permute                | n               | a          |
| shift between stages, backward          | collective-permute                | n               | a          |
| result leaves stage 0; x's gradient     | all-reduce over stage             | 1 + 1           | M·a        |
| FSDP: stage weights gathered            | all-gather over fsdp              | 1 / weight      | w          |
| weight gradients over data and fsdp     | all-reduce (CPU) / reduce-scatter | 1 / weight      | w          |
| tensor parallelism, inside the layers   | all-reduce over model             | 4·n·L/(R·S) (*) | a          |

(*) Megatron's 2 forward + 2 backward per layer (2 more with remat's recompute), in every iteration:
bubble iterations compute, and communicate, too. XLA combines the per-weight all-reduces (and the two
over stage) into one tuple all-reduce each, so the compiled step shows 2 all-reduces without TP.

With FSDP the stage weights are gathered ONCE per step, not once per microbatch: before the scan they
are constrained to their compute layout (split over `stage` and `model`, whole over `fsdp`), so the loop
reads loop-invariant gathered weights, and (per shard, above) their gradients are reduced once after it.
The price is memory: a stage's weights stay whole over `fsdp` for the step (1/stage of the layers,
/model under TP), and so does their gradient accumulator. With R > 1 nothing is exchanged between
stages for the weights: stored contiguously in layer order, the interleaved view needed an all-to-all
of every weight over `stage` per step and one of its gradient back; the order at rest (above) makes it
local (the tests check the compiled step for it).

The bubble. Each stage works R·M of the n iterations; the rest it idles (computes on a bubble):
  bubble = (S − 1) / (R·M + S − 1)   [GPipe, Huang et al. §2.3, with R repeats: Narayanan et al. §2.2]
Naive model parallelism (layers split over devices, the whole batch at once) is M = 1: (S − 1)/S, every
stage but one idle at any time. The bubble is small when R·M ≫ S (GPipe: M ≥ 4S). With R > 1 and M < S a
microbatch comes back to stage 0 before the others are through, and the schedule waits: n grows to
(R−1)·S + M + S − 1 (see `bubble_fraction`). Bubble iterations compute on zeros and their outputs are
discarded by selects; `poison_bubbles=True` fills every bubble slot with NaN instead, so a test proves
that no bubble value reaches the result or the gradients. As every iteration computes, a device's
matmul FLOPs are n iterations × L/(R·S) layers on one microbatch, and the bubble shows in the compiled
program as 1 − (the unpipelined FLOPs / devices) / (one device's FLOPs) = 1 − R·M/n (the tests measure
it, counting each loop body as often as it runs: XLA's `cost_analysis()` counts a loop body once).

Memory. The scan stores, per iteration, what the backward pass of one stage step needs: with
`remat="full"` only the stage input (one microbatch per iteration, n in all: the GPipe activation
stash), with `"dots"` also the projections' outputs, with `"none"` every intermediate. The remat wraps
the stage compute only: the bookkeeping around it (slices, selects, the permute) is linear and stores
nothing, so the I/O buffer is never saved per iteration.

With context parallelism. A layer that opens its own `jax.shard_map` — meshpar's attention does when the
sequence is split over `sequence` — runs under these vmaps because the active `Compute` lists the
vmapped mesh axes (`vmapped`): the shard_map is made manual over them too, which is what JAX needs to
batch it with an spmd axis name.

When it is worth it. Pipelining sends only a microbatch's activations point to point (b·s·h values per
stage boundary per microbatch, 2 bytes each in bf16) while a stage computes ≈ 24·b·s·h²·L/(R·S) FLOPs on
them (≈ 12h² weights per layer): compute-bound when 12·h·L/(R·S) > FLOP/s ÷ link bandwidth (H100 over
50 GB/s InfiniBand: ≈ 2·10⁴, so h·L/(R·S) ≳ 1700 — any large model). So it is the strategy for the slowest links (across nodes), where FSDP's weight
gathers and TP's per-layer all-reduces would not hide, and for models whose layers do not fit one
node's memory. Its costs are the bubble (buy it down with M, which costs activation memory, or with R,
which costs R× the permutes) and the microbatch: B/M rows must still fill the data-parallel axes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import Offloadable
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshpar import context, offload, sharding
from meshpar.errors import InputError

P = PartitionSpec
U = PartitionSpec.UNCONSTRAINED

_BATCH_AXES = ("data", "fsdp")  # what `batch` maps to in every rules preset; the active rules win


def _projections_saveable(prim: Any, *_, **params: Any) -> bool:
    """`dots_with_no_batch_dims_saveable` for a body vmapped over stages and batch shards.

    Under the two vmaps a projection `x @ w` (both operands per stage and per shard) becomes a dot_general
    with TWO batch dimensions, stage and shard; attention's score and value matmuls have more (batch,
    heads too). Save the former, recompute the latter, as the plain policy does outside a vmap (where it
    would save nothing here: every dot has batch dimensions).
    """
    if prim is jax.lax.dot_general_p:
        (_, _), (lhs_batch, _) = params["dimension_numbers"]
        return len(lhs_batch) <= 2
    return False


def _projections_offloaded(prim: Any, *args, **params: Any) -> Any:
    """`_projections_saveable`, saving to host memory (`remat="offload"`, meshpar.layers)."""
    return _projections_saveable(prim, *args, **params) and Offloadable("device", "pinned_host")


_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable, "dots": _projections_saveable,
             "offload": _projections_offloaded}


def iterations(stages: int, microbatches: int, repeats: int = 1) -> int:
    """How many steps the schedule takes: (R−1)·max(M, S) + M + S − 1 (R·M + S − 1 when M ≥ S or R = 1)."""
    return (repeats - 1) * max(microbatches, stages) + microbatches + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The fraction of the pipeline's time a stage idles: (S − 1)/(R·M + S − 1).

    M = 1, R = 1 is naive model parallelism: (S − 1)/S. With R > 1 and M < S the circular schedule must
    wait for microbatches to come round (a microbatch needs R·S stage steps in sequence), so it takes
    (R−1)·S + M + S − 1 iterations and the fraction is 1 − R·M/that, larger than the formula.
    """
    for name, value in (("stages", stages), ("microbatches", microbatches), ("repeats", repeats)):
        if value < 1:
            raise InputError(f"{name} = {value} must be >= 1")
    return 1.0 - repeats * microbatches / iterations(stages, microbatches, repeats)


def _constrain(x: jax.Array, mesh: Mesh, *spec: Any) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def _batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that split a batch: the active rules' `batch`, else data × fsdp."""
    compute = context.active()
    axes = compute.rules.table("activations").get("batch", _BATCH_AXES) if compute is not None else _BATCH_AXES
    return tuple(axis for axis in axes if mesh.shape[axis] > 1)


def _stage_weight_spec(variable: nnx.Variable, mesh: Mesh) -> tuple[Any, ...]:
    """The compute layout of one layer's weight (after the leading layers dim): its FSDP-gathered form.

    With an active Compute context, the activation rules applied to the weight's own logical names
    (what `sharding.gathered` does inside a layer: `embed` whole, `heads`/`mlp` over model); without
    one, the compiler's choice.
    """
    ndim = variable[...].ndim - 1
    compute = context.active()
    names = variable.get_metadata().get("out_sharding")
    if compute is None or names is None:
        return (U,) * ndim
    spec = sharding.spec_for(tuple(names)[-ndim:] if ndim else (), variable[...].shape[1:],
                             compute.rules.table("activations"), mesh, "pipelined stage weight")
    return tuple(spec) + (None,) * (ndim - len(spec))


def to_rest(state: nnx.State, mesh: Mesh, repeats: int) -> nnx.State:
    """`state` (arrays laid out on `mesh`) with each stacked variable's `layers` axis from layer order into
    the pipeline's order at rest; each array keeps its sharding. The identity unless stage > 1 and R > 1.

    At rest the stack is split over `stage` in k = stage-size contiguous blocks, and block g holds the R
    chunks that stage group g runs, in turn: position (g, r, j) holds layer (r·k + g)·J + j (J = L/(k·R)),
    so the interleaved view [R, S, L/(R·S)] is a local reshape for any S divisible by k (`_run`). Called on
    the state after init and restore; checkpoints hold layer order (`to_layers`).
    """
    return _reordered(state, mesh, repeats, to_rest=True)


def to_layers(state: nnx.State, mesh: Mesh, repeats: int) -> nnx.State:
    """The inverse of `to_rest`: stacked variables (and their gradients) back in layer order."""
    return _reordered(state, mesh, repeats, to_rest=False)


def _reordered(state: nnx.State, mesh: Mesh, repeats: int, *, to_rest: bool) -> nnx.State:
    if mesh.shape["stage"] == 1 or repeats == 1:
        return state

    def one(variable: nnx.Variable) -> nnx.Variable:
        names = tuple(variable.get_metadata().get("out_sharding") or ())
        if "layers" not in names:
            return variable
        value = variable[...]
        layout = value.sharding if isinstance(value.sharding, NamedSharding) else NamedSharding(mesh, P())
        return variable.replace(_swap_chunks(value, layout, names.index("layers"), repeats, to_rest))

    return jax.tree.map(one, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _swap_chunks(x: jax.Array, layout: NamedSharding, dim: int, repeats: int, to_rest: bool) -> jax.Array:
    """Axis `dim` of `x` viewed as [R, k, J] (layer order) → [k, R, J] (at rest), or back; laid out as `x`.

    The k blocks stay on `stage` through the swap, so the exchange is one all-to-all over `stage` (into
    the view for `to_rest`, out of it for `to_layers`), never a gather of the whole stack.
    """
    mesh, k, L = layout.mesh, layout.mesh.shape["stage"], x.shape[dim]
    if L % (k * repeats):
        raise InputError(f"pipeline: L = {L} layers cannot be stored as stage={k} blocks of R = {repeats} "
                         f"chunks each: L is not divisible by {k * repeats}")
    spec = (*layout.spec, *(None,) * (x.ndim - len(layout.spec)))
    before, after = spec[:dim], spec[dim + 1:]

    def blocks(y: jax.Array, k_at: int) -> jax.Array:  # the layers axis as 3 dims, the k blocks on `stage`
        view = tuple("stage" if i == k_at else None for i in range(3))
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(*before, *view, *after),
                                                                 memory_kind=layout.memory_kind))

    source, k_at = ((repeats, k), 1) if to_rest else ((k, repeats), 0)
    y = blocks(x.reshape(*x.shape[:dim], *source, L // (k * repeats), *x.shape[dim + 1:]), k_at)
    y = blocks(jnp.swapaxes(y, dim, dim + 1), 1 - k_at)
    return jax.lax.with_sharding_constraint(y.reshape(x.shape), layout)


def lane_context(batch: tuple[str, ...] | None) -> context.Compute | None:
    """The active Compute as seen inside the vmaps over stages and batch shards (either schedule's): those
    mesh axes belong to the vmapped dimensions, the weights are already in their compute layout (their
    at-rest one there: jax 0.11 rejects a vmapped axis such as fsdp in a constraint), and each shard's
    weight gradients stay in the compute layout (reduced once, after the loop)."""
    compute = context.active()
    if compute is None:
        return None
    activations = tuple((name, () if name == "batch" else axes) for name, axes in compute.rules.activations)
    return dataclasses.replace(compute, vmapped=compute.vmapped + ("stage",) + (batch or ()),
                               rules=dataclasses.replace(compute.rules, params=activations,
                                                         activations=activations, grads=activations))


def _shift(x_S: jax.Array, mesh: Mesh) -> jax.Array:
    """Move every stage's output one stage on, round the ring: `out[s] = x[s − 1 mod S]`.

    A `ppermute` over `stage` (the only manual axis; the others stay with the compiler): one
    collective-permute, and its transpose in the backward pass is one too. With k = S / stage-size
    stages per device group, only the last of each group's k crosses devices.
    """
    k = mesh.shape["stage"]
    if k == 1:
        return jnp.roll(x_S, 1, axis=0)
    ring = [(i, (i + 1) % k) for i in range(k)]

    def local(block: jax.Array) -> jax.Array:
        incoming = jax.lax.ppermute(block[-1:], "stage", ring)
        return jnp.concatenate([incoming, block[:-1]], axis=0)

    compute = context.active()
    vmapped = set(compute.vmapped) if compute is not None else set()  # e.g. gradient accumulation's replicas
    return jax.shard_map(local, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"),
                         axis_names={"stage"} | vmapped)(x_S)


def _check(L: int, B: int, *, mesh: Mesh, stages: int, microbatches: int, repeats: int, remat: str) -> None:
    S, M, R = stages, microbatches, repeats
    for name, value in (("stages", S), ("microbatches", M), ("repeats", R)):
        if value < 1:
            raise InputError(f"pipeline: {name} = {value} must be >= 1")
    if remat not in context.REMAT_POLICIES:
        raise InputError(f"pipeline: remat policy '{remat}' is not one of {', '.join(context.REMAT_POLICIES)}")
    if L % (S * R):
        raise InputError(f"pipeline: L = {L} layers are not divisible by S = {S} stages × R = {R} repeats")
    if "stage" not in mesh.shape:
        raise InputError(f"pipeline: the mesh has no 'stage' axis (axes: {', '.join(mesh.axis_names)})")
    if S % mesh.shape["stage"]:
        raise InputError(f"pipeline: S = {S} stages cannot be split over mesh axis stage={mesh.shape['stage']}")
    if B % M:
        raise InputError(f"pipeline: the batch B = {B} is not divisible into M = {M} microbatches")
    axes = _batch_axes(mesh)
    ways = math.prod(mesh.shape[axis] for axis in axes)
    if (B // M) % ways:
        split = " × ".join(f"{axis}={mesh.shape[axis]}" for axis in axes)
        raise InputError(f"pipeline: a microbatch of B/M = {B}/{M} = {B // M} rows is not divisible by the "
                         f"batch mesh axes {split} = {ways}")


def pipeline(stack: nnx.Module, x_BTD: jax.Array, *args: jax.Array, mesh: Mesh, stages: int, microbatches: int,
             repeats: int = 1, remat: str = "none", poison_bubbles: bool = False) -> jax.Array:
    """Apply the L stacked layers of `stack` to `x_BTD` in order, as a pipeline over the `stage` axis.

    The stack's variables are in the order at rest for this mesh and R (`to_rest`; layer order when R = 1).
    The same result as `meshpar.layers.scan` on the layers in order; `args` (e.g. the positions `[T]`) go
    to every layer unchanged, the same for every microbatch and stage. `stages` S (a multiple of the
    mesh's stage size), `microbatches` M (B/M rows each, divisible by the batch mesh axes), `repeats` R
    (circular schedule; L divisible by S·R), `remat` the per-iteration rematerialisation ("none", "full",
    "dots"). `poison_bubbles=True` fills bubble slots with NaN (a test aid: a leak shows as NaN).
    """
    return _run(stack, x_BTD, *args, mesh=mesh, stages=stages, microbatches=microbatches, repeats=repeats,
                remat=remat, poison_bubbles=poison_bubbles)[0]


def _run(stack: nnx.Module, x_BTD: jax.Array, *args: jax.Array, mesh: Mesh, stages: int, microbatches: int,
         repeats: int, remat: str, poison_bubbles: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`pipeline`, also returning the final stage buffer `[S, B/M, T, D]` and I/O buffer `[S, M, B/M, T, D]`."""
    graphdef, stacked = nnx.split(stack)
    leaves = jax.tree.leaves(stacked)
    if not leaves:
        raise InputError("pipeline: the stack has no variables")
    L, (B, T, D) = leaves[0].shape[0], x_BTD.shape
    _check(L, B, mesh=mesh, stages=stages, microbatches=microbatches, repeats=repeats, remat=remat)
    S, M, R = stages, microbatches, repeats
    Lc, mb = L // (S * R), B // M  # layers per stage per repeat; rows per microbatch
    k = mesh.shape["stage"]  # stage groups of devices
    period = max(M, S)  # stage 0 starts microbatch m of repeat r at iteration r·period + m
    n_iter = iterations(S, M, R)
    batch = _batch_axes(mesh) or None
    K = math.prod(mesh.shape[axis] for axis in batch or ())  # batch shards
    fill = jnp.nan if poison_bubbles else 0.0

    # [L, ...] → [R, S, Lc, ...] with S on `stage`, gathered over fsdp here, ONCE per step; then one copy
    # per batch shard [K, R, S, Lc, ...] (K over the batch axes: still one copy per device), so that each
    # shard accumulates its own weight gradients over the iterations and they are reduced once, after.
    offloaded = context.active() is not None and offload.weights_offloaded(context.active().rules.parallel)

    def stage_view(variable: nnx.Variable) -> nnx.Variable:
        rest = _stage_weight_spec(variable, mesh)
        value = variable[...]
        if offloaded:
            value = offload.to_device(value)  # fetched from host memory once per step, like the gather
        value = _constrain(value, mesh, "stage", *rest)  # gather over fsdp in the at-rest layout
        # At rest stage group g holds its R chunks in turn (`to_rest`): [k, R, S/k, Lc] → [R, S, Lc] is local.
        value = value.reshape(k, R, S // k, Lc, *value.shape[1:])
        value = _constrain(value, mesh, "stage", None, None, None, *rest).swapaxes(0, 1)
        value = _constrain(value.reshape(R, S, Lc, *value.shape[4:]), mesh, None, "stage", None, *rest)
        value = jnp.broadcast_to(value, (K, *value.shape))
        return variable.replace(_constrain(value, mesh, batch, None, "stage", None, *rest))

    weights = jax.tree.map(stage_view, stacked, is_leaf=lambda v: isinstance(v, nnx.Variable))
    local = lane_context(batch)

    def one_shard(weights_RC: nnx.State, repeat: jax.Array, x_bTD: jax.Array) -> jax.Array:
        """One stage step on one batch shard: the stage's Lc layers of `repeat` on its rows of a microbatch."""
        chunk = jax.tree.map(lambda w: w[0] if R == 1 else jax.lax.dynamic_index_in_dim(w, repeat, 0, False),
                             weights_RC)

        def one_layer(x, layer):
            return nnx.merge(graphdef, layer)(x, *args), None

        if remat != "none":  # the stage's recompute in the backward pass keeps layer inputs, not intermediates
            one_layer = jax.checkpoint(one_layer, policy=_POLICIES[remat], prevent_cse=False)
        with context.use(local) if local is not None else contextlib.nullcontext():
            return jax.lax.scan(one_layer, x_bTD, chunk)[0]

    def one_stage(weights_KRC: nnx.State, repeat: jax.Array, x_mTD: jax.Array) -> jax.Array:
        x_KbTD = x_mTD.reshape(K, mb // K, T, D)  # local: the microbatch is split over the batch axes
        y_KbTD = jax.vmap(one_shard, in_axes=(0, None, 0), spmd_axis_name=batch)(weights_KRC, repeat, x_KbTD)
        return y_KbTD.reshape(mb, T, D)

    all_stages = jax.vmap(one_stage, in_axes=(2, 0, 0), spmd_axis_name="stage")
    if remat != "none":
        all_stages = jax.checkpoint(all_stages, policy=_POLICIES[remat], prevent_cse=False)

    # Microbatch m = rows m, M + m, …: a local reshape when the batch is split over data × fsdp.
    x_MbTD = _constrain(x_BTD.reshape(mb, M, T, D).swapaxes(0, 1), mesh, None, batch, U, U)
    stage_S = jnp.arange(S)
    first = (stage_S == 0)[:, None, None, None]
    io = jnp.broadcast_to(x_MbTD, (S, M, mb, T, D))  # only stage 0's copy is read (per device: one copy)
    if poison_bubbles:
        io = jnp.where(first[..., None], io, jnp.nan)
    io = _constrain(io, mesh, "stage", None, batch, U, U)
    state = _constrain(jnp.full((S, mb, T, D), fill, x_BTD.dtype), mesh, "stage", batch, U, U)

    def slot(j: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Item j (= iteration − stage) of a stage's work: its repeat, its microbatch, whether it is real."""
        j0 = jnp.maximum(j, 0)
        repeat, m = j0 // period, j0 % period
        return jnp.minimum(repeat, R - 1), jnp.minimum(m, M - 1), (j >= 0) & (repeat < R) & (m < M)

    def iteration(carry, t):
        state, io = carry
        repeat_S, _, real_S = slot(t - stage_S)
        real = real_S[:, None, None, None]
        _, m_in, _ = slot(t)
        stage_in = jnp.where(first, jax.lax.dynamic_index_in_dim(io, m_in, 1, False), state)
        out = all_stages(weights, repeat_S, jnp.where(real, stage_in, 0.0))  # bubbles compute on zeros
        if poison_bubbles:
            out = jnp.where(real, out, jnp.nan)
        out = _constrain(out, mesh, "stage", batch, U, U)
        state = _constrain(_shift(out, mesh), mesh, "stage", batch, U, U)  # s → s+1: collective-permute
        # state[0] now holds what stage S−1 finished: the next repeat's input, or the result.
        _, m_out, real_out = slot(t - (S - 1))
        keep = jax.lax.dynamic_index_in_dim(io, m_out, 1, False)
        written = jnp.where(first & real_out, state, keep)
        io = _constrain(jax.lax.dynamic_update_index_in_dim(io, written, m_out, 1), mesh, "stage", None, batch, U, U)
        return (state, io), None

    (state, io), _ = jax.lax.scan(iteration, (state, io), jnp.arange(n_iter))
    y_MbTD = _constrain(io[0], mesh, None, batch, U, U)
    return y_MbTD.swapaxes(0, 1).reshape(B, T, D), state, io
