"""Blockwise ("flash") causal attention in pure JAX: the [T, S] score matrix never exists.

Shapes: B batch, T query positions, S key positions, N query heads, K kv heads, G = N / K query heads
per kv head, H head dim; t, s the sizes of one query and one key block (`block_q`, `block_k`).

The sequence is cut into query blocks and key blocks. Which (query block, key block) pairs are worth
computing is STATIC: `block_pattern` reads it from positions known when the program is traced (the
natural order 0..T−1, a zigzag order, or device 0's positions of a layout every device shares), and
marks each pair SKIP (every query before every key, or with a sliding window W every key W or more
before every query: fully masked), FULL (every query sees every key) or MASKED (the diagonal, and the
window's far edge: the mask is applied, from the DYNAMIC positions the kernel gets). One `lax.scan` runs
over the listed pairs only, so a causal T×T attention does the n(n+1)/2 pairs of an n×n grid, not n²,
and a window of W about n·(W/block + 1): linear in T.

Documents (segment ids [B, T] of queries and keys: a query sees only keys of its own document) are data,
known only when the step runs, so their skip is DYNAMIC: before the scan, every listed pair gets a flag,
"some row has a query block and a key block whose ranges of ids overlap" (ids of packed documents grow
along a row, so disjoint ranges mean no shared document); a pair without it is skipped by `lax.cond`, its
matmuls not run. The masks of the pairs that run include the ids. (Under `vmap` with a batched flag — a
pipeline's lanes, accumulation's replicas — JAX turns the conditional into a select: the result is the
same, the work is not saved there.)

Forward (Dao et al. 2022, "FlashAttention", Alg. 1, in scan form): per pair, the f32 score block
[B, K, G, t, s] updates the query block's running max m, denominator l and output accumulator o (the
online softmax); the result is out = o / l and the log-sum-exp lse = m + log l of every query row.
Backward (a `jax.custom_vjp`): only q, k, v, out and lse are saved; per pair the block's scores are
recomputed, p = exp(s − lse), and
    dv += pᵀ·dout,   dp = dout·vᵀ,   ds = p ⊙ (dp − (Σ_h dout ⊙ out − dlse)),   dq += ds·k,   dk += dsᵀ·q
(the dlse term is the cotangent of the lse output, which ring attention's accumulator differentiates).
Memory: the saved inputs and outputs, O(T·(N+K)·H), plus the accumulators and one block's scores,
O(B·N·t·s): linear in T, where dense attention keeps [B, N, T, S] scores and probabilities.
Compute: the visible pairs' matmuls, forward 4·B·N·H·t·s per pair, backward 2.5× that (the recompute of
the scores, then dv, dp, dq, dk).

Scores, softmax statistics and accumulators are float32 whatever the compute dtype; the probabilities
and score gradients enter the matmuls in the dtype of v and q (as the dense kernel does).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshpar.errors import InputError

SKIP, MASKED, FULL = 0, 1, 2


def block_pattern(q_positions: Sequence[np.ndarray] | np.ndarray, k_positions: np.ndarray, block_q: int,
                  block_k: int, window: int | None = None) -> np.ndarray:
    """[T/block_q, S/block_k] of SKIP, MASKED, FULL for causal attention at these static positions, with a
    sliding `window` (`kernels.Causal`) or none.

    `q_positions` may be several layouts (e.g. one per device, when every device runs the same program
    on different positions), and `k_positions` as many, paired with them, or one for all: a pair of tiles is
    skipped only if every layout skips it, and FULL only if it is FULL in every one.
    """
    several = lambda positions: [np.asarray(p) for p in positions] if np.ndim(positions) == 2 else None
    q_layouts = several(q_positions) or [np.asarray(q_positions)]
    k_layouts = several(k_positions) or [np.asarray(k_positions)] * len(q_layouts)
    skip, full = True, True
    for q_pos, k_pos in zip(q_layouts, k_layouts, strict=True):
        q, k = q_pos.reshape(-1, block_q), k_pos.reshape(-1, block_k)
        q_min, q_max = q.min(axis=1)[:, None], q.max(axis=1)[:, None]
        k_min, k_max = k.min(axis=1)[None, :], k.max(axis=1)[None, :]
        skip = skip & ((q_max < k_min) | (window is not None and q_min - k_max >= window))
        full = full & (q_min >= k_max) & (window is None or q_max - k_min < window)
    return np.where(skip, SKIP, np.where(full, FULL, MASKED)).astype(np.int8)


def attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, q_pos_T: jax.Array, k_pos_S: jax.Array,
              pattern: np.ndarray, window: int | None = None, segments: tuple[jax.Array, jax.Array] | None = None,
              softcap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Causal GQA attention over the pairs `pattern` (from `block_pattern`) allows: (out f32 [B, T, N, H],
    lse f32 [B, T, N]). Query t sees key s iff 0 <= q_pos_T[t] − k_pos_S[s] < window (None: no bound) and,
    with `segments` (document ids of queries [B, T] and keys [B, S]), both are of one document; block
    sizes are T and S over the pattern's shape; with `softcap` c, scores are c·tanh(s / c) (`soft_cap`). A
    query row that sees no key gets out 0 and lse −inf."""
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    nq, nk = pattern.shape
    if T % nq or S % nk:
        raise InputError(f"a {nq}×{nk} block pattern does not tile T = {T} queries and S = {S} keys")
    pairs = tuple((i, j, int(pattern[i, j]) == FULL) for i in range(nq) for j in range(nk) if pattern[i, j] != SKIP)
    if not pairs:  # e.g. a ring's block wholly beyond a sliding window
        B, _, N, H = q_BTNH.shape
        return jnp.zeros((B, T, N, H), jnp.float32), jnp.full((B, T, N), -jnp.inf, jnp.float32)
    segments = None if segments is None else tuple(ids.astype(jnp.int32) for ids in segments)
    return _flash(q_BTNH, k_BSKH, v_BSKH, q_pos_T.astype(jnp.int32), k_pos_S.astype(jnp.int32), segments,
                  pairs, T // nq, S // nk, window, softcap)


def soft_cap(s: jax.Array, softcap: float | None) -> jax.Array:
    """c·tanh(s / c): scores bounded to (−c, c) and nearly unchanged where |s| ≪ c (None: s as it is)."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def visible(q_pos_T: jax.Array, k_pos_S: jax.Array, window: int | None,
            segments: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Whether each query sees each key: [T, S] from the positions, 0 <= q − k < window (None: no bound);
    [B, T, S] with `segments` (ids [B, T], [B, S]: the same document)."""
    delta_TS = q_pos_T[:, None] - k_pos_S[None, :]
    seen_TS = (delta_TS >= 0) & (delta_TS < window) if window is not None else delta_TS >= 0
    return seen_TS if segments is None else seen_TS & same_document(*segments)


def same_document(q_seg_BT: jax.Array, k_seg_BS: jax.Array) -> jax.Array:
    """[B, T, S]: whether query and key carry the same document id."""
    return q_seg_BT[:, :, None] == k_seg_BS[:, None, :]


def _live_pairs(segments: tuple[jax.Array, jax.Array], pairs: tuple, bt: int, bs: int) -> jax.Array:
    """[pairs]: whether some row's query block and key block overlap in document ids (module docstring)."""
    q_seg_BT, k_seg_BS = segments
    blocks = lambda ids_BX, b: ids_BX.reshape(ids_BX.shape[0], -1, b)
    q_min_BI, q_max_BI = blocks(q_seg_BT, bt).min(-1), blocks(q_seg_BT, bt).max(-1)
    k_min_BJ, k_max_BJ = blocks(k_seg_BS, bs).min(-1), blocks(k_seg_BS, bs).max(-1)
    i_P, j_P = (np.array(column) for column in list(zip(*pairs))[:2])
    overlap_BP = (q_min_BI[:, i_P] <= k_max_BJ[:, j_P]) & (k_min_BJ[:, j_P] <= q_max_BI[:, i_P])
    return overlap_BP.any(axis=0)


def _grouped(q_BTNH: jax.Array, K: int) -> jax.Array:
    B, T, N, H = q_BTNH.shape
    return q_BTNH.reshape(B, T, K, N // K, H)


def _scores(q_BtKGH, k_BsKH, qpos_t, kpos_s, segments_ts, full, window, softcap):
    """Scaled, soft-capped, masked f32 scores [B, K, G, t, s] of one block pair (`segments_ts`: the pair's ids
    or None)."""
    H = q_BtKGH.shape[-1]
    s = soft_cap(jnp.einsum("btkgh,bskh->bkgts", q_BtKGH, k_BsKH, preferred_element_type=jnp.float32) / math.sqrt(H),
                 softcap)
    seen_ts = visible(qpos_t, kpos_s, window) | full
    if segments_ts is not None:
        seen_ts = (seen_ts & same_document(*segments_ts))[:, None, None]
    return jnp.where(seen_ts, s, -jnp.inf)


def _pair_segments(segments, qs, ks, bt, bs):
    """The document ids of one block pair, or None."""
    return None if segments is None else (_slice(segments[0], qs, bt, 1), _slice(segments[1], ks, bs, 1))


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _over_pairs(body, init, pairs, live_P=None):
    """`body(carry, i, j, full)` for every listed pair, in one `lax.scan`; where `live_P` is given, only for
    the pairs it flags (the others leave the carry as it is)."""
    i_P, j_P, full_P = (jnp.asarray(np.array(column)) for column in zip(*pairs))
    if live_P is None:
        return lax.scan(lambda carry, xs: (body(carry, *xs), None), init, (i_P, j_P, full_P))[0]

    def maybe(carry, xs):
        live, *pair = xs
        return lax.cond(live, lambda c: body(c, *pair), lambda c: c, carry), None

    return lax.scan(maybe, init, (live_P, i_P, j_P, full_P))[0]


def _forward(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, segments, pairs, bt, bs, window, softcap):
    # One barrier over every input: when an enclosing loop is linearised, JAX hoists what depends only on
    # that loop's constants (a ring's queries, the positions) out of it, and here that would be every
    # pair's query block and mask, stacked per pair: memory quadratic in T. Behind the barrier nothing
    # of the kernel depends on a subset of its inputs.
    q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, segments = lax.optimization_barrier(
        (q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, segments))
    (B, T, N, H), K = q_BTNH.shape, k_BSKH.shape[2]
    q_BTKGH = _grouped(q_BTNH, K)

    def pair(carry, i, j, full):
        o_BTKGH, m_BKGT, l_BKGT = carry
        qs, ks = i * bt, j * bs
        s_BKGts = _scores(_slice(q_BTKGH, qs, bt, 1), _slice(k_BSKH, ks, bs, 1), _slice(q_pos_T, qs, bt, 0),
                          _slice(k_pos_S, ks, bs, 0), _pair_segments(segments, qs, ks, bt, bs), full, window, softcap)
        m_old, l_old = _slice(m_BKGT, qs, bt, 3), _slice(l_BKGT, qs, bt, 3)
        m_new = jnp.maximum(m_old, s_BKGts.max(axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing visible yet: exp(−inf) = 0
        p_BKGts = jnp.exp(s_BKGts - m_safe[..., None])
        alpha_BKGt = jnp.exp(m_old - m_safe)
        pv_BtKGH = jnp.einsum("bkgts,bskh->btkgh", p_BKGts.astype(v_BSKH.dtype), _slice(v_BSKH, ks, bs, 1),
                              preferred_element_type=jnp.float32)
        o_old = _slice(o_BTKGH, qs, bt, 1)
        o_new = o_old * jnp.moveaxis(alpha_BKGt, -1, 1)[..., None] + pv_BtKGH
        return (lax.dynamic_update_slice_in_dim(o_BTKGH, o_new, qs, 1),
                lax.dynamic_update_slice_in_dim(m_BKGT, m_new, qs, 3),
                lax.dynamic_update_slice_in_dim(l_BKGT, alpha_BKGt * l_old + p_BKGts.sum(axis=-1), qs, 3))

    # Carries are derived from the inputs (not fresh zeros) so that inside a shard_map they vary over the
    # same manual axes as what the loop writes into them.
    zeros_BKGT = jnp.moveaxis(jnp.zeros_like(q_BTKGH[..., 0], jnp.float32), 1, -1)
    init = (jnp.zeros_like(q_BTKGH, jnp.float32), zeros_BKGT - jnp.inf, zeros_BKGT)
    live_P = None if segments is None else _live_pairs(segments, pairs, bt, bs)
    o_BTKGH, m_BKGT, l_BKGT = _over_pairs(pair, init, pairs, live_P)
    seen = l_BKGT > 0
    lse_BKGT = jnp.where(seen, m_BKGT + jnp.log(jnp.where(seen, l_BKGT, 1.0)), -jnp.inf)
    out_BTKGH = o_BTKGH / jnp.moveaxis(jnp.where(seen, l_BKGT, 1.0), -1, 1)[..., None]
    return out_BTKGH.reshape(B, T, N, H), jnp.moveaxis(lse_BKGT, -1, 1).reshape(B, T, N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _flash(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, segments, pairs, bt, bs, window, softcap):
    return _forward(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, segments, pairs, bt, bs, window, softcap)


def _flash_fwd(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, segments, pairs, bt, bs, window, softcap):
    out_BTNH, lse_BTN = _forward(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, segments, pairs, bt, bs, window, softcap)
    return (out_BTNH, lse_BTN), (q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, segments, out_BTNH, lse_BTN)


def _flash_bwd(pairs, bt, bs, window, softcap, residuals, cotangents):
    q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, segments, out_BTNH, lse_BTN = residuals
    dout_BTNH, dlse_BTN = cotangents
    (B, T, N, H), K = q_BTNH.shape, k_BSKH.shape[2]
    G = N // K
    to_BKGT = lambda x_BTN: jnp.moveaxis(x_BTN.reshape(B, T, K, G), 1, -1)
    lse_BKGT = to_BKGT(lse_BTN)
    lse_BKGT = jnp.where(lse_BKGT == -jnp.inf, 0.0, lse_BKGT)  # rows that saw nothing: p = exp(−inf) = 0
    # Σ_s p·dp = Σ_h dout·out per query row; the lse output's own cotangent enters with the opposite sign.
    delta_BKGT = to_BKGT(jnp.sum(dout_BTNH.astype(jnp.float32) * out_BTNH, axis=-1) - dlse_BTN)
    q_BTKGH, do_BTKGH = _grouped(q_BTNH, K), _grouped(dout_BTNH.astype(v_BSKH.dtype), K)
    scale = 1 / math.sqrt(H)

    def pair(carry, i, j, full):
        dq_BTKGH, dk_BSKH, dv_BSKH = carry
        qs, ks = i * bt, j * bs
        q_BtKGH, k_BsKH, v_BsKH = _slice(q_BTKGH, qs, bt, 1), _slice(k_BSKH, ks, bs, 1), _slice(v_BSKH, ks, bs, 1)
        do_BtKGH = _slice(do_BTKGH, qs, bt, 1)
        s_BKGts = _scores(q_BtKGH, k_BsKH, _slice(q_pos_T, qs, bt, 0), _slice(k_pos_S, ks, bs, 0),
                          _pair_segments(segments, qs, ks, bt, bs), full, window, softcap)
        p_BKGts = jnp.exp(s_BKGts - _slice(lse_BKGT, qs, bt, 3)[..., None])
        dv_BsKH = jnp.einsum("bkgts,btkgh->bskh", p_BKGts.astype(v_BSKH.dtype), do_BtKGH,
                             preferred_element_type=jnp.float32)
        dp_BKGts = jnp.einsum("btkgh,bskh->bkgts", do_BtKGH, v_BsKH, preferred_element_type=jnp.float32)
        ds_BKGts = p_BKGts * (dp_BKGts - _slice(delta_BKGT, qs, bt, 3)[..., None]) * scale
        if softcap is not None:  # d(c·tanh(x / c))/dx = 1 − tanh², tanh = the capped score / c (masked: p = 0)
            ds_BKGts = ds_BKGts * (1 - jnp.square(jnp.where(p_BKGts > 0, s_BKGts, 0.0) / softcap))
        ds_BKGts = ds_BKGts.astype(q_BTNH.dtype)
        dq_BtKGH = jnp.einsum("bkgts,bskh->btkgh", ds_BKGts, k_BsKH, preferred_element_type=jnp.float32)
        dk_BsKH = jnp.einsum("bkgts,btkgh->bskh", ds_BKGts, q_BtKGH, preferred_element_type=jnp.float32)
        add = lambda acc, x, start: lax.dynamic_update_slice_in_dim(
            acc, _slice(acc, start, x.shape[1], 1) + x, start, 1)
        return add(dq_BTKGH, dq_BtKGH, qs), add(dk_BSKH, dk_BsKH, ks), add(dv_BSKH, dv_BsKH, ks)

    init = (jnp.zeros_like(q_BTKGH, jnp.float32), jnp.zeros_like(k_BSKH, jnp.float32),
            jnp.zeros_like(v_BSKH, jnp.float32))
    live_P = None if segments is None else _live_pairs(segments, pairs, bt, bs)
    dq_BTKGH, dk_BSKH, dv_BSKH = _over_pairs(pair, init, pairs, live_P)
    no_grad = None if segments is None else (None, None)
    return (dq_BTKGH.reshape(q_BTNH.shape).astype(q_BTNH.dtype), dk_BSKH.astype(k_BSKH.dtype),
            dv_BSKH.astype(v_BSKH.dtype), None, None, no_grad)


_flash.defvjp(_flash_fwd, _flash_bwd)
