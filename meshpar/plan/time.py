"""Step time of one layout from its FLOPs, HBM traffic and collectives (`meshpar.plan.comm`).

Overlap, stated: tensor-parallel, expert-parallel (the all-to-alls), Ulysses / all-gather context-parallel and
pipeline transfers are on the critical path (the next matmul needs them); ring attention's K/V permutes hide
behind the block matmuls (exposed: what exceeds the attention compute); data-parallel / ZeRO traffic
(gradient reduction, ZeRO-3 weight gathers) runs asynchronously beside compute — exposed is what exceeds the
step's compute, and at least one layer's share (the last gradients are reduced after the last backward layer).

Compute: model FLOPs per token 6Ψ + 12·L·N·H·T (`meshpar.mfu`: PaLM's; the full T×T attention square, not
halved for the causal mask — the convention MFU is reported in; Ψ of a mixture of experts: the active
parameters, k of the E experts). What a device executes: forward 2·Ψ_l + 4·N_l·H·T_kv per token (the experts'
weights once per row they compute per token: `layout.layer_matmul_params`; local, all-gather and Ulysses
attention compute the masked half too; zigzag ring only the visible blocks, ≈ half), backward twice that,
+1 forward of the layers with full remat, +1 attention forward with dots and with ring (its steps are
rematerialised), +1 forward with 1F1B (it recomputes each chunk in its backward; the remat applies
inside). Layers before the stack (`layer_prefix`, `Shape.lead`) cost their matmuls alike (`lead_seconds`):
outside GPipe's schedule once per accumulation step, the batch split over the stages too; inside 1F1B's
slots (stage 0's first part) in every slot, as if every stage held them. Multi-token prediction's modules
(`Shape.mtp`) run after the stack as the prefix runs before it outside a pipeline, and the head once more each.
Time = FLOPs / (peak · efficiency) (under `train.fp8` the projections' and MLPs' at the FP8 peak;
MFU is still counted against the compute dtype's peak, the convention torchtitan reports FP8 runs in) + HBM
traffic of the non-matmul tensors (3 passes over the activations, / HBM bandwidth) per microbatch, for every
pass of the pipeline schedule, plus the exposed communication, plus the optimizer update (memory-bound), plus
the host↔device copies of offload.

Host offload's copies (`comm.host_traffic`) are charged in full at `host_bw`·`net_efficiency`, one
direction after the other: not overlapped with compute or with each other. An upper bound, stated: the
update's copies wait for the last gradients and prefetching them would hold them in device memory, which
offload exists to avoid; the weight fetches and remat `offload`'s copies could hide behind the layers'
compute (XLA's async copies), but whether XLA's schedule does is not measured here (no GPU in the tests).
The search only reaches for offload when no layout fits without it, so the bound ranks offload layouts
among themselves and never displaces a layout that fits without it.
"""

from __future__ import annotations

import dataclasses

from meshpar.fp8 import unsupported
from meshpar.hardware import Hardware
from meshpar.mfu import mfu
from meshpar.pipeline import schedule
from meshpar.plan.comm import collective_time, collectives, host_traffic
from meshpar.plan.layout import (PRECISIONS, Layout, Run, check, expert_rows, layer_applications, layer_matmul_params,
                                 lead_matmul_params, local_dims, local_elements, passes)
from meshpar.plan.memory import Memory, attention_bytes_per_token, memory
from meshpar.plan.shape import Shape
from meshpar.rules import SLOT_SCHEDULES


def bubble(lay: Layout, deferred: float = 1.0) -> float:
    """Idle fraction of the layout's pipeline (`schedule.bubble_fraction`, `zero_bubble_fraction`); 0 without
    one. `deferred`: the share of the weights' gradient matmuls zero-bubble defers (`deferred_share`); the
    rest runs with the input's gradient."""
    if lay.mesh.stage == 1:
        return 0.0
    if lay.parallel.pipeline_schedule == "zero_bubble":
        return schedule.zero_bubble_fraction(lay.mesh.stage, lay.M, lay.R, input_grad=3 - deferred,
                                             weight_grad=deferred)
    return schedule.bubble_fraction(lay.mesh.stage, lay.M, lay.R)


def deferred_share(shape: Shape, lay: Layout, run: Run) -> float:
    """Zero-bubble: the share of a layer's weight-gradient matmuls that it defers, all but a mixture's
    experts' (their gradients come out of the dispatch's shard_map with the input's: `split_backward`).
    Other schedules defer none and never read it: 1, without the search paying for the count."""
    if lay.mesh.stage == 1 or lay.parallel.pipeline_schedule != "zero_bubble":
        return 1.0
    return layer_matmul_params(shape, lay, run, experts=False) / layer_matmul_params(shape, lay, run)


