"""The 1F1B pipeline schedule (PipeDream-Flush, Narayanan et al. 2021), plain or interleaved, and its
zero-bubble form, as one SPMD program.

Letters: P stages, M microbatches, R chunks per stage (interleaved), J = L/(P·R) layers per chunk, Z batch
shards (data × fsdp), b rows of a microbatch on one shard, W stash entries.

Why. GPipe (`meshpar.pipeline.gpipe`) runs every microbatch forward, then every one backward: each stage
keeps the input of every schedule iteration until the backward pass, M + P − 1 microbatches of
activations, so buying the bubble down with more microbatches costs memory. 1F1B starts a microbatch's
backward pass as soon as its forward pass has left the last stage, so a stage holds a bounded number of
microbatches whatever M is: activation memory flat in M, the same bubble.

The schedule. One slot = every stage runs the forward of one microbatch and the backward of another (a
VJP driven here, not `jax.grad` of the whole). Stage q forwards microbatch m in slot m + q and
backwards it in slot m + 2(P − 1) − q (`schedule.microbatches_in`); the last stage turns its forward
output into the loss and its cotangent in the same slot, and backwards it at once. P = 3, M = 4
(Fm / Bm: forward / backward of m):

    slot     0    1    2      3      4      5      6    7
    stage 0  F0   F1   F2     F3     B0     B1     B2   B3
    stage 1  .    F0   F1     F2 B0  F3 B1  B2     B3   .
    stage 2  .    .    F0 B0  F1 B1  F2 B2  F3 B3  .    .
    runs     F    F    F+B    F+B    F+B    F+B    B    B

n = M + 2(P − 1) slots (`schedule.slots`) in three phases (`schedule.phases`): P − 1 that only forward
(nothing has reached the last stage yet), M that do both, P − 1 that only backward (the last forward is
done). They are three `lax.scan`s over the same slot function, so a forward-only slot computes no backward
and costs F, a backward-only one B: the step takes (P − 1)·F + M·(F + B) + (P − 1)·B = (M + P − 1)·(F + B),
and each stage works M·(F + B) of it: GPipe's bubble (`schedule.bubble_fraction`). Bubble slots compute on
zeros and selects drop their results; `poison_bubbles=True` feeds them NaN instead, so a test proves
none reaches the loss or a gradient.

Interleaved (R > 1 chunks per stage; Narayanan et al. 2021 §2.2). Stage q holds chunks c = 0 … R−1 of
J = L/(P·R) layers, chunk c being virtual stage c·P + q (the order at rest of `meshpar.pipeline.order`).
Microbatches go in groups of P, each group through chunk 0 of every stage, then chunk 1, … (M a multiple
of P); an activation leaving stage P − 1 goes round the ring to stage 0 for the next chunk, and the
backwards mirror the forwards R·P − 1 slots later, cotangents going round the other way. A slot then runs
one chunk's forward and one chunk's backward per stage (the chunks picked per stage by a dynamic index),
R·M + R·P + P − 2 slots in the same three phases, R·P − 1 forward-only and R·P − 1 backward-only: the step
takes (R·M + P − 1)·(F + B)/R, the bubble (P − 1)/(R·M + P − 1); the stash holds 2(R·P − 1) chunk inputs
(`schedule`: `microbatches_in`, `forward_slot`, `phases`, `stash_size`). Everything below holds per chunk.

Zero-bubble (ZB-H1's order, Qi et al. 2023; `zero_bubble=True`). The same slots, each backward split
(`meshpar.pipeline.split_backward`): the input's gradient in the backward's slot, the weights' gradient from
the boundary it leaves, in slot u + R·P + P − 2 for a stage's u-th backward on every stage (stage q defers
it q slots, a ring of P boundaries), so that the weights' parts fill the last R·M slots, which 1F1B spends
on stage 0's ramp-down: (P − 1)(F + B)/R idles instead of (P − 1)(F + B + W)/R (`schedule`:
`weight_offset`, `weight_grads_in`, `zero_bubble_phases`, `zero_bubble_fraction`, `deferred_size`). The
gradients the split finishes with the input's (`Split.early`: norms' scales, a mixture's experts) are added
in the backward's slot. The split is traced under the vmaps over stages and batch shards, as a lane runs
the layer, so that a shard_map inside (context attention, the experts' dispatch) leaves those mesh axes to
the vmaps, as it does when a lane runs it whole.

Each slot is computed like GPipe's iterations, under the vmaps over stages and batch shards of
`meshpar.pipeline.stages`, so the layers run unchanged under GSPMD. The loss runs per microbatch inside the
pipeline, on the last stage, and so does the embedding, on the first: the model is taken in parts
(below). Under the vmap every stage computes both, masked (the last stage's loss and the first stage's
lookup are on the critical path anyway, so no slot gets longer).

Collectives per step (per device; a = one microbatch's activations on one device, as in `gpipe`):
- activations q → q+1 (`stages.shift`): one collective-permute of a per forward slot, M + P − 1;
- cotangents q+1 → q (its transpose): one collective-permute of a per backward slot, M + P − 1;
- the gradients of the stage weights over data × fsdp, of the embedding and head over stage, data and
  fsdp, and the loss: reduced once, after the slots (XLA combines them: 2 all-reduces without TP);
  FSDP's gathers of every weight once, before them (the weights stay whole over fsdp for the step, as
  in GPipe); the layers' own (tensor and context parallelism) in every slot, bubbles included.
No stage-0 result is all-reduced over `stage` (GPipe's): the loss never leaves the last stage. Within a
slot the collectives run in one order on every device, forward, shift, loss, backward, shift (`_after`).

Memory. A stage keeps the input of every microbatch it has forwarded and not yet backwarded, for the
backward pass to recompute the stage from (the standard trade: one more forward of each stage, what
GPipe pays with remat=full; `remat` then applies per layer inside that recompute). Stage q holds
microbatch m from slot m + q to slot m + 2(P − 1) − q: 2(P − 1 − q) slots, at most 2(P − 1) microbatch
inputs (stage 0), a ring stash of W = `schedule.stash_size(P)` entries read before it is written in each
slot. That is the bound for any lockstep schedule with GPipe's bubble. (The asynchronous 1F1B holds P:
there a hop costs one forward, not a forward and a backward.) Beside the stash, the two in-flight
buffers, one stage's backward working set, and per batch shard (one per device) the weight and
embedding/head gradient accumulators: nothing grows with M but the int32 tokens.

The model's parts, the one protocol: `embed(tokens_BT) -> x_BTD` (the input of the stacked layers),
`blocks` (the stacked layers, run by `meshpar.layers.scan`, each called as `layer(x_BTD, positions_T)`,
or with packed documents `layer(x_BTD, positions_BT, segments_BT)`: the rows of the microbatch, like the
tokens), `final_norm(x_BTD) -> hidden_BTD` and `output_head() -> head_DV`, such that `hidden_states(tokens,
positions)` is `final_norm(layers.scan(blocks, embed(tokens), positions))` and the loss is meshpar's
chunked cross-entropy of `hidden` and `output_head()`, weighted (`meshpar.batch`): `models/transformer.py`
offers them. Where the layers carry more than the residual stream, or layers run before the stack, the
model offers `stack_input(tokens_BT, *args)` (the layers' args of those rows), their input (embed's output
and the rest), used in embed's place: a mixture of experts' layers carry `(x_BTD, RouterStats)`, the router
statistics of each row; a `layer_prefix`'s layers run there, on stage 0 in each slot (`meshpar.layers`).
Every buffer, the stash, the shift and the cotangents then hold that tuple, and the loss of a microbatch
adds its router losses pooled over the microbatch's rows (the lanes' statistics summed: `LANES`) and its
MoE layers, weighed 1/M (`train.router_loss_scope = microbatch`; `meshpar.moe.routing`). Evaluation (no
backward) keeps GPipe's forward (`layers.scan`), which holds no activations for a backward pass.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshpar import context, remat as remat_lib
from meshpar.batch import Batch
from meshpar.errors import InputError
from meshpar.loss import chunked_cross_entropy, next_token_inputs
from meshpar.moe import routing
from meshpar.pipeline import schedule, split_backward, stages as stages_lib
from meshpar.pipeline.stages import U, constrain

PARTS = ("embed", "blocks", "final_norm", "output_head")

# (other params, tokens [b, T], the layers' args for those rows) → the stacked layers' input: x [b, T, D], or a
# tuple with the rows first (a mixture of experts' residual stream and router statistics)
First = Callable[..., Any]
# (other params, the layers' output, (targets [b, T], their weights [b, T])) → (the rows' weighted loss sum, a
# report: what the step adds up per microbatch, e.g. router statistics; () for none)
Last = Callable[[nnx.State, Any, tuple[jax.Array, jax.Array]], tuple[jax.Array, Any]]
# The vmap over a stage's batch shards: a loss pools a microbatch's rows over it (`jax.lax.psum(x, LANES)`).
LANES = "lanes"


class Result(NamedTuple):
    """A 1F1B step: the loss, the gradients, per microbatch the sum of `Last`'s reports [M, ...], and the
    in-flight buffers after the last slot (a test's view of the bubbles): the activations that went to each
    stage [P, Z, b, T, D] and the cotangents that came back to it."""

    loss: jax.Array
    grads: nnx.State
    reports: Any
    in_flight: tuple[Any, Any]


class _Flags(NamedTuple):
    """Per stage in a slot: the chunks of its layers it forwards (F) and backwards (B) (0 without
    interleaving), whether each is the model's first chunk (stage 0's chunk 0: the embedding before it) or
    the forward its last (the last stage's last chunk: the loss after it), and whether the microbatches
    exist (else it computes on a bubble)."""

    chunk_F: jax.Array
    chunk_B: jax.Array
    first_F: jax.Array
    first_B: jax.Array
    last_F: jax.Array
    real_F: jax.Array
    real_B: jax.Array
    chunk_W: jax.Array
    real_W: jax.Array


class _Lane(NamedTuple):
    """What one stage sees of a slot on one batch shard: the cotangent from the stage after and the stashed
    input of the microbatch it backwards; the activation from the stage before, and after its forward its
    output before and after the shift; the tokens of the microbatches it forwards and backwards, with their
    rows of the layers' per-row arguments (`stages.row_args`), and the targets and weights of the one it
    forwards."""

    g: jax.Array | None = None
    stashed: jax.Array | None = None
    x: jax.Array | None = None
    y: jax.Array | None = None
    shifted: jax.Array | None = None
    inputs_F: jax.Array | None = None
    inputs_B: jax.Array | None = None
    rows_F: tuple | None = None
    rows_B: tuple | None = None
    targets: tuple[jax.Array, jax.Array] | None = None


class _Backward(NamedTuple):
    """A backward lane's results: its share of the loss and its report, its input's cotangent, its gradients
    (zero-bubble: the early leaves of the weights' gradient, and its chunk's boundary for the others)."""

    loss: jax.Array
    report: Any
    dx: Any
    d_w: nnx.State | list
    d_other: nnx.State
    boundary: Any = ()


def _masked(keep: jax.Array, tree: Any) -> Any:
    """`tree` where `keep`, zeros elsewhere: a select, so a NaN in a dropped bubble never propagates."""
    return jax.tree.map(lambda x: jnp.where(keep, x, jnp.zeros_like(x)), tree)


def _where(keep: jax.Array, a: Any, b: Any) -> Any:
    """`a` where `keep`, else `b`, leaf by leaf (b may be a scalar)."""
    return jax.tree.map(lambda x, y: jnp.where(keep, x, y), a, jax.tree.map(lambda x: b, a) if jnp.isscalar(b) else b)


def _after(x: Any, *tokens: Any) -> Any:
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
    return _masked(~never, x)


def _ring_read(ring_PW: Any, entry_P: jax.Array) -> Any:
    """Each stage's own entry of a ring [P, W, ...] of every leaf (the stash, zero-bubble's boundaries): [P, ...]."""
    read = lambda ring_W, entry: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, entry, 0, False), ring_W)
    return jax.vmap(read, spmd_axis_name="stage")(ring_PW, entry_P)


def _ring_write(ring_PW: Any, value_P: Any, entry: jax.Array) -> Any:
    """Every stage's `value_P` into entry `entry` of its ring [P, W, ...]."""
    return jax.tree.map(lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x, entry, 1), ring_PW, value_P)


