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
    on different positions): a pair is skipped only if every layout skips it, and FULL only if it is FULL
    in every one.
    """
    layouts = [np.asarray(q_positions)] if np.ndim(q_positions) == 1 else [np.asarray(p) for p in q_positions]
    k = np.asarray(k_positions).reshape(-1, block_k)
    k_min, k_max = k.min(axis=1)[None, :], k.max(axis=1)[None, :]
    skip, full = True, True
    for positions in layouts:
        q = positions.reshape(-1, block_q)
        q_min, q_max = q.min(axis=1)[:, None], q.max(axis=1)[:, None]
        skip = skip & ((q_max < k_min) | (window is not None and q_min - k_max >= window))
        full = full & (q_min >= k_max) & (window is None or q_max - k_min < window)
    return np.where(skip, SKIP, np.where(full, FULL, MASKED)).astype(np.int8)


def attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, q_pos_T: jax.Array, k_pos_S: jax.Array,
              pattern: np.ndarray, window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Causal GQA attention over the pairs `pattern` (from `block_pattern`) allows: (out f32 [B, T, N, H],
    lse f32 [B, T, N]). Query t sees key s iff 0 <= q_pos_T[t] − k_pos_S[s] < window (None: no bound);
    block sizes are T and S over the pattern's shape. A query row that sees no key gets out 0 and lse −inf."""
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    nq, nk = pattern.shape
    if T % nq or S % nk:
        raise InputError(f"a {nq}×{nk} block pattern does not tile T = {T} queries and S = {S} keys")
    pairs = tuple((i, j, int(pattern[i, j]) == FULL) for i in range(nq) for j in range(nk) if pattern[i, j] != SKIP)
    if not pairs:  # e.g. a ring's block wholly beyond a sliding window
        B, _, N, H = q_BTNH.shape
        return jnp.zeros((B, T, N, H), jnp.float32), jnp.full((B, T, N), -jnp.inf, jnp.float32)
    return _flash(q_BTNH, k_BSKH, v_BSKH, q_pos_T.astype(jnp.int32), k_pos_S.astype(jnp.int32),
                  pairs, T // nq, S // nk, window)


def visible(q_pos_T: jax.Array, k_pos_S: jax.Array, window: int | None) -> jax.Array:
    """[T, S]: whether each query sees each key, 0 <= q − k < window (None: no bound)."""
    delta_TS = q_pos_T[:, None] - k_pos_S[None, :]
    return (delta_TS >= 0) & (delta_TS < window) if window is not None else delta_TS >= 0


def _grouped(q_BTNH: jax.Array, K: int) -> jax.Array:
    B, T, N, H = q_BTNH.shape
    return q_BTNH.reshape(B, T, K, N // K, H)


def _scores(q_BtKGH, k_BsKH, qpos_t, kpos_s, full, window):
    """Scaled, masked f32 scores [B, K, G, t, s] of one block pair."""
    H = q_BtKGH.shape[-1]
    s = jnp.einsum("btkgh,bskh->bkgts", q_BtKGH, k_BsKH, preferred_element_type=jnp.float32) / math.sqrt(H)
    return jnp.where(visible(qpos_t, kpos_s, window) | full, s, -jnp.inf)


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _over_pairs(body, init, pairs):
    """`body(carry, i, j, full)` for every listed pair, in one `lax.scan`."""
    i_P, j_P, full_P = (jnp.asarray(np.array(column)) for column in zip(*pairs))
    return lax.scan(lambda carry, xs: (body(carry, *xs), None), init, (i_P, j_P, full_P))[0]


def _forward(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, pairs, bt, bs, window):
    # One barrier over every input: when an enclosing loop is linearised, JAX hoists what depends only on
    # that loop's constants (a ring's queries, the positions) out of it, and here that would be every
    # pair's query block and mask, stacked per pair: memory quadratic in T. Behind the barrier nothing
    # of the kernel depends on a subset of its inputs.
    q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S = lax.optimization_barrier((q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S))
    (B, T, N, H), K = q_BTNH.shape, k_BSKH.shape[2]
    q_BTKGH = _grouped(q_BTNH, K)

    def pair(carry, i, j, full):
        o_BTKGH, m_BKGT, l_BKGT = carry
        qs, ks = i * bt, j * bs
        s_BKGts = _scores(_slice(q_BTKGH, qs, bt, 1), _slice(k_BSKH, ks, bs, 1), _slice(q_pos_T, qs, bt, 0),
                          _slice(k_pos_S, ks, bs, 0), full, window)
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
    o_BTKGH, m_BKGT, l_BKGT = _over_pairs(pair, init, pairs)
    seen = l_BKGT > 0
    lse_BKGT = jnp.where(seen, m_BKGT + jnp.log(jnp.where(seen, l_BKGT, 1.0)), -jnp.inf)
    out_BTKGH = o_BTKGH / jnp.moveaxis(jnp.where(seen, l_BKGT, 1.0), -1, 1)[..., None]
    return out_BTKGH.reshape(B, T, N, H), jnp.moveaxis(lse_BKGT, -1, 1).reshape(B, T, N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, pairs, bt, bs, window):
    return _forward(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, pairs, bt, bs, window)


def _flash_fwd(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, pairs, bt, bs, window):
    out_BTNH, lse_BTN = _forward(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, pairs, bt, bs, window)
    return (out_BTNH, lse_BTN), (q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, out_BTNH, lse_BTN)


def _flash_bwd(pairs, bt, bs, window, residuals, cotangents):
    q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S, out_BTNH, lse_BTN = residuals
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
        s_BKGts = _scores(q_BtKGH, k_BsKH, _slice(q_pos_T, qs, bt, 0), _slice(k_pos_S, ks, bs, 0), full, window)
        p_BKGts = jnp.exp(s_BKGts - _slice(lse_BKGT, qs, bt, 3)[..., None])
        dv_BsKH = jnp.einsum("bkgts,btkgh->bskh", p_BKGts.astype(v_BSKH.dtype), do_BtKGH,
                             preferred_element_type=jnp.float32)
        dp_BKGts = jnp.einsum("btkgh,bskh->bkgts", do_BtKGH, v_BsKH, preferred_element_type=jnp.float32)
        ds_BKGts = (p_BKGts * (dp_BKGts - _slice(delta_BKGT, qs, bt, 3)[..., None]) * scale).astype(q_BTNH.dtype)
        dq_BtKGH = jnp.einsum("bkgts,bskh->btkgh", ds_BKGts, k_BsKH, preferred_element_type=jnp.float32)
        dk_BsKH = jnp.einsum("bkgts,btkgh->bskh", ds_BKGts, q_BtKGH, preferred_element_type=jnp.float32)
        add = lambda acc, x, start: lax.dynamic_update_slice_in_dim(
            acc, _slice(acc, start, x.shape[1], 1) + x, start, 1)
        return add(dq_BTKGH, dq_BtKGH, qs), add(dk_BSKH, dk_BsKH, ks), add(dv_BSKH, dv_BsKH, ks)

    init = (jnp.zeros_like(q_BTKGH, jnp.float32), jnp.zeros_like(k_BSKH, jnp.float32),
            jnp.zeros_like(v_BSKH, jnp.float32))
    dq_BTKGH, dk_BSKH, dv_BSKH = _over_pairs(pair, init, pairs)
    return (dq_BTKGH.reshape(q_BTNH.shape).astype(q_BTNH.dtype), dk_BSKH.astype(k_BSKH.dtype),
            dv_BSKH.astype(v_BSKH.dtype), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
