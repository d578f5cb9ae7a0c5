"""Training state, abstract-first sharded init, and the jitted training step.

The state (model parameters, AdamW moments, step count) is born sharded: the model is first built
abstractly (`nnx.eval_shape`), the rules turn its logical axes into shardings, and one `jax.jit` with
those `out_shardings` creates every array directly on the devices that own it, so no full-size array
ever exists on one device. The step is one jitted program with the state donated; the compiler (GSPMD)
inserts the collectives the layout needs: the gradient all-reduce for data parallelism, per-layer
parameter all-gathers (and gradient reductions) for FSDP, the TP all-reduces.

Gradient accumulation (`grad_accum=K`) runs K microbatches in a `lax.scan` inside the step with ONE
gradient synchronisation: each batch shard's gradients are kept apart (a `vmap` over the shards whose
axis lies on the batch mesh axes, so the compiler has nothing to reduce) and summed once after the
scan. Left to itself, the compiler all-reduces inside the loop, once per microbatch. The price is the
accumulator: one whole (unsharded) gradient per device, as with PyTorch's `no_sync`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshpar import attention, context, sharding
from meshpar.rules import Rules

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    global_batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    compute_dtype: str = "float32"
    remat: str = "none"
    grad_accum: int = 1
    decay_steps: int = 0  # length of the cosine schedule; 0: train.steps. Fix it to extend a run by resuming.

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"train.compute_dtype = '{self.compute_dtype}' is not one of "
                             f"{', '.join(COMPUTE_DTYPES)}")
        if self.remat not in context.REMAT_POLICIES:
            raise ValueError(f"train.remat = '{self.remat}' is not one of {', '.join(context.REMAT_POLICIES)}")
        for name in ("steps", "global_batch", "seq_len", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} = {getattr(self, name)} must be >= 1")
        if self.decay_steps < 0:
            raise ValueError(f"train.decay_steps = {self.decay_steps} must be >= 0 (0: train.steps)")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps = {self.warmup_steps} must be >= 0")
        if self.global_batch % self.grad_accum:
            raise ValueError(f"train.global_batch = {self.global_batch} is not divisible into "
                             f"train.grad_accum = {self.grad_accum} microbatches")

    @property
    def dtype(self) -> jnp.dtype:
        return COMPUTE_DTYPES[self.compute_dtype]


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW with linear warmup and cosine decay to a tenth of the peak."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=cfg.lr / (cfg.warmup_steps + 1), peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.decay_steps or cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr / 10)

    def decayed(params: nnx.State) -> Any:  # no weight decay on norm scales
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any("norm" in str(getattr(k, "key", "")) for k in path), params)

    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decayed))


class TrainState(nnx.Module):
    """The model and its optimizer: everything a step reads and writes."""

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation):
        self.model = model
        self.opt = nnx.Optimizer(model, tx, wrt=nnx.Param)


ModelFactory = Callable[[nnx.Rngs], nnx.Module]


@dataclasses.dataclass(frozen=True)
class Sharded:
    """A state's structure and its shardings on one mesh under one rules table."""

    graphdef: nnx.GraphDef
    abstract: nnx.State
    shardings: nnx.State
    mesh: Mesh
    rules: Rules


def plan_state(make_model: ModelFactory, tx: optax.GradientTransformation, mesh: Mesh, rules: Rules,
               seed: int = 0) -> Sharded:
    """Build the state abstractly and resolve its shardings; nothing is allocated."""
    with nnx.use_eager_sharding(False):  # meshpar, not Flax, resolves logical names
        abstract_ts = nnx.eval_shape(lambda: TrainState(make_model(nnx.Rngs(seed)), tx))
    graphdef, abstract = nnx.split(abstract_ts)
    return Sharded(graphdef, abstract, sharding.state_shardings(abstract, mesh, rules), mesh, rules)


def init_state(make_model: ModelFactory, tx: optax.GradientTransformation, plan: Sharded,
               seed: int = 0) -> nnx.State:
    """Create the state directly in its shardings (the same values on every mesh for one seed)."""

    def create() -> nnx.State:
        with nnx.use_eager_sharding(False):
            return nnx.state(TrainState(make_model(nnx.Rngs(seed)), tx))

    return jax.jit(create, out_shardings=plan.shardings)()


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean of logsumexp(logits) - logits[target], in float32.

    Written with a one-hot mask rather than a gather so that, with the vocabulary split over `model`,
    every device reduces its own slice and only [B, T] partial sums cross devices: the full
    [B, T, V] logits never exist on one device.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    is_target_BTV = jnp.arange(logits_BTV.shape[-1]) == targets_BT[..., None]
    return jnp.mean(logz_BT - jnp.sum(jnp.where(is_target_BTV, logits_BTV, 0.0), axis=-1))


