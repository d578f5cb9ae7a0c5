"""The layout planner: which mesh and settings train a model fastest on a given cluster, before renting it.

`search` enumerates every factorisation of the device count into the five mesh axes (data, stage, fsdp,
sequence, model) and every setting that changes memory or speed (ZeRO stage, Megatron SP, context
attention mode, pipeline microbatches and repeats, remat, gradient accumulation), keeps the layouts that
meshpar can build (the divisibility rules of `meshpar.plan_cost.check`), prunes what does not fit in
memory, and ranks the rest by predicted step time (`meshpar.plan_time.estimate`). `best_layout` gives
the winner as a mesh and `--set`-style overrides (for `launch.train --mesh auto`); `model_states`
is the ZeRO paper's per-device model-state memory for a bare parameter count.

Search space, and what is left out because it never wins in this model: `model` stays inside a host
(tensor parallelism across the network is never faster); `sequence` ≤ 64; ZeRO 2 and 3 over `fsdp`
(ZeRO 0 is the `data` axis; ZeRO 1 holds more than 2 and sends more: meshpar all-reduces its whole
gradient, then all-gathers the parameters); the zigzag order for ring attention (balanced causal work);
`sequence` and `model` may cross hosts, priced at the network's bandwidth; microbatches M ∈ {S, 2S, 4S,
8S} (the two largest the batch allows) and repeats R ∈ {1, 2, 4}; and per layout only the fastest
(remat, grad_accum) pair that fits. Layouts that differ only in how the batch ways split into data × fsdp
are ranked once, by their fastest split. Host offload (`parallel.offload`, remat `offload`) only when no
layout fits without it: its copies are priced as an upper bound (`meshpar.plan_time`), and the host's
memory must hold what it moves there.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math

from meshpar import attention
from meshpar.errors import InputError
from meshpar.mesh import host_split
from meshpar.plan_cost import (EFFICIENCY, MODES, OFFLOADS, PRECISIONS, REMATS, Layout, Memory, Run, Shape, check,
                               layer_applications, local_elements, memory)
from meshpar.plan_hardware import PRESETS, Hardware, parse as parse_hardware
from meshpar.plan_time import Estimate, bubble, compute_seconds, estimate, iterations
from meshpar.train import remat_candidates

__all__ = ["Estimate", "Hardware", "Layout", "NothingFits", "PRESETS", "Run", "Shape", "best_layout",
           "bubble", "estimate", "iterations", "model_states", "overrides", "search", "parse_hardware"]

GB = 1e9
MAX_SEQUENCE = 64


class NothingFits(InputError):
    """No layout fits in memory; the message names the smallest requirement."""

    def __init__(self, message: str, smallest: Estimate | None):
        super().__init__(message)
        self.smallest = smallest


def model_states(params: float, zero_stage: int, shards: int, precision: str = "mixed") -> dict[str, float]:
    """Per-device model-state bytes of `params` parameters with Adam, the ZeRO paper's model (§3.1, §5).

    mixed: fp16 params 2Ψ, grads 2Ψ, optimizer 12Ψ (fp32 copy, m, v); fp32 (meshpar): 4Ψ, 4Ψ, 8Ψ.
    Stage 1 divides the optimizer by `shards` (N_d), stage 2 the gradients too, stage 3 the parameters too.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise InputError(f"zero stage {zero_stage} is not one of 0, 1, 2, 3")
    if precision not in PRECISIONS:
        raise InputError(f"precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    if shards < 1 or params < 0:
        raise InputError(f"need params >= 0 and shards >= 1, got {params}, {shards}")
    p, g, o = PRECISIONS[precision]
    out = {"params": p * params / (shards if zero_stage >= 3 else 1),
           "grads": g * params / (shards if zero_stage >= 2 else 1),
           "optimizer": o * params / (shards if zero_stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _hardware(hardware: Hardware | str) -> Hardware:
    return hardware if isinstance(hardware, Hardware) else parse_hardware(hardware)


def check_cluster(devices: int, devices_per_host: int) -> int:
    """Devices per host as the mesh sees it (a single partial host holds all the devices)."""
    if devices < 1 or devices_per_host < 1:
        raise InputError(f"devices ({devices}) and devices per host ({devices_per_host}) must be >= 1")
    if devices <= devices_per_host:
        if devices_per_host % devices:
            raise InputError(f"{devices} devices on hosts of {devices_per_host}: a partial host must hold a "
                             f"divisor of {devices_per_host} devices")
        return devices
    if devices % devices_per_host:
        raise InputError(f"{devices} devices are not divisible by {devices_per_host} devices per host: "
                         f"a mesh needs whole, equal hosts")
    return devices_per_host


def _meshes(shape: Shape, devices: int, dph: int, run: Run):
    """Mesh sizes (data, stage, fsdp, sequence, model) that meshpar can build for this model and batch."""
    for model in _divisors(math.gcd(devices, dph)):
        if shape.heads % model or shape.kv_heads % model or shape.d_ff % model or shape.vocab % model:
            continue
        rest = devices // model
        for seq in _divisors(rest):
            if seq > MAX_SEQUENCE or run.seq_len % seq:
                continue
            for stage in _divisors(rest // seq):
                if shape.layers % stage:
                    continue
                batch_ways = rest // (seq * stage)
                for fsdp in _divisors(batch_ways):
                    data = batch_ways // fsdp
                    if run.global_batch % batch_ways or (fsdp > 1 and shape.d_model % fsdp):
                        continue
                    sizes = dict(data=data, stage=stage, fsdp=fsdp, sequence=seq, model=model)
                    try:
                        host_split(sizes, dph)
                    except ValueError:
                        continue
                    yield sizes


def _settings(shape: Shape, sizes: dict[str, int], run: Run):
    """(zero, sp, mode, M, R) choices for one mesh, before remat and accumulation."""
    zeros = (2, 3) if sizes["fsdp"] > 1 else (0,)
    sps = (False, True) if sizes["model"] > 1 else (False,)
    modes = MODES if sizes["sequence"] > 1 else ("ring",)
    S = sizes["stage"]
    rows = run.global_batch // (sizes["data"] * sizes["fsdp"])
    # the two largest microbatch counts (more microbatches: a smaller bubble and smaller passes)
    counts = [M for M in (8 * S, 4 * S, 2 * S, S) if rows % M == 0][:2]
    pipes = [(0, 1)] if S == 1 else [(M, R) for M in counts for R in (1, 2, 4) if shape.layers % (S * R) == 0]
    for zero in zeros:
        for sp in sps:
            for mode in modes:
                for M, R in pipes:
                    yield zero, sp, mode, M, R


@dataclasses.dataclass
class SearchResult:
    ranked: list[Estimate]  # fitting layouts, fastest first (at most `top`)
    considered: int  # layouts (mesh × settings) that build
    evaluated: int  # (remat, grad_accum) variants whose memory was computed
    fitting: int  # layouts with a variant that fits, among those not pruned
    pruned: int  # never visited: model states alone exceed memory, or compute alone is slower than the top


def _family(lay: Layout) -> tuple:
    """A layout up to its data × fsdp split (ranked once: the table lists the fastest split)."""
    return (lay.stage, lay.sequence, lay.model, lay.zero_stage, lay.sequence_parallel, lay.context_attention,
            lay.M, lay.R)


def _rank(e: Estimate) -> tuple[float, float]:
    return (e.step_s, e.memory.total)


def _accums(rows: int) -> list[int]:
    return [k for k in (1, 2, 4, 8, 16, 32) if rows % k == 0]


def _layout(sizes: dict[str, int], zero: int, sp: bool, mode: str, M: int, R: int, remat: str = "none",
            accum: int = 1, offload: str = "none") -> Layout:
    return Layout(**sizes, zero_stage=zero, sequence_parallel=sp, context_attention=mode, microbatches=M,
                  pipeline_repeats=R, remat=remat, grad_accum=accum, offload=offload)


def _tp_floor(shape: Shape, lay: Layout, run: Run, hw: Hardware) -> float:
    """A lower bound of the exposed tensor-parallel time: 13 activation-sized transfers of (n−1)/n per layer."""
    if lay.model == 1:
        return 0.0
    b = run.global_batch / (lay.data * lay.fsdp * lay.M * lay.grad_accum)
    a = b * run.seq_len / lay.sequence * shape.d_model * run.c
    return 13 * a * (lay.model - 1) / lay.model * layer_applications(shape, lay) / max(hw.link_bw, hw.net_bw)


# (offload, remat) variants of a layout. Without offload, cheapest first: per accumulation the first that
# fits is timed. Offload is tried only when no layout fits without it (meshpar.offload: `optimizer+params`
# needs a remat), and every offload variant that fits is timed: their speed order is not known in advance.
PLAIN = tuple(("none", remat) for remat in ("none", "dots", "full"))
OFFLOADED = tuple((offload, remat) for offload in OFFLOADS for remat in REMATS
                  if (offload, remat) not in PLAIN and (offload, remat) != ("optimizer+params", "none"))


def search(model, *, devices: int, devices_per_host: int, hardware: Hardware | str, global_batch: int,
           seq_len: int, compute_dtype: str = "bfloat16", precision: str = "fp32", top: int = 10,
           mem_fraction: float = 0.9, efficiency: float = EFFICIENCY, flash_attention: bool = True) -> SearchResult:
    """Rank the layouts that fit, fastest first. Raises NothingFits (naming the smallest need) if none does.

    `flash_attention`: the attention kernel keeps no score matrix (meshpar's blockwise kernel, the GPU
    default); False models the dense kernel.
    Branch and bound: layouts are visited in the order of their compute time alone (no remat, no
    communication: a lower bound of every variant); the search stops when that bound passes the
    `top`-th best step time found, or reaches layouts whose model states alone do not fit. For each
    layout visited, per gradient accumulation, the cheapest remat that fits is timed; the fastest kept.
    Only if nothing fits, and the hardware gives its host (`Hardware.offloads`), the same search runs
    again over the host-offload variants (`OFFLOADED`), with the host memory as a second budget.
    """
    shape, hw = Shape.of(model), _hardware(hardware)
    dph = check_cluster(devices, devices_per_host)
    if global_batch < 1 or seq_len < 1:
        raise InputError(f"global batch ({global_batch}) and sequence length ({seq_len}) must be >= 1")
    if compute_dtype not in ("bfloat16", "float32"):
        raise InputError(f"compute dtype '{compute_dtype}' is not bfloat16 or float32")
    if top < 1:
        raise InputError(f"top = {top} must be >= 1")
    run = Run(global_batch, seq_len, compute_dtype, precision, efficiency, flash_attention)
    result = _search(shape, dph, run, hw, top, mem_fraction, devices, PLAIN)
    if not result.ranked and hw.offloads:
        result = _search(shape, dph, run, hw, top, mem_fraction, devices, OFFLOADED)
    if not result.ranked:
        raise _nothing_fits(shape, devices, dph, run, hw, mem_fraction)
    return result


def _search(shape: Shape, dph: int, run: Run, hw: Hardware, top: int, mem_fraction: float, devices: int,
            variants: tuple[tuple[str, str], ...]) -> SearchResult:
    """One branch-and-bound pass over the layouts with these (offload, remat) variants (see `search`)."""
    budget, host_budget = hw.hbm * mem_fraction, hw.host_mem * mem_fraction
    pb, _, ob = PRECISIONS[run.precision]
    first_only = variants == PLAIN

    def states_fit(base: Layout, offload: str) -> bool:
        params, moments = pb * local_elements(shape, base, "params"), ob * local_elements(shape, base, "optimizer")
        device = {"none": params + moments, "optimizer": params, "optimizer+params": 0.0}[offload]
        return device <= budget and params + moments - device <= host_budget

    bases = []
    for sizes in _meshes(shape, devices, dph, run):
        for zero, sp, mode, M, R in _settings(shape, sizes, run):
            base = _layout(sizes, zero, sp, mode, M, R)
            if check(shape, base, run):
                continue
            if not any(states_fit(base, offload) for offload in {offload for offload, _ in variants}):
                bases.append((math.inf, base))  # the model states alone do not fit
            else:
                bases.append((compute_seconds(shape, base, run, hw)[0] + _tp_floor(shape, base, run, hw), base))
    bases.sort(key=lambda item: item[0])  # (stable: the enumeration order breaks ties)
    best: list[Estimate] = []
    evaluated = fitting = 0
    for n, (lower, base) in enumerate(bases):
        if lower == math.inf or (len(best) >= top and lower >= best[top - 1].step_s):
            break  # sorted: no later layout can beat the top ones
        chosen, timed = None, set()
        for accum in _accums(run.global_batch // (base.data * base.fsdp * base.M)):
            for offload, remat in variants:
                evaluated += 1
                lay = dataclasses.replace(base, offload=offload, remat=remat, grad_accum=accum)
                mem = memory(shape, lay, run)
                if mem.total > budget or mem.host > host_budget:
                    continue
                if (offload, remat) not in timed:  # the same variant at a larger accumulation is never faster
                    timed.add((offload, remat))
                    est = estimate(shape, lay, run, hw, dph, mem_fraction=mem_fraction, strict=False)
                    if chosen is None or est.step_s < chosen.step_s:
                        chosen = est
                if first_only:
                    break  # a cheaper remat fits at this accumulation
            if first_only and variants[0] in timed:
                break
        if chosen is not None:
            fitting += 1
            family = _family(chosen.layout)
            twin = next((e for e in best if _family(e.layout) == family), None)
            if twin is not None and _rank(twin) <= _rank(chosen):
                continue  # the same layout with another data × fsdp split is already as good
            if twin is not None:
                best.remove(twin)
            bisect.insort(best, chosen, key=_rank)
            del best[top:]
    else:
        n = len(bases)
    return SearchResult(best, len(bases), evaluated, fitting, len(bases) - n)


def _nothing_fits(shape: Shape, devices: int, dph: int, run: Run, hw: Hardware, mem_fraction: float) -> NothingFits:
    """The error, naming the layout that needs the least memory (an exhaustive pass: this is the rare case);
    with offload, the least of device and host memory over their budgets."""
    budget, host_budget = hw.hbm * mem_fraction, hw.host_mem * mem_fraction
    offloads = OFFLOADS if hw.offloads else ("none",)
    smallest: tuple[float, Layout] | None = None
    for sizes in _meshes(shape, devices, dph, run):
        for zero, sp, mode, M, R in _settings(shape, sizes, run):
            for accum in _accums(run.global_batch // (sizes["data"] * sizes["fsdp"] * (M or 1))):
                for offload in offloads:
                    lay = _layout(sizes, zero, sp, mode, M, R, "full", accum, offload)
                    if not check(shape, lay, run):
                        mem = memory(shape, lay, run)
                        need = max(mem.total / budget, mem.host / host_budget if mem.host else 0.0)
                        if smallest is None or need < smallest[0]:
                            smallest = (need, lay)
    if smallest is None:
        return NothingFits(f"nothing fits: no layout of {devices} devices builds for this model and batch (global "
                           f"batch {run.global_batch}, sequence {run.seq_len}): the batch must divide over the "
                           f"data-parallel ways, heads / kv heads / d_ff / vocab over model", None)
    small = estimate(shape, smallest[1], run, hw, dph, mem_fraction=mem_fraction)
    offloaded = small.layout.offload != "none"
    host_need = f" and {small.memory.host / GB:.1f} GB of host memory per device" if offloaded else ""
    host_have = f" and {host_budget / GB:.1f} GB of host memory per device" if offloaded else ""
    return NothingFits(
        f"nothing fits: the smallest layout needs {small.memory.total / GB:.1f} GB per device{host_need} "
        f"({describe(small.layout)}), but {hw.name} has {budget / GB:.1f} GB usable ({mem_fraction:.0%} of "
        f"{hw.hbm / GB:.0f} GB){host_have}; use more devices, a smaller batch or sequence, or GPUs with more "
        f"memory", small)


def describe(lay: Layout) -> str:
    parts = [lay.describe(), f"zero={lay.zero_stage}"]
    if lay.model > 1 and lay.sequence_parallel:
        parts.append("sp")
    if lay.sequence > 1:
        zigzag = lay.context_attention == "ring" and lay.load_balance
        parts.append(lay.context_attention + ("+zigzag" if zigzag else ""))
    if lay.stage > 1:
        parts.append(f"M={lay.M},R={lay.R}")
    parts.append(f"remat={lay.remat}")
    if lay.offload != "none":
        parts.append(f"offload={lay.offload}")
    if lay.grad_accum > 1:
        parts.append(f"accum={lay.grad_accum}")
    return " ".join(parts)


def overrides(lay: Layout) -> dict[str, object]:
    """The `--set` overrides of a layout (typed values: `f"{key}={value}"` is a valid --set item)."""
    return {"parallel.zero_stage": lay.zero_stage, "parallel.sequence_parallel": lay.sequence_parallel,
            "parallel.context_attention": lay.context_attention, "parallel.load_balance": lay.load_balance,
            "parallel.microbatches": lay.M if lay.stage > 1 else 0,
            "parallel.pipeline_repeats": lay.R, "parallel.offload": lay.offload, "train.remat": lay.remat,
            "train.grad_accum": lay.grad_accum}


def layout_of(sizes: dict[str, int], parallel, train, platform: str = "gpu") -> Layout:
    """The planner's Layout of a mesh and the run's `rules.ParallelConfig` and `train.TrainConfig`;
    `remat = auto` is the platform's first candidate (`train.remat_candidates`)."""
    return Layout(**sizes, zero_stage=parallel.zero_stage, sequence_parallel=parallel.sequence_parallel,
                  context_attention=parallel.context_attention, load_balance=parallel.load_balance,
                  microbatches=parallel.microbatches, pipeline_repeats=parallel.pipeline_repeats,
                  pipeline_schedule=parallel.pipeline_schedule,
                  remat=remat_candidates(train, platform, parallel)[0], grad_accum=train.grad_accum,
                  offload=parallel.offload)


def run_of(train, platform: str = "gpu", precision: str = "fp32", efficiency: float = EFFICIENCY) -> Run:
    """The planner's Run of a `train.TrainConfig`; the attention kernel is resolved for `platform`."""
    flash = attention.resolve_kernel(train.attention_kernel, train.seq_len, platform, train.dtype) != "dense"
    return Run(train.global_batch, train.seq_len, train.compute_dtype, precision, efficiency, flash)


def layout_memory(model_cfg, sizes: dict[str, int], parallel, train, platform: str = "gpu") -> Memory:
    """Predicted per-device memory of a run's layout (`plan_cost.memory`)."""
    return memory(Shape.of(model_cfg), layout_of(sizes, parallel, train, platform), run_of(train, platform))


def best_layout(model_cfg, *, devices: int, devices_per_host: int, hardware: Hardware | str, global_batch: int,
                seq_len: int, **options) -> tuple[dict[str, int], dict[str, object]]:
    """The fastest layout that fits: (mesh sizes for MeshConfig(**sizes), overrides for --set).

    `options`: compute_dtype, precision, mem_fraction, efficiency, flash_attention (see `search`).
    Raises NothingFits.
    """
    result = search(model_cfg, devices=devices, devices_per_host=devices_per_host, hardware=hardware,
                    global_batch=global_batch, seq_len=seq_len, top=1, **options)
    lay = result.ranked[0].layout
    return lay.sizes, overrides(lay)