def _add_leaves(tree: Any, leaves: tuple[int, ...], values: list) -> Any:
    """`tree` with `values` added to its leaves numbered `leaves` (in flattening order)."""
    flat, treedef = jax.tree.flatten(tree)
    for i, value in zip(leaves, values):
        flat[i] = flat[i] + value
    return jax.tree.unflatten(treedef, flat)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


class _Schedule:
    """One 1F1B step: the stage weights and tokens as the slots read them, the lanes, and the slots."""

    def __init__(self, stack: nnx.Module, other: nnx.State, first: First, last: Last, inputs_BT: jax.Array,
                 targets: tuple[jax.Array, jax.Array], args: tuple, *, mesh: Mesh, stages: int, microbatches: int,
                 repeats: int, remat: str, poison_bubbles: bool, zero_bubble: bool = False):
        self.graphdef, weights, consts = nnx.split(stack, nnx.Param, ...)
        leaves = jax.tree.leaves(weights)
        if not leaves:
            raise InputError("1f1b pipeline: the stack has no parameters")
        self.L, batch = leaves[0].shape[0], stages_lib.batch_axes(mesh)
        stages_lib.check(self.L, inputs_BT.shape[0], mesh.shape, stages=stages, microbatches=microbatches,
                         repeats=repeats, batch=batch)
        schedule.check_interleaving(stages, microbatches, repeats)
        self.policy = None if remat == "none" else remat_lib.policy(remat)  # per layer, in the recompute
        self.zero_bubble, self.split = zero_bubble, None  # the layer's split backward, made in `run`
        self.P, self.M, self.R, self.mesh, self.args = stages, microbatches, repeats, mesh, args
        self.J = self.L // (stages * repeats)  # layers per chunk
        lanes = stages_lib.lane_axes(batch)  # a lane's rows stay split over `expert`
        self.lanes, self.inside = lanes or None, tuple(axis for axis in batch if axis not in lanes) or None
        self.Z = math.prod(mesh.shape[axis] for axis in lanes)
        self.W, self.fill = schedule.stash_size(stages, repeats), jnp.nan if poison_bubbles else 0.0
        self.first, self.last, self.lane_compute = first, last, stages_lib.lane_context(self.lanes, batch)
        # The stage weights [L, ...] → [P, R, J, ...] with P on `stage`, and the other weights (embedding,
        # head) in their compute layout: gathered over fsdp here, ONCE per step.
        self.weights_PRJ, self.consts_PRJ = (jax.tree.map(self._stage_view, tree, is_leaf=_is_variable)
                                           for tree in (weights, consts))
        self.other = jax.tree.map(self._compute_view, other, is_leaf=_is_variable)
        self.inputs_MZbT, self.targets_MZbT = self._microbatched(inputs_BT), jax.tree.map(self._microbatched, targets)
        self.rows_MZb = jax.tree.map(self._microbatched, stages_lib.row_args(args, inputs_BT.shape[0]))

    def _stage_view(self, variable: nnx.Variable) -> nnx.Variable:
        """[L, ...] at rest → [P, R, J, ...]: stage q's chunk c, the layers of virtual stage c·P + q. At rest
        each of the p stage groups holds its R chunks in turn (`meshpar.pipeline.order`), each the layers
        of its P/p stages: a local transpose."""
        rest = stages_lib.weight_spec(variable, self.mesh, stacked=True)
        value = constrain(variable[...], self.mesh, "stage", *rest)
        p = self.mesh.shape["stage"]
        value = value.reshape(p, self.R, self.P // p, self.J, *variable.shape[1:])
        value = value.swapaxes(1, 2).reshape(self.P, self.R, self.J, *variable.shape[1:])
        return variable.replace(constrain(value, self.mesh, "stage", None, None, *rest))

    def _at_rest(self, g_PRJ: jax.Array) -> jax.Array:
        """The inverse of `_stage_view`: [P, R, J, ...] → [L, ...] in the order at rest."""
        p = self.mesh.shape["stage"]
        g = g_PRJ.reshape(p, self.P // p, self.R, self.J, *g_PRJ.shape[3:]).swapaxes(1, 2)
        return g.reshape(self.L, *g_PRJ.shape[3:])

    def _compute_view(self, variable: nnx.Variable) -> nnx.Variable:
        if context.active() is None or variable.get_metadata().get("out_sharding") is None:
            return variable
        return variable.replace(constrain(variable[...], self.mesh,
                                          *stages_lib.weight_spec(variable, self.mesh, stacked=False)))

    def _microbatched(self, x_BT: jax.Array) -> jax.Array:
        """Microbatch m = rows m, M + m, …, its b rows on batch shard z at [m, z]: a local reshape."""
        B, rest = x_BT.shape[0], x_BT.shape[1:]
        x_MZbT = x_BT.reshape(B // self.M, self.M, *rest).swapaxes(0, 1).reshape(self.M, self.Z, -1, *rest)
        return constrain(x_MZbT, self.mesh, None, self.lanes, self.inside, *(U,) * len(rest))

    def _first(self, other: nnx.State, tokens_bT: jax.Array, rows: tuple) -> Any:
        """`first` on a lane's tokens, with the layers' args of its rows (a prefix of layers runs there)."""
        return self.first(other, tokens_bT, *stages_lib.lane_args(self.args, rows))

    def _in_lane(self):
        return context.use(self.lane_compute) if self.lane_compute is not None else contextlib.nullcontext()

    def _laid_out(self, tree: Any, *lead: Any) -> Any:
        """Every leaf of `tree` on the mesh axes `lead` of its leading dimensions, the rest the compiler's."""
        return jax.tree.map(lambda a: constrain(a, self.mesh, *lead, *(U,) * (a.ndim - len(lead))), tree)

    def _activations(self, x_PZb: Any) -> Any:
        return self._laid_out(x_PZb, "stage", self.lanes, self.inside)

    def _stash_layout(self, stash_PWZb: Any) -> Any:
        return self._laid_out(stash_PWZb, "stage", None, self.lanes, self.inside)

    def _stage(self, w_RJ: nnx.State, c_RJ: nnx.State, chunk: jax.Array, x_bTD: Any, rows: tuple) -> Any:
        """Chunk `chunk` of a stage's R: its J layers on one batch shard's rows of a microbatch."""
        w_J, c_J = self._chunk(w_RJ, chunk), self._chunk(c_RJ, chunk)
        args = stages_lib.lane_args(self.args, rows)

        def one_layer(x, layer):
            return nnx.merge(self.graphdef, *layer)(x, *args), None

        if self.policy is not None:  # the backward's recompute keeps what the policy saves, per layer
            one_layer = jax.checkpoint(one_layer, policy=self.policy, prevent_cse=False)
        return jax.lax.scan(one_layer, x_bTD, (w_J, c_J))[0]

    def _chunk(self, tree_RJ: Any, chunk: jax.Array) -> Any:
        # one chunk: a static index, which XLA:GPU does not copy out of the stage weights (a dynamic one costs
        # llama_8b's 1F1B on stage=4,data=2 1.3 GB more per GPU)
        index = (lambda x: x[0]) if self.R == 1 else (lambda x: jax.lax.dynamic_index_in_dim(x, chunk, 0, False))
        return jax.tree.map(index, tree_RJ)

    def _input_grad(self, w_RJ: nnx.State, c_RJ: nnx.State, chunk: jax.Array, x_bTD: Any, g_bTD: Any,
                    rows: tuple) -> tuple[Any, tuple[list, list]]:
        """Zero-bubble's backward of chunk `chunk`: its input's cotangent and, per layer, the boundary its
        weights' gradient reads later and the weights' gradients it cannot defer (`split_backward`: early).
        Without remat the forward keeps every layer's residuals for it; with any policy only each layer's
        input, and each layer's forward runs again."""
        w_J, c_J = self._chunk(w_RJ, chunk), self._chunk(c_RJ, chunk)
        args = stages_lib.lane_args(self.args, rows)
        keep_all = self.policy is None

        def forward(x, layer):
            y, residuals = self.split.forward(layer[0], x, (layer[1], args))
            return y, residuals if keep_all else x

        def backward(g, layer_saved):
            (w, c), saved = layer_saved
            residuals = saved if keep_all else self.split.forward(w, saved, (c, args))[1]
            dx, boundary, early = self.split.input_grad(w, residuals, g)
            return dx, (boundary, early)

        saved_J = jax.lax.scan(forward, x_bTD, (w_J, c_J))[1]
        return jax.lax.scan(backward, g_bTD, ((w_J, c_J), saved_J), reverse=True)

    def _in_chunk(self, w_RJ: nnx.State, leaves: tuple[int, ...], d_J: list, chunk: jax.Array) -> list:
        """Zero-bubble: the gradients `d_J` [J, ...] of the stage weights' `leaves`, as the stage's [R, J, ...],
        zeros but for chunk `chunk`."""
        if self.R == 1:
            return [d[None] for d in d_J]
        w_leaves = jax.tree.leaves(w_RJ)
        return [jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(w_leaves[i]), d, chunk, 0)
                for i, d in zip(leaves, d_J)]

    def _weight_lane(self, w_RJ: nnx.State, c_RJ: nnx.State, lane: _Lane, flags: _Flags) -> list:
        """Zero-bubble: one stage on one batch shard computes the weights' gradient of chunk c_W of a
        microbatch it backwarded earlier, from that backward's boundary: the `late` leaves (`split_backward`)."""
        with self._in_lane():
            w_J = self._chunk(w_RJ, flags.chunk_W)
            d_J = jax.lax.scan(lambda _, w_boundary: (None, self.split.weight_grad(*w_boundary)), None,
                               (w_J, lane.stashed))[1]
            return _masked(flags.real_W, self._in_chunk(w_RJ, self.split.late, d_J, flags.chunk_W))

    def _forward_lane(self, w_RJ: nnx.State, c_RJ: nnx.State, lane: _Lane, flags: _Flags) -> tuple[Any, Any]:
        """One stage on one batch shard: the forward of microbatch m_F through chunk c_F, whose input is the
        embedding for the first chunk, else what came from the stage before. Returns (its input, its output)."""
        with self._in_lane():
            x_bTD = _where(flags.first_F, self._first(self.other, lane.inputs_F, lane.rows_F), lane.x)
            x_bTD = _where(flags.real_F, x_bTD, self.fill)
            return x_bTD, self._stage(w_RJ, c_RJ, flags.chunk_F, x_bTD, lane.rows_F)

    def _loss_lane(self, lane: _Lane, flags: _Flags) -> tuple[jax.Array, Any, nnx.State, Any, Any]:
        """The last stage's loss of the microbatch it just forwarded: (loss, report, its gradient of `other`,
        the cotangent and input its backward takes there), zeros and `lane`'s own elsewhere."""
        at_loss = flags.last_F & flags.real_F
        y_bTD = _after(lane.y, lane.shifted)  # the loss's collectives after the shift's
        loss, loss_vjp, report = jax.vjp(lambda o, y: self.last(o, y, lane.targets), self.other, y_bTD, has_aux=True)
        d_loss, g_last = loss_vjp(jnp.ones_like(loss))
        x_B = _after(lane.stashed, g_last, d_loss)  # the stage's collectives after the loss's
        return (jnp.where(at_loss, loss, 0.0), _masked(at_loss, report), _masked(at_loss, d_loss),
                _where(at_loss, g_last, lane.g), _where(at_loss, lane.x, x_B))

    def _backward_lane(self, w_RJ: nnx.State, c_RJ: nnx.State, lane: _Lane, flags: _Flags, *,
                       with_loss: bool) -> _Backward:
        """One stage on one batch shard: the backward of microbatch m_B through chunk c_B, recomputing the
        chunk from its stashed input, with the cotangent from the stage after; `with_loss`: the last chunk of
        the last stage first turns its forward output (of m_F, which is m_B there) into the loss and that
        cotangent. The weights' gradient is the stage's [R, J, ...], zeros but for chunk c_B."""
        with self._in_lane():
            loss, report, d_loss, g_bTD, x_B = jnp.zeros(()), self.no_report, None, lane.g, lane.stashed
            if with_loss:
                loss, report, d_loss, g_bTD, x_B = self._loss_lane(lane, flags)
            real = flags.real_B
            g_bTD, x_B = _where(real, g_bTD, self.fill), _where(real, x_B, self.fill)
            if self.zero_bubble:  # most weights' gradient later, from the boundary; the early leaves now
                dx_bTD, (boundary, early_J) = self._input_grad(w_RJ, c_RJ, flags.chunk_B, x_B, g_bTD, lane.rows_B)
                d_w = self._in_chunk(w_RJ, self.split.early, early_J, flags.chunk_B)
            else:
                boundary = ()
                d_w, dx_bTD = jax.vjp(lambda w, x: self._stage(w, c_RJ, flags.chunk_B, x, lane.rows_B), w_RJ,
                                      x_B)[1](g_bTD)
            # The first chunk hands its input's cotangent to the embedding (zeros elsewhere: a scatter of zeros).
            d_embed = jax.vjp(lambda o: self._first(o, lane.inputs_B, lane.rows_B), self.other)[1](
                _masked(flags.first_B & real, dx_bTD))[0]
            d_other = d_embed if d_loss is None else jax.tree.map(jnp.add, d_embed, d_loss)
            return _Backward(loss, report, dx_bTD, _masked(real, d_w), d_other, boundary)

    def _over_lanes(self, lane_fn: Callable, lanes_PZ: _Lane, t: jax.Array) -> Any:
        """`lane_fn(w_RJ, c_RJ, lane, flags)` on every stage (a vmap on `stage`) and batch shard (inside, a vmap
        on the batch axes) in slot t, with each stage's tokens and flags."""
        stage_P = jnp.arange(self.P)
        m_F, c_F, m_B, c_B = schedule.microbatches_in(t, self.P, self.R)
        m_W, c_W = (jnp.broadcast_to(a, (self.P,)) for a in schedule.weight_grads_in(t, self.P, self.R))
        flags = _Flags(c_F, c_B, (stage_P == 0) & (c_F == 0), (stage_P == 0) & (c_B == 0),
                       (stage_P == self.P - 1) & (c_F == self.R - 1), (m_F >= 0) & (m_F < self.M),
                       (m_B >= 0) & (m_B < self.M), c_W, (m_W >= 0) & (m_W < self.M))
        pick = lambda tree, m: jax.tree.map(
            lambda x_MZbT: jax.lax.dynamic_index_in_dim(x_MZbT, jnp.clip(m, 0, self.M - 1), 0, False), tree)

        def one_stage(w_J, c_J, lanes_Z, m_F, m_B, flags):
            lanes_Z = lanes_Z._replace(inputs_F=pick(self.inputs_MZbT, m_F), inputs_B=pick(self.inputs_MZbT, m_B),
                                       rows_F=pick(self.rows_MZb, m_F), rows_B=pick(self.rows_MZb, m_B),
                                       targets=pick(self.targets_MZbT, m_F))
            return jax.vmap(lane_fn, in_axes=(None, None, 0, None), axis_name=LANES, spmd_axis_name=self.lanes)(
                w_J, c_J, lanes_Z, flags)

        return jax.vmap(one_stage, spmd_axis_name="stage")(self.weights_PRJ, self.consts_PRJ, lanes_PZ, m_F, m_B, flags)

    def _stashed(self, stash_PWZbTD: Any, t: jax.Array) -> Any:
        """The input each stage backwards in slot t: it entered the stage (for chunk c_B) in the slot that
        forwarded it, into that slot's ring entry, mod W."""
        _, _, m_B, c_B = schedule.microbatches_in(t, self.P, self.R)
        entry_P = schedule.forward_slot(m_B, c_B, jnp.arange(self.P), self.P, self.R) % self.W
        return self._activations(_ring_read(stash_PWZbTD, entry_P))

    def _deferred_layout(self, ring_PWZ: Any) -> Any:
        return self._laid_out(ring_PWZ, "stage", None, self.lanes)

    def _slot(self, carry, t, *, forward: bool, backward: bool, weights: bool = False):
        """Slot t: every stage's forward (then the shift on) and backward (then the shift back); zero-bubble:
        the backward's boundary into the ring of deferred weights' parts, and a weights' part from it."""
        x_PZbTD, g_PZbTD, stash_PWZbTD, deferred_PWZ, (loss_PZ, reports_PZM, d_w, d_other) = carry
        lanes = _Lane(g=g_PZbTD, stashed=self._stashed(stash_PWZbTD, t))  # read before this slot's write
        shift = lambda tree: jax.tree.map(functools.partial(stages_lib.shift, mesh=self.mesh), tree)
        if forward:
            x_in, y_PZbTD = self._over_lanes(self._forward_lane, _Lane(x=x_PZbTD), t)
            x_PZbTD = self._activations(shift(self._activations(y_PZbTD)))  # q → q+1
            stash_PWZbTD = self._stash_layout(_ring_write(stash_PWZbTD, x_in, t % self.W))
            lanes = lanes._replace(x=x_in, y=y_PZbTD, shifted=x_PZbTD)
        if backward:
            out = self._over_lanes(functools.partial(self._backward_lane, with_loss=forward), lanes, t)
            dx_PZbTD = self._activations(out.dx)  # q+1 → q: the shift's transpose, one collective-permute
            g_PZbTD = self._activations(jax.linear_transpose(shift, dx_PZbTD)(dx_PZbTD)[0])
            loss_PZ = loss_PZ + out.loss
            if forward:  # the report of microbatch m_F, which only the loss's slots have
                m_F = jnp.clip(schedule.microbatches_in(t, self.P, self.R)[0][-1], 0, self.M - 1)
                reports_PZM = jax.tree.map(lambda acc, r: acc.at[:, :, m_F].add(r), reports_PZM, out.report)
            d_other = jax.tree.map(jnp.add, d_other, out.d_other)
            if not self.zero_bubble:
                d_w = jax.tree.map(jnp.add, d_w, out.d_w)
            else:  # written before it is read: stage 0 takes its own at once
                d_w = _add_leaves(d_w, self.split.early, out.d_w)
                deferred_PWZ = self._deferred_layout(_ring_write(deferred_PWZ, out.boundary, t % self.W_deferred))
        if weights:  # stage q backwarded the chunk it takes now q slots ago (`schedule.weight_offset`)
            boundary_PZ = _ring_read(deferred_PWZ, (t - jnp.arange(self.P)) % self.W_deferred)
            # its collectives (a weight gradient's sum over positions SP splits) after the backward's: the shift's,
            # the embedding's
            boundary_PZ = _after(boundary_PZ, g_PZbTD, d_other)
            d_w = _add_leaves(d_w, self.split.late, self._over_lanes(self._weight_lane, _Lane(stashed=boundary_PZ), t))
        return (x_PZbTD, g_PZbTD, stash_PWZbTD, deferred_PWZ, (loss_PZ, reports_PZM, d_w, d_other)), None

    def _accumulators(self, like: Any) -> Any:  # per stage and batch shard: one copy per device
        return self._laid_out(jax.tree.map(lambda x: jnp.zeros((self.P, self.Z, *x.shape), x.dtype), like), "stage",
                              self.lanes)

    def _report_like(self, x_like: Any) -> Any:
        """The shape of `last`'s report on one lane (it pools over the lanes: evaluated under their vmap)."""
        def report(x, targets):
            with self._in_lane():
                return self.last(self.other, x, targets)[1]

        zeros_Z = lambda tree: jax.tree.map(lambda a: jnp.zeros((self.Z, *a.shape), a.dtype), tree)
        targets = jax.tree.map(lambda t: t[0], self.targets_MZbT)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), jax.eval_shape(
            jax.vmap(report, axis_name=LANES), zeros_Z(x_like), targets))

    def _deferred_ring(self, x_like: Any) -> list:
        """Zero-bubble: splits a layer's backward (`split_backward`, traced as a lane runs it) and makes the ring
        of the boundaries of deferred weights' parts, [P, P, Z, J, ...] per boundary value (NaN-filled with
        poisoned bubbles: a weights' part of a bubble reads no real boundary)."""
        per_layer = lambda tree, lead: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[lead:], a.dtype), tree)
        args = stages_lib.lane_args(per_layer(self.args, 0), per_layer(self.rows_MZb, 2))

        def trace(_):  # as a lane runs it (module docstring)
            self.split = split_backward.Split.of(
                lambda w, x, extra: nnx.merge(self.graphdef, w, extra[0])(x, *extra[1]),
                per_layer(self.weights_PRJ, 3), x_like, (per_layer(self.consts_PRJ, 3), args))

        with self._in_lane():
            lanes = jax.vmap(trace, axis_name=LANES, spmd_axis_name=self.lanes)
            jax.eval_shape(jax.vmap(lanes, spmd_axis_name="stage"), jnp.zeros((self.P, self.Z)))
        self.W_deferred = schedule.deferred_size(self.P)

        def ring(aval):
            fill = self.fill if jnp.issubdtype(aval.dtype, jnp.inexact) else 0
            return jnp.full((self.P, self.W_deferred, self.Z, self.J, *aval.shape), fill, aval.dtype)

        return self._deferred_layout([ring(v.aval) for v in self.split.boundary])

    def run(self) -> tuple[jax.Array, nnx.State, nnx.State, Any, tuple[Any, Any]]:
        """The slots, phase by phase: (loss, stack gradients, `other` gradients, reports, in-flight buffers)."""
        P, Z = self.P, self.Z
        with self._in_lane():
            x_like = jax.eval_shape(self._first, self.other, self.inputs_MZbT[0, 0],
                                    jax.tree.map(lambda a: a[0, 0], self.rows_MZb))
        report_like = self._report_like(x_like)
        self.no_report = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), report_like)
        empty = lambda *lead: jax.tree.map(lambda a: jnp.full((*lead, *a.shape), self.fill, a.dtype), x_like)
        x_PZbTD, g_PZbTD = self._activations(empty(P, Z)), self._activations(empty(P, Z))
        stash_PWZbTD = self._stash_layout(empty(P, self.W, Z))
        reports_PZM = jax.tree.map(lambda a: jnp.zeros((P, Z, self.M, *a.shape), a.dtype), report_like)
        deferred_PWZ, phases = (), tuple((*phase, False) for phase in schedule.phases(P, self.M, self.R))
        if self.zero_bubble:
            deferred_PWZ, phases = self._deferred_ring(x_like), schedule.zero_bubble_phases(P, self.M, self.R)
        carry = (x_PZbTD, g_PZbTD, stash_PWZbTD, deferred_PWZ, (jnp.zeros((P, Z), jnp.float32), reports_PZM,
                                                  self._accumulators(jax.tree.map(lambda w: w[0], self.weights_PRJ)),
                                                  self._accumulators(self.other)))
        for start, stop, forward, backward, weights in phases:
            body = functools.partial(self._slot, forward=forward, backward=backward, weights=weights)
            carry, _ = jax.lax.scan(body, carry, jnp.arange(start, stop))
        x_PZbTD, g_PZbTD, _, _, (loss_PZ, reports_PZM, d_w, d_other) = carry
        # the per-shard (and, for `other`, per-stage) gradients reduced once, after the slots
        d_w = jax.tree.map(lambda g: self._at_rest(g.sum(1)), d_w)
        return (loss_PZ.sum(), d_w, jax.tree.map(lambda g: g.sum((0, 1)), d_other),
                jax.tree.map(lambda r: r.sum((0, 1)), reports_PZM), (x_PZbTD, g_PZbTD))


