"""Train a preset on a mesh.

    python -m launch.train --config tiny --cpu-devices 8 --mesh fsdp=8
    python -m launch.train --config tiny --cpu-devices 8 --mesh data=2,fsdp=4 --steps 50 \
        --set model.n_layers=4 --metrics-file runs/m.jsonl --report runs/report.json
    python -m launch.train --config tiny --cpu-devices 8 --checkpoint-dir runs/ckpt   # resumes if it can
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", help="preset name in configs/ (default: tiny)")
    p.add_argument("--mesh", help="axis sizes, e.g. data=2,fsdp=4; unnamed axes are 1, one -1 takes the rest "
                                  "(default: the preset's mesh, fsdp over all devices); 'auto': the planner's best layout")
    p.add_argument("--hardware", default="h100", help="with --mesh auto: the hardware the planner assumes "
                                                     "(h100, h200, a100 or a custom spec; see launch.plan)")
    p.add_argument("--steps", type=int, help="total training steps (overrides train.steps)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. model.n_layers=4 (repeatable)")
    p.add_argument("--metrics-file", help="write one JSON object per step to this file")
    p.add_argument("--report", help="write the compiled step's report (memory, flops, collectives) to this file")
    p.add_argument("--checkpoint-dir", help="save checkpoints here; if it holds one, resume from the latest "
                                            "(on whatever mesh this run has)")
    p.add_argument("--cpu-devices", type=int, help="run on this many fake CPU devices (per process)")
    p.add_argument("--coordinator", help="host:port of process 0 (or MESHPAR_COORDINATOR); with --num-processes "
                                         "and --process-id. Default: SLURM / Open MPI / Kubernetes if detected")
    p.add_argument("--num-processes", type=int, help="number of processes (or MESHPAR_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="this process's index (or MESHPAR_PROCESS_ID)")
    return p.parse_args(argv)


def auto_layout(cfg, hardware: str):
    """The planner's fastest layout that fits the devices present (meshpar.plan), applied to `cfg`."""
    import jax

    from meshpar import config as config_lib, mesh as mesh_lib, plan

    sizes, overrides = plan.best_layout(cfg.model, devices=jax.device_count(), devices_per_host=jax.local_device_count(),
                                        hardware=hardware, global_batch=cfg.train.global_batch,
                                        seq_len=cfg.train.seq_len, compute_dtype=cfg.train.compute_dtype)
    chosen = dataclasses.replace(cfg, mesh=mesh_lib.MeshConfig(**sizes))
    chosen = config_lib.apply(chosen, [f"{key}={value}" for key, value in overrides.items()])
    print(f"--mesh auto: {mesh_lib.describe(sizes)} "
          + " ".join(f"{key}={value}" for key, value in overrides.items()), flush=True)
    return chosen


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import jax

    if args.cpu_devices is not None:  # must happen before JAX starts a backend
        if args.cpu_devices < 1:
            sys.exit(f"--cpu-devices {args.cpu_devices}: must be >= 1")
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)

    import configs
    from meshpar import config as config_lib, distributed, mesh as mesh_lib, rules
    from meshpar.run import run
    from models.transformer import Transformer

    try:
        print(distributed.initialize(distributed.from_environment(
            coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id)), flush=True)
        cfg = configs.load(args.config)
        if args.mesh not in (None, "auto"):
            cfg = dataclasses.replace(cfg, mesh=mesh_lib.parse(args.mesh))
        steps = [] if args.steps is None else [f"train.steps={args.steps}"]
        cfg = config_lib.apply(cfg, [*args.set, *steps])
        if args.mesh == "auto":
            cfg = auto_layout(cfg, args.hardware)
        mesh = mesh_lib.build(cfg.mesh)
    except ValueError as err:
        sys.exit(f"error: {err}")

    try:
        run(lambda rngs: Transformer(cfg.model, dtype=cfg.train.dtype, rngs=rngs), cfg.train, cfg.data, mesh,
            rules.make(cfg.parallel), metrics_file=args.metrics_file, report_file=args.report,
            checkpoint_dir=args.checkpoint_dir, checkpoint=cfg.checkpoint, config=dataclasses.asdict(cfg))
    except ValueError as err:  # bad input found while building the run: say what, without a traceback
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
