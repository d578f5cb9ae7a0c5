"""The load-balanced ("zigzag") sequence order for context parallelism over n shards.

Under a causal mask a contiguous split of the sequence over n devices is unbalanced: the last device's
queries see every key, the first device's only its own (about 2n − 1 times less work). The zigzag order
cuts the sequence into 2n equal chunks and gives shard i chunks i and 2n − 1 − i, so every shard has the
same number of visible (query, key) pairs. The training step puts tokens, targets and rotary positions in
this order once (`meshpar.loss.next_token_inputs`); every per-token layer is indifferent to the order, and
attention masks by the global positions (`positions`, `local_positions`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshpar.errors import InputError


def _order(n_shards: int) -> np.ndarray:
    """Chunk order: shard i holds chunks i and 2n−1−i, e.g. n=2 → [0, 3, 1, 2]."""
    return np.array([c for i in range(n_shards) for c in (i, 2 * n_shards - 1 - i)])


def check(T: int, n_shards: int) -> None:
    """Refuse a sequence the zigzag order cannot cut into 2·n equal chunks."""
    if n_shards < 1:
        raise InputError(f"zigzag needs n_shards >= 1, got {n_shards}")
    if T % (2 * n_shards):
        raise InputError(f"load-balanced (zigzag) order splits the sequence into 2·n = {2 * n_shards} chunks, "
                         f"but T = {T} is not divisible by {2 * n_shards}")


def _permute_chunks(x: jax.Array, order: np.ndarray, axis: int) -> jax.Array:
    axis = axis % x.ndim
    T = x.shape[axis]
    chunks = x.reshape(x.shape[:axis] + (len(order), T // len(order)) + x.shape[axis + 1:])
    return jnp.take(chunks, jnp.asarray(order), axis=axis).reshape(x.shape)


def zigzag(x: jax.Array, n_shards: int, axis: int = 1) -> jax.Array:
    """Reorder the sequence `axis` into the load-balanced order for `n_shards` shards.

    The sequence is cut into 2·n equal chunks; shard i (the i-th contiguous slice of t = T/n once the
    result is split over n devices) holds chunks i and 2n−1−i, so under a causal mask every shard has
    the same number of (query, key) pairs to compute. `unzigzag` is the inverse.
    """
    check(x.shape[axis], n_shards)
    return _permute_chunks(x, _order(n_shards), axis)


def unzigzag(x: jax.Array, n_shards: int, axis: int = 1) -> jax.Array:
    """The inverse of `zigzag`: back to the natural sequence order."""
    check(x.shape[axis], n_shards)
    return _permute_chunks(x, np.argsort(_order(n_shards)), axis)


def positions(T: int, n_shards: int) -> jax.Array:
    """The global positions of the zigzag order (int32 [T]): `zigzag(arange(T), n_shards, axis=0)`."""
    return zigzag(jnp.arange(T, dtype=jnp.int32), n_shards, axis=0)


def local_positions(i, t: int, n: int, balanced: bool, xp=jnp):
    """Global positions of the t positions shard i holds (contiguous, or zigzag when `balanced`); `xp=np`
    for a static i."""
    if not balanced:
        return i * t + xp.arange(t, dtype=np.int32)
    c = t // 2
    return xp.concatenate([i * c + xp.arange(c, dtype=np.int32), (2 * n - 1 - i) * c + xp.arange(c, dtype=np.int32)])


def global_positions(T: int, n: int, balanced: bool) -> np.ndarray:
    """Every shard's positions, in shard order: the order of a sequence split over n shards."""
    return np.concatenate([local_positions(i, T // n, n, balanced, np) for i in range(n)])