@dataclasses.dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: Memory
    budget: float  # usable bytes per device
    comm: dict[str, tuple[float, float]]  # axis → (wire bytes per device per step, seconds)
    compute_s: float  # matmul + HBM time of the step, bubbles included
    exposed_s: float  # communication not hidden behind compute
    step_s: float
    tokens_per_s: float
    mfu: float
    bubble: float
    problems: tuple[str, ...] = ()
    exposed: dict[str, float] = dataclasses.field(default_factory=dict)  # kind → exposed seconds
    optimizer_s: float = 0.0
    host_budget: float = 0.0  # usable host bytes per device
    host_s: float = 0.0  # host↔device copies of offload (not overlapped)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.budget and self.memory.host <= self.host_budget and not self.problems

    def row(self) -> dict:
        lay, par, mem = self.layout, self.layout.parallel, self.memory
        return {
            "mesh": lay.sizes, "zero_stage": par.zero_stage, "sequence_parallel": par.sequence_parallel,
            "context_attention": par.context_attention if lay.mesh.sequence > 1 else None,
            "load_balance": par.load_balance if lay.mesh.sequence > 1 else None,
            "microbatches": lay.M if lay.mesh.stage > 1 else None,
            "pipeline_repeats": lay.R if lay.mesh.stage > 1 else None,
            "pipeline_schedule": par.pipeline_schedule if lay.mesh.stage > 1 else None,
            "remat": lay.remat, "grad_accum": lay.grad_accum, "offload": par.offload,
            "memory_bytes": {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
                             "activations": mem.activations, "other": mem.other, "update": mem.update,
                             "total": mem.total},
            "host_memory_bytes": {"states": mem.host_states, "temp": mem.host_temp, "total": mem.host},
            "fits": self.fits, "budget_bytes": self.budget, "host_budget_bytes": self.host_budget,
            "comm": {axis: {"bytes": b, "seconds": s} for axis, (b, s) in self.comm.items()},
            "compute_s": self.compute_s, "exposed_comm_s": self.exposed_s, "exposed_by_kind_s": self.exposed,
            "optimizer_s": self.optimizer_s, "host_transfer_s": self.host_s, "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "bubble": self.bubble,
            "problems": list(self.problems),
        }


def layer_flops_per_token(shape: Shape, lay: Layout, run: Run) -> tuple[float, float]:
    """(projection, attention) matmul FLOPs of one layer's forward pass per local token, on one device (of one
    entry of the stack: a period's layers, each window bounding its keys)."""
    _, _, N, *_ = local_dims(shape, lay, run)
    return 2 * layer_matmul_params(shape, lay, run), 4 * N * shape.head_dim * shape.attention_keys(_keys(lay, run))


def _keys(lay: Layout, run: Run) -> float:
    """The keys a query's attention computes with where no window bounds them."""
    T, n = run.seq_len, lay.mesh.sequence
    if run.flash_attention:
        return T / 2  # a fused kernel skips the masked blocks
    if n > 1 and lay.parallel.context_attention == "ring" and lay.parallel.load_balance:
        return T * (n + 1) / (2 * n)  # zigzag: the local block whole, then two visible half blocks per step
    return T  # the whole masked square is computed (and the busiest ring device does all blocks)


def lead_seconds(shape: Shape, lay: Layout, run: Run, per_flop: tuple[float, float]) -> float:
    """Seconds of the prefix's layers (`Shape.lead`) and multi-token prediction's (`Shape.mtp`) in a step, at
    `per_flop` (the projections', attention's seconds per FLOP over every pass): GPipe runs them once per
    accumulation step on the batch split over data, fsdp, expert and stage; 1F1B in every slot on a
    microbatch (`meshpar.layers`)."""
    if not shape.lead and not shape.mtp:
        return 0.0
    b, t, N, *_ = local_dims(shape, lay, run)
    outside = lay.mesh.stage == 1 or lay.parallel.pipeline_schedule not in SLOT_SCHEDULES
    tokens = b * t * (lay.M / lay.mesh.stage if outside else 1)
    keys = _keys(lay, run)
    proj = 2 * (lead_matmul_params(shape, lay, run) + lead_matmul_params(shape, lay, run, "mtp_layers"))
    attn = 4 * N * shape.head_dim * (shape.lead_keys(keys) + shape.mtp * keys)
    return (lay.grad_accum if outside else passes(lay)) * tokens * (proj * per_flop[0] + attn * per_flop[1])


