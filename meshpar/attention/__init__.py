"""Causal grouped-query attention, as the model calls it (`attend`), on one device or with the sequence
split over the mesh axis `sequence`.

The wing: `kernels` (one block of attention: dense, blockwise, cuDNN, and the choice among them), `flash`
(the blockwise kernel), `zigzag` (the load-balanced sequence order), `context_parallel` (ring, all-gather
and Ulysses attention over a split sequence).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from meshpar import context, sharding
from meshpar.attention import zigzag
from meshpar.attention.context_parallel import context_attention
from meshpar.attention.kernels import cached_attention, causal_attention, platform_of
from meshpar.errors import InputError

__all__ = ["attend", "cached_attention", "causal_attention", "sequence_order"]

Reorder = Callable[[jax.Array], jax.Array]


def sequence_order(T: int) -> tuple[Reorder, jax.Array, Reorder]:
    """(reorder, positions, restore) of a sequence of T tokens for the active step: under load-balanced
    context parallelism the zigzag order `attend` expects and its global positions, else the order as it
    is and 0..T−1. `reorder` and `restore` act on axis 1 ([B, T, ...])."""
    compute = context.active()
    n = compute.mesh.shape.get("sequence", 1) if compute is not None else 1
    if n > 1 and compute.rules.parallel.load_balance:
        return lambda x: zigzag.zigzag(x, n), zigzag.positions(T, n), lambda x: zigzag.unzigzag(x, n)
    return (lambda x: x), jnp.arange(T), (lambda x: x)


def attend(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, window: int | None = None,
           segments_BT: jax.Array | None = None, softcap: float | None = None,
           sinks_N: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention of q [B, T, N, H] over k, v [B, T, K, H], with T maybe split over `sequence`;
    with a sliding `window`, each query sees its `window` latest keys; with `segments_BT` (the document id
    of every position, in the activations' order: `meshpar.batch`), only keys of its own document
    (`kernels.Causal`); with `softcap` c, scores soft-capped to c·tanh(s / c) (Gemma 2); with `sinks_N`, each
    head's sink logit in its softmax's denominator (gpt-oss: `kernels.add_sinks`). Under context
    parallelism the ids travel with their keys.

    Reads the active `meshpar.context.Compute`: its `attention_kernel` is the block kernel (`auto` with
    none). With none (eager use of a model), or when its mesh's `sequence` axis has size 1, this is
    `causal_attention` (batch / head sharding need no collective). Otherwise the schedule is the rules'
    `parallel.context_attention` (ring, allgather or ulysses: `meshpar.attention.context_parallel`), and
    `parallel.load_balance` says the activations are in zigzag order (`meshpar.attention.zigzag`): the
    training step reorders tokens, targets and rotary positions once (`meshpar.loss.next_token_inputs`),
    every per-token layer is indifferent to the order, and attention masks by the zigzag positions. The ring
    then does equal work on every device; allgather and ulysses do the same work either way.

    Layout: q is laid out by the activation rules as ("batch", "seq", "heads", None) and k, v as
    ("batch", "seq", "kv_heads", None); `seq` must map to `sequence`. The shard_map is manual over every
    mesh axis those specs name (data, fsdp, model as well as sequence), not just `sequence`: XLA's
    partitioner replicates the operand of an all-gather or all-to-all in a partially manual region over
    the automatic axes (measured: a data=2,sequence=2,model=2 mesh gathers batch and heads first), which
    would undo data and tensor parallelism; per-device blocks avoid that. Ulysses then needs the heads
    per `model` shard divisible by the `sequence` size.
    """
    compute = context.active()
    axis = "sequence"
    if compute is None:
        return causal_attention(q_BTNH, k_BTKH, v_BTKH, window=window, segments_BT=segments_BT, softcap=softcap,
                                sinks_N=sinks_N)
    kernel = compute.attention_kernel
    if compute.mesh.shape.get(axis, 1) == 1:
        return causal_attention(q_BTNH, k_BTKH, v_BTKH, window=window, segments_BT=segments_BT, kernel=kernel,
                                platform=platform_of(compute.mesh), softcap=softcap, sinks_N=sinks_N)
    parallel, mesh, table = compute.rules.parallel, compute.mesh, compute.rules.table("activations")
    q_spec = sharding.spec_for(("batch", "seq", "heads", None), q_BTNH.shape, table, mesh.shape,
                               "attention q [B, T, N, H]")
    kv_spec = sharding.spec_for(("batch", "seq", "kv_heads", None), k_BTKH.shape, table, mesh.shape,
                                "attention k, v [B, T, K, H]")
    if q_spec[1] != axis or kv_spec[1] != axis:
        raise InputError(f"context-parallel attention needs the activation rule 'seq' to map to mesh axis "
                         f"'{axis}' alone; it gives {q_spec[1]!r}")
    return context_attention(parallel.context_attention, q_BTNH, k_BTKH, v_BTKH, mesh=mesh, axis=axis,
                             load_balanced=parallel.load_balance, kernel=kernel, q_spec=q_spec, kv_spec=kv_spec,
                             vmapped=compute.vmapped, window=window, segments_BT=segments_BT, softcap=softcap,
                             sinks_N=sinks_N)
