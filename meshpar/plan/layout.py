"""A layout as the planner evaluates it, and what it asks of the training step's own checks.

A `Layout` is a mesh (`MeshConfig`), the parallel settings (`ParallelConfig`) and the two training
settings that change memory or speed (remat, gradient accumulation): the same objects a run is made of,
so the planner mirrors none of them, and what is valid is what they and the training step accept
(`check`). A `Run` is the rest of what the cost model needs: batch, sequence, dtype, precision of the model
states, efficiency, attention kernel.

Letters: B global batch, T sequence, b = B/(data·fsdp·expert·M·A) rows of one microbatch on one device (M
pipeline microbatches, A accumulation steps), t = T/sequence positions per device, e bytes per element of
the compute dtype; N, K, F, V heads, kv heads, d_ff, vocab split over `model`. A mixture of experts: n = b·t
tokens a device routes, ep = the `expert` axis, r the rows it sends to each expert shard
(`meshpar.moe.dispatch`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from meshpar import mesh as mesh_lib, moe, offload, remat as remat_lib, sharding
from meshpar.attention import context_parallel
from meshpar.attention.kernels import resolve_kernel
from meshpar.errors import InputError
from meshpar.mesh import MeshConfig
from meshpar.pipeline import schedule, stages
from meshpar.plan.shape import Shape
from meshpar.rules import BATCH_AXES, ParallelConfig, make as make_rules
from meshpar.train import check_accumulation, check_schedule

PRECISIONS = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}  # bytes per element: params, grads, optimizer
EFFICIENCY = 0.6  # achieved / peak matmul FLOP/s: a stated default, not fitted (see the published-run tests)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh, the parallel settings, the remat policy and the accumulation steps; and what follows from
    them: `sizes` (the mesh's), `batch_ways` (how many ways the batch is split), `zero_ways` (how many ways
    ZeRO splits the weights outside the experts: fsdp × expert), M and R (the pipeline's microbatches and
    repeats, 1 without a pipeline)."""

    mesh: MeshConfig
    parallel: ParallelConfig = ParallelConfig()
    remat: str = "none"
    grad_accum: int = 1

    @classmethod
    def of_run(cls, mesh: MeshConfig, parallel: ParallelConfig, train, platform: str = "gpu") -> Layout:
        """The layout of a run's mesh, `ParallelConfig` and `train.TrainConfig`; `remat = auto` is the
        platform's first candidate (`meshpar.remat.candidates`)."""
        return cls(mesh, parallel, remat_lib.candidates(train.remat, platform, parallel)[0], train.grad_accum)

    def __post_init__(self):
        if self.grad_accum < 1:
            raise InputError(f"grad_accum = {self.grad_accum} must be >= 1")
        # Derived once: the planner's search asks for them hundreds of thousands of times.
        sizes, stage = self.mesh.sizes(), self.mesh.stage
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "batch_ways", math.prod(sizes[axis] for axis in BATCH_AXES))  # the batch's split
        object.__setattr__(self, "zero_ways", sizes["fsdp"] * sizes["expert"])
        object.__setattr__(self, "M", 1 if stage == 1 else schedule.microbatches(self.parallel.microbatches, stage))
        object.__setattr__(self, "R", 1 if stage == 1 else self.parallel.pipeline_repeats)

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    def replace(self, *, remat: str | None = None, grad_accum: int | None = None, **parallel) -> Layout:
        """The same layout with other settings (`parallel` fields by name)."""
        changed = {name: value for name, value in parallel.items() if getattr(self.parallel, name) != value}
        return Layout(self.mesh, dataclasses.replace(self.parallel, **changed) if changed else self.parallel,
                      self.remat if remat is None else remat, self.grad_accum if grad_accum is None else grad_accum)

    def describe(self) -> str:
        """`data=2,fsdp=4 zero=3 ring+zigzag M=8,R=1 remat=dots accum=2`: what sets this layout apart."""
        par = self.parallel
        parts = [mesh_lib.describe(self.mesh), f"zero={par.zero_stage}"]
        if self.mesh.model > 1 and par.sequence_parallel:
            parts.append("sp")
        if self.mesh.sequence > 1:
            parts.append(par.context_attention + ("+zigzag" if par.context_attention == "ring" and par.load_balance
                                                  else ""))
        if self.mesh.stage > 1:
            parts.append(f"M={self.M},R={self.R}" + (f",{par.pipeline_schedule}" if par.pipeline_schedule != "gpipe"
                                                       else ""))
        if par.expert_capacity:
            parts.append(f"capacity={par.expert_capacity:g}")
        parts.append(f"remat={self.remat}")
        if par.offload != "none":
            parts.append(f"offload={par.offload}")
        if self.grad_accum > 1:
            parts.append(f"accum={self.grad_accum}")
        return " ".join(parts)

    def overrides(self) -> dict[str, object]:
        """The `--set` overrides of this layout (typed values: `f"{key}={value}"` is a valid --set item)."""
        par = self.parallel
        return {"parallel.zero_stage": par.zero_stage, "parallel.sequence_parallel": par.sequence_parallel,
                "parallel.context_attention": par.context_attention, "parallel.load_balance": par.load_balance,
                "parallel.microbatches": self.M if self.mesh.stage > 1 else 0,
                "parallel.pipeline_repeats": self.R, "parallel.pipeline_schedule": par.pipeline_schedule,
                "parallel.offload": par.offload, "parallel.expert_capacity": par.expert_capacity,
                "train.remat": self.remat, "train.grad_accum": self.grad_accum}


