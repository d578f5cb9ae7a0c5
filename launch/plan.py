"""Plan a layout before renting the cluster: predicted memory, communication and step time of every layout.

    python -m launch.plan --config llama_8b --devices 64 --devices-per-host 8 --hardware h100 \
        --global-batch 512 --seq-len 8192                  # ranked table of the layouts that fit
    python -m launch.plan --config llama_70b --devices 512 --top 3 --json        # for scripts
    python -m launch.plan --config llama_8b --devices 64 --mesh fsdp=8,model=8 \
        --set parallel.sequence_parallel=true --set train.remat=full             # one layout
    python -m launch.plan --params 7.5e9 --zero-stage 3 --shards 64 --precision mixed   # model states only
    python -m launch.plan --config llama_8b --devices 64 --plot launch/plan_memory.png
    python -m launch.plan --config llama_70b --devices 512 --set train.attention_kernel=dense   # what-if: T² scores
    python -m launch.plan --config llama3_8b --devices 8 --mesh fsdp=8 --set train.fp8=tensorwise  # FP8 matmuls
    python -m launch.plan --config llama_70b --devices 8 --global-batch 8      # fits only with host offload
    python -m launch.plan --config llama_8b --devices 8 --mesh fsdp=8 --set parallel.offload=optimizer \
        --set train.remat=offload                                                 # offload, one layout

`--hardware`: h100, h200, a100, gh200, `h100,hbm=94e9` (a preset with fields replaced) or a full custom
spec `flops=...,hbm=...,hbm_bw=...,link_bw=...,net_bw=...` (+ `host_bw=...,host_mem=...` for host offload;
see meshpar/hardware.py). The search tries host offload (`parallel.offload`, `train.remat=offload`)
only when no layout fits without it. The model is in meshpar/plan/ (memory.py, comm.py); what it assumes
about overlap is in meshpar/plan/time.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from meshpar.errors import InputError

# chosen by the search (a capacity only with --mesh); train.attention_kernel is not (it is a what-if)
SETTINGS = ("parallel.zero_stage", "parallel.sequence_parallel", "parallel.context_attention",
            "parallel.load_balance", "parallel.microbatches", "parallel.pipeline_repeats",
            "parallel.pipeline_schedule", "parallel.offload",
            "parallel.expert_capacity", "train.remat", "train.grad_accum")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="preset in configs/ (the model; batch and sequence defaults)")
    p.add_argument("--devices", type=int, help="number of accelerators")
    p.add_argument("--devices-per-host", type=int, default=8, help="accelerators per host (default 8)")
    p.add_argument("--hardware", default="h100", help="h100, h200, a100, gh200, or a custom spec (default h100)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--compute-dtype", choices=("bfloat16", "float32"), help="default: the preset's")
    p.add_argument("--precision", choices=("fp32", "mixed"), default="fp32",
                   help="model-state bytes: fp32 (meshpar: f32 params 4 + grads 4 + Adam 8 per parameter) or "
                        "mixed (the ZeRO paper: 2 + 2 + 12)")
    p.add_argument("--mesh", help="evaluate this one layout (e.g. data=2,fsdp=4,model=8) instead of searching")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"config overrides (model.*, and with --mesh the settings {', '.join(SETTINGS)})")
    p.add_argument("--top", type=int, default=10, help="how many layouts to list (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--mem-fraction", type=float, default=0.9, help="usable fraction of device memory (default "
                   "0.9; JAX preallocates 0.75 unless XLA_PYTHON_CLIENT_MEM_FRACTION says more)")
    p.add_argument("--efficiency", type=float, help="achieved/peak matmul FLOP/s (default 0.6)")
    p.add_argument("--plot", metavar="PNG", help="also draw predicted per-device memory by strategy")
    p.add_argument("--params", type=float, help="model-state memory of a bare parameter count (no --config)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help="with --params (default: all stages)")
    p.add_argument("--shards", type=int,
                   help="with --params: the ZeRO data-parallel degree N_d (default --devices or 1)")
    return p.parse_args(argv)


def _params_only(args: argparse.Namespace) -> None:
    from meshpar.plan import model_states

    shards = args.shards or args.devices or 1
    stages = [args.zero_stage] if args.zero_stage is not None else [0, 1, 2, 3]
    rows = [dict(zero_stage=z, **model_states(args.params, z, shards, args.precision)) for z in stages]
    if args.json:
        print(json.dumps({"params": args.params, "shards": shards, "precision": args.precision,
                          "per_device_bytes": rows}, indent=2))
        return
    print(f"{args.params:.4g} parameters, {args.precision} precision, ZeRO over N_d = {shards} devices; "
          f"per-device model states in GB (1e9 bytes), activations not included")
    print(f"{'zero':>4}  {'params':>10}  {'grads':>10}  {'optimizer':>10}  {'total':>10}")
    for r in rows:
        cells = (f"{r[k] / 1e9:>10.2f}" for k in ("params", "grads", "optimizer", "total"))
        print(f"{r['zero_stage']:>4}  " + "  ".join(cells))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.params is not None:
            if args.config:
                raise InputError("--params estimates a bare parameter count; leave out --config")
            _params_only(args)
            return
        run(args)
    except InputError as err:
        sys.exit(f"error: {err}")


def run(args: argparse.Namespace) -> None:
    import configs
    from launch.configure import shape as shape_of
    from meshpar import config as config_lib, mesh as mesh_lib, plan, remat as remat_lib
    from meshpar.plan import report
    from meshpar.plan.layout import EFFICIENCY

    if not args.config or not args.devices:
        raise InputError("give --config NAME and --devices N (or --params N for model states only)")
    hw = plan.parse_hardware(args.hardware)
    dph = min(args.devices_per_host, args.devices)
    cfg = configs.load(args.config)
    flags = [f"train.global_batch={args.global_batch}"] if args.global_batch else []
    flags += [f"train.seq_len={args.seq_len}"] if args.seq_len else []
    flags += [f"train.compute_dtype={args.compute_dtype}"] if args.compute_dtype else []
    if args.seq_len and args.seq_len > cfg.model.max_seq_len:
        flags.append(f"model.max_seq_len={args.seq_len}")
    # a capacity may fix the search's (it tries dropless and `CAPACITY`); the other settings are its to choose
    chosen = set(SETTINGS) - {"parallel.expert_capacity"}
    settings = [s for s in args.set if s.partition("=")[0].strip() in chosen]
    if settings and not args.mesh:
        raise InputError(f"{', '.join(settings)}: layout settings need --mesh (the search chooses them itself)")
    cfg = config_lib.apply(cfg, [*args.set, *flags])
    shape = shape_of(cfg)
    t = cfg.train
    runp = plan.Run.of(t, "gpu", args.precision, args.efficiency or EFFICIENCY)
    head = report.header(shape, runp, hw, args.devices, dph, args.mem_fraction, args.config)

    if args.mesh:
        mesh = mesh_lib.parse(args.mesh).resolve(args.devices)
        plan.check_cluster(args.devices, args.devices_per_host)
        mesh_lib.host_split(mesh.sizes(), dph)
        for remat in remat_lib.candidates(t.remat, "gpu", cfg.parallel):  # auto: the fastest policy that fits
            lay = plan.Layout(mesh, cfg.parallel, remat, t.grad_accum)
            estimates = [plan.estimate(shape, lay, runp, hw, dph, mem_fraction=args.mem_fraction)]
            if estimates[0].fits:
                break
        if estimates[0].problems:
            raise InputError(f"layout {lay.describe()} does not build: {'; '.join(estimates[0].problems)}")
        e = estimates[0]
        host = f" and {e.memory.host / 1e9:.1f} GB of {e.host_budget / 1e9:.1f} GB host memory" if e.memory.host else ""
        summary = "fits" if e.fits else (f"does NOT fit: needs {e.memory.total / 1e9:.1f} GB of {e.budget / 1e9:.1f} "
                                         f"GB usable{host}")
        result = None
    else:
        started = time.perf_counter()
        result = plan.search(shape, devices=args.devices, devices_per_host=args.devices_per_host, hardware=hw,
                             global_batch=t.global_batch, seq_len=t.seq_len, compute_dtype=t.compute_dtype,
                             precision=args.precision, top=args.top, mem_fraction=args.mem_fraction,
                             efficiency=runp.efficiency, flash_attention=runp.flash_attention, fp8=t.fp8,
                             capacities=plan.capacities(cfg.parallel))
        search_s = time.perf_counter() - started
        estimates = result.ranked
        summary = report.why(estimates, shape, runp)
    if args.plot:
        report.plot_memory(args.plot, shape, runp, hw, args.devices, dph, args.mem_fraction,
                           f"{args.config}: predicted memory per device on {args.devices} × {hw.name}, "
                           f"batch {t.global_batch} × {t.seq_len} (remat=full, one sequence per microbatch)",
                           pick=estimates[0] if result else None)
    if args.json:
        out = {"config": args.config, "params": shape.params, "hardware": dataclasses.asdict(hw),
               "devices": args.devices, "devices_per_host": dph, "global_batch": t.global_batch,
               "seq_len": t.seq_len, "compute_dtype": t.compute_dtype, "precision": args.precision,
               "layouts": report.as_json(estimates), "summary": summary}
        if result:
            out["search"] = {"considered": result.considered, "evaluated": result.evaluated,
                             "fitting": result.fitting, "pruned": result.pruned, "seconds": search_s}
        print(json.dumps(out, indent=2))
        return
    print(head)
    print()
    print(report.table(estimates))
    print()
    if result:
        print(f"searched {result.considered:,} layouts (mesh × settings) that build: visited "
              f"{result.considered - result.pruned:,} in order of their compute time and sized {result.evaluated:,} "
              f"remat/accumulation variants, {result.fitting:,} fit; the rest cannot beat #{len(estimates)} or "
              f"do not fit, in {search_s:.1f} s. One row per layout up to its data × fsdp split (the fastest split "
              f"shown).")
        print(summary)
    else:
        print(f"{args.mesh}: {summary}")


if __name__ == "__main__":
    main()
