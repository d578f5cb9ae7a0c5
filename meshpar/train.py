"""Training state, abstract-first sharded init, and the jitted training step.

The state (model parameters, AdamW moments, step count) is born sharded: the model is first built
abstractly (`nnx.eval_shape`), the rules turn its logical axes into shardings, and one `jax.jit` with
those `out_shardings` creates every array directly on the devices that own it, so no full-size array
ever exists on one device. The step is one jitted program with the state donated; the compiler (GSPMD)
inserts the collectives the layout needs: the gradient all-reduce for data parallelism, per-layer
parameter all-gathers (and gradient reductions) for FSDP, the TP all-reduces. With
`parallel.pipeline_schedule=1f1b` on a `stage` mesh the loss and gradients come from the 1F1B schedule
(`meshpar.pipeline.one_f_one_b`, which runs the loss inside the pipeline), not from `jax.value_and_grad`.

The batch (`meshpar.batch.Batch`, or a token array) is weighed once, up front: its target weights are
divided by their sum over the global batch (`batch.normalised`), so the loss of every part of it — a
device's rows, an accumulation microbatch, a pipeline microbatch — is its share of the global weighted
mean, and the parts' losses and gradients are simply summed: the same number on every mesh and for any
accumulation, however unevenly the weights fall. The step reports that sum of weights (metric `tokens`:
the targets trained on).

Gradient accumulation (`grad_accum=A`) runs A microbatches in a `lax.scan` inside the step. The
accumulator has the gradient's own layout (the `grads` rules: split over `fsdp` under ZeRO-2/3, over
`model` under TP, over `stage` under PP), so its bytes per device are the ZeRO formula's. Each
microbatch's gradient is reduced into it over the axes that split the accumulator (per microbatch: a
reduce-scatter over `fsdp` on GPUs, an all-reduce then a slice on CPU; and over `sequence`, whose
shards hold partial weight gradients), but NOT over the pure replica axes — the batch axes over which
gradients are whole (`data`; `fsdp` too under ZeRO 0/1): there each replica keeps its own partial sum
(a `vmap` over the replicas whose axis lies on those mesh axes, so the compiler has nothing to reduce)
and they are all-reduced once, after the scan. Left to itself, the compiler would all-reduce over them
inside the loop, once per microbatch.
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar import (context, dpo, fp8 as fp8_lib, frozen, lora as lora_lib, offload, pipeline, remat as remat_lib,
                     sharding)
from meshpar.attention.kernels import KERNELS
from meshpar.batch import Batch, as_batch, normalised
from meshpar.errors import InputError
from meshpar.loss import MTPStats, ahead_totals, next_token_loss_and_routing
from meshpar.moe import routing
from meshpar.pipeline import one_f_one_b
from meshpar.rules import SLOT_SCHEDULES, ParallelConfig, Rules

ModelFactory = Callable[[nnx.Rngs], nnx.Module]
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
NONFINITE = ("stop", "skip")
ROUTER_LOSS_SCOPES = ("auto", "batch", "microbatch")
OBJECTIVES = ("lm", "dpo")


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
    remat: str = "auto"  # auto, none, dots, full, offload: meshpar.remat
    grad_accum: int = 1
    decay_steps: int = 0  # length of the cosine schedule; 0: train.steps. Fix it to extend a run by resuming.
    attention_kernel: str = "auto"  # auto, dense, blockwise (cudnn: GPUs); see meshpar.attention.kernels
    loss_chunk: int = 0  # positions per sequence shard in one loss chunk; 0: auto (meshpar.loss)
    eval_every: int = 0  # evaluate on the held-out split every this many steps and at the last; 0: never
    eval_batches: int = 4  # global batches of held-out tokens per evaluation (the same ones every time)
    on_nonfinite: str = "stop"  # a NaN/Inf loss or gradient norm: "stop" the run, or "skip" the update
    sample_every: int = 0  # print a greedy sample (meshpar.generate) every this many steps and at the last; 0: never
    # A mixture of experts' router losses (meshpar.moe.routing), as transformers' router_aux_loss_coef weighs them
    router_aux_loss_coef: float = 0.001  # × the load-balancing loss (Switch / Mixtral)
    router_z_loss_coef: float = 0.0  # × the router z-loss (ST-MoE)
    router_loss_scope: str = "auto"  # where they pool: auto, batch, microbatch (`router_pools`)
    router_seq_aux_loss_coef: float = 0.0  # × DeepSeek-V3's sequence-wise balance loss (summed over layers)
    # loss-free balancing (model.selection_bias): each step moves the biases by this (DeepSeek-V3's); 0: frozen
    router_bias_update_rate: float = 0.001
    # LoRA (meshpar.lora): adapters of rank lora_rank on lora_targets train, every other weight is frozen; 0: none
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the update is scaled by lora_alpha / lora_rank (/ √lora_rank with lora_rslora)
    lora_targets: str = "q,k,v,o,gate,up,down"  # comma-separated: q, k, v, o, gate, up, down, experts (meshpar.lora)
    lora_rslora: bool = False
    frozen_dtype: str = "float32"  # the frozen weights' (LoRA's base, DPO's reference): float32 or bfloat16
    objective: str = "lm"  # lm: next-token cross-entropy; dpo: preference pairs (meshpar.dpo)
    dpo_beta: float = 0.1  # DPO's β: how far the policy may move from the reference
    fp8: str = "none"  # none, tensorwise, rowwise: attention's and the MLPs' matmuls in FP8 (meshpar.fp8)
    mtp_loss_weight: float = 0.3  # λ: × L_MTP, the multi-token prediction modules' loss (model.mtp_depth > 0)

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise InputError(f"train.compute_dtype = '{self.compute_dtype}' is not one of "
                             f"{', '.join(COMPUTE_DTYPES)}")
        if self.remat not in ("auto", *remat_lib.POLICIES):
            raise InputError(f"train.remat = '{self.remat}' is not one of auto, {', '.join(remat_lib.POLICIES)}")
        if self.attention_kernel not in KERNELS:
            raise InputError(f"train.attention_kernel = '{self.attention_kernel}' is not one of {', '.join(KERNELS)}")
        if self.loss_chunk < 0:
            raise InputError(f"train.loss_chunk = {self.loss_chunk} must be >= 0 (0: auto)")
        if self.on_nonfinite not in NONFINITE:
            raise InputError(f"train.on_nonfinite = '{self.on_nonfinite}' is not one of {', '.join(NONFINITE)}")
        for name in ("eval_every", "sample_every"):
            if getattr(self, name) < 0:
                raise InputError(f"train.{name} = {getattr(self, name)} must be >= 0 (0: never)")
        for name in ("steps", "global_batch", "seq_len", "grad_accum", "eval_batches"):
            if getattr(self, name) < 1:
                raise InputError(f"train.{name} = {getattr(self, name)} must be >= 1")
        if self.decay_steps < 0:
            raise InputError(f"train.decay_steps = {self.decay_steps} must be >= 0 (0: train.steps)")
        if not self.clip_norm > 0:
            raise InputError(f"train.clip_norm = {self.clip_norm} must be > 0 (a large value: no clipping)")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_seq_aux_loss_coef",
                     "router_bias_update_rate", "mtp_loss_weight"):
            if getattr(self, name) < 0:
                raise InputError(f"train.{name} = {getattr(self, name)} must be >= 0")
        if self.router_loss_scope not in ROUTER_LOSS_SCOPES:
            raise InputError(f"train.router_loss_scope = '{self.router_loss_scope}' is not one of "
                             f"{', '.join(ROUTER_LOSS_SCOPES)}")
        if self.warmup_steps < 0:
            raise InputError(f"train.warmup_steps = {self.warmup_steps} must be >= 0")
        if self.global_batch % self.grad_accum:
            raise InputError(f"train.global_batch = {self.global_batch} is not divisible into "
                             f"train.grad_accum = {self.grad_accum} microbatches")
        if self.lora_rank < 0:
            raise InputError(f"train.lora_rank = {self.lora_rank} must be >= 0 (0: no adapters)")
        self.lora  # noqa: B018  validates the adapters' settings
        if self.frozen_dtype not in COMPUTE_DTYPES:
            raise InputError(f"train.frozen_dtype = '{self.frozen_dtype}' is not one of {', '.join(COMPUTE_DTYPES)}")
        if self.fp8 not in fp8_lib.RECIPES:
            raise InputError(f"train.fp8 = '{self.fp8}' is not one of {', '.join(fp8_lib.RECIPES)}")
        if self.objective not in OBJECTIVES:
            raise InputError(f"train.objective = '{self.objective}' is not one of {', '.join(OBJECTIVES)}")
        if self.objective == "dpo" and self.router_seq_aux_loss_coef:
            raise InputError(f"train.router_seq_aux_loss_coef = {self.router_seq_aux_loss_coef} is a language-model "
                             f"loss's: train.objective = dpo does not add it (set it to 0)")
        if self.objective == "dpo" and not self.dpo_beta > 0:
            raise InputError(f"train.dpo_beta = {self.dpo_beta} must be > 0")
        if self.objective == "dpo" and self.global_batch % (2 * self.grad_accum):
            raise InputError(f"train.objective = dpo takes pairs of rows (chosen, rejected): train.global_batch = "
                             f"{self.global_batch} must be an even number of rows per microbatch (grad_accum = "
                             f"{self.grad_accum})")

    @property
    def dtype(self) -> jnp.dtype:
        return COMPUTE_DTYPES[self.compute_dtype]

    @property
    def lora(self) -> lora_lib.LoraConfig | None:
        """The LoRA adapters' settings (None: every weight trains)."""
        if not self.lora_rank:
            return None
        named = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        return lora_lib.LoraConfig(self.lora_rank, self.lora_alpha, named, self.lora_rslora)

    @property
    def frozen(self) -> jnp.dtype:
        return COMPUTE_DTYPES[self.frozen_dtype]

    def frozen_base(self, make_model: ModelFactory) -> ModelFactory:
        """`make_model` (its model built with this run's LoRA adapters) as the run trains it: every weight but the
        adapters frozen in `frozen_dtype`; `make_model` itself without LoRA."""
        return make_model if self.lora is None else lora_lib.on_frozen_base(make_model, self.frozen)

    @property
    def reference(self) -> jnp.dtype | None:
        """The dtype of the frozen copy of the starting weights the state holds as DPO's reference model (full
        fine-tuning), else None (no copy; a LoRA run's reference is its base, the adapters off)."""
        return self.frozen if self.objective == "dpo" and self.lora is None else None


