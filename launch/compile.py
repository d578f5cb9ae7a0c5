"""Will it fit? Compile the real training step for fake CPU devices, or for a GPU cluster with no GPU.

    python -m launch.compile --config llama_8b --devices 8 --mesh fsdp=8 --set train.global_batch=32 \
        --set train.remat=full
    python -m launch.compile --config llama3_8b --target h100 --devices-per-host 8 --mesh fsdp=8
    python -m launch.compile --config llama_70b --target h100 --topology 1x8x8 --mesh fsdp=8,model=8 \
        --set parallel.sequence_parallel=true --set train.grad_accum=8 --set train.global_batch=64 --json
    python -m launch.compile --config llama_8b --target h100 --hosts 8 --mesh auto --top 3   # the planner's picks

Nothing is allocated: the state and the batch are shapes with shardings (`meshpar.compiler.fit`), so any size
compiles on this machine. Printed per device: the compiler's arguments, temp, outputs and aliased bytes and
the peak they imply (arguments + temp + outputs − aliased), in device memory and beside them in host memory
(`parallel.offload`, meshpar.offload), the collectives of one step, the compile time, and beside them the
planner's prediction for the same layout (`predicted_peak_bytes`, and `predicted_host_bytes` under host
offload, `meshpar.plan`).

Without `--target` the program is XLA:CPU's for `--devices` fake CPU devices (its all-reduces stand where a GPU
reduce-scatters, its bf16 collectives are widened to float32); the planner's figure in the form this CPU
compile takes is beside it (`predicted_cpu_peak_bytes`: XLA:CPU has no host memory of its own).

With `--target h100|h200|a100|b200` the program is XLA:GPU's for that cluster (`meshpar.compiler.gpu`: the
target described by `meshpar.gpu_target`, `--hosts` of `--devices-per-host`, or `--topology 1xHxG`), compiled
with meshpar's GPU flags, on this machine whether it has GPUs or not. It needs jax >= 0.12 with its CUDA
plugin and cuDNN's wheel (`make gpu-compile-deps`; the error says the pip command). Printed besides: the
collectives' dtypes and how many run asynchronously and overlap compute, the kernels (cuDNN attention and why
it was or was not chosen, cuBLAS and Triton GEMMs, other fusions), `remat=auto`'s choice under the target's
memory (what XLA's allocator gives: XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set, of what CUDA reports),
the FLOPs (the kernels' and the model's), and the step time the program implies beside the planner's.

`--mesh auto` compiles the planner's `--top` layouts (for `--hardware`, or the target) instead, one report
each, and says which fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from meshpar.errors import InputError

GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.compile", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", help="preset name in configs/ (default: tiny)")
    p.add_argument("--devices", type=int, help="fake CPU devices to compile for (default 8; not with --target)")
    p.add_argument("--target", help="compile XLA:GPU's program for a cluster of these GPUs: h100, h200, a100, b200")
    p.add_argument("--hosts", type=int, help="with --target: hosts (default 1)")
    p.add_argument("--devices-per-host", type=int, help="with --target: GPUs per host (default 8)")
    p.add_argument("--topology", help="with --target: 1xHOSTSxGPUS_PER_HOST instead of --hosts/--devices-per-host")
    p.add_argument("--mesh", help="axis sizes, e.g. fsdp=8,model=8 (default: the preset's mesh); 'auto': the "
                                  "planner's --top layouts")
    p.add_argument("--hardware", help="with --mesh auto and no --target: the planner's hardware and the memory "
                                      "the layouts must fit (default h100)")
    p.add_argument("--top", type=int, help="with --mesh auto: how many layouts (default 5)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. train.remat=full (repeatable)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    flag = lambda name: f"--{name.replace('_', '-')}"
    given = lambda *names: next((flag(name) for name in names if getattr(args, name) is not None), None)
    if args.target is None and given("hosts", "devices_per_host", "topology"):
        p.error(f"{given('hosts', 'devices_per_host', 'topology')} describes the GPU cluster of --target: give "
                f"--target too")
    if args.target is not None and given("devices"):
        p.error("--devices counts fake CPU devices: with --target the cluster is --hosts and --devices-per-host "
                "(or --topology)")
    if args.target is not None and given("hardware"):
        p.error(f"--hardware names the planner's hardware without --target: with --target it is {args.target}")
    if args.topology is not None and given("hosts", "devices_per_host"):
        p.error(f"--topology {args.topology} gives the hosts and the GPUs per host: drop "
                f"{given('hosts', 'devices_per_host')}")
    if args.mesh != "auto" and given("top", "hardware"):
        p.error(f"{given('top', 'hardware')} is for --mesh auto (the planner's layouts): give --mesh auto too")
    defaults = {"hosts": 1, "devices_per_host": 8, "hardware": "h100", "top": 5}
    return argparse.Namespace(**{**vars(args), **{k: v for k, v in defaults.items() if getattr(args, k) is None}})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from launch import devices

    if args.target:
        # XLA's GPU compiler logs an error line per buffer it cannot fit when a step is far over the GPU's
        # memory: the report says so in one line.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # A GPU target compiles on the CPU backend's process, leaving any GPUs here alone.
    devices.setup(1 if args.target else args.devices or 8, "--devices")  # before JAX starts a backend

    from launch.configure import compile_check, configure, device_budget, planned_layouts
    from meshpar.compiler import gpu

    try:
        cluster = gpu.Cluster.parse(args.target, args.topology, args.hosts, args.devices_per_host) \
            if args.target else None
        if args.mesh == "auto":
            cfg, *_ = configure(args.config, None, args.set, cluster=cluster)
            budget = device_budget(args.hardware, cluster=cluster)
            reports = [dict(compile_check(chosen, cluster), planner_rank=rank, fits=None)
                       for rank, (chosen, _) in enumerate(planned_layouts(cfg, args.hardware, args.top, cluster), 1)]
            for report in reports:
                report["fits"] = report["memory_per_device"]["peak_bytes"] <= budget
        else:
            cfg, *_ = configure(args.config, args.mesh, args.set, cluster=cluster)
            reports = [compile_check(cfg, cluster)]
    except InputError as err:
        sys.exit(f"error: {err}")
    if args.json:
        print(json.dumps(reports if args.mesh == "auto" else reports[0], indent=2))
    else:
        print("\n\n".join(describe(report) for report in reports))


def describe(report: dict) -> str:
    """The report as text: memory, collectives, and for a GPU program its kernels and step time."""
    m = report["memory_per_device"]
    fits = {None: "", True: ", fits", False: ", does NOT fit"}[report.get("fits")]
    where = report.get("target", f"{report['devices']} fake CPU devices (XLA:CPU's program)")
    lines = [f"{report['config']} on {where}: {report['layout']}; compiled in {report['compile_s']:.1f}s{fits}",
             "memory per device (GB = 1e9 bytes):"]
    for key in ("arguments_bytes", "temp_bytes", "outputs_bytes", "alias_bytes", "peak_bytes"):
        lines.append(f"  {key:<20} {m[key] / GB:9.2f}  (host memory: {m['host_' + key] / GB:.2f})")
    lines.append(f"  {'planner peak':<20} {report['predicted_peak_bytes'] / GB:9.2f}  (host memory: "
                 f"{report['predicted_host_bytes'] / GB:.2f})")
    if "gpu" not in report:
        on_cpu = report["predicted_cpu_peak_bytes"]
        lines.append(f"  {'planner, CPU form':<20} {on_cpu / GB:9.2f}  ({on_cpu / m['peak_bytes'] - 1:+.1%} vs this "
                     f"compile: XLA:CPU keeps host temporaries on the device)")
        lines.append("collectives per step (count × GB per device):")
        for op, entry in report["collectives"].items():
            lines.append(f"  {op:<20} {entry['count']:6d} × {entry['bytes'] / max(entry['count'], 1) / GB:.4f}")
        lines.append(f"flops per device: {report['flops_per_device']:.3e}")
        return "\n".join(lines)
    return "\n".join(lines + describe_gpu(report))


def describe_gpu(report: dict) -> list[str]:
    program, check = report["gpu"], report["step_time_check"]
    tried = ", ".join(f"{remat} {peak / GB:.1f} GB" for remat, peak in report["remat_tried_peak_bytes"].items())
    lines = [f"  {'usable on the GPU':<20} {report['budget_bytes'] / GB:9.2f}  (remat={report['remat']}; compiled "
             f"peaks: {tried})",
             "collectives per step (count, GB per device by dtype, async / overlapping compute):"]
    for op, entry in program["collectives"].items():
        dtypes = ", ".join(f"{dtype} {size / GB:.3f}" for dtype, size in entry["bytes_by_dtype"].items())
        lines.append(f"  {op:<20} {entry['count']:6d}  {dtypes:<28} async {entry['async']}, overlapped "
                     f"{entry['overlapped']}")
    k = program["kernels"]
    lines += [f"attention: {report['attention']}",
              f"kernels per step: {k['attention']} cuDNN attention, {k['gemm']} cuBLAS GEMMs, {k['fp8_gemm']} cuBLASLt "
              f"FP8 GEMMs, {k['triton_gemm']} Triton GEMMs, {k['fusion']} other fusions, {k['memory']} other ops, {k['host_copy']} host copies",
              f"flops per device: {report['flops_per_device']:.3e} in the program's GEMMs and attention, "
              f"{report['model_flops_per_device']:.3e} the model's (6N + 12·L·H·Q·T per token)",
              f"step time: {check['program_step_s']:.3f} s from the program (roofline), {check['planner_step_s']:.3f} s "
              f"the planner's ({check['ratio'] - 1:+.0%})"]
    for part, values in check["parts_s"].items():
        lines.append(f"  {part:<22} program {values['program']:.3f} s, planner {values['planner']:.3f} s")
    if "differs_most" in check:
        lines.append(f"  they differ most in {check['differs_most']}")
    return lines


if __name__ == "__main__":
    main()
