"""Presenting plans: the ranked table, the one-line reason, JSON rows, and the memory-by-strategy picture."""

from __future__ import annotations

from meshpar import mesh as mesh_lib
from meshpar.hardware import Hardware
from meshpar.mesh import MeshConfig
from meshpar.plan.layout import Layout, Run
from meshpar.plan.memory import memory
from meshpar.plan.shape import Shape
from meshpar.plan.time import Estimate, estimate
from meshpar.rules import ParallelConfig

GB = 1e9
KINDS = {"tp": "tensor-parallel", "ep": "expert-parallel", "cp": "context-parallel", "pp": "pipeline",
         "dp": "data-parallel/ZeRO", "fp8": "FP8 scales' amax"}


def _attention(lay: Layout) -> str:
    if lay.mesh.sequence == 1:
        return "-"
    par = lay.parallel
    return par.context_attention + ("+zigzag" if par.context_attention == "ring" and par.load_balance else "")


def _comm(e: Estimate) -> str:
    parts = [f"{axes} {b / GB:.1f}/{s:.2f}" for axes, (b, s) in sorted(e.comm.items(), key=lambda kv: -kv[1][1])]
    return ", ".join(parts) or "-"


def _offloads(lay: Layout) -> bool:
    return lay.parallel.offload != "none" or lay.remat == "offload"