def next_token_loss(model: nnx.Module, tokens_BT: jax.Array) -> jax.Array:
    """Cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1].

    With the sequence split over `sequence` and `load_balance` on, inputs, targets and positions are
    put in zigzag order once, here: every shard then holds an early and a late chunk of each sequence,
    so causal attention costs every shard the same. The mean loss does not depend on the order.
    """
    inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
    positions_T = jnp.arange(inputs_BT.shape[1])
    compute = context.active()
    if compute is not None and compute.mesh.shape["sequence"] > 1 and compute.rules.parallel.load_balance:
        n = compute.mesh.shape["sequence"]
        inputs_BT, targets_BT = attention.zigzag(inputs_BT, n), attention.zigzag(targets_BT, n)
        positions_T = attention.zigzag_positions(inputs_BT.shape[1], n)
    return cross_entropy(model(inputs_BT, positions_T), targets_BT)


def _batch_axes(plan: Sharded) -> tuple[str, ...]:
    return tuple(axis for axis in plan.rules.table("activations")["batch"] if plan.mesh.shape[axis] > 1)


LossFn = Callable[[nnx.State, jax.Array], jax.Array]


def _accumulated(plan: Sharded, cfg: TrainConfig, loss_fn: LossFn, params: nnx.State,
                 tokens_BT: jax.Array) -> tuple[jax.Array, nnx.State]:
    """Loss and gradients over `grad_accum` microbatches with one gradient reduction (module docstring)."""
    axes = _batch_axes(plan)
    S = math.prod(plan.mesh.shape[axis] for axis in axes)  # batch shards
    K, (B, T) = cfg.grad_accum, tokens_BT.shape
    if B % (S * K):
        raise ValueError(f"train.global_batch = {B} is not divisible into {K} microbatches on each of the "
                         f"{S} batch shards ({' × '.join(axes)})")
    # Shard s holds rows [s·B/S, (s+1)·B/S); its microbatch k is the k-th block of those rows.
    tokens_KSbT = jnp.swapaxes(tokens_BT.reshape(S, K, B // (S * K), T), 0, 1)
    tokens_KSbT = jax.lax.with_sharding_constraint(
        tokens_KSbT, NamedSharding(plan.mesh, jax.sharding.PartitionSpec(None, axes or None)))
    per_shard = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0), spmd_axis_name=axes or None)
    # Inside the vmap the batch mesh axes belong to the shard axis; the rows of one shard are local.
    local_rules = dataclasses.replace(plan.rules, activations=tuple(
        (name, () if name == "batch" else mesh_axes) for name, mesh_axes in plan.rules.activations))

    def microbatch(carry, tokens_SbT):
        loss_sum, grads_S = carry
        with context.use(dataclasses.replace(context.active(), rules=local_rules)):
            loss_S, g_S = per_shard(params, tokens_SbT)
        return (loss_sum + loss_S.sum(), jax.tree.map(jnp.add, grads_S, g_S)), None

    zeros_S = jax.tree.map(lambda p: jnp.zeros((S, *p.shape), jnp.float32), params)
    (loss_sum, grads_S), _ = jax.lax.scan(microbatch, (jnp.zeros((), jnp.float32), zeros_S), tokens_KSbT)
    return loss_sum / (S * K), jax.tree.map(lambda g: g.sum(0) / (S * K), grads_S)


def _loss_and_grads(plan: Sharded, cfg: TrainConfig, model: nnx.Module,
                    tokens_BT: jax.Array) -> tuple[jax.Array, nnx.State]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = lambda p, t: next_token_loss(nnx.merge(graphdef, p, rest), t)
    if cfg.grad_accum == 1:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BT)
    else:
        loss, grads = _accumulated(plan, cfg, loss_fn, params, tokens_BT)
    return loss, sharding.constrain_grads(grads, plan.mesh, plan.rules)


def loss_and_grads(plan: Sharded, tokens: NamedSharding,
                   cfg: TrainConfig = TrainConfig()) -> Callable[[nnx.State, jax.Array], tuple[jax.Array, nnx.State]]:
    """A jitted `(state, tokens) → (loss, parameter gradients)`: what parity tests compare."""

    def fn(state: nnx.State, tokens_BT: jax.Array) -> tuple[jax.Array, nnx.State]:
        with context.use(context.Compute(plan.mesh, plan.rules, cfg.remat)):
            return _loss_and_grads(plan, cfg, nnx.merge(plan.graphdef, state).model, tokens_BT)

    return jax.jit(fn, in_shardings=(plan.shardings, tokens))


def make_step(plan: Sharded, tokens: NamedSharding,
              cfg: TrainConfig = TrainConfig()) -> Callable[[nnx.State, jax.Array], tuple[nnx.State, dict[str, jax.Array]]]:
    """The jitted training step `(state, tokens) → (state, metrics)`, donating the old state.

    `tokens` is the sharding of the token batch (`sharding.batch_sharding`).
    """

    def step(state: nnx.State, tokens_BT: jax.Array) -> tuple[nnx.State, dict[str, jax.Array]]:
        with context.use(context.Compute(plan.mesh, plan.rules, cfg.remat)):
            ts = nnx.merge(plan.graphdef, state)
            loss, grads = _loss_and_grads(plan, cfg, ts.model, tokens_BT)
            ts.opt.update(ts.model, grads)
            return nnx.state(ts), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, in_shardings=(plan.shardings, tokens), out_shardings=(plan.shardings, None),
                   donate_argnums=0)
