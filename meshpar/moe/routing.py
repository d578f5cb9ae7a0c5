"""Routing: each token's top-k experts and their weights, and the router's statistics and losses.

A router is one linear map per token to E logits; softmax gives the probabilities p [E], the k largest
choose the experts, and their probabilities weigh the experts' outputs: renormalised over the k chosen
(`norm_topk_prob`; Mixtral always, Qwen3-MoE as its config says) or as they are.

Two losses keep routing healthy, each pooled over every token and every MoE layer of a forward pass, as
transformers' `load_balancing_loss_func` pools them (or of each pipeline microbatch: `train.router_loss_scope`):
- load balance (Switch Transformer, Mixtral): E · Σ_e f_e · P_e, with f_e the fraction of the (token,
  choice) assignments that went to expert e (Σ_e f_e = k) and P_e the mean router probability of e; k at a
  perfect balance. Its gradient reaches the router through P (f counts, it has none).
- z-loss (ST-MoE): the mean of logsumexp(logits)², which keeps the logits small.
To pool them across layers the model carries `RouterStats` beside the residual stream, summed over each
row's positions and over the layers it has passed; per row, so a pipeline moves them with their rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RouterStats(NamedTuple):
    """Sums over a row's positions and the MoE layers it passed ([B, ...], float32)."""

    counts_BE: jax.Array  # assignments to each expert (k per token and layer)
    probs_BE: jax.Array  # router probabilities of each expert
    z_B: jax.Array  # logsumexp(router logits)²
    dropped_B: jax.Array  # assignments dropped at capacity (meshpar.moe.dispatch)

    @classmethod
    def zeros(cls, rows: int, experts: int) -> RouterStats:
        return cls(jnp.zeros((rows, experts)), jnp.zeros((rows, experts)), jnp.zeros((rows,)), jnp.zeros((rows,)))

    def __add__(self, other: RouterStats) -> RouterStats:  # type: ignore[override]
        return RouterStats(*(a + b for a, b in zip(self, other)))

    def grouped(self, groups: int) -> RouterStats:
        """Summed into `groups` pools, pool g of the rows g, groups + g, … (a pipeline's microbatch g): one row
        each, what `losses` takes and a step adds up over its accumulation microbatches."""
        return RouterStats(*(x.reshape(x.shape[0] // groups, groups, *x.shape[1:]).sum(0) for x in self))


class Routes(NamedTuple):
    experts_BTk: jax.Array  # int32 expert ids, best first
    weights_BTk: jax.Array  # what each chosen expert's output is multiplied by (float32)
    stats: RouterStats  # this layer's share (dropped: 0, the dispatch counts it)


def route(logits_BTE: jax.Array, k: int, norm_topk_prob: bool) -> Routes:
    """The top-k experts of every token and their weights, from router logits [B, T, E]."""
    logits_BTE = logits_BTE.astype(jnp.float32)
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    top_BTk, experts_BTk = jax.lax.top_k(probs_BTE, k)
    if norm_topk_prob:
        top_BTk = top_BTk / top_BTk.sum(-1, keepdims=True)
    E = logits_BTE.shape[-1]
    counts_BE = jnp.sum(jax.nn.one_hot(experts_BTk, E, dtype=jnp.float32), axis=(1, 2))
    z_B = jnp.sum(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)), axis=1)
    stats = RouterStats(counts_BE, probs_BTE.sum(1), z_B, jnp.zeros_like(z_B))
    return Routes(experts_BTk.astype(jnp.int32), top_BTk, stats)


def token_layers(stats: RouterStats) -> jax.Array:
    """The number of (token, layer) pairs the stats pool, a constant: each adds 1 to the probabilities' sum."""
    return jax.lax.stop_gradient(stats.probs_BE.sum())


def balance_loss(stats: RouterStats, pool: RouterStats | None = None) -> jax.Array:
    """E · Σ_e f_e · P_e over the pooled tokens and layers (module docstring). With `pool`, the statistics
    of rows of which `stats` holds a share (a pipeline lane's of its microbatch): that share of the pool's
    loss, f and the token count from the pool. The loss is linear in P given them, so the shares add up to
    the pool's loss, and so do their gradients."""
    pool = stats if pool is None else pool
    counts_E, probs_E = pool.counts_BE.sum(0), stats.probs_BE.sum(0)
    n = token_layers(pool)
    return counts_E.shape[0] * jnp.sum((counts_E / n) * (probs_E / n))


def z_loss(stats: RouterStats, pool: RouterStats | None = None) -> jax.Array:
    """The mean over the pooled tokens and layers of logsumexp(router logits)²; with `pool`, `stats`'s share."""
    return stats.z_B.sum() / token_layers(stats if pool is None else pool)


def losses(stats: RouterStats) -> tuple[jax.Array, jax.Array]:
    """(load balance, z-loss): each the mean over the rows of `stats` of that row's pool's loss (the pools of
    `RouterStats.grouped`)."""
    per_pool = jax.vmap(lambda pool: (balance_loss(pool), z_loss(pool)))(jax.tree.map(lambda x: x[:, None], stats))
    return per_pool[0].mean(), per_pool[1].mean()


# What a step of a mixture of experts reports beside its loss (`metrics`), in this order.
ROUTER_METRICS = ("router_aux_loss", "router_z_loss", "expert_share_min", "expert_share_max", "dropped_fraction")


def metrics(stats: RouterStats) -> dict[str, jax.Array]:
    """What a step reports of its routing, from its pools (`grouped`): both losses (`losses`), the smallest and
    largest expert's share of the assignments (1/E each at a perfect balance), and the fraction of
    assignments dropped at capacity."""
    counts_E = stats.counts_BE.sum(0)
    share_E = counts_E / counts_E.sum()
    values = (*losses(stats), share_E.min(), share_E.max(), stats.dropped_B.sum() / counts_E.sum())
    return dict(zip(ROUTER_METRICS, values))
