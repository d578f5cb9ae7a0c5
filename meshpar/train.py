"""Training state, abstract-first sharded init, and the jitted training step.

The state (model parameters, AdamW moments, step count) is born sharded: the model is first built
abstractly (`nnx.eval_shape`), the rules turn its logical axes into shardings, and one `jax.jit` with
those `out_shardings` creates every array directly on the devices that own it, so no full-size array
ever exists on one device. The step is one jitted program with the state donated; the compiler (GSPMD)
inserts the collectives the layout needs: the gradient all-reduce for data parallelism, per-layer
parameter all-gathers (and gradient reductions) for FSDP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshpar import sharding
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

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"train.compute_dtype = '{self.compute_dtype}' is not one of "
                             f"{', '.join(COMPUTE_DTYPES)}")
        for name in ("steps", "global_batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} = {getattr(self, name)} must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps = {self.warmup_steps} must be >= 0")

    @property
    def dtype(self) -> jnp.dtype:
        return COMPUTE_DTYPES[self.compute_dtype]


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW with linear warmup and cosine decay to a tenth of the peak."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=cfg.lr / (cfg.warmup_steps + 1), peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr / 10)

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


def next_token_loss(model: nnx.Module, tokens_BT: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1], in float32."""
    logits_BTV = model(tokens_BT[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT[:, 1:]).mean()


def loss_and_grads(plan: Sharded, tokens: NamedSharding) -> Callable[[nnx.State, jax.Array], tuple[jax.Array, nnx.State]]:
    """A jitted `(state, tokens) → (loss, parameter gradients)`: what parity tests compare."""

    def fn(state: nnx.State, tokens_BT: jax.Array) -> tuple[jax.Array, nnx.State]:
        with sharding.activation_rules(plan.mesh, plan.rules):
            model = nnx.merge(plan.graphdef, state).model
            return nnx.value_and_grad(next_token_loss)(model, tokens_BT)

    return jax.jit(fn, in_shardings=(plan.shardings, tokens))


def make_step(plan: Sharded, tokens: NamedSharding) -> Callable[[nnx.State, jax.Array], tuple[nnx.State, dict[str, jax.Array]]]:
    """The jitted training step `(state, tokens) → (state, metrics)`, donating the old state.

    `tokens` is the sharding of the token batch (`sharding.batch_sharding`).
    """

    def step(state: nnx.State, tokens_BT: jax.Array) -> tuple[nnx.State, dict[str, jax.Array]]:
        with sharding.activation_rules(plan.mesh, plan.rules):
            ts = nnx.merge(plan.graphdef, state)
            loss, grads = nnx.value_and_grad(next_token_loss)(ts.model, tokens_BT)
            ts.opt.update(ts.model, grads)
            return nnx.state(ts), {"loss": loss, "grad_norm": optax.global_norm(grads)}

    return jax.jit(step, in_shardings=(plan.shardings, tokens), out_shardings=(plan.shardings, None),
                   donate_argnums=0)