def one_f_one_b(stack: nnx.Module, other: nnx.State, first: First, last: Last, inputs_BT: jax.Array,
                targets: tuple[jax.Array, jax.Array], *args: jax.Array, mesh: Mesh, stages: int, microbatches: int,
                remat: str, poison_bubbles: bool, repeats: int = 1, zero_bubble: bool = False) -> Result:
    """The weighted loss of a batch and its gradients, as a 1F1B pipeline of the stacked layers (docstring).

    Per microbatch: `first(other, inputs)` on stage 0, the L layers of `stack` (each called as
    `layer(x, *args)`, the per-row args as the microbatch's rows) split into P stages, `last(other, y,
    (targets, weights))` (its rows' weighted loss sum: the weights of the whole batch sum to 1 for a mean,
    and a report) on the last stage, run on each batch shard's rows (a vmap named `LANES`). `stages` P (a
    multiple of the mesh's stage size), `microbatches` M (B/M rows each, divisible by the batch mesh
    axes), `repeats` R chunks per stage (interleaved 1F1B; the stack in the order at rest of
    `meshpar.pipeline.order`), `remat` the per-layer policy of the backward's recompute, `poison_bubbles`
    NaN in bubble slots. The gradients are those of the stack's parameters and of `other`.
    """
    loss, d_stack, d_other, reports, in_flight = _Schedule(
        stack, other, first, last, inputs_BT, targets, args, mesh=mesh, stages=stages, microbatches=microbatches,
        repeats=repeats, remat=remat, poison_bubbles=poison_bubbles, zero_bubble=zero_bubble).run()
    return Result(loss, (d_stack, d_other), reports, in_flight)


