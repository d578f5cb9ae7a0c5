"""The 1F1B pipeline schedule (PipeDream-Flush, Narayanan et al. 2021) as one SPMD program.

Why. GPipe (`meshpar.pipeline`) runs every microbatch forward, then every one backward: each stage keeps
the input of every schedule iteration until the backward pass, M + S − 1 microbatches of activations,
so buying the bubble down with more microbatches costs memory. 1F1B starts a microbatch's backward pass
as soon as its forward pass has left the last stage, so a stage holds a bounded number of microbatches
whatever M is: activation memory flat in M, the same bubble.

The schedule. One slot = every stage runs the forward of one microbatch and the backward of another (a
VJP driven here, not `jax.grad` of the whole). Stage s forwards microbatch m in slot m + s and
backwards it in slot m + 2(S − 1) − s; the last stage turns its forward output into the loss and its
cotangent in the same slot, and backwards it at once. S = 3, M = 4 (Fm / Bm: forward / backward of m):

    slot     0    1    2      3      4      5      6    7
    stage 0  F0   F1   F2     F3     B0     B1     B2   B3
    stage 1  .    F0   F1     F2 B0  F3 B1  B2     B3   .
    stage 2  .    .    F0 B0  F1 B1  F2 B2  F3 B3  .    .
    runs     F    F    F+B    F+B    F+B    F+B    B    B

n = M + 2(S − 1) slots (`slots`): S − 1 that only forward (nothing has reached the last stage yet), M
that do both, S − 1 that only backward (the last forward is done). They are three `lax.scan`s over the
same slot function, so a forward-only slot computes no backward and costs F, a backward-only one B: the
step takes (S − 1)·F + M·(F + B) + (S − 1)·B = (M + S − 1)·(F + B), and each stage works M·(F + B) of it:
bubble (S − 1)/(M + S − 1), GPipe's (`meshpar.pipeline.bubble_fraction`). Bubble slots compute on zeros
and selects drop their results; `poison_bubbles=True` feeds them NaN instead, so a test proves none
reaches the loss or a gradient.

Each slot is computed like GPipe's iterations: a `jax.vmap` over the stages (`spmd_axis_name="stage"`)
and, inside, one over the batch shards (the data × fsdp axes), so the layers run unchanged under GSPMD.
The loss runs per microbatch inside the pipeline, on the last stage, and so does the embedding, on the
first: the model is taken in parts (below). Under the vmap every stage computes both, masked (the last
stage's loss and the first stage's lookup are on the critical path anyway, so no slot gets longer).

Collectives per step (per device; a = one microbatch's activations on one device, as in pipeline.py):
- activations s → s+1 (`pipeline._shift`): one collective-permute of a per forward slot, M + S − 1;
- cotangents s+1 → s (its transpose): one collective-permute of a per backward slot, M + S − 1;
- the gradients of the stage weights over data × fsdp, of the embedding and head over stage, data and
  fsdp, and the loss: reduced once, after the slots (XLA combines them: 2 all-reduces without TP);
  FSDP's gathers of every weight once, before them (the weights stay whole over fsdp for the step, as
  in GPipe); the layers' own (tensor and context parallelism) in every slot, bubbles included.
No stage-0 result is all-reduced over `stage` (GPipe's): the loss never leaves the last stage. Within a
slot the collectives run in one order on every device, forward, shift, loss, backward, shift (`_after`).

Memory. A stage keeps the input of every microbatch it has forwarded and not yet backwarded, for the
backward pass to recompute the stage from (the standard trade: one more forward of each stage, what
GPipe pays with remat=full; `remat` then applies per layer inside that recompute). Stage s holds
microbatch m from slot m + s to slot m + 2(S − 1) − s: 2(S − 1 − s) slots, at most 2(S − 1) microbatch
inputs (stage 0), a ring stash of W = 2(S − 1) entries read before it is written in each slot. That is
the bound for any lockstep schedule with GPipe's bubble: a slot moves an activation one stage on, so a
round trip from stage 0 takes 2(S − 1) slots, in each of which stage 0 must start a microbatch. (The
asynchronous 1F1B holds S: there a hop costs one forward, not a forward and a backward.) Beside the
stash, the two in-flight buffers, one stage's backward working set, and per batch shard (one per device)
the weight and embedding/head gradient accumulators: nothing grows with M but the int32 tokens.

The model's parts, the one protocol: `embed(tokens_BT) -> x_BTD` (the input of the stacked layers),
`blocks` (the stacked layers, run by `meshpar.layers.scan`, each called as `layer(x_BTD, positions_T)`),
`final_norm(x_BTD) -> hidden_BTD` and `output_head() -> head_DV`, such that `hidden_states(tokens,
positions)` is `final_norm(layers.scan(blocks, embed(tokens), positions))` and the loss is meshpar's
chunked cross-entropy of `hidden` and `output_head()`: `models/transformer.py` offers them. Evaluation
(no backward) keeps GPipe's forward (`layers.scan`), which holds no activations for a backward pass.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshpar import context, sharding
from meshpar.errors import InputError
from meshpar.loss import chunked_cross_entropy, next_token_inputs
from meshpar.layers import _POLICIES  # the lane's VJP runs inside the vmaps: its dots have their own batch dims
from meshpar.pipeline import U, _batch_axes, _check, _constrain, _shift, _stage_weight_spec, lane_context

PARTS = ("embed", "blocks", "final_norm", "output_head")

First = Callable[[nnx.State, jax.Array], jax.Array]  # (other params, tokens [b, T]) → x [b, T, D]
Last = Callable[[nnx.State, jax.Array, jax.Array], jax.Array]  # (other params, y [b, T, D], targets [b, T]) → loss


def slots(stages: int, microbatches: int) -> int:
    """M + 2(S − 1): S − 1 forward-only slots, M forward-and-backward ones, S − 1 backward-only ones."""
    return microbatches + 2 * (stages - 1)


def microbatches_in(slot: Any, stages: int) -> tuple[Any, Any]:
    """The microbatches every stage s = 0 … S−1 forwards and backwards in `slot`: (slot − s,
    slot − 2(S − 1) + s), real where in [0, M). An int slot gives numpy arrays, a traced one jax arrays."""
    xp = jnp if isinstance(slot, jax.Array) else np
    stage_S = xp.arange(stages)
    return slot - stage_S, slot - 2 * (stages - 1) + stage_S


def stash_size(stages: int) -> int:
    """Microbatch inputs a stage may hold between slots: 2(S − 1) (stage 0; stage s needs 2(S − 1 − s))."""
    return max(2 * (stages - 1), 1)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _masked(keep: jax.Array, tree: Any) -> Any:
    """`tree` where `keep`, zeros elsewhere: a select, so a NaN in a dropped bubble never propagates."""
    return jax.tree.map(lambda x: jnp.where(keep, x, jnp.zeros_like(x)), tree)


def _after(x: jax.Array, *tokens: Any) -> jax.Array:
    """`x`, once every array in `tokens` is computed: a select on a predicate that is always false (nothing is
    below −inf, NaN included) but that XLA does not fold, so whatever reads `x` runs after the tokens.

    Why: XLA:CPU runs independent computations concurrently, and two collectives of one kind in flight at
    once can meet in each other's rendezvous (collective-permutes share one id, as do a shard_map's
    all-gathers): seen as wrong losses and aborts with ring or all-gather attention in both halves of a
    slot under gradient accumulation. An optimization barrier does not order them (XLA removes it before
    the runtime sees the program); data does.
    """
    leaves = jax.tree.leaves(tokens)
    never = functools.reduce(jnp.logical_or, [leaf.ravel()[0] < -jnp.inf for leaf in leaves])
    return jnp.where(never, jnp.zeros_like(x), x)


def _compute_view(variable: nnx.Variable, mesh: Mesh) -> nnx.Variable:
    """A (non-layer) weight in its compute layout, gathered over fsdp once per step, outside the slots."""
    compute = context.active()
    names = variable.get_metadata().get("out_sharding")
    if compute is None or names is None:
        return variable
    spec = sharding.spec_for(tuple(names), variable.shape, compute.rules.table("activations"), mesh, "weight")
    return variable.replace(_constrain(variable[...], mesh, *spec))


def one_f_one_b(stack: nnx.Module, other: nnx.State, first: First, last: Last, inputs_BT: jax.Array,
                targets_BT: jax.Array, *args: jax.Array, mesh: Mesh, stages: int, microbatches: int, remat: str,
                poison_bubbles: bool) -> tuple[jax.Array, nnx.State, nnx.State, tuple[jax.Array, jax.Array]]:
    """The mean loss of a batch and its gradients, as a 1F1B pipeline of the stacked layers (docstring).

    Per microbatch: `first(other, inputs)` on stage 0, the L layers of `stack` (each called as
    `layer(x, *args)`) split into S stages, `last(other, y, targets)` (the mean loss of its rows) on the
    last stage. `stages` S (a multiple of the mesh's stage size), `microbatches` M (B/M rows each,
    divisible by the batch mesh axes), `remat` the per-layer policy of the backward's recompute,
    `poison_bubbles` NaN in bubble slots. Returns the loss, the gradients of the stack's parameters and of
    `other`, and the in-flight buffers after the last slot (a test's view of the bubbles): the
    activations that went to each stage [S, K, b, T, D] and the cotangents that came back to it.
    """
    graphdef, weights, consts = nnx.split(stack, nnx.Param, ...)
    leaves = jax.tree.leaves(weights)
    if not leaves:
        raise InputError("1f1b pipeline: the stack has no parameters")
    L, (B, T) = leaves[0].shape[0], inputs_BT.shape
    _check(L, B, mesh=mesh, stages=stages, microbatches=microbatches, repeats=1, remat=remat)
    if remat != "none" and remat not in _POLICIES:
        raise InputError(f"1f1b pipeline: remat '{remat}' is not one of none, {', '.join(_POLICIES)}")
    S, M = stages, microbatches
    Lc, mb = L // S, B // M  # layers per stage; rows per microbatch
    batch = _batch_axes(mesh) or None
    K = math.prod(mesh.shape[axis] for axis in batch or ())  # batch shards
    b, W = mb // K, stash_size(S)
    fill = jnp.nan if poison_bubbles else 0.0
    lane_compute = lane_context(batch)
    in_lane = lambda: context.use(lane_compute) if lane_compute is not None else contextlib.nullcontext()

    # [L, ...] → [S, Lc, ...] with S on `stage`, gathered over fsdp here, ONCE per step; the other weights
    # (embedding, head) in their compute layout too.
    def stage_view(variable: nnx.Variable) -> nnx.Variable:
        rest = _stage_weight_spec(variable, mesh)
        value = _constrain(variable[...], mesh, "stage", *rest).reshape(S, Lc, *variable.shape[1:])
        return variable.replace(_constrain(value, mesh, "stage", None, *rest))

    weights_SC, consts_SC = (jax.tree.map(stage_view, tree, is_leaf=_is_variable) for tree in (weights, consts))
    other = jax.tree.map(functools.partial(_compute_view, mesh=mesh), other, is_leaf=_is_variable)

    # Microbatch m = rows m, M + m, …, its b rows on batch shard k at [m, k]: a local reshape.
    def microbatched(x_BT: jax.Array) -> jax.Array:
        x_MKbT = x_BT.reshape(mb, M, T).swapaxes(0, 1).reshape(M, K, b, T)
        return _constrain(x_MKbT, mesh, None, batch, None, U)

    inputs_MKbT, targets_MKbT = microbatched(inputs_BT), microbatched(targets_BT)

    def stage(w_C: nnx.State, c_C: nnx.State, x_bTD: jax.Array) -> jax.Array:
        """A stage's Lc layers on one batch shard's rows of a microbatch."""

        def one_layer(x, layer):
            return nnx.merge(graphdef, *layer)(x, *args), None

        if remat != "none":  # the backward's recompute keeps what the policy saves, per layer
            one_layer = jax.checkpoint(one_layer, policy=_POLICIES[remat], prevent_cse=False)
        return jax.lax.scan(one_layer, x_bTD, (w_C, c_C))[0]

    def forward_lane(w_C, c_C, data, flags) -> tuple[jax.Array, jax.Array]:
        """One stage on one batch shard: the forward of microbatch m_F, whose input is the embedding on
        stage 0, else what came from the stage before. Returns (its input, its output)."""
        with in_lane():
            x_bTD = jnp.where(flags["first"], first(other, data["inputs_F"]), data["x"])
            x_bTD = jnp.where(flags["real_F"], x_bTD, fill)
            return x_bTD, stage(w_C, c_C, x_bTD)

    def backward_lane(w_C, c_C, data, flags, *, with_loss: bool) -> dict[str, Any]:
        """One stage on one batch shard: the backward of microbatch m_B, recomputing the stage from its
        stashed input, with the cotangent from the stage after; `with_loss`: the last stage first turns its
        forward output (of m_F, which is m_B there) into the loss and that cotangent."""
        with in_lane():
            g_bTD, x_B, loss, d_loss = data["g"], data["stashed"], jnp.zeros(()), None
            if with_loss:
                at_loss = flags["last"] & flags["real_F"]
                y_bTD = _after(data["y"], data["shifted"])  # the loss's collectives after the shift's
                loss, loss_vjp = jax.vjp(lambda o, y: last(o, y, data["targets"]) / (M * K), other, y_bTD)
                d_loss, g_last = loss_vjp(jnp.ones_like(loss))
                x_B = _after(x_B, g_last, d_loss)  # the stage's collectives after the loss's
                loss, d_loss = jnp.where(at_loss, loss, 0.0), _masked(at_loss, d_loss)
                g_bTD, x_B = jnp.where(at_loss, g_last, g_bTD), jnp.where(at_loss, data["x"], x_B)
            real = flags["real_B"]
            g_bTD, x_B = jnp.where(real, g_bTD, fill), jnp.where(real, x_B, fill)
            d_w, dx_bTD = jax.vjp(lambda w, x: stage(w, c_C, x), w_C, x_B)[1](g_bTD)
            # Stage 0 hands its input's cotangent to the embedding (zeros elsewhere: a scatter of zeros).
            d_embed = jax.vjp(lambda o: first(o, data["inputs_B"]), other)[1](_masked(flags["first"] & real, dx_bTD))[0]
            d_other = d_embed if d_loss is None else jax.tree.map(jnp.add, d_embed, d_loss)
            return {"loss": loss, "dx": dx_bTD, "d_w": _masked(real, d_w), "d_other": d_other}

    def over_lanes(lane: Callable, data_SK: dict[str, jax.Array], t: jax.Array) -> Any:
        """`lane(w_C, c_C, data, flags)` on every stage (a vmap on `stage`) and batch shard (inside, a vmap
        on the batch axes) in slot t, with each stage's tokens and flags."""
        stage_S = jnp.arange(S)
        m_F, m_B = microbatches_in(t, S)
        flags = {"first": stage_S == 0, "last": stage_S == S - 1, "real_F": (m_F >= 0) & (m_F < M),
                 "real_B": (m_B >= 0) & (m_B < M)}

        def one_stage(w_C, c_C, data_K, m_F, m_B, flags):
            pick = lambda x_MKbT, m: jax.lax.dynamic_index_in_dim(x_MKbT, jnp.clip(m, 0, M - 1), 0, False)
            data_K = dict(data_K, inputs_F=pick(inputs_MKbT, m_F), inputs_B=pick(inputs_MKbT, m_B),
                          targets=pick(targets_MKbT, m_F))
            return jax.vmap(lane, in_axes=(None, None, 0, None), spmd_axis_name=batch)(w_C, c_C, data_K, flags)

        return jax.vmap(one_stage, spmd_axis_name="stage")(weights_SC, consts_SC, data_SK, m_F, m_B, flags)

    def stashed(stash_SWKbTD: jax.Array, t: jax.Array) -> jax.Array:
        """The input each stage backwards in slot t: microbatch m_B entered stage s in slot m_B + s, into
        ring entry (m_B + s) mod W."""
        entry_S = (microbatches_in(t, S)[1] + jnp.arange(S)) % W
        read = lambda stash_WKbTD, entry: jax.lax.dynamic_index_in_dim(stash_WKbTD, entry, 0, False)
        return activations(jax.vmap(read, spmd_axis_name="stage")(stash_SWKbTD, entry_S))

    def activations(x: jax.Array) -> jax.Array:
        return _constrain(x, mesh, "stage", batch, None, U, U)

    def accumulators(like: Any) -> Any:  # per stage and batch shard: one copy per device
        return jax.tree.map(lambda x: _constrain(jnp.zeros((S, K, *x.shape), x.dtype), mesh, "stage", batch,
                                                 *(U,) * x.ndim), like)

    def one_slot(carry, t, *, forward: bool, backward: bool):
        x_SKbTD, g_SKbTD, stash_SWKbTD, (loss_SK, d_w, d_other) = carry
        data = {"g": g_SKbTD, "stashed": stashed(stash_SWKbTD, t)}  # read before this slot's write
        if forward:
            x_in, y_SKbTD = over_lanes(forward_lane, {"x": x_SKbTD}, t)
            x_SKbTD = activations(_shift(activations(y_SKbTD), mesh))  # s → s+1: collective-permute
            stash_SWKbTD = jax.lax.dynamic_update_index_in_dim(stash_SWKbTD, x_in, t % W, 1)
            stash_SWKbTD = _constrain(stash_SWKbTD, mesh, "stage", None, batch, None, U, U)
            data = dict(data, x=x_in, y=y_SKbTD, shifted=x_SKbTD)
        if backward:
            out = over_lanes(functools.partial(backward_lane, with_loss=forward), data, t)
            dx_SKbTD = activations(out["dx"])  # s+1 → s: the shift's transpose, one collective-permute
            g_SKbTD = activations(jax.linear_transpose(functools.partial(_shift, mesh=mesh), dx_SKbTD)(dx_SKbTD)[0])
            loss_SK = loss_SK + out["loss"]
            d_w = jax.tree.map(jnp.add, d_w, out["d_w"])
            d_other = jax.tree.map(jnp.add, d_other, out["d_other"])
        return (x_SKbTD, g_SKbTD, stash_SWKbTD, (loss_SK, d_w, d_other)), None

    with in_lane():
        x_like = jax.eval_shape(first, other, inputs_MKbT[0, 0])
    empty = lambda *lead: jnp.full((*lead, *x_like.shape), fill, x_like.dtype)
    x_SKbTD, g_SKbTD = activations(empty(S, K)), activations(empty(S, K))
    stash_SWKbTD = _constrain(empty(S, W, K), mesh, "stage", None, batch, None, U, U)  # the ring, W entries
    carry = (x_SKbTD, g_SKbTD, stash_SWKbTD, (jnp.zeros((S, K), jnp.float32),
                                               accumulators(jax.tree.map(lambda w: w[0], weights_SC)),
                                               accumulators(other)))
    for start, stop, forward, backward in ((0, S - 1, True, False), (S - 1, M + S - 1, True, True),
                                           (M + S - 1, slots(S, M), False, True)):
        body = functools.partial(one_slot, forward=forward, backward=backward)
        carry, _ = jax.lax.scan(body, carry, jnp.arange(start, stop))
    x_SKbTD, g_SKbTD, _, (loss_SK, d_w, d_other) = carry
    # the per-shard (and, for `other`, per-stage) gradients reduced once, after the slots
    d_w = jax.tree.map(lambda g: g.sum(1).reshape(L, *g.shape[3:]), d_w)
    return loss_SK.sum(), d_w, jax.tree.map(lambda g: g.sum((0, 1)), d_other), (x_SKbTD, g_SKbTD)


def _in_stack(path: tuple, variable: Any) -> bool:
    return path[:1] == ("blocks",) and isinstance(variable, nnx.Param)


def model_loss_and_grads(model: nnx.Module, tokens_BT: jax.Array, *, mesh: Mesh, stages: int, microbatches: int,
                         remat: str = "none", chunk: int = 0,
                         poison_bubbles: bool = False) -> tuple[jax.Array, nnx.State]:
    """(mean next-token loss, gradients of every `nnx.Param`) of `model` (in parts: module docstring) on
    tokens [B, T + 1], as `jax.value_and_grad` of `meshpar.loss.next_token_loss` gives them, by 1F1B."""
    return _model_run(model, tokens_BT, mesh=mesh, stages=stages, microbatches=microbatches, remat=remat,
                      chunk=chunk, poison_bubbles=poison_bubbles)[:2]


def _model_run(model: nnx.Module, tokens_BT: jax.Array, *, mesh: Mesh, stages: int, microbatches: int, remat: str,
               chunk: int, poison_bubbles: bool) -> tuple[jax.Array, nnx.State, tuple[jax.Array, jax.Array]]:
    """`model_loss_and_grads`, also returning `one_f_one_b`'s in-flight buffers."""
    missing = [part for part in PARTS if not hasattr(model, part)]
    if missing:
        raise InputError(f"parallel.pipeline_schedule = 1f1b runs the model in parts ({', '.join(PARTS)}: "
                         f"meshpar.pipeline_1f1b); {type(model).__name__} has no {', '.join(missing)}")
    inputs_BT, targets_BT, positions_T = next_token_inputs(tokens_BT)
    parts, stack_params, other, others = nnx.split(model, _in_stack, nnx.Param, ...)
    with_other = lambda o: nnx.merge(parts, stack_params, o, others)

    def last(o: nnx.State, y_bTD: jax.Array, targets_bT: jax.Array) -> jax.Array:
        piece = with_other(o)
        return chunked_cross_entropy(piece.final_norm(y_bTD), piece.output_head(), targets_bT, chunk)

    embed = lambda o, tokens_bT: with_other(o).embed(tokens_bT)
    loss, d_stack, d_other, in_flight = one_f_one_b(model.blocks, other, embed, last, inputs_BT, targets_BT,
                                                    positions_T, mesh=mesh, stages=stages, microbatches=microbatches,
                                                    remat=remat, poison_bubbles=poison_bubbles)
    return loss, nnx.merge_state(nnx.State({"blocks": d_stack}), d_other), in_flight


def value_and_grad(graphdef: nnx.GraphDef, rest: nnx.State, loss: Any = None,
                   chunk: int = 0) -> Callable[[nnx.State, jax.Array], tuple[jax.Array, nnx.State]]:
    """The training step's `(params, tokens) → (loss, gradients)` for the model `graphdef`, `rest` by 1F1B,
    on the active Compute: S = its mesh's `stage` size, M = `parallel.microbatches` or 2S, its remat.
    `loss` must be None (next-token cross-entropy): a custom loss cannot run inside the pipeline."""
    if loss is not None:
        raise InputError("parallel.pipeline_schedule = 1f1b computes the next-token loss inside the pipeline, "
                         "microbatch by microbatch; a custom loss cannot run there: use pipeline_schedule=gpipe")

    def fn(params: nnx.State, tokens_BT: jax.Array) -> tuple[jax.Array, nnx.State]:
        compute = context.active()
        S = compute.mesh.shape["stage"]
        return model_loss_and_grads(nnx.merge(graphdef, params, rest), tokens_BT, mesh=compute.mesh, stages=S,
                                    microbatches=compute.rules.parallel.microbatches or 2 * S,
                                    remat=compute.remat, chunk=chunk)

    return fn