def layer_traffic_per_token(shape: Shape, lay: Layout, run: Run) -> float:
    """Bytes one layer's non-matmul work writes per local token, on a GPU: the residual stream and two
    norms (float32 statistics and outputs), the region inputs, q, k, v and the attention output, SwiGLU's
    three [F] tensors and their products, and what attention keeps of its scores; a mixture's experts the
    same per row of its buffers, and the buffers (send, receive, sorted, each way: 6 of D)."""
    D, H, e, L = shape.d_model, shape.head_dim, run.e, shape.period
    _, _, N, K, F, _ = local_dims(shape, lay, run)
    sp = lay.mesh.model if lay.parallel.sequence_parallel else 1
    experts = 0.0
    if shape.experts:
        rows = expert_rows(shape, lay, run)[2]
        experts = rows * (6 * shape.expert_width / lay.mesh.model + 6 * D) * e * shape.moe_layers
    return (L * ((2 * e + 16) * D / sp + 2 * D * e + 2 * (N + K) * H * e) + 6 * F * e * shape.mlp_layers + experts
            + attention_bytes_per_token(shape, lay, run))


def fp8_cast_bytes(shape: Shape, lay: Layout, run: Run) -> tuple[float, float]:
    """HBM bytes of one layer's FP8 casts (`train.fp8`; 0, 0 without): (per local token, per pass over its
    weights). A cast reads its input twice in the compute dtype (the amax, then the scaling) and writes one
    byte: the matmuls' inputs (x once for q, k and v, once for gate and up), their output gradients, and
    under rowwise the inputs again, scaled along the tokens for the weights' gradients. A weight is cast
    once a pass (forward, backward); under tensorwise its FP8-gathered copy is also widened back to the
    compute dtype first. A mixture's expert rows are left out."""
    if run.fp8 == "none":
        return 0.0, 0.0
    D, H, e, L, mlp = shape.d_model, shape.head_dim, run.e, shape.period, shape.mlp_layers
    _, _, N, K, F, _ = local_dims(shape, lay, run)
    rowwise = run.fp8 == "rowwise"
    inputs, grads = L * (2 * D + N * H) + mlp * F, L * ((N + 2 * K) * H + D) + mlp * (2 * F + D)
    weights = local_elements(shape, lay, "activations", only_layers=True) / (shape.layers / lay.mesh.stage)
    return (2 * e + 1) * ((1 + rowwise) * inputs + grads), weights * (2 * e + 1 + (not rowwise) * (1 + e))


def compute_seconds(shape: Shape, lay: Layout, run: Run, hw: Hardware) -> tuple[float, float]:
    """(compute seconds of the step, attention seconds): matmuls at peak·efficiency plus HBM traffic.

    Every microbatch pass through this device's layers counts, pipeline bubbles included (they compute
    on zeros); the head and loss run outside the pipeline, on every stage.
    """
    peak = hw.peak(run.e) * run.efficiency
    # FP8 (`train.fp8`): the projections' matmuls at the FP8 peak, attention's and the head's as they were (on
    # hardware without FP8, which `estimate` refuses, at the compute dtype's)
    proj_peak = hw.peak(1) * run.efficiency if run.fp8 != "none" and hw.fp8_flops else peak
    b, t, _, _, _, V = local_dims(shape, lay, run)
    tokens = b * t  # one microbatch on one device
    proj, attn = layer_flops_per_token(shape, lay, run)
    ring = lay.mesh.sequence > 1 and lay.parallel.context_attention == "ring"
    one_f_one_b = lay.mesh.stage > 1 and lay.parallel.pipeline_schedule in SLOT_SCHEDULES
    # passes over the layer: forward, backward (2), a recompute of the projections (full remat, 1F1B's chunks)
    # and of attention (any remat; ring's steps, rematerialised anyway, unless full remat recomputes them)
    proj_passes = 3 + (lay.remat == "full") + one_f_one_b
    attn_passes = 3 + (lay.remat != "none") + (ring and lay.remat != "full") + one_f_one_b
    # zero-bubble: the deferred weights' gradients (one matmul per weight) run in R·M of the R·M + P − 1 slots
    if lay.mesh.stage > 1 and lay.parallel.pipeline_schedule == "zero_bubble":
        weight_share = lay.R * lay.M / schedule.iterations(lay.mesh.stage, lay.M, lay.R)
        proj_passes -= (1 - weight_share) * deferred_share(shape, lay, run)
    matmul_layer = (proj_passes * proj / proj_peak + attn_passes * attn / peak) * tokens
    act = layer_traffic_per_token(shape, lay, run)
    if ring and not run.flash_attention:  # every step's [t, t] score block goes through HBM, not just one
        N, n = shape.heads / lay.mesh.model, lay.mesh.sequence
        act += N * (attn / (4 * N * shape.head_dim) - run.seq_len / n) * (4 + run.e)
    hbm_layer = 3 * act * tokens * (2 if lay.remat == "full" or one_f_one_b else 1) / hw.hbm_bw
    per_token, per_weight_pass = fp8_cast_bytes(shape, lay, run)
    hbm_layer += (per_token * tokens + per_weight_pass * (2 + (lay.remat == "full"))) / hw.hbm_bw
    layer_steps = layer_applications(shape, lay)
    head = (3 * 2 * shape.d_model * V / peak + 3 * 4 * V / hw.hbm_bw) * tokens * lay.grad_accum * lay.M
    head *= 1 + shape.mtp  # multi-token prediction's modules each run the head again
    lead = lead_seconds(shape, lay, run, (proj_passes / proj_peak, attn_passes / peak))
    return layer_steps * (matmul_layer + hbm_layer) + head + lead, 3 * attn * tokens / peak * layer_steps


