"""Routing: each token's top-k experts and their weights, and the router's statistics and losses.

A router is one linear map per token to E logits, turned into E scores: softmax over the experts (Mixtral,
Qwen3-MoE) or a sigmoid per expert (DeepSeek-V3: `router_score = sigmoid`). The k best scores choose the
experts, and their scores weigh the experts' outputs: renormalised over the k chosen (`norm_topk_prob`;
Mixtral always, Qwen3-MoE and DeepSeek-V3 as their configs say) or as they are, then × `routed_scaling`.
DeepSeek-V3 adds two things to the choice, none to the weights:
- group-limited routing: the E experts fall into `expert_groups` groups of E/G (a node's), each group scores
  the sum of its two best scores, and a token chooses its k experts among the `topk_groups` best groups;
- loss-free balancing: a per-expert bias b_e (`SelectionBias`, never trained by the optimizer) is added to
  the scores for choosing only. After each optimizer step b_e += u · sign(mean load − load_e), load_e the
  assignments expert e got in this layer over the step's whole batch (`balanced`). Those loads reach the
  step as the bias's gradient: `with_loads` is the identity on the layer's output whose backward pass
  returns the layer's counts as the bias's cotangent, so every path that differentiates the parameters
  (accumulation, any sharding, a pipeline's own backward) sums them over the step's batch as it sums
  gradients; the step takes them out before clipping and the optimizer.

Three losses keep routing healthy:
- load balance (Switch Transformer, Mixtral): E · Σ_e f_e · P_e, with f_e the fraction of the (token,
  choice) assignments that went to expert e (Σ_e f_e = k) and P_e the mean router probability of e (the
  scores normalised over the experts: softmax's, or the sigmoid scores divided by their sum); k at a
  perfect balance. Pooled over every token and every MoE layer of a forward pass, as transformers'
  `load_balancing_loss_func` pools them (or of each pipeline microbatch: `train.router_loss_scope`). Its
  gradient reaches the router through P (f counts, it has none).
- sequence-wise balance (DeepSeek-V3 eq. 17-20): per sequence and MoE layer Σ_e f_e · P_e with
  f_e = E/(k·T) · (the sequence's assignments to e) and P_e the mean over its T tokens of the normalised
  scores; summed over the layers, averaged over the sequences.
- z-loss (ST-MoE): the mean of logsumexp(logits)², which keeps the logits small.
To pool them across layers the model carries `RouterStats` beside the residual stream, summed over each
row's positions and over the layers it has passed; per row, so a pipeline moves them with their rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

SCORES = ("softmax", "sigmoid")


class SelectionBias(nnx.Param):
    """A MoE layer's per-expert bias for choosing experts (loss-free balancing): the step differentiates it,
    its "gradient" being the layer's loads (`with_loads`), and updates it by `balanced`, never the optimizer."""


# What the optimizer trains: every parameter but the selection biases, which the step moves itself.
TRAINED = nnx.All(nnx.Param, nnx.Not(SelectionBias))


class RouterStats(NamedTuple):
    """Sums over a row's positions and the MoE layers it passed ([B, ...], float32)."""

    counts_BE: jax.Array  # assignments to each expert (k per token and layer)
    probs_BE: jax.Array  # router probabilities of each expert (scores normalised over the experts)
    z_B: jax.Array  # logsumexp(router logits)²
    dropped_B: jax.Array  # assignments dropped at capacity (meshpar.moe.dispatch)
    seq_B: jax.Array  # Σ over the layers of the sequence-wise Σ_e f_e · P_e (f constant: no gradient)

    @classmethod
    def zeros(cls, rows: int, experts: int) -> RouterStats:
        return cls(jnp.zeros((rows, experts)), jnp.zeros((rows, experts)), *(jnp.zeros((rows,)) for _ in range(3)))

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


