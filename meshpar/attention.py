"""Causal grouped-query attention.

Shapes: B batch, T query positions, S key positions, N query heads, K kv heads, G = N / K query heads
per kv head, H head dim. Scores and softmax statistics are float32 whatever the compute dtype; the
probabilities are cast back to the compute dtype for the value matmul.

With heads split over `model` (K divisible by the axis) each device attends over its own heads and no
collective runs; with the batch split, likewise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array) -> jax.Array:
    """softmax(q kᵀ / √H + causal mask) v, with each group of G query heads sharing one kv head."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH,
                              preferred_element_type=jnp.float32) / jnp.sqrt(H).astype(jnp.float32)
    causal_TS = jnp.arange(T)[:, None] >= jnp.arange(k_BSKH.shape[1])[None, :]
    scores_BKGTS = jnp.where(causal_TS, scores_BKGTS, -jnp.inf)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
    return out_BTKGH.reshape(B, T, N, H)
