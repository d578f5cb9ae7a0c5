"""Direct preference optimisation (Rafailov et al., 2023), the sigmoid loss, as TRL's `DPOTrainer` computes it.

A batch holds pairs: rows 2i and 2i + 1 are the chosen and the rejected response to one prompt (`data.packing =
pairs` keeps them so, in one step, on one device). A sequence's log-probability log π(y|x) is the sum over its
targets of weight > 0 (the response's tokens: `launch.prepare` weighs the prompt 0). With r = β · (log π(y|x) −
log π_ref(y|x)) for each response, the loss of a pair is −log σ(r_chosen − r_rejected), averaged over the pairs
of the global batch.

The reference model's log-probabilities are computed in the step, before the gradient, with no gradient
(`reference_log_probs`): a LoRA run's reference is its own base (the adapters switched off: `meshpar.lora`), a
full fine-tuning run's the frozen copy of its starting weights the state holds (`TrainConfig.reference`). They
travel in the batch (`Batch.reference`), so accumulation's microbatches and the mesh's shards carry their own.

Metrics, as TRL names them: `rewards/chosen`, `rewards/rejected` (the mean r of each), `rewards/margins` (the
mean r_chosen − r_rejected), `rewards/accuracies` (the share of pairs with r_chosen > r_rejected), and
`logps/chosen`, `logps/rejected` (the mean log π).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshpar import lora
from meshpar.attention import sequence_order
from meshpar.batch import Batch
from meshpar.errors import InputError
from meshpar.loss import final_hidden_states, next_token_inputs, token_log_probs
from meshpar.moe import routing
from meshpar.rules import SLOT_SCHEDULES

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


class Rewards(NamedTuple):
    """A part of the batch's share of each metric's mean over the global batch's pairs (its sum over its pairs
    divided by their global number), so that the parts' add up as the step's losses do."""

    chosen: jax.Array
    rejected: jax.Array
    accuracies: jax.Array
    logps_chosen: jax.Array
    logps_rejected: jax.Array


def metrics(rewards: Rewards) -> dict[str, jax.Array]:
    return dict(zip(METRICS, (rewards.chosen, rewards.rejected, rewards.chosen - rewards.rejected,
                              rewards.accuracies, rewards.logps_chosen, rewards.logps_rejected)))


def check_schedule(schedule: str, stages: int) -> None:
    """Refuse a pipeline schedule that computes the loss inside the pipeline, per microbatch and position: DPO
    takes each sequence's log-probability whole."""
    if stages > 1 and schedule in SLOT_SCHEDULES:
        raise InputError(f"train.objective = dpo takes each sequence's log-probability whole, which "
                         f"parallel.pipeline_schedule = {schedule} cannot give (it computes the next-token loss inside "
                         f"the pipeline): use pipeline_schedule=gpipe")


def _per_target(model, batch: Batch, chunk: int) -> tuple[jax.Array, jax.Array, routing.RouterStats | None]:
    """(log-probabilities [B, T] of the targets of weight > 0, else 0, in the step's sequence order; that order's
    inverse; a mixture's router statistics or None)."""
    x = next_token_inputs(batch)
    hidden_BTD, stats = final_hidden_states(model, x)
    logp_BT = token_log_probs(hidden_BTD, model.output_head(), x.targets, chunk, getattr(model, "logit_softcap", None))
    return jnp.where(x.weights > 0, logp_BT, 0.0), sequence_order(x.targets.shape[1])[2], stats


def reference_log_probs(model, reference, batch: Batch, chunk: int = 0) -> jax.Array:
    """`Batch.reference` [B, T + 1] of `batch`: under `reference` (a frozen model), else under `model` with its
    adapters off; no gradient flows into it."""
    if reference is None and not lora.has_adapters(model):
        raise InputError("train.objective = dpo needs a reference model: LoRA adapters to switch off "
                         "(train.lora_rank > 0), or the frozen copy of the starting weights a full fine-tuning "
                         "run's state holds (train.reference)")
    with lora.disabled():
        logp_BT, restore, _ = _per_target(reference or model, batch, chunk)
    return jax.lax.stop_gradient(jnp.pad(restore(logp_BT), ((0, 0), (1, 0))))


def loss(beta: float, pairs: int, chunk: int = 0, aux_coef: float = 0.0, z_coef: float = 0.0, pools: int = 1):
    """The DPO loss `(model, batch) → (loss, Rewards)` of a batch of `pairs` pairs in all (`Batch.reference`
    filled in), plus a mixture's router losses as the language-model loss adds them (`meshpar.loss`)."""

    def fn(model, batch: Batch) -> tuple[jax.Array, Rewards]:
        if batch.reference is None:
            raise InputError("the DPO loss needs the reference model's log-probabilities in the batch "
                             "(meshpar.dpo.reference_log_probs)")
        logp_BT, _, stats = _per_target(model, batch, chunk)
        logp_P2 = logp_BT.sum(axis=1).reshape(-1, 2)  # (chosen, rejected) per pair
        reward_P2 = beta * (logp_P2 - batch.reference.sum(axis=1).reshape(-1, 2))
        margin_P = reward_P2[:, 0] - reward_P2[:, 1]
        value = -jax.nn.log_sigmoid(margin_P).sum() / pairs
        if stats is not None:
            balance, z = routing.losses(stats.grouped(pools))
            value = value + aux_coef * balance + z_coef * z
        share = lambda x: x.sum() / pairs
        rewards = Rewards(share(reward_P2[:, 0]), share(reward_P2[:, 1]), share((margin_P > 0).astype(jnp.float32)),
                          share(logp_P2[:, 0]), share(logp_P2[:, 1]))
        return value, jax.lax.stop_gradient(rewards)

    return fn