def _choice(scores_BTE: jax.Array, bias_E: jax.Array | None, groups: int, topk_groups: int) -> jax.Array:
    """The scores the experts are chosen by: biased, and -inf outside each token's `topk_groups` best groups."""
    if bias_E is not None:
        scores_BTE = scores_BTE + jax.lax.stop_gradient(bias_E)
    if groups == 1:
        return scores_BTE
    *lead, E = scores_BTE.shape
    grouped_BTGe = scores_BTE.reshape(*lead, groups, E // groups)
    group_BTG = jax.lax.top_k(grouped_BTGe, 2)[0].sum(-1)  # a group scores its two best
    best_BTg = jax.lax.top_k(group_BTG, topk_groups)[1]
    kept_BTG = jax.nn.one_hot(best_BTg, groups, dtype=jnp.float32).sum(-2) > 0
    return jnp.where(kept_BTG[..., None], grouped_BTGe, -jnp.inf).reshape(scores_BTE.shape)


def route(logits_BTE: jax.Array, k: int, norm_topk_prob: bool, score: str = "softmax", groups: int = 1,
          topk_groups: int = 1, scaling: float = 1.0, bias_E: jax.Array | None = None) -> Routes:
    """The top-k experts of every token and their weights, from router logits [B, T, E], as the module
    docstring says (the names of the model's config: `router_score`, `expert_groups`, `topk_groups`,
    `routed_scaling`; `bias_E` a `SelectionBias`'s value, added for the choice only)."""
    logits_BTE = logits_BTE.astype(jnp.float32)
    if score == "softmax":
        scores_BTE = probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    else:
        scores_BTE = jax.nn.sigmoid(logits_BTE)
        probs_BTE = scores_BTE / scores_BTE.sum(-1, keepdims=True)
    if bias_E is None and groups == 1:  # chosen by the scores themselves: one top_k
        top_BTk, experts_BTk = jax.lax.top_k(scores_BTE, k)
    else:
        experts_BTk = jax.lax.top_k(_choice(scores_BTE, bias_E, groups, topk_groups), k)[1]
        top_BTk = jnp.take_along_axis(scores_BTE, experts_BTk, axis=-1)
    if norm_topk_prob:
        total_BT1 = top_BTk.sum(-1, keepdims=True)
        top_BTk = top_BTk / (total_BT1 + 1e-20 if score == "sigmoid" else total_BT1)  # as transformers' sigmoid
    if scaling != 1.0:
        top_BTk = top_BTk * scaling
    return Routes(experts_BTk.astype(jnp.int32), top_BTk, _stats(logits_BTE, probs_BTE, experts_BTk))


def _stats(logits_BTE: jax.Array, probs_BTE: jax.Array, experts_BTk: jax.Array) -> RouterStats:
    """A layer's router statistics from its logits, normalised scores and choices (dropped: 0)."""
    (_, T, E), k = logits_BTE.shape, experts_BTk.shape[-1]
    counts_BE = jnp.sum(jax.nn.one_hot(experts_BTk, E, dtype=jnp.float32), axis=(1, 2))
    z_B = jnp.sum(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)), axis=1)
    f_BE = counts_BE * (E / (k * T))  # the sequence's f: counts, no gradient
    seq_B = jnp.sum(f_BE * probs_BTE.mean(1), axis=-1)
    return RouterStats(counts_BE, probs_BTE.sum(1), z_B, jnp.zeros_like(z_B), seq_B)


@jax.custom_vjp
def with_loads(y_BTD: jax.Array, bias_E: jax.Array, counts_BE: jax.Array) -> jax.Array:
    """`y_BTD`, a MoE layer's output; its backward pass gives `bias_E` (the layer's `SelectionBias`) the layer's
    loads, Σ over the rows of `counts_BE` [B, E] (the rows the loss depends on: a pipeline's bubbles are
    dropped by selects, which give their rows a zero cotangent)."""
    return y_BTD


def _with_loads_fwd(y_BTD, bias_E, counts_BE):
    return y_BTD, jax.lax.stop_gradient(counts_BE)


def _with_loads_bwd(counts_BE, g_BTD):
    live_B = jnp.any(g_BTD != 0, axis=tuple(range(1, g_BTD.ndim)))
    loads_E = jnp.where(live_B[:, None], counts_BE, 0.0).sum(0)
    return g_BTD, loads_E, jnp.zeros_like(counts_BE)


with_loads.defvjp(_with_loads_fwd, _with_loads_bwd)


def balanced(bias_LE: jax.Array, loads_LE: jax.Array, rate: float) -> jax.Array:
    """Loss-free balancing's update of a layer's (or a stack's) selection bias from its loads over the step's
    batch: b_e += rate · sign(mean_e' load − load_e), an overloaded expert made less likely to be chosen."""
    return bias_LE + rate * jnp.sign(loads_LE.mean(-1, keepdims=True) - loads_LE)


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


def sequence_loss(stats: RouterStats, rows: int) -> jax.Array:
    """The sequence-wise balance loss of `rows` sequences, of which `stats` holds some (per row, not pooled):
    their share of the mean over the sequences of Σ_layers Σ_e f_e · P_e. Linear per row: shares add up."""
    return stats.seq_B.sum() / rows


def losses(stats: RouterStats) -> tuple[jax.Array, jax.Array]:
    """(load balance, z-loss): each the mean over the rows of `stats` of that row's pool's loss (the pools of
    `RouterStats.grouped`)."""
    per_pool = jax.vmap(lambda pool: (balance_loss(pool), z_loss(pool)))(jax.tree.map(lambda x: x[:, None], stats))
    return per_pool[0].mean(), per_pool[1].mean()


# What a step of a mixture of experts reports beside its loss (`metrics`), in this order.
ROUTER_METRICS = ("router_aux_loss", "router_z_loss", "expert_share_min", "expert_share_max", "dropped_fraction",
                  "router_seq_aux_loss")


def metrics(stats: RouterStats, rows: int = 0) -> dict[str, jax.Array]:
    """What a step reports of its routing, from its pools (`grouped`): both losses (`losses`), the smallest and
    largest expert's share of the assignments (1/E each at a perfect balance), and the fraction of
    assignments dropped at capacity; with `rows` (the step's sequences) the sequence-wise loss too."""
    counts_E = stats.counts_BE.sum(0)
    share_E = counts_E / counts_E.sum()
    values = (*losses(stats), share_E.min(), share_E.max(), stats.dropped_B.sum() / counts_E.sum())
    values += (sequence_loss(stats, rows),) if rows else ()
    return dict(zip(ROUTER_METRICS, values))
