"""Next-token cross-entropy that never holds the whole [B, T, V] logits.

The logits of a large vocabulary are the largest activation of a language model: float32 [B, T, V] is
4.2 GB per sequence of 8192 tokens at V = 128,256, and their softmax and gradient as much again. The
loss here runs over chunks of the sequence instead: a `lax.scan` over chunks of c positions, each
computing its logits [b, c, v] on one device, their log-sum-exp and the target logit, and returning only
a sum. The chunk's body is rematerialised (`jax.checkpoint`), so the backward pass recomputes one chunk's
logits at a time and keeps nothing of them: memory O(b·c·v), for one more forward pass of the output
head (2·B·T·D·V FLOPs, a third of the head's forward + backward).

Sharding. The loss is a `jax.shard_map` over the mesh axes that split the batch, the sequence and the
vocabulary, so each device works on its own rows, positions (zigzag order included: the mean does not
depend on the order) and vocabulary slice, with the output head [D, V/model] as compute uses it (gathered
once over `fsdp`, outside the chunk loop). Vocab-parallel (Megatron): the log-sum-exp takes the max and
the sum of exponentials across the `model` shards (pmax, psum of [b, c]) and the target logit comes from
the shard that holds it (psum); the full [B, T, V] logits never exist on one device. The hidden states
enter as ("batch", "seq", "embed") — with Megatron SP this is where their sequence is gathered over
`model`, as the head needs. In the backward pass every device accumulates its own partial gradient of the
head over the chunks, and it is reduced ONCE, where the shard_map hands it back (left to the compiler, a
chunk loop all-reduces the head's whole gradient in every chunk).

Weights (`meshpar.batch`): every target's loss is multiplied by its weight and the weighted losses are
summed; a batch without weights weighs each of its B·T targets 1/(B·T), so the loss is their mean. The
training step divides the weights by their sum over the global batch once, so any part of the batch — a
device's rows, a chunk, a microbatch — adds its share of the global mean, whatever the mesh or the
accumulation.

A model that offers `hidden_states(tokens, positions) -> [B, T, D]` and `output_head() -> [D, V]` gets the
chunked loss (its logits are `logits(hidden, head)`, soft-capped by its `logit_softcap` if it has one:
Gemma 2's final soft-capping); any other model is called as
`model(tokens, positions) -> logits`, or `model(tokens) -> logits`, and its logits are reduced whole. With
documents (segment ids) the model is called with them too: `hidden_states(tokens, positions, segments)`,
`model(tokens, positions, segments)`, the positions `[B, T]` restarting at every document.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from meshpar import context, sharding
from meshpar.attention import sequence_order
from meshpar.attention.flash import soft_cap
from meshpar.batch import Batch, as_batch, document_positions, loss_weights
from meshpar.divisors import largest_divisor
from meshpar.errors import InputError
from meshpar.moe import routing
from meshpar.moe.routing import RouterStats

# Per-device bytes of one chunk's float32 logits under `loss_chunk = 0` (auto): 256 MiB, a few percent
# of an accelerator, while a chunk's head matmul keeps ≥ 1k rows at 8B sizes (b·c = 4·256 on fsdp=8).
CHUNK_BYTES = 2**28


def logits(hidden_BTD: jax.Array, head_DV: jax.Array, softcap: float | None = None) -> jax.Array:
    """Float32 logits [B, T, V] of hidden states [B, T, D] through the output head [D, V]; with `softcap` c,
    c·tanh(logits / c) (Gemma 2's final soft-capping)."""
    logits_BTV = soft_cap(jnp.einsum("btd,dv->btv", hidden_BTD, head_DV, preferred_element_type=jnp.float32), softcap)
    return sharding.constrain(logits_BTV, ("batch", "seq", "vocab"))


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array) -> jax.Array:
    """Weighted sum over positions of logsumexp(logits) − logits[target], in float32, of whole logits.

    Written with a one-hot mask rather than a gather so that, with the vocabulary split over `model`
    by the compiler, every device reduces its own slice and only [B, T] partial sums cross devices.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    is_target_BTV = jnp.arange(logits_BTV.shape[-1]) == targets_BT[..., None]
    return jnp.sum(weights_BT * (logz_BT - jnp.sum(jnp.where(is_target_BTV, logits_BTV, 0.0), axis=-1)))


def chunk_length(b: int, t: int, v: int, chunk: int = 0) -> int:
    """Positions in one loss chunk on a device holding b rows, t positions and v vocabulary entries:
    `chunk` if given, else the most whose float32 logits stay within CHUNK_BYTES; always a divisor of t."""
    return largest_divisor(t, chunk or max(1, CHUNK_BYTES // (4 * b * v)))


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where the loss's inputs live: the specs of hidden [B, T, D], head [D, V] and targets [B, T], the mesh
    axes that split rows and positions (`rows`) and the vocabulary (`vocab`), and the shard_map's manual
    axes (those, and any that an enclosing vmap owns). No mesh: one device, no collectives."""

    mesh: Mesh | None = None
    hidden: P = P()
    head: P = P()
    targets: P = P()
    rows: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    scatter: tuple[str, ...] = ()  # the rows axes that split D in the head's gradient (ZeRO-2/3: fsdp)
    manual: frozenset[str] = frozenset()


