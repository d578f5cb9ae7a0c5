"""Train a preset on a mesh.

    python -m launch.train --config tiny --cpu-devices 8 --mesh fsdp=8
    python -m launch.train --config tiny --cpu-devices 8 --mesh data=2,fsdp=4 --steps 50 \
        --set model.n_layers=4 --metrics-file runs/m.jsonl --report runs/report.json
    python -m launch.train --config tiny --cpu-devices 8 --checkpoint-dir runs/ckpt   # resumes if it can
    python -m launch.train --config tiny --cpu-devices 8 --set train.eval_every=20 --tensorboard-dir runs/tb \
        --profile-steps 5:6

Errors found by meshpar's own checks (bad settings, files, checkpoints; a diverged run) print as one line
and exit 1; anything else is a bug and keeps its traceback. SIGTERM or SIGINT (or --exit-after-s) stops the
run after the step in flight with a checkpoint of it, and the process exits with code 75 (EX_TEMPFAIL: run
the same command again to resume); a second signal ends it at once, the previous checkpoint intact. Before
the first step (while the run starts, restores or compiles) there is nothing to save: a signal ends the
process at once, with code 75 as well (`meshpar.signals`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from meshpar import signals
from meshpar.errors import InputError


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds > 0")
    return seconds


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
    p.add_argument("--exit-after-s", type=_seconds, metavar="SECONDS",
                   help="stop after this many seconds of training (compilation included) as on SIGTERM: save "
                        "and exit with code 75, e.g. a little under the job's time limit")
    p.add_argument("--cpu-devices", type=int, help="run on this many fake CPU devices (per process)")
    p.add_argument("--coordinator", help="host:port of process 0 (or MESHPAR_COORDINATOR); with --num-processes "
                                         "and --process-id. Default: SLURM / Open MPI / Kubernetes if detected")
    p.add_argument("--num-processes", type=int, help="number of processes (or MESHPAR_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="this process's index (or MESHPAR_PROCESS_ID)")
    p.add_argument("--coordinator-timeout", type=float, default=300,
                   help="seconds to wait for the coordinator (default 300)")
    p.add_argument("--heartbeat-timeout", type=_seconds, default=100, metavar="SECONDS",
                   help="end the job when a process sends no heartbeat for this long (dead or stalled), naming "
                        "it, instead of waiting in a collective forever (default 100, JAX's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from launch import devices

    devices.setup(args.cpu_devices)  # before JAX starts a backend

    from launch.configure import configure, flops_per_token
    from meshpar import distributed, metrics, mfu
    from meshpar.errors import TrainingStopped
    from meshpar.preemption import Stopping
    from meshpar.run import Checkpoints, Outputs, Throughput, parse_profile_steps, run

    try:
        joined = distributed.initialize(distributed.from_environment(
            coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id),
            args.coordinator_timeout, args.heartbeat_timeout)
        if joined:
            print(joined, flush=True)
        steps = [] if args.steps is None else [f"train.steps={args.steps}"]
        cfg, mesh, rules, make_model = configure(args.config, args.mesh, [*args.set, *steps], args.hardware,
                                                 args.init_from)
        init_params = None
        if args.init_from:
            from launch import weights

            init_params = weights.load(args.init_from, mesh, rules, merge_lora=cfg.train.lora is None).params
        profile = parse_profile_steps(args.profile_steps) if args.profile_steps else None
        peak, source = mfu.device_peak(2 if cfg.train.compute_dtype == "bfloat16" else 4, args.peak_tflops)
        throughput = Throughput(flops_per_token(cfg), peak) if peak else None
        if metrics.is_logger():
            print(f"MFU against {peak / 1e12:,.3g} TFLOP/s per device ({source})" if peak else f"no MFU: {source}",
                  flush=True)
        outputs = Outputs(args.metrics_file, args.report, args.tensorboard_dir, profile, args.profile_dir)
        # where the run began: a LoRA run's checkpoints hold no base, and name this instead (launch.weights)
        began = str(Path(args.init_from).absolute()) if args.init_from else None
        checkpoints = Checkpoints(args.checkpoint_dir, cfg.checkpoint, {**dataclasses.asdict(cfg), "init_from": began},
                                  args.allow_config_change)
        result = run(make_model, cfg.train, cfg.data, mesh, rules, outputs=outputs, checkpoints=checkpoints,
                     throughput=throughput, init_params=init_params, stopping=Stopping(exit_after_s=args.exit_after_s))
    except (InputError, TrainingStopped) as err:  # meshpar's own checks: say what, without a traceback
        sys.exit(f"error: {err}")
    if result.stopped:
        sys.exit(signals.EXIT_REQUEUE)


if __name__ == "__main__":
    signals.exit_before_training()  # a process of its own, so its signals are meshpar's from the first second
    sys.stdout.reconfigure(line_buffering=True)  # a log file (SLURM's) shows each line when it is said
    main()