def header(shape: Shape, run: Run, hw: Hardware, devices: int, devices_per_host: int, mem_fraction: float,
           name: str = "model") -> str:
    hosts = max(1, devices // devices_per_host)
    host = (f"; host memory {hw.host_mem * mem_fraction / GB:.1f} per device, host↔device {hw.host_bw / GB:.0f} "
            f"GB/s each way (offload: only when nothing fits without it)" if hw.offloads else "")
    active = f", {shape.matmul_params / 1e9:.2f}B active per token" if shape.experts else ""
    return (f"{name} ({shape.params / 1e9:.2f}B parameters{active}) on {devices} × {hw.name} ({hosts} host(s) of "
            f"{min(devices, devices_per_host)}), global batch {run.global_batch} × {run.seq_len} tokens, "
            f"{run.compute_dtype} compute{f' (FP8 matmuls: {run.fp8})' if run.fp8 != 'none' else ''}, "
            f"{'fp32 master weights + Adam' if run.precision == 'fp32' else 'mixed precision (ZeRO paper)'}\n"
            f"memory per device in GB (1e9 bytes), usable {hw.hbm * mem_fraction / GB:.1f} "
            f"({mem_fraction:.0%} of {hw.hbm / GB:.0f}){host}; comm per mesh axis: GB on the wire / seconds per "
            f"step; MFU: PaLM's 6Ψ + 12·L·N·H·T per token (full attention square), against the {run.compute_dtype} "
            f"peak")


def table(estimates: list[Estimate]) -> str:
    gb = lambda x: f"{x / GB:.1f}"
    host = any(_offloads(e.layout) for e in estimates)
    only_host = lambda *columns: list(columns) if host else []  # the offload columns, where a row offloads
    moe = any(e.layout.parallel.expert_capacity for e in estimates)
    only_moe = lambda *columns: list(columns) if moe else []  # a mixture's capacity, where a row sets one
    columns = [  # (header, left-aligned, cell of (rank, estimate))
        ("#", False, lambda i, e: str(i)),
        ("mesh", True, lambda i, e: mesh_lib.describe(e.layout.mesh)),
        ("zero", False, lambda i, e: str(e.layout.parallel.zero_stage)),
        ("sp", False, lambda i, e: "yes" if e.layout.parallel.sequence_parallel and e.layout.mesh.model > 1 else "-"),
        ("attention", True, lambda i, e: _attention(e.layout)),
        ("pipeline", True, lambda i, e: _pipeline(e.layout)),
        *only_moe(("capacity", False, lambda i, e: f"{e.layout.parallel.expert_capacity:g}"
                   if e.layout.parallel.expert_capacity else "dropless")),
        ("remat", True, lambda i, e: e.layout.remat),
        *only_host(("offload", True, lambda i, e: e.layout.parallel.offload.replace("none", "-"))),
        ("accum", False, lambda i, e: str(e.layout.grad_accum)),
        *((label, False, lambda i, e, part=part: gb(getattr(e.memory, part))) for label, part in (
            ("params", "params"), ("grads", "grads"), ("optim", "optimizer"), ("acts", "activations"),
            ("other", "other"))),
        *only_host(("update", False, lambda i, e: gb(e.memory.update))),
        ("total", False, lambda i, e: gb(e.memory.total)),
        *only_host(("host", False, lambda i, e: gb(e.memory.host))),
        ("fits", False, lambda i, e: "yes" if e.fits else "NO"),
        ("comm per axis (GB/s)", True, lambda i, e: _comm(e)),
        ("compute s", False, lambda i, e: f"{e.compute_s:.2f}"),
        *only_host(("host s", False, lambda i, e: f"{e.host_s:.2f}")),
        ("step s", False, lambda i, e: f"{e.step_s:.2f}"),
        ("tokens/s", False, lambda i, e: f"{e.tokens_per_s:,.0f}"),
        ("MFU", False, lambda i, e: f"{e.mfu:.1%}"),
    ]
    rows = [[label for label, _, _ in columns]]
    rows += [[cell(i, e) for _, _, cell in columns] for i, e in enumerate(estimates, 1)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    fmt = lambda r: "  ".join(c.ljust(w) if left else c.rjust(w) for c, w, (_, left, _) in zip(r, widths, columns))
    return "\n".join(fmt(r).rstrip() for r in rows)


def _parts(e: Estimate) -> dict[str, float]:
    return {"compute": e.compute_s, **{k: v for k, v in e.exposed.items()}, "optimizer": e.optimizer_s,
            "host": e.host_s}


def why(ranked: list[Estimate], shape: Shape | None = None, run: Run | None = None) -> str:
    """One line: what the best layout's step is made of, what it needs to fit, why the runner-up is slower."""
    best = ranked[0]
    lay, m = best.layout, best.memory
    kind, seconds = max(best.exposed.items(), key=lambda kv: kv[1]) if best.exposed else ("dp", 0.0)
    notes = ([f"{lay.remat} remat"] if lay.remat != "none" else []) + (
        [f"pipeline bubble {best.bubble:.0%}"] if lay.mesh.stage > 1 else [])
    host = f"; host {m.host / GB:.1f} of {best.host_budget / GB:.1f} GB" if _offloads(lay) else ""
    copies = f" + {best.host_s:.2f} s of host↔device copies" if _offloads(lay) else ""
    text = (f"why: #1 fits ({m.total / GB:.1f} of {best.budget / GB:.1f} GB{host}) and its {best.step_s:.2f} s step "
            f"is {best.compute_s:.2f} s of compute" + (f" ({', '.join(notes)})" if notes else "")
            + f" + {best.exposed_s:.2f} s of exposed communication (most: {KINDS[kind]} {seconds:.2f} s){copies}")
    used = [what for what, on in (("remat", lay.remat != "none"), ("accumulation", lay.grad_accum > 1),
                                  ("offload", lay.parallel.offload != "none")) if on]
    if shape is not None and run is not None and used:
        plain = memory(shape, lay.replace(remat="none", grad_accum=1, offload="none"), run).total
        text += f"; without {' and '.join(used)} it would need {plain / GB:.0f} GB"
    if len(ranked) > 1:
        other = ranked[1]
        diff = {k: _parts(other).get(k, 0.0) - v for k, v in _parts(best).items()}
        diff.update({k: v for k, v in _parts(other).items() if k not in diff})
        key = max(diff, key=diff.get)
        reason = {"compute": "more compute" + (" (recompute)" if other.layout.remat != lay.remat else "")
                  + (" (pipeline bubble)" if other.bubble > best.bubble else ""),
                  "optimizer": "a larger optimizer update", "host": "more host↔device copies"}.get(
                      key, f"more exposed {KINDS.get(key, key)} communication")
        text += (f"; #2 ({mesh_lib.describe(other.layout.mesh)}, {other.layout.remat} remat"
                 + (f", offload {other.layout.parallel.offload}" if other.layout.parallel.offload != "none" else "")
                 + f") is {other.step_s / best.step_s - 1:.1%} slower: {reason} (+{diff[key]:.2f} s)")
    return text


def plot_memory(path: str, shape: Shape, run: Run, hw: Hardware, devices: int, devices_per_host: int,
                mem_fraction: float, title: str, pick: Estimate | None = None) -> list[tuple[str, Estimate]]:
    """Stacked bars of predicted per-device memory for one strategy per family (remat full, one sequence
    per microbatch), and the planner's pick; a line at the usable memory. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, h = devices, min(devices, devices_per_host)
    bars = []
    families = [("DP", dict(data=n), 0), ("ZeRO-1", dict(fsdp=n), 1), ("ZeRO-2", dict(fsdp=n), 2),
                ("ZeRO-3 / FSDP", dict(fsdp=n), 3), (f"TP{h}", dict(data=n // h, model=h), 0),
                (f"TP{h}+SP", dict(data=n // h, model=h), 0), (f"FSDP+TP{h}", dict(fsdp=n // h, model=h), 3),
                (f"FSDP+CP{h} ring", dict(fsdp=n // h, sequence=h), 3),
                (f"FSDP+PP{h}", dict(fsdp=n // h, stage=h), 3)]
    for label, sizes, zero in families:
        lay = Layout(MeshConfig(**sizes), ParallelConfig(zero_stage=zero, sequence_parallel=label.endswith("+SP")),
                     remat="full")
        lay = lay.replace(grad_accum=max(1, run.global_batch // (lay.batch_ways * lay.M)))  # one sequence each
        bars.append((label, estimate(shape, lay, run, hw, devices_per_host, mem_fraction=mem_fraction, strict=False)))
    if pick is not None:
        lay = pick.layout
        bars.append((f"planner's pick\n{mesh_lib.describe(lay.mesh)}\nremat={lay.remat}, accum={lay.grad_accum}", pick))
    parts = {"params": "parameters", "grads": "gradients (alive at the peak)", "optimizer": "Adam moments",
             "activations": "activations (saved + one layer's working set)",
             "other": "other: accumulation buffer, kept / gathered weights, update"}
    fig, ax = plt.subplots(figsize=(13, 5.5))
    bottom = [0.0] * len(bars)
    for part, label in parts.items():
        values = [getattr(e.memory, part) / GB for _, e in bars]
        ax.bar(range(len(bars)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, (_, e) in enumerate(bars):
        ax.text(i, bottom[i], f"{e.memory.total / GB:.0f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(hw.hbm * mem_fraction / GB, color="red", linestyle="--", label=f"usable {hw.name} memory")
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("predicted GB per device")
    ax.set_ylim(0, max(3 * hw.hbm * mem_fraction / GB, 1.05 * min(max(bottom), 6 * hw.hbm / GB)))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return bars


def as_json(estimates: list[Estimate]) -> list[dict]:
    return [dict(e.row(), rank=i, describe=mesh_lib.describe(e.layout.mesh)) for i, e in enumerate(estimates, 1)]


def _pipeline(lay) -> str:
    """`gpipe 8/2` (schedule, M/R): the pipeline column; `-` without one."""
    return f"{lay.parallel.pipeline_schedule} {lay.M}/{lay.R}" if lay.mesh.stage > 1 else "-"