def _in_stack(path: tuple, variable: Any) -> bool:
    return path[:1] == ("blocks",) and isinstance(variable, nnx.Param)


def model_loss_and_grads(model: nnx.Module, batch: Batch | jax.Array, *, mesh: Mesh, stages: int,
                         microbatches: int, repeats: int = 1, remat: str = "none", chunk: int = 0,
                         aux_coef: float = 0.0, z_coef: float = 0.0, poison_bubbles: bool = False,
                         zero_bubble: bool = False) -> Result:
    """The next-token loss of `model` (in parts: module docstring) on a batch (or tokens [B, T + 1]) and the
    gradients of every `nnx.Param`: what `jax.value_and_grad` of `meshpar.loss.next_token_loss` gives, by
    1F1B (interleaved with `repeats` > 1: the stack, and its gradient, in the order at rest). A mixture of
    experts (its layers carry router statistics beside the residual stream) adds its router's losses,
    aux_coef · load balance + z_coef · z-loss, each pooled per microbatch over its rows and MoE layers and
    averaged over the microbatches (`meshpar.moe.routing`); its reports are each microbatch's pooled
    statistics [M, ...] (`RouterStats.grouped`), the others' ()."""
    missing = [part for part in PARTS if not hasattr(model, part)]
    if missing:
        raise InputError(f"parallel.pipeline_schedule = {'zero_bubble' if zero_bubble else '1f1b'} runs the model "
                         f"in parts ({', '.join(PARTS)}: "
                         f"meshpar.pipeline.one_f_one_b); {type(model).__name__} has no {', '.join(missing)}")
    x = next_token_inputs(batch)
    parts, stack_params, other, others = nnx.split(model, _in_stack, nnx.Param, ...)
    with_other = lambda o: nnx.merge(parts, stack_params, o, others)

    def last(o: nnx.State, carry: Any, targets: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, Any]:
        piece = with_other(o)
        y_bTD, stats = carry if isinstance(carry, tuple) else (carry, None)
        value = chunked_cross_entropy(piece.final_norm(y_bTD), piece.output_head(), targets[0], chunk, targets[1],
                                      getattr(piece, "logit_softcap", None))
        if stats is None:
            return value, ()
        stats = stats.grouped(1)  # this lane's rows; the microbatch's are all its lanes' (no gradient: f, n)
        pool = jax.tree.map(lambda s: jax.lax.psum(jax.lax.stop_gradient(s), LANES), stats)
        router = aux_coef * routing.balance_loss(stats, pool) + z_coef * routing.z_loss(stats, pool)
        return value + router / microbatches, jax.tree.map(lambda s: s[0], stats)

    def first(o: nnx.State, tokens_bT: jax.Array, *args: jax.Array) -> Any:
        piece = with_other(o)
        return piece.stack_input(tokens_bT, *args) if hasattr(piece, "stack_input") else piece.embed(tokens_bT)

    documents = () if x.segments is None else (x.segments,)
    result = one_f_one_b(model.blocks, other, first, last, x.inputs, (x.targets, x.weights), x.positions, *documents,
                         mesh=mesh, stages=stages, microbatches=microbatches, repeats=repeats, remat=remat,
                         poison_bubbles=poison_bubbles, zero_bubble=zero_bubble)
    d_stack, d_other = result.grads
    return result._replace(grads=nnx.merge_state(nnx.State({"blocks": d_stack}), d_other))


