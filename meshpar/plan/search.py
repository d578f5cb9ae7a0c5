"""The layout search: which mesh and settings train a model fastest on a given cluster, before renting it.

`search` enumerates every factorisation of the device count into the six mesh axes (data, stage, fsdp,
expert, sequence, model; `expert` only for a mixture of experts, and dividing its experts) and every
setting that changes memory or speed (ZeRO stage, Megatron SP, context attention mode, pipeline
microbatches and repeats, remat, gradient accumulation), keeps the layouts that
meshpar can build (`meshpar.plan.layout.check`: the training step's own checks), prunes what does not fit
in memory, and ranks the rest by predicted step time (`meshpar.plan.time.estimate`). `best_layout` gives
the winner as a mesh and `--set`-style overrides (for `launch.train --mesh auto`); `model_states` is the
ZeRO paper's per-device model-state memory for a bare parameter count.

Search space, and what is left out because it never wins in this model: `model` stays inside a host (its
size divides the devices per host: tensor parallelism across the network is never faster); `sequence` ≤ 64
and may cross hosts, priced at the network's bandwidth; ZeRO 2 and 3 over `fsdp` (and `expert`: `meshpar.rules`;
ZeRO 0 is the `data` axis; ZeRO 1 holds more than 2 and sends more: meshpar all-reduces its whole gradient,
then all-gathers the parameters); the zigzag order for context attention (balanced causal work); the
GPipe/circular and the 1F1B/interleaved schedules (GPipe only for a mixture of experts) with microbatches
M ∈ {P, 2P, 4P, 8P} (the two largest the batch allows) and repeats R ∈ {1, 2, 4}; a mixture's dispatch
dropless and at capacity
`CAPACITY` (XLA compiles dropless's grouped matmuls as El·ep·r masked rows, `layout.expert_rows`, so with many
experts per device a capacity is far faster and smaller; `capacities` fixes the choice); and per layout only
the fastest (remat, grad_accum) pair that fits. Layouts that differ only in how the batch ways split into
data × fsdp are ranked once, by their fastest split. Host offload
(`parallel.offload`, remat `offload`) only when no layout fits without it: its copies are priced as an
upper bound (`meshpar.plan.time`), and the host's memory must hold what it moves there.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from meshpar import fp8 as fp8_lib, remat as remat_lib
from meshpar.divisors import divisors
from meshpar.errors import InputError
from meshpar.hardware import Hardware, parse as parse_hardware
from meshpar.mesh import MeshConfig, host_split
from meshpar.plan.layout import (EFFICIENCY, PRECISIONS, Layout, Run, check, layer_applications, local_elements,
                                 parameter_problems)
from meshpar.plan.memory import memory
from meshpar.plan.shape import Shape
from meshpar.plan.time import Estimate, compute_seconds, estimate
from meshpar.rules import CONTEXT_ATTENTION, OFFLOAD, PIPELINE_SCHEDULES, ParallelConfig

GB = 1e9
MAX_SEQUENCE = 64
CAPACITY = 1.25  # the capacity factor the search tries beside dropless (Switch Transformer's, GShard's range)


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
    """Meshes that can split this model and batch (a cheap first cut: `check` asks the rest)."""
    for model in divisors(math.gcd(devices, dph)):
        if parameter_problems(shape, 0, 1, 1, model):
            continue
        rest = devices // model
        for seq in divisors(rest):
            if seq > MAX_SEQUENCE or run.seq_len % seq:
                continue
            for stage in divisors(rest // seq):
                if shape.layers % stage:
                    continue
                batch_ways = rest // (seq * stage)
                if run.global_batch % batch_ways:
                    continue
                # a dense model's batch needs no `expert` axis (it would be one more data-parallel axis)
                for expert in [e for e in divisors(batch_ways) if shape.experts % e == 0] if shape.experts else [1]:
                    for fsdp in divisors(batch_ways // expert):
                        if fsdp > 1 and parameter_problems(shape, 3, 1, fsdp, 1):
                            continue
                        mesh = MeshConfig(data=batch_ways // (fsdp * expert), stage=stage, fsdp=fsdp, expert=expert,
                                          sequence=seq, model=model)
                        try:
                            host_split(mesh.sizes(), dph)
                        except InputError:
                            continue
                        yield mesh


def _settings(shape: Shape, mesh: MeshConfig, run: Run, capacities: tuple[float, ...]):
    """The ParallelConfigs to try on one mesh, before remat and accumulation."""
    zeros = (2, 3) if mesh.fsdp * mesh.expert > 1 else (0,)
    sps = (False, True) if mesh.model > 1 else (False,)
    modes = CONTEXT_ATTENTION if mesh.sequence > 1 else ("ring",)
    P = mesh.stage
    rows = run.global_batch // (mesh.data * mesh.fsdp * mesh.expert)
    # the two largest microbatch counts (more microbatches: a smaller bubble and smaller passes)
    counts = [M for M in (8 * P, 4 * P, 2 * P, P) if rows % M == 0][:2]
    pipes = [(0, 1, "gpipe")] if P == 1 else [(M, R, kind) for M in counts for R in (1, 2, 4)
                                              for kind in PIPELINE_SCHEDULES if shape.layers % (P * R) == 0]
    for zero in zeros:
        for sp in sps:
            for mode in modes:
                for M, R, kind in pipes:
                    for capacity in capacities if shape.experts else (0.0,):
                        yield ParallelConfig(zero_stage=zero, sequence_parallel=sp, context_attention=mode,
                                             microbatches=M, pipeline_repeats=R, pipeline_schedule=kind,
                                             expert_capacity=capacity)


@dataclasses.dataclass
class SearchResult:
    ranked: list[Estimate]  # fitting layouts, fastest first (at most `top`)
    considered: int  # layouts (mesh × settings) that build
    evaluated: int  # (remat, grad_accum) variants whose memory was computed
    fitting: int  # layouts with a variant that fits, among those not pruned
    pruned: int  # never visited: model states alone exceed memory, or compute alone is slower than the top


def _family(lay: Layout) -> tuple:
    """A layout up to its data × fsdp split (ranked once: the table lists the fastest split)."""
    return (lay.mesh.stage, lay.mesh.expert, lay.mesh.sequence, lay.mesh.model,
            dataclasses.replace(lay.parallel, offload="none"))


def _rank(e: Estimate) -> tuple[float, float]:
    return (e.step_s, e.memory.total)


def _accums(rows: int) -> list[int]:
    return [k for k in (1, 2, 4, 8, 16, 32) if rows % k == 0]


def _tp_floor(shape: Shape, lay: Layout, run: Run, hw: Hardware) -> float:
    """A lower bound of the exposed tensor-parallel time: 13 activation-sized transfers of (n−1)/n per layer."""
    if lay.mesh.model == 1:
        return 0.0
    b = run.global_batch / (lay.batch_ways * lay.M * lay.grad_accum)
    a = b * run.seq_len / lay.mesh.sequence * shape.d_model * run.e
    m = lay.mesh.model
    return 13 * a * (m - 1) / m * layer_applications(shape, lay) / max(hw.link_bw, hw.net_bw)


# (offload, remat) variants of a layout. Without offload, cheapest first: per accumulation the first that
# fits is timed. Offload is tried only when no layout fits without it, the moments (and remat `offload`)
# before the weights (meshpar.offload: `optimizer+params` needs a remat), and every offload variant that fits
# is timed: their speed order is not known in advance.
PLAIN = tuple(("none", remat) for remat in ("none", "dots", "full"))
OFFLOADED = tuple(tuple((offload, remat) for offload in offloads for remat in remat_lib.POLICIES
                        if (offload, remat) not in PLAIN and (offload, remat) != ("optimizer+params", "none"))
                  for offloads in (("none", "optimizer"), ("optimizer+params",)))


def search(shape: Shape, *, devices: int, devices_per_host: int, hardware: Hardware | str, global_batch: int,
           seq_len: int, compute_dtype: str = "bfloat16", precision: str = "fp32", top: int = 10,
           mem_fraction: float = 0.9, efficiency: float = EFFICIENCY, flash_attention: bool = True,
           fp8: str = "none", capacities: tuple[float, ...] = (0.0, CAPACITY)) -> SearchResult:
    """Rank the layouts that fit, fastest first. Raises NothingFits (naming the smallest need) if none does.

    `flash_attention`: the attention kernel keeps no score matrix (meshpar's blockwise kernel, the GPU
    default); False models the dense kernel. `fp8`: the matmuls' FP8 recipe (`train.fp8`). `capacities`: a
    mixture's `parallel.expert_capacity` values to try (0: dropless).
    Branch and bound: layouts are visited in the order of their compute time alone (no remat, no
    communication: a lower bound of every variant); the search stops when that bound passes the
    `top`-th best step time found, or reaches layouts whose model states alone do not fit. For each
    layout visited, per gradient accumulation, the cheapest remat that fits is timed; the fastest kept.
    Only if nothing fits, and the hardware gives its host (`Hardware.offloads`), the same search runs
    again over the host-offload variants (`OFFLOADED`: the moments', then, if still nothing fits, the
    weights' too), with the host memory as a second budget.
    """
    hw = _hardware(hardware)
    dph = check_cluster(devices, devices_per_host)
    if global_batch < 1 or seq_len < 1:
        raise InputError(f"global batch ({global_batch}) and sequence length ({seq_len}) must be >= 1")
    if compute_dtype not in ("bfloat16", "float32"):
        raise InputError(f"compute dtype '{compute_dtype}' is not bfloat16 or float32")
    if top < 1:
        raise InputError(f"top = {top} must be >= 1")
    if problem := fp8_lib.unsupported(fp8, hw, f"hardware '{hw.name}'"):
        raise InputError(problem)
    run = Run(global_batch, seq_len, compute_dtype, precision, efficiency, flash_attention, fp8)
    if any(c < 0 for c in capacities) or not capacities:
        raise InputError(f"expert capacities {capacities}: give one or more, each 0 (dropless) or > 0")
    result = _search(shape, dph, run, hw, top, mem_fraction, devices, PLAIN, capacities)
    for offloaded in OFFLOADED if hw.offloads else ():
        if result.ranked:
            break
        result = _search(shape, dph, run, hw, top, mem_fraction, devices, offloaded, capacities)
    if not result.ranked:
        raise _nothing_fits(shape, devices, dph, run, hw, mem_fraction, capacities)
    return result


def _bases(shape: Shape, dph: int, run: Run, hw: Hardware, devices: int, budget: float, host_budget: float,
           variants: tuple[tuple[str, str], ...], capacities: tuple[float, ...]) -> list[tuple[float, Layout]]:
    """Every layout that builds, with a lower bound of its step time (∞: its model states alone do not
    fit), cheapest first."""
    pb, _, ob = PRECISIONS[run.precision]

    def states_fit(base: Layout, offload: str) -> bool:
        params = pb * local_elements(shape, base, "params", part="trained") + \
            shape.frozen_bytes * local_elements(shape, base, "params", part="frozen")
        moments = ob * local_elements(shape, base, "optimizer", part="trained")
        device = {"none": params + moments, "optimizer": params, "optimizer+params": 0.0}[offload]
        return device <= budget and params + moments - device <= host_budget

    bases = []
    for mesh in _meshes(shape, devices, dph, run):
        for parallel in _settings(shape, mesh, run, capacities):
            base = Layout(mesh, parallel)
            if check(shape, base, run):
                continue
            if not any(states_fit(base, offload) for offload in {offload for offload, _ in variants}):
                bases.append((math.inf, base))
            else:
                bases.append((compute_seconds(shape, base, run, hw)[0] + _tp_floor(shape, base, run, hw), base))
    bases.sort(key=lambda item: item[0])  # (stable: the enumeration order breaks ties)
    return bases


def _variant(base: Layout, **settings) -> Layout | None:
    """`base` with these settings, or None where meshpar refuses the combination (e.g. 1F1B with weights in
    host memory)."""
    try:
        return base.replace(**settings)
    except InputError:
        return None


def _fastest_variant(shape: Shape, base: Layout, run: Run, hw: Hardware, dph: int, budget: float,
                     host_budget: float, mem_fraction: float, variants: tuple[tuple[str, str], ...]
                     ) -> tuple[Estimate | None, int]:
    """The fastest (offload, remat, accumulation) variant of `base` that fits, and how many were evaluated."""
    chosen, timed, evaluated = None, set(), 0
    first_only = variants == PLAIN
    for accum in _accums(run.global_batch // (base.batch_ways * base.M)):
        for offload, remat in variants:
            evaluated += 1
            lay = _variant(base, offload=offload, remat=remat, grad_accum=accum)
            if lay is None:
                continue
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
    return chosen, evaluated


def _search(shape: Shape, dph: int, run: Run, hw: Hardware, top: int, mem_fraction: float, devices: int,
            variants: tuple[tuple[str, str], ...], capacities: tuple[float, ...]) -> SearchResult:
    """One branch-and-bound pass over the layouts with these (offload, remat) variants (see `search`)."""
    budget, host_budget = hw.hbm * mem_fraction, hw.host_mem * mem_fraction
    bases = _bases(shape, dph, run, hw, devices, budget, host_budget, variants, capacities)
    best: list[Estimate] = []
    evaluated = fitting = 0
    for n, (lower, base) in enumerate(bases):
        if lower == math.inf or (len(best) >= top and lower >= best[top - 1].step_s):
            break  # sorted: no later layout can beat the top ones
        chosen, count = _fastest_variant(shape, base, run, hw, dph, budget, host_budget, mem_fraction, variants)
        evaluated += count
        if chosen is None:
            continue
        fitting += 1
        twin = next((e for e in best if _family(e.layout) == _family(chosen.layout)), None)
        if twin is not None and _rank(twin) <= _rank(chosen):
            continue  # the same layout with another data × fsdp split is already as good
        if twin is not None:
            best.remove(twin)
        bisect.insort(best, chosen, key=_rank)
        del best[top:]
    else:
        n = len(bases)
    return SearchResult(best, len(bases), evaluated, fitting, len(bases) - n)


def _nothing_fits(shape: Shape, devices: int, dph: int, run: Run, hw: Hardware, mem_fraction: float,
                  capacities: tuple[float, ...]) -> NothingFits:
    """The error, naming the layout that needs the least memory (an exhaustive pass: this is the rare case);
    with offload, the least of device and host memory over their budgets."""
    budget, host_budget = hw.hbm * mem_fraction, hw.host_mem * mem_fraction
    offloads = OFFLOAD if hw.offloads else ("none",)
    smallest: tuple[float, Layout] | None = None
    for mesh in _meshes(shape, devices, dph, run):
        for parallel in _settings(shape, mesh, run, capacities):
            base = Layout(mesh, parallel)
            for accum in _accums(run.global_batch // (base.batch_ways * base.M)):
                for offload in offloads:
                    lay = _variant(base, offload=offload, remat="full", grad_accum=accum)
                    if lay is not None and not check(shape, lay, run):
                        mem = memory(shape, lay, run)
                        need = max(mem.total / budget, mem.host / host_budget if mem.host else 0.0)
                        if smallest is None or need < smallest[0]:
                            smallest = (need, lay)
    if smallest is None:
        return NothingFits(f"nothing fits: no layout of {devices} devices builds for this model and batch (global "
                           f"batch {run.global_batch}, sequence {run.seq_len}): the batch must divide over the "
                           f"data-parallel ways, heads / kv heads / d_ff / vocab over model", None)
    small = estimate(shape, smallest[1], run, hw, dph, mem_fraction=mem_fraction)
    offloaded = small.layout.parallel.offload != "none"
    host_need = f" and {small.memory.host / GB:.1f} GB of host memory per device" if offloaded else ""
    host_have = f" and {host_budget / GB:.1f} GB of host memory per device" if offloaded else ""
    return NothingFits(
        f"nothing fits: the smallest layout needs {small.memory.total / GB:.1f} GB per device{host_need} "
        f"({small.layout.describe()}), but {hw.name} has {budget / GB:.1f} GB usable ({mem_fraction:.0%} of "
        f"{hw.hbm / GB:.0f} GB){host_have}; use more devices, a smaller batch or sequence, or GPUs with more "
        f"memory", small)


def capacities(parallel: ParallelConfig) -> tuple[float, ...]:
    """The expert capacities a search tries for a run of these settings: the one they set, else dropless and
    `CAPACITY`."""
    return (parallel.expert_capacity,) if parallel.expert_capacity else (0.0, CAPACITY)


def best_layout(shape: Shape, *, devices: int, devices_per_host: int, hardware: Hardware | str, global_batch: int,
                seq_len: int, **options) -> tuple[MeshConfig, dict[str, object]]:
    """The fastest layout that fits: (its mesh, its overrides for --set).

    `options`: compute_dtype, precision, mem_fraction, efficiency, flash_attention (see `search`).
    Raises NothingFits.
    """
    result = search(shape, devices=devices, devices_per_host=devices_per_host, hardware=hardware,
                    global_batch=global_batch, seq_len=seq_len, top=1, **options)
    lay = result.ranked[0].layout
    return lay.mesh, lay.overrides()
