"""A training batch: the tokens, and where documents are packed, which document each token belongs to and
how much each target counts.

Every field is `[B, T + 1]`, one row per sequence, laid out over the batch axes like the tokens; the model
reads `row[:-1]` and predicts `row[1:]`:
- `tokens`: int32 token ids;
- `segments`: int32 ids of the documents packed into each row (None: one document per row). A token
  attends only to earlier tokens of its own document, and positions restart at each document's first
  token (`document_positions`). Ids are distinct per document of a row and grow along it (the blockwise
  kernel skips tiles by their ranges of ids); padding may take 0;
- `weights`: float32, how much each token counts as a target (column 0 is never one; None: all 1). 0 for
  prompts, padding, and the first token of a packed document (it would be predicted from the previous
  document);
- `reference`: float32, each target's log-probability under a DPO run's reference model, 0 where it is no
  target (column 0 too), so a row's sum is its sequence's (`meshpar.dpo`); the step fills it in (None: none).

The loss of a batch is Σ weight · token loss / Σ weight over the GLOBAL batch: the training step divides
the weights by their global sum once (`normalised`), so every part of the batch — a device's rows, a
microbatch of accumulation or of a pipeline — adds its weighted sum and the parts need no counts of their own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Batch(NamedTuple):
    tokens: jax.Array
    segments: jax.Array | None = None
    weights: jax.Array | None = None
    reference: jax.Array | None = None


def as_batch(batch: Batch | jax.Array) -> Batch:
    """A batch as given, or a token array `[B, T + 1]` as a batch of whole rows weighted equally."""
    return batch if isinstance(batch, Batch) else Batch(batch)


def target_weights(batch: Batch) -> jax.Array:
    """The weight of every target `[B, T]` (float32): the given ones, or 1."""
    if batch.weights is None:
        return jnp.ones(batch.tokens[:, 1:].shape, jnp.float32)
    return batch.weights[:, 1:].astype(jnp.float32)


def loss_weights(batch: Batch) -> jax.Array:
    """What each target `[B, T]` weighs in the loss (a weighted sum): the given weights, or 1/(B·T) each,
    which makes the sum a mean."""
    if batch.weights is None:
        return jnp.full(batch.tokens[:, 1:].shape, 1 / batch.tokens[:, 1:].size, jnp.float32)
    return target_weights(batch)


def normalised(batch: Batch) -> tuple[Batch, jax.Array]:
    """(the batch with its target weights divided by their sum, that sum): a loss over any part of it is then
    that part's share of the global mean. A batch with no weight at all keeps zeros (its loss is 0)."""
    weights_BT = target_weights(batch)
    total = weights_BT.sum()
    weights_BT = weights_BT / jnp.where(total > 0, total, 1.0)
    return batch._replace(weights=jnp.pad(weights_BT, ((0, 0), (1, 0)))), total


def document_positions(segments_BT: jax.Array) -> jax.Array:
    """Each token's position within its document `[B, T]` (int32): 0 where the segment id changes."""
    T = segments_BT.shape[1]
    t_T = jnp.arange(T, dtype=jnp.int32)
    starts_BT = jnp.concatenate([jnp.ones_like(segments_BT[:, :1], bool), segments_BT[:, 1:] != segments_BT[:, :-1]],
                                axis=1)
    return t_T - jax.lax.cummax(jnp.where(starts_BT, t_T, 0), axis=1)
