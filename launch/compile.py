"""Will it fit? Compile the real training step for N fake CPU devices and print its memory per device.

    python -m launch.compile --config llama_8b --devices 8 --mesh fsdp=8 --set train.global_batch=32 \
        --set train.remat=full
    python -m launch.compile --config llama_8b --devices 8 --mesh sequence=4,fsdp=2 --set train.remat=full \
        --set train.seq_len=32768 --set model.max_seq_len=32768 --set train.global_batch=2
    python -m launch.compile --config llama_70b --devices 64 --mesh fsdp=8,model=8 --set train.remat=full \
        --set parallel.sequence_parallel=true --set train.grad_accum=8 --set train.global_batch=64 --json
    python -m launch.compile --config llama_8b --devices 64 --mesh auto --top 5    # the planner's picks

Nothing is allocated: the state and the batch are shapes with shardings (`meshpar.compiler.fit`), so any size
compiles on this machine (llama_70b on 64 devices: ~5 s). Printed per device: XLA's arguments, temp,
outputs and aliased bytes and the peak they imply (arguments + temp + outputs − aliased), in device memory
and beside them in host memory (`parallel.offload`, meshpar.offload), the collectives
of one step (as `--report` counts them), the compile time, and beside them the planner's prediction for
the same layout (`predicted_peak_bytes`, and `predicted_host_bytes` under host offload, `meshpar.plan`) and
in the form this CPU compile takes (`predicted_cpu_peak_bytes`: XLA:CPU has no host memory of its own, so
offload's temporaries stay on the device; the planner's figure for this compile).
`--mesh auto` compiles the planner's `--top` layouts for `--hardware` instead, one report each, and says
which fit.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshpar.errors import InputError

GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.compile", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", help="preset name in configs/ (default: tiny)")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices to compile for (default 8)")
    p.add_argument("--mesh", help="axis sizes, e.g. fsdp=8,model=8 (default: the preset's mesh); 'auto': the "
                                  "planner's --top layouts")
    p.add_argument("--hardware", default="h100", help="with --mesh auto: the planner's hardware and the memory "
                                                     "the layouts must fit (default h100)")
    p.add_argument("--top", type=int, default=5, help="with --mesh auto: how many layouts (default 5)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. train.remat=full (repeatable)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from launch import devices

    devices.setup(args.devices, "--devices")  # before JAX starts a backend

    from launch.configure import compile_check, configure, device_budget, planned_layouts

    try:
        if args.mesh == "auto":
            cfg, *_ = configure(args.config, None, args.set)
            budget = device_budget(args.hardware)
            reports = [dict(compile_check(chosen), planner_rank=rank, fits=None)
                       for rank, (chosen, _) in enumerate(planned_layouts(cfg, args.hardware, args.top), 1)]
            for report in reports:
                report["fits"] = report["memory_per_device"]["peak_bytes"] <= budget
        else:
            cfg, *_ = configure(args.config, args.mesh, args.set)
            reports = [compile_check(cfg)]
    except InputError as err:
        sys.exit(f"error: {err}")
    if args.json:
        print(json.dumps(reports if args.mesh == "auto" else reports[0], indent=2))
    else:
        print("\n\n".join(describe(report) for report in reports))


def describe(report: dict) -> str:
    m = report["memory_per_device"]
    fits = {None: "", True: ", fits", False: ", does NOT fit"}[report.get("fits")]
    lines = [f"{report['config']} on {report['devices']} devices: {report['layout']}; compiled in "
             f"{report['compile_s']:.1f}s{fits}", "memory per device (GB = 1e9 bytes):"]
    for key in ("arguments_bytes", "temp_bytes", "outputs_bytes", "alias_bytes", "peak_bytes"):
        lines.append(f"  {key:<20} {m[key] / GB:9.2f}  (host memory: {m['host_' + key] / GB:.2f})")
    on_cpu = report["predicted_cpu_peak_bytes"]
    lines.append(f"  {'planner peak':<20} {report['predicted_peak_bytes'] / GB:9.2f}  (host memory: "
                 f"{report['predicted_host_bytes'] / GB:.2f})")
    lines.append(f"  {'planner, CPU form':<20} {on_cpu / GB:9.2f}  ({on_cpu / m['peak_bytes'] - 1:+.1%} vs this compile: "
                 f"XLA:CPU keeps host temporaries on the device)")
    lines.append("collectives per step (count × GB per device):")
    for op, entry in report["collectives"].items():
        lines.append(f"  {op:<20} {entry['count']:6d} × {entry['bytes'] / max(entry['count'], 1) / GB:.4f}")
    lines.append(f"flops per device: {report['flops_per_device']:.3e}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
