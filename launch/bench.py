"""Benchmark a named set of layouts and print one table.

    python -m launch.bench                      # every layout, tiny, 8 fake CPU devices
    python -m launch.bench --layouts fsdp8,tp8 --steps 30 --set train.seq_len=256
    python -m launch.bench --config tiny_moe --layouts single,single+capacity,ep8,ep8+capacity
    python -m launch.bench --layouts pp4-gpipe,pp4-circular,pp4-1f1b,pp4-interleaved,pp4-zero-bubble,pp4-zero-bubble-r2 \
        --set model.n_layers=8

Each layout trains the same config for `--steps` steps (the first step is left out of the medians) and
reports the step's compile time, the median step time and tokens/s, the per-device argument bytes (parameters + optimizer
state + batch) and temp bytes from XLA's `memory_analysis()`, and the collectives of one step
(count × bytes per device, loop bodies counted once per iteration). On a machine with GPUs the
layouts run on them (those that fit the GPU count); otherwise on fake CPU devices.
"""

from __future__ import annotations

import argparse
import json

from meshpar import gpu_flags
from meshpar.errors import InputError

LAYOUTS = {  # name → (mesh, overrides)
    "single": ("", []),
    "dp8": ("data=8", []),
    "fsdp8": ("fsdp=8", []),
    "hsdp2x4": ("data=2,fsdp=4", []),
    "zero1": ("fsdp=8", ["parallel.zero_stage=1"]),
    "zero2": ("fsdp=8", ["parallel.zero_stage=2"]),
    "tp8": ("model=8", []),
    "tp8+sp": ("model=8", ["parallel.sequence_parallel=true"]),
    "dp2+tp4": ("data=2,model=4", []),
    "dp2+fsdp2+tp2": ("data=2,fsdp=2,model=2", []),
    "fsdp8+remat": ("fsdp=8", ["train.remat=full"]),
    "fsdp8+dots": ("fsdp=8", ["train.remat=dots"]),
    "fsdp8+accum2": ("fsdp=8", ["train.grad_accum=2"]),
    "fsdp8+bf16": ("fsdp=8", ["train.compute_dtype=bfloat16"]),
    "cp8-ring": ("sequence=8", ["parallel.context_attention=ring"]),
    "cp8-allgather": ("sequence=8", ["parallel.context_attention=allgather"]),
    "cp8-ulysses": ("sequence=8", ["parallel.context_attention=ulysses"]),
    "dp2+cp4": ("data=2,sequence=4", []),
    "pp2+dp4": ("stage=2,data=4", ["parallel.microbatches=4"]),
    "pp2+fsdp2+tp2": ("stage=2,fsdp=2,model=2", ["parallel.microbatches=4"]),
    # the pipeline schedules at P = 4, M = 8 (--set model.n_layers=8: P·R divides the layers)
    "pp4-gpipe": ("stage=4,data=2", ["parallel.microbatches=8"]),
    "pp4-circular": ("stage=4,data=2", ["parallel.microbatches=8", "parallel.pipeline_repeats=2"]),
    "pp4-1f1b": ("stage=4,data=2", ["parallel.microbatches=8", "parallel.pipeline_schedule=1f1b"]),
    "pp4-interleaved": ("stage=4,data=2", ["parallel.microbatches=8", "parallel.pipeline_schedule=1f1b",
                                           "parallel.pipeline_repeats=2"]),
    "pp4-zero-bubble": ("stage=4,data=2", ["parallel.microbatches=8", "parallel.pipeline_schedule=zero_bubble"]),
    "pp4-zero-bubble-r2": ("stage=4,data=2", ["parallel.microbatches=8", "parallel.pipeline_schedule=zero_bubble",
                                              "parallel.pipeline_repeats=2"]),
    # a mixture of experts (--config tiny_moe): dropless, and at capacity 1.25
    "single+capacity": ("", ["parallel.expert_capacity=1.25"]),
    "ep8": ("expert=8", []),
    "ep8+capacity": ("expert=8", ["parallel.expert_capacity=1.25"]),
    "dp2+ep4": ("data=2,expert=4", []),
    "ep2+fsdp2+tp2": ("expert=2,fsdp=2,model=2", []),
}
SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "collective-permute": "CP", "all-to-all": "A2A"}


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table(rows: list[dict]) -> str:
    head = ["layout", "mesh", "compile s", "step ms", "tokens/s", "args MiB", "temp MiB", "collectives (count×MiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        coll = ", ".join(f"{SHORT[k]} {v['count']}×{_mb(v['bytes'])}" for k, v in r["collectives"].items()) or "–"
        lines.append(f"| {r['layout']} | {r['mesh']} | {r['compile_s']:.1f} | {r['step_time_s_median'] * 1e3:.0f} | "
                     f"{r['tokens_per_s_median']:,.0f} | {_mb(r['memory_per_device']['arguments_bytes'])} | "
                     f"{_mb(r['memory_per_device']['temp_bytes'])} | {coll} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.bench", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from: {', '.join(LAYOUTS)}")
    p.add_argument("--mesh", help="one mesh (e.g. data=2,fsdp=2,model=2) with no other settings, instead of --layouts")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--cpu-devices", type=int, help="run on this many fake CPU devices (default: the GPUs if a "
                                                    "CUDA plugin is installed, else 8 CPU devices)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    layouts = {args.mesh: (args.mesh, [])} if args.mesh else LAYOUTS
    names = [args.mesh] if args.mesh else args.layouts.split(",")
    unknown = [name for name in names if name not in layouts]
    if unknown:
        p.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")

    from launch import devices

    # decided before JAX starts a backend: the GPUs where a CUDA plugin is installed, else 8 CPU devices
    devices.setup(args.cpu_devices or (None if gpu_flags.cuda_installed() else 8))

    import jax

    import configs
    from meshpar import config as config_lib, mesh as mesh_lib, rules
    from meshpar.data import load_tokens
    from meshpar.run import Outputs, run

    base = config_lib.apply(configs.load(args.config), [*args.set, f"train.steps={args.steps}"])
    tokens = load_tokens(base.data)
    rows = []
    print(f"{args.config} on {jax.device_count()} × {jax.devices()[0].device_kind}, {args.steps} steps each")
    for name in names:
        mesh_text, overrides = layouts[name]
        cfg = config_lib.apply(base, overrides)
        devices = jax.devices()[:1] if not mesh_text else jax.devices()
        try:
            mesh = mesh_lib.build(mesh_lib.parse(mesh_text), devices)
        except InputError as err:
            print(f"skip {name}: {err}")
            continue
        report = run(cfg.model_factory(), cfg.train, tokens, mesh, rules.make(cfg.parallel),
                     outputs=Outputs(progress=False)).report
        rows.append({**report, "layout": name, "mesh": mesh_lib.describe(dict(mesh.shape))})
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