def value_and_grad(graphdef: nnx.GraphDef, rest: nnx.State, loss: Any = None, chunk: int = 0, aux_coef: float = 0.0,
                   z_coef: float = 0.0) -> Callable[[nnx.State, jax.Array], tuple[tuple[jax.Array, Any], nnx.State]]:
    """The training step's `(params, tokens) → ((loss, router statistics or None), gradients)` for the model
    `graphdef`, `rest` by 1F1B (as `jax.value_and_grad(..., has_aux=True)` of the step's loss gives them; a
    mixture of experts' router losses weighed `aux_coef`, `z_coef` and pooled per microbatch), on the
    active Compute: P = its mesh's `stage` size, M = `schedule.microbatches`, R its pipeline repeats, its
    remat. `loss` must be None (next-token cross-entropy): a custom loss cannot run inside the pipeline."""
    if loss is not None:
        raise InputError(f"parallel.pipeline_schedule = {context.active().rules.parallel.pipeline_schedule} computes "
                         "the next-token loss inside the pipeline, microbatch by microbatch; a custom loss cannot "
                         "run there: use pipeline_schedule=gpipe")

    def fn(params: nnx.State, batch: Batch) -> tuple[tuple[jax.Array, Any], nnx.State]:
        compute = context.active()
        P = compute.mesh.shape["stage"]
        result = model_loss_and_grads(nnx.merge(graphdef, params, rest), batch, mesh=compute.mesh, stages=P,
                                      microbatches=schedule.microbatches(compute.rules.parallel.microbatches, P),
                                      repeats=compute.rules.parallel.pipeline_repeats, remat=compute.remat,
                                      chunk=chunk, aux_coef=aux_coef, z_coef=z_coef,
                                      zero_bubble=compute.rules.parallel.pipeline_schedule == "zero_bubble")
        return (result.loss, result.reports or None), result.grads

    return fn
