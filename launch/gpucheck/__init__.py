"""Measure meshpar's GPU claims on the machine at hand, in one command, within a time budget.

    PYTHONPATH=. python -m launch.gpucheck [--minutes 8] [--out runs/gpucheck] [--sections numerics,speed,...]

It installs nothing: the machine's jax with its CUDA plugin, flax, optax and orbax. Sections, cheapest first
so that a run cut off still leaves results:
  1. machine    device kind and count, memory, jax / jaxlib / CUDA plugin versions, the XLA flags in force;
  2. numerics   the dense, blockwise and cuDNN kernels' bf16 output and gradients against float32 attention
                of the same inputs, at the presets' head dims: the largest relative errors;
  3. speed      dense, blockwise and cuDNN, forward and forward + backward, T = 2k and 8k (32k: blockwise
                and cuDNN), GQA at llama_8b's heads;
  4. training   llama_1b, T = 4096, 2 sequences, bf16, 20 steps with the defaults: remat=auto's choice,
                tokens/s, MFU, measured and compiled peak memory, and beside them launch.compile's peak
                (fake CPU devices) and the planner's;
  5. ab         one change at a time from section 4's step: GPU flags off, remat none/dots/full, the
                blockwise kernel instead of cuDNN, parallel.offload=optimizer;
  6. multi      with several GPUs, the same per-GPU batch on fsdp=N and data=N, and the scaling against one.

Every measurement is a job in a process of its own (`--job`, internal): XLA reads its flags once, when JAX
starts its backend (the flags' A/B needs a process per variant), a device's peak memory counts from the
process's start, and a child can be stopped at the deadline. This process never starts JAX, so each job has
the GPUs' memory to itself. A job starts only if its estimate (a generous constant, or the measured time of
the training job it varies) fits the time left, and is stopped at the deadline; either way it is recorded
(done, skipped, failed with its error in one line, cut off) and the run goes on; a training job whose loss
is not finite is failed, and a kernel whose error against float32 is not finite leaves its numerics job
partial, their figures kept. gpucheck.json and gpucheck.md are rewritten whole after every job, each job's
output goes to logs/, and nothing in them is estimated: a figure not measured is absent (–). Without a GPU
it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from launch.gpucheck.jobs import JOBS, run_here
from launch.gpucheck.record import Check, run_in_process
from launch.gpucheck.sections import MACHINE, SECTIONS, run_sections
from meshpar import gpu_flags

REFUSAL_EXIT = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.gpucheck", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=8, help="the time budget (default 8): no job runs past it")
    p.add_argument("--out", default="runs/gpucheck", help="where gpucheck.json, gpucheck.md and logs/ go "
                                                          "(default runs/gpucheck)")
    optional = [name for name in SECTIONS if name != "machine"]
    p.add_argument("--sections", default=",".join(optional),
                   help=f"comma-separated, in this order, from: {', '.join(optional)} (the machine always runs)")
    p.add_argument("--job", choices=JOBS, help="internal: run one job in this process, printing its rows")
    p.add_argument("--job-args", default="{}", help="internal: the job's arguments, JSON")
    p.add_argument("--no-gpu-flags", action="store_true", help="internal: the job runs without meshpar's XLA flags")
    p.add_argument("--cpu-devices", type=int, help="internal: the job runs on this many fake CPU devices")
    args = p.parse_args(argv)
    args.sections = [name for name in args.sections.split(",") if name]
    if unknown := [name for name in args.sections if name not in optional]:
        p.error(f"--sections: unknown {unknown}; known: {', '.join(optional)}")
    if args.minutes <= 0:
        p.error(f"--minutes {args.minutes}: must be > 0")
    return args


def refuse(reason: str) -> None:
    print(f"gpucheck: no GPU here ({reason}); it measures meshpar on GPUs only", file=sys.stderr)
    sys.exit(REFUSAL_EXIT)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.job:
        from launch import devices

        if args.cpu_devices or not args.no_gpu_flags:
            devices.setup(args.cpu_devices)  # fake CPU devices, or the GPUs with meshpar's flags: before JAX starts
        run_here(args.job, json.loads(args.job_args))
        return
    if not gpu_flags.cuda_installed():
        refuse("jax's CUDA plugin is not installed")
    deadline = time.monotonic() + args.minutes * 60
    out = Path(args.out)
    machine_outcome = run_in_process(MACHINE, deadline - time.monotonic(), out / "logs" / "00-machine.log")
    if machine_outcome.status != "done":
        refuse(f"jax did not start: {machine_outcome.reason}")
    if (found := machine_outcome.rows[0]["platform"]) != "gpu":
        refuse(f"jax runs on {found}")
    command = "python -m launch.gpucheck " + " ".join(sys.argv[1:] if argv is None else argv)
    check = Check(out, deadline, command.strip())
    check.open_section("machine", SECTIONS["machine"][0])
    check.record(MACHINE, machine_outcome)
    check.close_section()
    run_sections(check, args.sections)
    print(f"gpucheck: {out / 'gpucheck.md'} and {out / 'gpucheck.json'} ({check.doc['elapsed_s']} s)")