def estimate(shape: Shape, lay: Layout, run: Run, hw: Hardware, devices_per_host: int, *,
             mem_fraction: float = 0.9, strict: bool = True) -> Estimate:
    """Predicted memory, communication and time of `lay` for the model `shape`.

    `strict=False` skips the checks of what meshpar builds (to compare with published runs of other shapes).
    """
    problems = tuple(check(shape, lay, run)) if strict else ()
    offloads = lay.parallel.offload != "none" or lay.remat == "offload"
    if offloads and not hw.offloads:
        problems += (f"hardware '{hw.name}' does not give host_bw and host_mem, which host offload needs: add "
                     f"e.g. host_bw=64e9,host_mem=250e9 (PCIe Gen5 x16, 2 TB for 8 GPUs) to the spec",)
    if fp8_problem := unsupported(run.fp8, hw, f"hardware '{hw.name}'"):
        problems += (fp8_problem,)
    mem = memory(shape, lay, run)
    compute, attn_s = compute_seconds(shape, lay, run, hw)
    timed = [(x, *collective_time(x, lay, hw, devices_per_host)) for x in collectives(shape, lay, run)]
    kind_s = {kind: sum(sec * x.count for x, _, sec in timed if x.kind == kind)
              for kind in ("dp", "tp", "ep", "cp", "ring", "pp", "fp8")}
    exposed = {"tp": kind_s["tp"], "ep": kind_s["ep"], "cp": kind_s["cp"] + max(0.0, kind_s["ring"] - attn_s),
               "pp": kind_s["pp"], "fp8": kind_s["fp8"]}
    critical = sum(exposed.values())
    dp = kind_s["dp"]
    exposed["dp"] = max(dp / max(1.0, shape.layers / lay.mesh.stage), dp - compute - critical)
    _, _, ob = PRECISIONS[run.precision]
    optimizer_s = (local_elements(shape, lay, "optimizer", part="trained") * (4 + 4 + ob + 4 + ob)  # r p,g,m,v; w p,m,v
                   / hw.hbm_bw)
    host_s = sum(host_traffic(shape, lay, run)) / (hw.host_bw * hw.net_efficiency) if offloads and hw.offloads else 0.0
    step = compute + sum(exposed.values()) + optimizer_s + host_s
    comm: dict[str, list[float]] = {}
    for x, wire, sec in timed:
        entry = comm.setdefault("×".join(x.axes), [0.0, 0.0])
        entry[0] += wire * x.count
        entry[1] += sec * x.count
    tokens_step = run.global_batch * run.seq_len
    return Estimate(layout=lay, memory=mem, budget=hw.hbm * mem_fraction,
                    comm={k: (v[0], v[1]) for k, v in comm.items()}, compute_s=compute,
                    exposed_s=sum(exposed.values()), step_s=step, tokens_per_s=tokens_step / step,
                    mfu=mfu(shape.model_flops_per_token(run.seq_len), tokens_step / step, lay.devices,
                            hw.peak(run.e)), bubble=bubble(lay, deferred_share(shape, lay, run)),
                    problems=problems, exposed=exposed, optimizer_s=optimizer_s,
                    host_budget=hw.host_mem * mem_fraction, host_s=host_s)