@dataclasses.dataclass(frozen=True)
class Run:
    global_batch: int
    seq_len: int
    compute_dtype: str = "bfloat16"
    precision: str = "fp32"
    efficiency: float = EFFICIENCY
    flash_attention: bool = True  # the kernel keeps no score matrix (blockwise, meshpar's on GPUs); False: dense
    fp8: str = "none"  # the projections' and MLPs' matmuls in FP8 (`train.fp8`, meshpar.fp8)

    @classmethod
    def of(cls, train, platform: str = "gpu", precision: str = "fp32", efficiency: float = EFFICIENCY) -> Run:
        """The run of a `train.TrainConfig`; the attention kernel is resolved for `platform`."""
        flash = resolve_kernel(train.attention_kernel, train.seq_len, platform, train.dtype) != "dense"
        return cls(train.global_batch, train.seq_len, train.compute_dtype, precision, efficiency, flash, train.fp8)

    @property
    def e(self) -> int:
        """Bytes per element of the compute dtype."""
        return 2 if self.compute_dtype == "bfloat16" else 4


def check(shape: Shape, lay: Layout, run: Run) -> list[str]:
    """Why meshpar would refuse this layout, in the training step's own words (empty: it builds).

    The same checks a run makes, asked here: the remat policy and host offload's needs (`meshpar.remat`,
    `meshpar.offload`), every parameter's split under each rules table and the token batch's
    (`sharding.spec_for`: a dimension its mesh axes do not divide), the residual stream's positions
    (Megatron SP splits them over `model` too), gradient accumulation's (`train.check_accumulation`), the
    pipeline's (`pipeline.stages.check`, `train.check_schedule`) and context
    attention's (`attention.context_parallel.check`). The experts' split over `expert` is a parameter's.
    """
    problems = list(parameter_problems(shape, lay.parallel.zero_stage, lay.mesh.stage, lay.mesh.fsdp, lay.mesh.model,
                                       lay.mesh.expert))

    def ask(check_, *args, **kwargs) -> None:
        try:
            check_(*args, **kwargs)
        except InputError as err:
            problems.append(str(err))

    sizes, par, table = lay.sizes, lay.parallel, _tables(lay.parallel)["activations"]
    B, T, A = run.global_batch, run.seq_len, lay.grad_accum
    ask(remat_lib.check, lay.remat)
    ask(offload.check, par, lay.remat)
    ask(sharding.spec_for, ("batch", None), (B, T + 1), table, sizes, f"token batch [{B}, {T + 1}]")
    ask(sharding.spec_for, ("resid_seq",), (T,), table, sizes, "the residual stream's positions")
    ask(check_accumulation, B, lay.batch_ways, A, table["batch"])
    if lay.mesh.stage > 1:
        ask(stages.check, shape.layers, B // A, sizes, stages=lay.mesh.stage, microbatches=lay.M, repeats=lay.R)
        ask(check_schedule, dataclasses.replace(par, microbatches=lay.M), lay.mesh.stage)
    if lay.mesh.sequence > 1:
        ways = lambda name: math.prod(sizes[axis] for axis in table[name])
        ask(context_parallel.check, par.context_attention, T, (shape.heads, shape.kv_heads), lay.mesh.sequence,
            balanced=par.load_balance, head_ways=(ways("heads"), ways("kv_heads")))
    return problems


@functools.lru_cache(maxsize=65536)
def parameter_problems(shape: Shape, zero: int, stage: int, fsdp: int, model: int, expert: int = 1) -> tuple[str, ...]:
    """What `sharding.spec_for` refuses of the parameters under the rules of ZeRO stage `zero` (parameters
    are split over stage, fsdp, expert and model only), first problem per tensor."""
    sizes = dict(MeshConfig(stage=stage, fsdp=fsdp, expert=expert, model=model).sizes())
    problems = []
    for path, tensor_shape, names in shape.tensors:
        for table in _tables(ParallelConfig(zero_stage=zero)).values():
            try:
                sharding.spec_for(names, tensor_shape, table, sizes, f"parameter '{path}'")
            except InputError as err:
                problems.append(str(err))
                break
    return tuple(problems)


@functools.lru_cache(maxsize=None)
def _tables(parallel: ParallelConfig) -> dict[str, dict[str, tuple[str, ...]]]:
    rules = make_rules(parallel)
    return {kind: rules.table(kind) for kind in ("params", "grads", "optimizer", "activations")}


def local_elements(shape: Shape, lay: Layout, kind: str, only_layers: bool = False, part: str = "all") -> float:
    """Parameter elements on one device under a rules table (`activations`: the gathered compute form), of
    every tensor, or only of the `trained` or the `frozen` ones (`Shape.frozen`)."""
    return _local_elements(shape, lay.parallel.zero_stage, lay.mesh.stage, lay.mesh.fsdp, lay.mesh.model,
                           lay.mesh.expert, kind, only_layers, part)


def local_tensors(shape: Shape, lay: Layout, kind: str) -> tuple[float, ...]:
    """Elements on one device of each parameter tensor (`Shape.tensors` order) under a rules table."""
    return _local_tensors(shape, lay.parallel.zero_stage, lay.mesh.stage, lay.mesh.fsdp, lay.mesh.model,
                          lay.mesh.expert, kind)


@functools.lru_cache(maxsize=65536)
def _local_tensors(shape: Shape, zero: int, stage: int, fsdp: int, model: int, expert: int,
                   kind: str) -> tuple[float, ...]:
    table = _tables(ParallelConfig(zero_stage=zero))[kind]
    sizes = {"stage": stage, "fsdp": fsdp, "model": model, "expert": expert}
    # params are never split over data or sequence
    return tuple(n / math.prod(sizes.get(a, 1) for name in names if name for a in table.get(name, ()))
                 for n, names in shape.elements())


@functools.lru_cache(maxsize=65536)
def _local_elements(shape: Shape, zero: int, stage: int, fsdp: int, model: int, expert: int, kind: str,
                    only_layers: bool, part: str) -> float:
    tensors = _local_tensors(shape, zero, stage, fsdp, model, expert, kind)
    wanted = {"all": (False, True), "trained": (False,), "frozen": (True,)}[part]
    return sum(n for i, (n, (_, names)) in enumerate(zip(tensors, shape.elements()))
               if (not only_layers or "layers" in names) and shape.is_frozen(i) in wanted)


def layer_expert_elements(shape: Shape, lay: Layout) -> float:
    """Elements on one device of one stacked layer's experts as they compute (gathered over fsdp, split
    over expert and model)."""
    return sum(n for n, (_, names) in zip(local_tensors(shape, lay, "activations"), shape.elements())
               if "layers" in names and "experts" in names) / (shape.layers / lay.mesh.stage)


def transposed_for_gathers(shape: Shape, lay: Layout) -> float:
    """Elements on one device of the stacked weights that XLA's GPU compiler copies whole, before the layer
    loop, into another order: those whose first dimension split over fsdp at rest is not the first after
    `layers` (the attention output's and the MLP's down projection, a mixture's every expert weight in its
    [E, D, F] order), for a GPU all-gathers a layer's shard along its most major dimension. The copy lives
    through the step (read in the GPU program: one per such weight, its fsdp shard in the params' dtype).
    A pipeline gathers its stage weights whole once instead (`memory.PIPELINE`)."""
    if lay.zero_ways == 1 or lay.mesh.stage > 1:
        return 0.0
    table = _tables(ParallelConfig(zero_stage=lay.parallel.zero_stage))["params"]

    def transposed(names: tuple) -> bool:
        split = [i for i, name in enumerate(names) if name and "fsdp" in table.get(name, ())]
        return "layers" in names and bool(split) and split[0] != names.index("layers") + 1

    return sum(n for n, (_, names) in zip(local_tensors(shape, lay, "params"), shape.elements()) if transposed(names))


def layer_matmul_params(shape: Shape, lay: Layout, run: Run, *, experts: bool = True) -> float:
    """The parameters of one layer that enter matmuls, as one device computes with them per local token
    (heads and mlp split over `model`, embed whole); its experts' once per row it computes per token
    (`expert_rows`: k where the grouped matmuls skip the empty rows, more with capacity padding), or none
    of theirs (`experts=False`)."""
    return _matmul_params(shape, lay, run, "layers", experts) / (shape.layers / lay.mesh.stage)


def lead_matmul_params(shape: Shape, lay: Layout, run: Run, stacked: str = "lead_layers") -> float:
    """`layer_matmul_params` of the layers before the stack (`Shape.lead`) together, or of multi-token
    prediction's modules after it (`stacked="mtp_layers"`, `Shape.mtp`)."""
    return _matmul_params(shape, lay, run, stacked, True)


def _matmul_params(shape: Shape, lay: Layout, run: Run, stacked: str, experts: bool) -> float:
    tensors = local_tensors(shape, lay, "activations")
    per_expert = expert_rows(shape, lay, run)[1] / (shape.experts / lay.mesh.expert) if shape.experts else 0.0
    return sum(n * (per_expert if "experts" in names else 1) for n, (_, names) in zip(tensors, shape.elements())
               if stacked in names and shape.is_matmul(names) and (experts or "experts" not in names))


def expert_rows(shape: Shape, lay: Layout, run: Run) -> tuple[int, float, float]:
    """A mixture of experts on one device per microbatch (`meshpar.moe.dispatch`): (r, the rows its experts
    compute per local token, the rows of its dispatch buffers per local token). The buffers hold ep·r rows.
    At capacity each local expert computes its [ep·U] rows of the [El, ep·U] buffers, U = ceil(c·n·k/E).
    Dropless (ep·r = ep·n·min(k, El) rows, sorted by expert) XLA, on the CPU and on the GPU alike, compiles
    the grouped matmul (`jax.lax.ragged_dot`) as one matmul per local expert over every row of the buffer,
    masked: El·ep·r rows (the H100 program of `deepseek_v3` on expert=8: 143 times the model's FLOPs)."""
    b, t, *_ = local_dims(shape, lay, run)
    n, k, E, ep = int(b * t), shape.experts_per_token, shape.experts, lay.mesh.expert
    capacity = lay.parallel.expert_capacity
    r = moe.rows_per_shard(n, k, E, ep, capacity)
    return r, ep * r / n * (1 if capacity else E // ep), ep * r / n


def local_dims(shape: Shape, lay: Layout, run: Run) -> tuple[float, float, float, float, float, float]:
    """(b, t, N, K, F, V) on one device: rows of one microbatch, positions, and the model-split dims."""
    m = lay.mesh.model
    b = run.global_batch / (lay.batch_ways * lay.M * lay.grad_accum)
    t = run.seq_len / lay.mesh.sequence
    return b, t, shape.heads / m, shape.kv_heads / m, shape.d_ff / m, shape.vocab / m


def passes(lay: Layout) -> int:
    """Microbatch passes through a device's layers per step: per accumulation step one, or every pipeline
    iteration (bubbles included)."""
    return lay.grad_accum * (schedule.iterations(lay.mesh.stage, lay.M, lay.R) if lay.mesh.stage > 1 else 1)


def layer_applications(shape: Shape, lay: Layout) -> float:
    """Layers a device applies per step: its layers in every microbatch pass."""
    return passes(lay) * shape.layers / (lay.mesh.stage * lay.R)