def schedule(cfg: TrainConfig) -> optax.Schedule:
    """Learning rate by update count: linear warmup, then cosine decay to a tenth of the peak."""
    return optax.warmup_cosine_decay_schedule(
        init_value=cfg.lr / (cfg.warmup_steps + 1), peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.decay_steps or cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr / 10)


def clip_scale(norm: jax.Array, max_norm: float) -> jax.Array:
    """What clipping by global norm multiplies the gradients by: min(1, max_norm / norm)."""
    return jnp.minimum(1.0, max_norm / norm)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` as one multiply by `clip_scale`: XLA fuses the multiply into AdamW's
    update, where optax's select wrote the clipped gradients out first (one more pass over them). The
    norm is the step's `grad_norm` metric; the compiler computes it once."""

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, optax.EmptyState]:
        scale = clip_scale(optax.tree.norm(updates), max_norm)
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW on `schedule(cfg)`; no weight decay on norm scales and biases (the
    parameters whose path names a norm or a bias)."""

    def decayed(params: nnx.State) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any(word in str(getattr(k, "key", "")) for k in path for word in ("norm", "bias")),
            params)

    return optax.chain(clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule(cfg), b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decayed))


class TrainState(nnx.Module):
    """The model and its optimizer: everything a step reads and writes; with `reference`, a frozen copy of the
    starting model beside them (full fine-tuning DPO's reference model: `TrainConfig.reference`)."""

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, reference: nnx.Module | None = None):
        self.model = model
        self.opt = nnx.Optimizer(model, tx, wrt=routing.TRAINED)
        if reference is not None:
            self.reference = reference


def _train_state(make_model: ModelFactory, tx: optax.GradientTransformation, seed: int,
                 reference: jnp.dtype | None, params: nnx.State | None = None) -> TrainState:
    """A TrainState of `make_model`'s model (holding `params` where given), with a `reference` copy of it frozen in
    that dtype where one is asked for."""
    model = make_model(nnx.Rngs(seed))
    copy = None if reference is None else frozen.freeze(make_model(nnx.Rngs(seed)), reference)
    for m in (model, copy):
        if m is not None and params is not None:
            frozen.load(m, params)
    return TrainState(model, tx, copy)


@dataclasses.dataclass(frozen=True)
class Sharded:
    """A state's structure and its shardings on one mesh under one rules table."""

    graphdef: nnx.GraphDef
    abstract: nnx.State
    shardings: nnx.State
    mesh: Mesh
    rules: Rules


def sharded_abstract(make_model: ModelFactory, tx: optax.GradientTransformation, mesh: Mesh, rules: Rules,
                     seed: int = 0, reference: jnp.dtype | None = None) -> Sharded:
    """The state built abstractly (with a frozen `reference` copy in that dtype where given), with its shardings
    on `mesh` by `rules`: nothing is allocated."""
    with nnx.use_eager_sharding(False):  # meshpar, not Flax, resolves logical names
        abstract_ts = nnx.eval_shape(lambda: _train_state(make_model, tx, seed, reference))
    graphdef, abstract = nnx.split(abstract_ts)
    if mesh.shape["stage"] > 1:
        check_schedule(rules.parallel, mesh.shape["stage"])
    if mesh.shape["stage"] > 1 and sharding.axis_size(abstract, "layers") is None:
        raise InputError(f"mesh axis stage = {mesh.shape['stage']} pipelines a stack of layers, and this model "
                         f"names no 'layers' axis: build its blocks with meshpar.layers.scan over a stacked "
                         f"'layers' axis, or use a mesh without 'stage'")
    return Sharded(graphdef, abstract, sharding.state_shardings(abstract, mesh, rules), mesh, rules)


def check_schedule(parallel: ParallelConfig, stages: int) -> None:
    """Refuse a pipeline schedule that cannot run these microbatches. The training step and the planner both
    ask this."""
    if parallel.pipeline_schedule in SLOT_SCHEDULES:
        pipeline.schedule.check_interleaving(stages, pipeline.schedule.microbatches(parallel.microbatches, stages),
                                             parallel.pipeline_repeats)


def router_pools(scope: str, parallel: ParallelConfig, stages: int) -> int:
    """How many pools a mixture of experts' router losses take in a batch (an accumulation microbatch): 1 for
    `train.router_loss_scope = batch`, as transformers pools a forward pass; M, the pipeline's microbatches
    (`schedule.microbatches`, also on a mesh without stages), for `microbatch`, as Megatron pools them
    (`auto`: microbatch under 1F1B and zero-bubble, batch elsewhere). Those cannot pool the batch: they run a
    microbatch's backward pass before the last microbatch's forward pass."""
    one_f_one_b_ = stages > 1 and parallel.pipeline_schedule in SLOT_SCHEDULES
    if scope == "batch" and one_f_one_b_:
        raise InputError(f"train.router_loss_scope = batch pools a mixture of experts' router losses over the "
                         f"whole batch, and parallel.pipeline_schedule = {parallel.pipeline_schedule} runs a "
                         f"microbatch's backward pass before the last one's forward pass: use "
                         f"router_loss_scope=microbatch (or auto)")
    if scope == "batch" or (scope == "auto" and not one_f_one_b_):
        return 1
    return pipeline.schedule.microbatches(parallel.microbatches, stages)


def init_state(make_model: ModelFactory, tx: optax.GradientTransformation, sharded: Sharded, seed: int = 0,
               params: nnx.State | None = None, reference: jnp.dtype | None = None) -> nnx.State:
    """Create the state directly in its shardings (the same values on every mesh for one seed), the stacked
    layers in the pipeline's order at rest (`pipeline.to_rest`). With `params` (the model's parameters in
    layer order, laid out on the mesh by the rules: imported weights, a parameters directory) the model
    holds them (a LoRA model: its base; `reference` as `sharded_abstract`'s, a copy of them too) and the
    optimizer state is fresh; no random weights are made where every weight is given (XLA drops the unused
    initialisation), so a fine-tuned model's memory is taken once."""

    def create(params: nnx.State | None) -> nnx.State:
        with nnx.use_eager_sharding(False):
            return nnx.state(_train_state(make_model, tx, seed, reference, params))

    return pipeline.to_rest(jax.jit(create, out_shardings=sharded.shardings)(params), sharded.mesh,
                            sharded.rules.parallel.pipeline_repeats)


def compute_context(sharded: Sharded, cfg: TrainConfig) -> context.Compute:
    """How the step computes; `remat = auto` without a memory check is its platform's first candidate."""
    remat = remat_lib.candidates(cfg.remat, sharded.mesh.devices.flat[0].platform, sharded.rules.parallel)[0]
    offload.check(sharded.rules.parallel, remat)
    fp8_lib.check(cfg.fp8, sharded.mesh.devices.flat[0])
    return context.Compute(sharded.mesh, sharded.rules, remat, cfg.attention_kernel, cfg.fp8)


def replica_axes(mesh: Mesh, rules: Rules) -> tuple[str, ...]:
    """The batch mesh axes (of size > 1) over which gradients are whole: pure data-parallel replicas."""
    split = {axis for _, axes in rules.grads for axis in axes}
    return tuple(axis for axis in rules.table("activations")["batch"] if mesh.shape[axis] > 1 and axis not in split)


# A loss: (model, batch) → Σ over the batch's targets of weight × loss (a scalar), the weights already divided
# by their global sum (module docstring): the step sums it over accumulation microbatches. It may also return
# a mixture of experts' router statistics beside it, (loss, RouterStats), which the step reports.
Loss = Callable[[nnx.Module, Batch], jax.Array | tuple[jax.Array, routing.RouterStats | None]]
# (params, batch) → ((loss, router statistics or None), grads)
ValueAndGrad = Callable[[nnx.State, Batch], tuple[tuple[jax.Array, Any], nnx.State]]


def default_loss(cfg: TrainConfig, router_losses: bool = True, pools: int = 1,
                 mtp_totals: jax.Array | None = None) -> Loss:
    """Next-token cross-entropy (`meshpar.loss.next_token_loss_and_routing`), or with `objective = dpo` the DPO
    loss of the global batch's pairs (`meshpar.dpo.loss`), chunked by `cfg.loss_chunk`; for a mixture of experts
    plus its router's losses (`router_losses`) in `pools` pools (`router_pools`), each accumulation
    microbatch's weighed 1 / grad_accum (their mean); with `mtp_totals` (the global batch's `ahead_totals`),
    plus mtp_loss_weight × the multi-token prediction modules' loss (none without: evaluation)."""
    aux_coef, z_coef = router_coefficients(cfg) if router_losses else (0.0, 0.0)
    if cfg.objective == "dpo":
        return dpo.loss(cfg.dpo_beta, cfg.global_batch // 2, cfg.loss_chunk, aux_coef, z_coef, pools)
    seq_coef = cfg.router_seq_aux_loss_coef / cfg.grad_accum if router_losses else 0.0
    mtp_coef = cfg.mtp_loss_weight if mtp_totals is not None else 0.0
    return lambda model, batch: next_token_loss_and_routing(model, batch, cfg.loss_chunk, aux_coef, z_coef, pools,
                                                            seq_coef, mtp_coef, mtp_totals)


def router_coefficients(cfg: TrainConfig) -> tuple[float, float]:
    """What an accumulation microbatch's load-balancing and z losses are multiplied by: their mean's share."""
    return cfg.router_aux_loss_coef / cfg.grad_accum, cfg.router_z_loss_coef / cfg.grad_accum


def check_mtp_schedule(depth: int, schedule: str, stages: int) -> None:
    """Refuse multi-token prediction modules (`model.mtp_depth`) under a schedule that runs the loss inside the
    pipeline's slots (1F1B, zero-bubble), which does not run them."""
    if depth and stages > 1 and schedule in SLOT_SCHEDULES:
        raise InputError(f"model.mtp_depth = {depth}: the multi-token prediction modules do not run inside "
                         f"parallel.pipeline_schedule = {schedule}; use pipeline_schedule=gpipe or mtp_depth=0")


def check_accumulation(rows: int, shards: int, steps: int, batch: tuple[str, ...]) -> None:
    """Refuse a batch of `rows` that does not split into `steps` accumulation microbatches on each of the
    `shards` batch shards (over the mesh axes `batch`). The training step and the planner both ask this."""
    if rows % (shards * steps):
        raise InputError(f"train.global_batch = {rows} is not divisible into train.grad_accum = {steps} microbatches "
                         f"on each of the {shards} batch shards ({' × '.join(batch) or 'one device'})")


def _accumulated(sharded: Sharded, cfg: TrainConfig, value_and_grad: ValueAndGrad, params: nnx.State,
                 batch: Batch) -> tuple[jax.Array, nnx.State]:
    """Loss and gradients over `grad_accum` microbatches into a sharded accumulator (module docstring)."""
    mesh, rules = sharded.mesh, sharded.rules
    batch_axes = tuple(axis for axis in rules.table("activations")["batch"] if mesh.shape[axis] > 1)
    # A mixture of experts pools its router statistics over the whole microbatch: no replica keeps its own sum.
    replicas = () if sharding.axis_size(sharded.abstract, "experts") is not None else replica_axes(mesh, rules)
    others = tuple(axis for axis in batch_axes if axis not in replicas)  # still split the rows of a microbatch
    Y, X = math.prod(mesh.shape[a] for a in replicas), math.prod(mesh.shape[a] for a in others)
    A, (B, T) = cfg.grad_accum, batch.tokens.shape
    check_accumulation(B, Y * X, A, batch_axes)
    if cfg.objective == "dpo" and B // (Y * X * A) % 2:
        raise InputError(f"train.objective = dpo: a pair's two rows must fall in one accumulation microbatch, and "
                         f"train.global_batch = {B} gives each of the {Y * X} batch shards one row of each of "
                         f"train.grad_accum = {A} microbatches; raise global_batch to {2 * B} or lower grad_accum")
    # Batch shard (y, x) holds rows [(y·X + x)·B/(Y·X), …); microbatch a takes the a-th block of b rows of
    # every shard, so that no row moves: [Y, X, A, b, T] → [A, Y, X·b, T].
    split = NamedSharding(mesh, P(None, replicas or None, others or None))
    batch_AYbT = jax.tree.map(lambda x_BT: jax.lax.with_sharding_constraint(
        x_BT.reshape(Y, X, A, B // (Y * X * A), T).transpose(2, 0, 1, 3, 4).reshape(A, Y, -1, T), split), batch)
    # Inside the vmap over replicas their mesh axes belong to the replica dimension; `batch` keeps the rest.
    outer = context.active()
    local = dataclasses.replace(outer, vmapped=outer.vmapped + replicas, rules=dataclasses.replace(
        rules, activations=tuple((name, others if name == "batch" else axes) for name, axes in rules.activations)))
    if replicas:
        per_shard = jax.vmap(value_and_grad, in_axes=(None, 0), spmd_axis_name=replicas)
    else:  # one replica: no vmap, which a mixture of experts' grouped matmul could not be batched by
        first, one = lambda tree: jax.tree.map(lambda x: x[0], tree), lambda tree: jax.tree.map(lambda x: x[None], tree)
        per_shard = lambda params, batch_1bT: one(value_and_grad(params, first(batch_1bT)))
    accumulator = jax.tree.map(lambda spec: NamedSharding(mesh, P(replicas or None, *spec)),
                               sharding.state_specs(params, mesh, rules, "grads"), is_leaf=lambda x: isinstance(x, P))

    def microbatch(carry, batch_YbT):
        loss_sum, acc_Y = carry
        with context.use(local):
            (loss_Y, stats_Y), g_Y = per_shard(params, batch_YbT)
        acc_Y = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, acc_Y, g_Y), accumulator)
        return (loss_sum + loss_Y.sum(), acc_Y), jax.tree.map(lambda s: s.sum(0), stats_Y)

    zeros_Y = jax.tree.map(lambda p: jnp.zeros((Y, *p.shape), jnp.float32), params)
    zeros_Y = jax.lax.with_sharding_constraint(zeros_Y, accumulator)
    (loss_sum, grads_Y), stats_A = jax.lax.scan(microbatch, (jnp.zeros((), jnp.float32), zeros_Y), batch_AYbT)
    stats = jax.tree.map(lambda s: s.sum(0), stats_A)  # the microbatches' router statistics, added up
    return (loss_sum, stats), jax.tree.map(lambda g: g.sum(0), grads_Y)  # the parts' shares of the mean: summed


def _with_stats(out: jax.Array | tuple) -> tuple[jax.Array, Any]:
    """A loss's value and its router statistics (None where it returns only a value)."""
    return out if isinstance(out, tuple) else (out, None)


def _prepared(cfg: TrainConfig, model: nnx.Module, reference: nnx.Module | None,
              batch: Batch | jax.Array) -> tuple[Batch, jax.Array]:
    """(the batch with its target weights divided by their sum, and for DPO its reference log-probabilities
    filled in; that sum)."""
    batch, count = normalised(as_batch(batch))
    if cfg.objective == "dpo":
        batch = batch._replace(reference=dpo.reference_log_probs(model, reference, batch, cfg.loss_chunk))
    return batch, count


def _loss_and_grads(sharded: Sharded, cfg: TrainConfig, loss: Loss | None, model: nnx.Module,
                    batch: Batch | jax.Array, reference: nnx.Module | None = None
                    ) -> tuple[jax.Array, nnx.State, jax.Array, Any]:
    """(loss, gradients, the batch's sum of target weights, router statistics, DPO's rewards or None)."""
    batch, count = _prepared(cfg, model, reference, batch)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    stages, parallel = sharded.mesh.shape["stage"], sharded.rules.parallel
    # (for a mixture of experts; under 1F1B it also refuses a batch scope, which the pipeline cannot pool)
    experts = sharding.axis_size(sharded.abstract, "experts")
    pools = router_pools(cfg.router_loss_scope, parallel, stages) if experts else 1
    depth = getattr(model, "mtp_depth", 0) if loss is None and cfg.objective == "lm" else 0
    if stages > 1 and parallel.pipeline_schedule in SLOT_SCHEDULES:  # the loss runs inside, pooled per microbatch
        check_mtp_schedule(depth, parallel.pipeline_schedule, stages)
        if experts and cfg.router_seq_aux_loss_coef:
            raise InputError(f"train.router_seq_aux_loss_coef = {cfg.router_seq_aux_loss_coef} is not computed inside "
                             f"parallel.pipeline_schedule = {parallel.pipeline_schedule}: set it to 0 or use "
                             f"pipeline_schedule=gpipe")
        if cfg.objective == "dpo":
            dpo.check_schedule(parallel.pipeline_schedule, stages)
        value_and_grad = one_f_one_b.value_and_grad(graphdef, rest, loss, cfg.loss_chunk, *router_coefficients(cfg))
    else:
        loss = loss or default_loss(cfg, pools=pools, mtp_totals=ahead_totals(batch, depth) if depth else None)
        value_and_grad = jax.value_and_grad(lambda p, t: _with_stats(loss(nnx.merge(graphdef, p, rest), t)),
                                            has_aux=True)
    if cfg.grad_accum == 1:
        (loss, stats), grads = value_and_grad(params, batch)
    else:
        (loss, stats), grads = _accumulated(sharded, cfg, value_and_grad, params, batch)
    return loss, sharding.constrain_grads(grads, sharded.mesh, sharded.rules), count, stats


def loss_and_grads(sharded: Sharded, tokens: NamedSharding, cfg: TrainConfig = TrainConfig(),
                   loss: Loss | None = None) -> Callable[[nnx.State, Batch | jax.Array], tuple[jax.Array, nnx.State]]:
    """`(state, batch) → (loss, parameter gradients)`, jitted: what parity tests compare. The state is at
    rest (as `init_state` makes it); the gradients come in layer order (`pipeline.to_layers`), as on any mesh.
    `tokens` is the sharding of every field of the batch (or of a token array)."""

    def fn(state: nnx.State, batch: Batch | jax.Array) -> tuple[jax.Array, nnx.State]:
        with context.use(compute_context(sharded, cfg)):
            ts = nnx.merge(sharded.graphdef, state)
            return _loss_and_grads(sharded, cfg, loss, ts.model, batch, getattr(ts, "reference", None))[:2]

    jitted = jax.jit(fn, in_shardings=(sharded.shardings, tokens))

    def in_layer_order(state: nnx.State, batch: Batch | jax.Array) -> tuple[jax.Array, nnx.State]:
        value, grads = jitted(state, batch)
        return value, pipeline.to_layers(grads, sharded.mesh, sharded.rules.parallel.pipeline_repeats)

    return in_layer_order


def _balance(model: nnx.Module, loads: nnx.State, cfg: TrainConfig, keep: jax.Array | None = None) -> None:
    """Loss-free balancing: each selection bias moved by its layer's loads over the step's batch, which the step
    got as its gradient (`routing.balanced`); where `keep` (a scalar bool) is true, left as it was. A LoRA run's
    base, the biases with it, stays as it is."""
    if cfg.router_bias_update_rate and cfg.lora is None and nnx.to_flat_state(loads):
        moved = lambda b, n: routing.balanced(b, n, cfg.router_bias_update_rate)
        update = moved if keep is None else lambda b, n: jnp.where(keep, b, moved(b, n))
        nnx.update(model, jax.tree.map(update, nnx.state(model, routing.SelectionBias), loads))


def make_step(sharded: Sharded, tokens: NamedSharding, cfg: TrainConfig = TrainConfig(), loss: Loss | None = None,
              votes: NamedSharding | None = None) -> Callable[..., tuple[nnx.State, dict[str, jax.Array]]]:
    """The jitted training step `(state, batch) → (state, metrics)`, donating the old state.

    `tokens` is the sharding of the batch's fields (`sharding.batch_sharding`; the batch a
    `meshpar.batch.Batch` or a token array); `loss` defaults to `default_loss(cfg)`. Metrics: `loss`,
    `grad_norm`, `tokens` (the batch's sum of target weights). With `cfg.on_nonfinite = "skip"` a step
    whose loss or gradient norm is not finite leaves the state as it was (metrics: `skipped` = 1). With
    `votes` (`meshpar.preemption.votes_sharding`) the step is `(state, batch, votes) → (state, metrics)` and metric `stop` is the largest vote: a stop
    agreed by the step's own program, so its collective is ordered with the step's.
    """

    def step(state: nnx.State, batch: Batch | jax.Array, *votes_D: jax.Array) -> tuple[nnx.State, dict[str, jax.Array]]:
        before = jax.tree.leaves(state)  # the arrays; the update below mutates the merged variables
        with context.use(compute_context(sharded, cfg)):
            ts = nnx.merge(sharded.graphdef, state)
            value, grads, count, stats = _loss_and_grads(sharded, cfg, loss, ts.model, batch,
                                                         getattr(ts, "reference", None))
            loads, grads = nnx.split_state(grads, routing.SelectionBias, ...)  # not gradients: no clip, no optimizer
            offloaded, skip = sharded.rules.parallel.offload != "none", cfg.on_nonfinite == "skip"
            grad_norm = offload.global_norm(ts.model, grads) if offloaded else optax.tree.norm(grads)
            finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
            if offloaded:  # streams the state through the devices a layer at a time (meshpar.offload)
                offload.update(ts.opt, ts.model, grads, clip_scale(grad_norm, cfg.clip_norm),
                              keep=~finite if skip else None)
            else:
                ts.opt.update(ts.model, grads)
            _balance(ts.model, loads, cfg, keep=~finite if skip and offloaded else None)  # else: kept below
            new_state, metrics = nnx.state(ts), {"loss": value, "grad_norm": grad_norm, "tokens": count}
            if isinstance(stats, MTPStats):  # L_MTP before λ: a cross-entropy like the main model's
                metrics["mtp_loss"], stats = stats.mtp, stats.router
            if stats is not None:
                rows = as_batch(batch).tokens.shape[0]
                metrics |= dpo.metrics(stats) if isinstance(stats, dpo.Rewards) else routing.metrics(stats, rows)
            if skip:
                if not offloaded:
                    after, structure = jax.tree.flatten(new_state)
                    new_state = structure.unflatten([jnp.where(finite, a, b) for a, b in zip(after, before)])
                metrics["skipped"] = (~finite).astype(jnp.int32)
            if votes_D:
                metrics["stop"] = votes_D[0].max()
            return new_state, metrics

    return jax.jit(step, in_shardings=(sharded.shardings, tokens, *([votes] if votes else [])),
                   out_shardings=(sharded.shardings, None), donate_argnums=0)


def make_eval_step(sharded: Sharded, tokens: NamedSharding, cfg: TrainConfig = TrainConfig(),
                   loss: Loss | None = None) -> Callable[[nnx.State, Batch | jax.Array], tuple[jax.Array, jax.Array]]:
    """The jitted `(state, batch) → (loss, sum of target weights)` on held-out batches: the training step's
    loss and layout, no gradients, the state kept (not donated). Compiled once; every evaluation reuses it.
    Several batches combine as Σ loss · weight / Σ weight, the loss of all their targets together."""
    loss = loss or default_loss(cfg, router_losses=False)

    def evaluate(state: nnx.State, batch: Batch | jax.Array) -> tuple[jax.Array, jax.Array]:
        with context.use(compute_context(sharded, cfg)):
            ts = nnx.merge(sharded.graphdef, state)
            batch, count = _prepared(cfg, ts.model, getattr(ts, "reference", None), batch)
            return _with_stats(loss(ts.model, batch))[0], count

    return jax.jit(evaluate, in_shardings=(sharded.shardings, tokens))