def _placement(hidden_BTD: jax.Array, head_DV: jax.Array, targets_BT: jax.Array) -> _Placement:
    compute = context.active()
    if compute is None:
        return _Placement()
    mesh, table = compute.mesh, compute.rules.table("activations")
    spec = lambda logical, x: sharding.spec_for(logical, x.shape, table, mesh.shape, f"loss input {logical}")
    axes = sharding.spec_axes
    hidden, head = spec(("batch", "seq", "embed"), hidden_BTD), spec(("embed", "vocab"), head_DV)
    grads = sharding.spec_for(("embed", "vocab"), head_DV.shape, compute.rules.table("grads"), mesh.shape,
                              "head gradient")
    scatter = tuple(a for a in axes(grads[:1]) if a in axes(hidden))
    return _Placement(mesh, hidden, head, spec(("batch", "seq"), targets_BT), axes(hidden), axes(head), scatter,
                      frozenset(axes(hidden) + axes(head) + compute.vmapped))


def _sum(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return lax.psum(x, axes) if axes else x


def _chunks(x: jax.Array, c: int) -> jax.Array:
    """[b, t, ...] → [t/c, b, c, ...]: the chunks first, for the scan."""
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // c, c, *x.shape[2:]), 1, 0)


def _logits(hidden_bcD: jax.Array, head_Dv: jax.Array, softcap: float | None) -> jax.Array:
    return soft_cap(jnp.einsum("bcd,dv->bcv", hidden_bcD, head_Dv, preferred_element_type=jnp.float32), softcap)


def _is_target(targets_bc: jax.Array, v: int, vocab: tuple[str, ...]) -> jax.Array:
    """One-hot [b, c, v] of the targets within this device's vocabulary slice (all False elsewhere)."""
    first = lax.axis_index(vocab) * v if vocab else 0
    return jnp.arange(v) == (targets_bc - first)[..., None]


def _forward_local(hidden_btD, head_Dv, targets_bt, weights_bt, *, chunk: int, vocab: tuple[str, ...],
                   softcap: float | None):
    """This device's Σ weight · (logsumexp − target logit) as a [1] partial sum, and the log-sum-exp and the
    target's logit at every position [b, t] (over the whole vocabulary: max and sum of exponentials combined
    over `vocab`)."""
    c = chunk_length(*targets_bt.shape, head_Dv.shape[1], chunk)

    def one_chunk(total, inputs):
        hidden_bcD, targets_bc, weights_bc = inputs
        logits_bcv = _logits(hidden_bcD, head_Dv, softcap)
        max_bc = logits_bcv.max(axis=-1)
        max_bc = lax.pmax(max_bc, vocab) if vocab else max_bc
        lse_bc = max_bc + jnp.log(_sum(jnp.exp(logits_bcv - max_bc[..., None]).sum(axis=-1), vocab))
        is_target_bcv = _is_target(targets_bc, logits_bcv.shape[-1], vocab)
        target_bc = _sum(jnp.where(is_target_bcv, logits_bcv, 0.0).sum(axis=-1), vocab)
        return total + jnp.sum(weights_bc * (lse_bc - target_bc)), (lse_bc, target_bc)

    total, per_position = lax.scan(one_chunk, jnp.zeros((), jnp.float32),
                                   (_chunks(hidden_btD, c), _chunks(targets_bt, c), _chunks(weights_bt, c)))
    lse_bt, target_bt = (jnp.moveaxis(x_Cbc, 0, 1).reshape(targets_bt.shape) for x_Cbc in per_position)
    return total[None], lse_bt, target_bt


def _reduce_head(dhead_Dv: jax.Array, rows: tuple[str, ...], scatter: tuple[str, ...]) -> jax.Array:
    """Sum the head's partial gradients over the `rows` shards, leaving D split over `scatter` (the
    gradient's layout: ZeRO-2/3's fsdp). With a split, one reduce-scatter over all of `rows` (scatter axes
    major) and an all-gather back over the others: unlike an all-reduce, XLA does not combine it with the
    embedding's gradient reduction at the end of the backward pass, so the whole float32 gradient of the
    head dies here instead of living through every layer's backward pass."""
    others = tuple(a for a in rows if a not in scatter)
    if not scatter:
        return _sum(dhead_Dv, rows)
    if dhead_Dv.shape[0] % math.prod(lax.axis_size(a) for a in rows):
        return _sum(lax.psum_scatter(dhead_Dv, scatter, scatter_dimension=0, tiled=True), others)
    dhead_Dv = lax.psum_scatter(dhead_Dv, scatter + others, scatter_dimension=0, tiled=True)
    return lax.all_gather(dhead_Dv, others, axis=0, tiled=True) if others else dhead_Dv


def _backward_local(hidden_btD, head_Dv, targets_bt, weights_bt, lse_bt, g, *, chunk: int, vocab: tuple[str, ...],
                    rows: tuple[str, ...], scatter: tuple[str, ...], softcap: float | None):
    """(d hidden [b, t, D], d head [D / scatter, v]) for the cotangent g: the head's gradient summed over
    the `rows` shards in float32, D split over `scatter`, the gradient's own layout."""
    c = chunk_length(*targets_bt.shape, head_Dv.shape[1], chunk)

    def one_chunk(dhead_Dv, inputs):
        hidden_bcD, targets_bc, weights_bc, lse_bc = inputs
        logits_bcv = _logits(hidden_bcD, head_Dv, softcap)
        is_target_bcv = _is_target(targets_bc, logits_bcv.shape[-1], vocab)
        scale_bc1 = (g * weights_bc)[..., None]
        dlogits_bcv = (jnp.exp(logits_bcv - lse_bc[..., None]) - is_target_bcv) * scale_bc1
        if softcap is not None:  # through c·tanh(x / c): · (1 − tanh²), tanh = the capped logit / c
            dlogits_bcv = dlogits_bcv * (1 - jnp.square(logits_bcv / softcap))
        dlogits_bcv = dlogits_bcv.astype(head_Dv.dtype)
        dhidden_bcD = _sum(jnp.einsum("bcv,dv->bcd", dlogits_bcv, head_Dv, preferred_element_type=jnp.float32),
                           vocab)
        dhead_Dv = dhead_Dv + jnp.einsum("bcd,bcv->dv", hidden_bcD, dlogits_bcv, preferred_element_type=jnp.float32)
        return dhead_Dv, dhidden_bcD.astype(hidden_bcD.dtype)

    dhead_Dv, dhidden_CbcD = lax.scan(one_chunk, jnp.zeros(head_Dv.shape, jnp.float32),
                                      (_chunks(hidden_btD, c), _chunks(targets_bt, c), _chunks(weights_bt, c),
                                       _chunks(lse_bt, c)))
    dhead_Dv = _reduce_head(dhead_Dv, rows, scatter).astype(head_Dv.dtype)
    return jnp.moveaxis(dhidden_CbcD, 0, 1).reshape(hidden_btD.shape), dhead_Dv


def _forward(hidden_BTD, head_DV, targets_BT, weights_BT, chunk: int, placement: _Placement, softcap: float | None):
    """(weighted loss sum, log-sum-exp [B, T], the targets' logits [B, T])."""
    body = functools.partial(_forward_local, chunk=chunk, vocab=placement.vocab, softcap=softcap)
    if placement.mesh is None:
        partial_sums, lse_BT, target_BT = body(hidden_BTD, head_DV, targets_BT, weights_BT)
    else:
        partial_sums, lse_BT, target_BT = jax.shard_map(
            body, mesh=placement.mesh,
            in_specs=(placement.hidden, placement.head, placement.targets, placement.targets),
            out_specs=(P(placement.rows or None), placement.targets, placement.targets),
            axis_names=set(placement.manual), check_vma=False)(hidden_BTD, head_DV, targets_BT, weights_BT)
    return partial_sums.sum(), lse_BT, target_BT


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _loss_sum(hidden_BTD, head_DV, targets_BT, weights_BT, chunk: int, placement: _Placement,
              softcap: float | None) -> jax.Array:
    return _forward(hidden_BTD, head_DV, targets_BT, weights_BT, chunk, placement, softcap)[0]


def _loss_sum_fwd(hidden_BTD, head_DV, targets_BT, weights_BT, chunk, placement, softcap):
    total, lse_BT, _ = _forward(hidden_BTD, head_DV, targets_BT, weights_BT, chunk, placement, softcap)
    return total, (hidden_BTD, head_DV, targets_BT, weights_BT, lse_BT)


def _loss_sum_bwd(chunk, placement, softcap, residuals, g):
    return (*_backward(chunk, placement, softcap, residuals, g), None, None)


def _backward(chunk, placement, softcap, residuals, g):
    """(d hidden, d head) of Σ g · weight · (logsumexp − target logit), from the forward pass's residuals."""
    body = functools.partial(_backward_local, chunk=chunk, vocab=placement.vocab, rows=placement.rows,
                             scatter=placement.scatter, softcap=softcap)
    if placement.mesh is None:
        dhidden_BTD, dhead_DV = body(*residuals, g)
    else:
        dhead_spec = P(placement.scatter or None, *placement.head[1:])
        dhidden_BTD, dhead_DV = jax.shard_map(
            body, mesh=placement.mesh,
            in_specs=(placement.hidden, placement.head, placement.targets, placement.targets, placement.targets, P()),
            out_specs=(placement.hidden, dhead_spec), axis_names=set(placement.manual), check_vma=False)(*residuals, g)
    return dhidden_BTD, dhead_DV


_loss_sum.defvjp(_loss_sum_fwd, _loss_sum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _log_probs(hidden_BTD, head_DV, targets_BT, chunk: int, placement: _Placement, softcap: float | None):
    return _log_probs_fwd(hidden_BTD, head_DV, targets_BT, chunk, placement, softcap)[0]


def _log_probs_fwd(hidden_BTD, head_DV, targets_BT, chunk, placement, softcap):
    zeros_BT = jnp.zeros(targets_BT.shape, jnp.float32)
    _, lse_BT, target_BT = _forward(hidden_BTD, head_DV, targets_BT, zeros_BT, chunk, placement, softcap)
    return target_BT - lse_BT, (hidden_BTD, head_DV, targets_BT, lse_BT)


def _log_probs_bwd(chunk, placement, softcap, residuals, g_BT):
    # log p = −(logsumexp − target logit): the loss's backward pass with weight −g at each position
    hidden_BTD, head_DV, targets_BT, lse_BT = residuals
    residuals = (hidden_BTD, head_DV, targets_BT, -g_BT.astype(jnp.float32), lse_BT)
    return (*_backward(chunk, placement, softcap, residuals, jnp.ones((), jnp.float32)), None)


_log_probs.defvjp(_log_probs_fwd, _log_probs_bwd)


def token_log_probs(hidden_BTD: jax.Array, head_DV: jax.Array, targets_BT: jax.Array, chunk: int = 0,
                    softcap: float | None = None) -> jax.Array:
    """The log-probability [B, T] (float32) of each target under `logits(hidden, head, softcap)`, chunk by chunk
    as the loss (module docstring): what a preference loss sums per sequence (`meshpar.dpo`)."""
    return _log_probs(hidden_BTD, head_DV, targets_BT, chunk, _placement(hidden_BTD, head_DV, targets_BT), softcap)


def chunked_cross_entropy(hidden_BTD: jax.Array, head_DV: jax.Array, targets_BT: jax.Array, chunk: int = 0,
                          weights_BT: jax.Array | None = None, softcap: float | None = None) -> jax.Array:
    """Weighted sum of the next-token cross-entropy of `logits(hidden, head, softcap)`, chunk by chunk (module
    docstring); without weights, the mean."""
    if weights_BT is None:
        weights_BT = jnp.full(targets_BT.shape, 1 / targets_BT.size)
    placement = _placement(hidden_BTD, head_DV, targets_BT)
    return _loss_sum(hidden_BTD, head_DV, targets_BT, weights_BT.astype(jnp.float32), chunk, placement, softcap)


def takes_positions(model) -> bool:
    """Whether `model(tokens, positions)` is its signature (two positional parameters), as meshpar's
    transformer's is; a model called as `model(tokens)` builds its own positions and causal mask."""
    parameters = inspect.signature(model.__call__).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in parameters) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


class NextToken(NamedTuple):
    """A batch as the model reads it, every field [B, T] in the step's sequence order: inputs, targets, their
    weights (summing to the batch's share of the loss), the rotary positions ([T], or [B, T] restarting at
    every document) and the document ids (None: one document per row)."""

    inputs: jax.Array
    targets: jax.Array
    weights: jax.Array
    positions: jax.Array
    segments: jax.Array | None


def next_token_inputs(batch: Batch | jax.Array) -> NextToken:
    """`NextToken` of a batch (or tokens [B, T + 1]): the model reads tokens[:, :-1] and predicts tokens[:, 1:],
    in the step's sequence order (zigzag when the sequence is split over `sequence` with `load_balance` on:
    `attention.sequence_order`). A batch without weights weighs every target 1/(B·T): the loss is a mean."""
    batch = as_batch(batch)
    inputs_BT, targets_BT = batch.tokens[:, :-1], batch.tokens[:, 1:]
    weights_BT = loss_weights(batch)
    reorder, positions_T, _ = sequence_order(inputs_BT.shape[1])
    segments_BT = None if batch.segments is None else batch.segments[:, :-1]
    positions = positions_T if segments_BT is None else reorder(document_positions(segments_BT))
    segments_BT = None if segments_BT is None else reorder(segments_BT)
    return NextToken(reorder(inputs_BT), reorder(targets_BT), reorder(weights_BT), positions, segments_BT)


class Ahead(NamedTuple):
    """What the multi-token prediction modules read and predict (`model.mtp_depth` = D; `models.mtp`), each field
    [D, B, T] in the step's sequence order: module k takes at position i the token t_{i+k} (`tokens`) and
    predicts t_{i+k+1} (`targets`), weighed as the main loss weighs that target, 0 over the last k positions and
    where the target lies in another document than position i (`weights`)."""

    tokens: jax.Array
    targets: jax.Array
    weights: jax.Array


def ahead_inputs(batch: Batch | jax.Array, depth: int) -> Ahead:
    """`Ahead` of a batch for `depth` modules: built in the natural order (a roll along T by k, its last k
    positions masked), then put in the step's order with the main inputs' permutation (`next_token_inputs`)."""
    batch = as_batch(batch)
    inputs_BT, targets_BT, weights_BT = batch.tokens[:, :-1], batch.tokens[:, 1:], loss_weights(batch)
    reorder = sequence_order(inputs_BT.shape[1])[0]
    t_T = jnp.arange(inputs_BT.shape[1])
    fields = []
    for k in range(1, depth + 1):
        ahead = lambda x_BT: jnp.roll(x_BT, -k, axis=1)
        keep_BT = jnp.broadcast_to(t_T < t_T.size - k, inputs_BT.shape)
        if batch.segments is not None:  # t_i and t_{i+k+1} in one document
            keep_BT = keep_BT & (batch.segments[:, :-1] == jnp.roll(batch.segments, -(k + 1), axis=1)[:, :-1])
        fields.append((ahead(inputs_BT), ahead(targets_BT), jnp.where(keep_BT, ahead(weights_BT), 0.0)))
    laid_out = lambda x_BT: sharding.constrain(reorder(x_BT), ("batch", "seq"))
    return Ahead(*(jnp.stack([laid_out(x_BT) for x_BT in field]) for field in zip(*fields)))


def ahead_totals(batch: Batch | jax.Array, depth: int) -> jax.Array:
    """Each module's sum of target weights [D] over `batch` (`ahead_inputs`): what its loss, a weighted mean,
    divides by. The training step takes it of the global batch once, so every part of the batch adds its
    share (as the main loss's weights are normalised: `meshpar.batch.normalised`)."""
    return ahead_inputs(batch, depth).weights.sum(axis=(1, 2))


class MTPStats(NamedTuple):
    """A loss's statistics with multi-token prediction: the router's (None: dense) and L_MTP, the modules' mean
    loss before `mtp_coef` (this part of the batch's share of it)."""

    router: RouterStats | None
    mtp: jax.Array


def final_hidden_states(model, x: NextToken) -> tuple[jax.Array, RouterStats | None]:
    """The final norm's output [B, T, D] of a model with `hidden_states` for the inputs `x`, and a mixture's router
    statistics beside it (its `routed_hidden_states`; None for any other model)."""
    documents = () if x.segments is None else (x.segments,)
    routed = getattr(model, "routed_hidden_states", None)
    return (routed or (lambda *a: (model.hidden_states(*a), None)))(x.inputs, x.positions, *documents)


def next_token_loss(model, batch: Batch | jax.Array, chunk: int = 0, aux_coef: float = 0.0,
                    z_coef: float = 0.0) -> jax.Array:
    """Weighted cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (module docstring): the mean
    over a batch without weights; for a mixture of experts, plus its router's losses
    (`next_token_loss_and_routing`)."""
    return next_token_loss_and_routing(model, batch, chunk, aux_coef, z_coef)[0]


def next_token_loss_and_routing(model, batch: Batch | jax.Array, chunk: int = 0, aux_coef: float = 0.0,
                                z_coef: float = 0.0, pools: int = 1, seq_coef: float = 0.0, mtp_coef: float = 0.0,
                                mtp_totals: jax.Array | None = None
                                ) -> tuple[jax.Array, RouterStats | MTPStats | None]:
    """`next_token_loss`, and, for a mixture of experts (a model with `routed_hidden_states`), its router's
    losses (`meshpar.moe.routing`), each pooled over the tokens and the MoE layers of the batch (`pools` = 1)
    or of each of its `pools` microbatches (rows m, pools + m, …: a pipeline's microbatch m) and averaged,
    added as aux_coef · load balance + z_coef · z-loss (transformers' `router_aux_loss_coef`), plus seq_coef ·
    the sequence-wise balance loss (DeepSeek-V3's, per sequence: no pools), with the router statistics summed
    per pool (None for any other model). A model with multi-token prediction modules (`mtp_depth` = D > 0) adds
    mtp_coef · L_MTP, L_MTP = (1/D) Σ_k L_k, L_k module k's weighted mean cross-entropy (`ahead_inputs`) over
    the targets whose weights sum to `mtp_totals[k - 1]` (default: this batch's, `ahead_totals`); its
    statistics are then `MTPStats` (mtp_coef = 0: no modules run).

    With the sequence split over `sequence` and `load_balance` on, inputs, targets and positions are
    put in zigzag order once, here: every shard then holds an early and a late chunk of each sequence,
    so causal attention costs every shard the same. The loss does not depend on the order. Only a
    model that takes positions (`takes_positions`) gets the zigzag order: one called as `model(tokens)`
    sees its tokens in order, so a causal mask it builds itself stays right (and cannot take documents).
    """
    batch = as_batch(batch)
    if not takes_positions(model):
        if batch.segments is not None:
            raise InputError(f"{type(model).__name__} is called as model(tokens), so it cannot keep the packed "
                             f"documents of this batch apart: give it positions and segments "
                             f"(model(tokens, positions, segments)), or train without packing")
        inputs_BT, targets_BT = batch.tokens[:, :-1], batch.tokens[:, 1:]
        return cross_entropy(model(inputs_BT), targets_BT, loss_weights(batch)), None
    x = next_token_inputs(batch)
    documents = () if x.segments is None else (x.segments,)
    if not (hasattr(model, "hidden_states") and hasattr(model, "output_head")):
        return cross_entropy(model(x.inputs, x.positions, *documents), x.targets, x.weights), None
    depth, softcap = getattr(model, "mtp_depth", 0) if mtp_coef else 0, getattr(model, "logit_softcap", None)
    if depth:
        ahead = ahead_inputs(batch, depth)
        hidden_BTD, hidden_KBTD, stats = model.mtp_hidden_states(x.inputs, x.positions, ahead.tokens, *documents)
        totals_K = ahead_totals(batch, depth) if mtp_totals is None else mtp_totals
        weights_KBT = ahead.weights / jnp.where(totals_K > 0, totals_K, 1.0)[:, None, None]
        mtp = sum(chunked_cross_entropy(hidden_KBTD[k], model.output_head(), ahead.targets[k], chunk,
                                        weights_KBT[k], softcap) for k in range(depth)) / depth
    else:
        hidden_BTD, stats = final_hidden_states(model, x)
    value = chunked_cross_entropy(hidden_BTD, model.output_head(), x.targets, chunk, x.weights, softcap)
    if depth:
        value = value + mtp_coef * mtp
    if stats is not None:
        if seq_coef:
            value = value + seq_coef * routing.sequence_loss(stats, x.inputs.shape[0])
        stats = stats.grouped(pools)
        balance, z = routing.losses(stats)
        value = value + aux_coef * balance + z_coef * z
    return value, MTPStats(stats, mtp) if depth else stats
