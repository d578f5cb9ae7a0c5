"""Train a preset on a mesh.

    python -m launch.train --config tiny --cpu-devices 8 --mesh fsdp=8
    python -m launch.train --config tiny --cpu-devices 8 --mesh data=2,fsdp=4 --steps 50 \
        --set model.n_layers=4 --metrics-file runs/m.jsonl --report runs/report.json
    python -m launch.train --config tiny --cpu-devices 8 --checkpoint-dir runs/ckpt   # resumes if it can
    python -m launch.train --config tiny --cpu-devices 8 --set train.eval_every=20 --tensorboard-dir runs/tb \
        --profile-steps 5:6

Errors found by meshpar's own checks (bad settings, files, checkpoints; a diverged run) print as one line
and exit 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from meshpar.errors import InputError


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
    p.add_argument("--tensorboard-dir", help="write TensorBoard event files here (loss, eval loss, grad norm, lr, "
                                             "tokens/s, step time, MFU)")
    p.add_argument("--profile-steps", metavar="FIRST:LAST", help="write a jax.profiler trace of these steps "
                                                                "(TensorBoard's profile tab, or Perfetto)")
    p.add_argument("--profile-dir", help="where the trace goes (default: TENSORBOARD_DIR/profile, else runs/profile)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU (default: the hardware "
                                                    "table on GPUs, a matmul probe on CPU)")
    p.add_argument("--init-from", metavar="DIR",
                   help="start a new run from the parameters in DIR (launch.convert from-hf's output, exported "
                        "parameters or a checkpoint); the model's config comes from DIR")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume a checkpoint although train/data settings differ from the saved ones")
    p.add_argument("--checkpoint-dir", help="save checkpoints here; if it holds one, resume from the latest "
                                            "(on whatever mesh this run has)")
    p.add_argument("--cpu-devices", type=int, help="run on this many fake CPU devices (per process)")
    p.add_argument("--coordinator", help="host:port of process 0 (or MESHPAR_COORDINATOR); with --num-processes "
                                         "and --process-id. Default: SLURM / Open MPI / Kubernetes if detected")
    p.add_argument("--num-processes", type=int, help="number of processes (or MESHPAR_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="this process's index (or MESHPAR_PROCESS_ID)")
    p.add_argument("--coordinator-timeout", type=float, default=300,
                   help="seconds to wait for the coordinator (default 300)")
    return p.parse_args(argv)


GB = 1e9


def device_budget(hardware: str, mem_fraction: float = 0.9) -> float:
    """Bytes a step may use per device: what the accelerator's allocator reports, else (fake CPU devices)
    `mem_fraction` of the planner's `hardware`."""
    import jax

    from meshpar import plan

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit") or plan.parse_hardware(hardware).hbm * mem_fraction


def planned_layouts(cfg, hardware: str, top: int):
    """The planner's `top` layouts for the devices present (meshpar.plan), each applied to `cfg`, with
    the planner's estimate: [(config, estimate)], fastest first."""
    import jax

    from meshpar import config as config_lib, mesh as mesh_lib, plan

    result = plan.search(cfg.model, devices=jax.device_count(), devices_per_host=jax.local_device_count(),
                         hardware=hardware, global_batch=cfg.train.global_batch, seq_len=cfg.train.seq_len,
                         compute_dtype=cfg.train.compute_dtype, top=top,
                         flash_attention=plan.run_of(cfg.train).flash_attention)
    out = []
    for est in result.ranked:
        chosen = dataclasses.replace(cfg, mesh=mesh_lib.MeshConfig(**est.layout.sizes))
        out.append((config_lib.apply(chosen, [f"{k}={v}" for k, v in plan.overrides(est.layout).items()]), est))
    return out


def auto_layout(cfg, hardware: str, top: int = 5):
    """The planner's fastest layout that the compiler confirms fits (`meshpar.fit`: the real step compiled
    for abstract state on these devices), trying the planner's top `top` in order."""
    from meshpar import fit, mesh as mesh_lib, plan, rules

    budget = device_budget(hardware)
    for chosen, est in planned_layouts(cfg, hardware, top):
        mesh = mesh_lib.build(chosen.mesh)
        report = fit.compile_step(model_factory(chosen), chosen.train, mesh, rules.make(chosen.parallel))
        peak = report["memory_per_device"]["peak_bytes"]
        fits = peak <= budget
        print(f"--mesh auto: {plan.describe(est.layout)}: compiler peak {peak / GB:.1f} GB per device (planner "
              f"{est.memory.total / GB:.1f}), {budget / GB:.1f} GB usable: {'fits' if fits else 'does not fit'}",
              flush=True)
        if fits:
            return chosen
    raise InputError(f"--mesh auto: none of the planner's top {top} layouts fits {budget / GB:.1f} GB per device "
                     f"once compiled; use more devices, a smaller batch or sequence, or set the layout with --mesh")


def model_factory(cfg):
    from models.transformer import Transformer

    return lambda rngs: Transformer(cfg.model, dtype=cfg.train.dtype, rngs=rngs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from launch import devices

    devices.setup(args.cpu_devices)  # before JAX starts a backend

    from meshpar import distributed, metrics, mfu
    from meshpar.errors import TrainingStopped
    from meshpar.plan_cost import Shape
    from meshpar.run import Throughput, parse_profile_steps, run

    try:
        joined = distributed.initialize(distributed.from_environment(
            coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id),
            args.coordinator_timeout)
        if joined:
            print(joined, flush=True)
        steps = [] if args.steps is None else [f"train.steps={args.steps}"]
        cfg, mesh, rules, make_model = configure(args.config, args.mesh, [*args.set, *steps], args.hardware,
                                                 args.init_from)
        init_params = None
        if args.init_from:
            from launch import weights

            init_params = weights.load(args.init_from, mesh, rules)[1]
        profile = parse_profile_steps(args.profile_steps) if args.profile_steps else None
        peak, source = mfu.device_peak(2 if cfg.train.compute_dtype == "bfloat16" else 4, args.peak_tflops)
        throughput = Throughput(Shape.of(cfg.model).model_flops_per_token(cfg.train.seq_len), peak) if peak else None
        if metrics.is_logger():
            print(f"MFU against {peak / 1e12:,.3g} TFLOP/s per device ({source})" if peak else f"no MFU: {source}",
                  flush=True)
        run(make_model, cfg.train, cfg.data, mesh, rules, metrics_file=args.metrics_file, report_file=args.report,
            checkpoint_dir=args.checkpoint_dir, checkpoint=cfg.checkpoint, config=dataclasses.asdict(cfg),
            tensorboard_dir=args.tensorboard_dir, profile_steps=profile, profile_dir=args.profile_dir,
            throughput=throughput, allow_config_change=args.allow_config_change, init_params=init_params)
    except (InputError, TrainingStopped) as err:  # meshpar's own checks: say what, without a traceback
        sys.exit(f"error: {err}")


def configure(name: str, mesh_text: str | None, overrides: list[str], hardware: str = "h100",
              init_from: str | None = None):
    """(config, mesh, rules, model factory) of a preset with `--mesh` and `--set` applied, and the model
    of `init_from` (a directory of saved parameters) if given."""
    import configs
    from meshpar import config as config_lib, mesh as mesh_lib, rules

    cfg = configs.load(name)
    if mesh_text not in (None, "auto"):
        cfg = dataclasses.replace(cfg, mesh=mesh_lib.parse(mesh_text))
    cfg = config_lib.apply(cfg, overrides)
    if init_from:
        from launch import weights
        from models.transformer import TransformerConfig

        if changed := [o for o in overrides if o.startswith("model.")]:
            raise InputError(f"--init-from {init_from} sets the model; {', '.join(changed)} cannot change it")
        cfg = dataclasses.replace(cfg, model=TransformerConfig(**weights.saved_config(init_from)[0]["model"]))
    if mesh_text == "auto":
        cfg = auto_layout(cfg, hardware)
    return cfg, mesh_lib.build(cfg.mesh), rules.make(cfg.parallel), model_factory(cfg)


if __name__ == "__main__":
    main()
