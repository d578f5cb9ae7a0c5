"""A training run: sharded init (or resume), the compiled step and its report, then the loop.

The loop dispatches step s before it reads the metrics of step s - 1, so the host never waits for the
device except to read numbers that are already done. A step's time is the wall time between two
consecutive finished steps; its tokens/s is the global batch's tokens over that time. With a checkpoint
directory the run resumes from its latest checkpoint, whatever mesh wrote it, and saves every
`checkpoint.every` steps and at the last one; `train.steps` counts from the start of training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshpar import analysis, mesh as mesh_lib, metrics, sharding
from meshpar.checkpoint import CheckpointConfig, Checkpointer
from meshpar.data import Batches, DataConfig, load_tokens
from meshpar.rules import Rules
from meshpar.train import ModelFactory, TrainConfig, init_state, make_step, optimizer, plan_state


@dataclasses.dataclass
class RunResult:
    state: nnx.State
    records: list[dict[str, Any]]
    report: dict[str, Any]


def param_count(abstract_state: nnx.State) -> int:
    return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(abstract_state, nnx.Param)))


def run(make_model: ModelFactory, train: TrainConfig, data: DataConfig | np.ndarray, mesh: Mesh, rules: Rules, *,
        metrics_file: str | None = None, report_file: str | None = None, checkpoint_dir: str | None = None,
        checkpoint: CheckpointConfig = CheckpointConfig(), config: dict | None = None, progress: bool = True,
        log=print) -> RunResult:
    """Train `make_model`'s model up to step `train.steps` on `mesh`; return the state and metrics.

    `data` is a source to load, or tokens already loaded (a benchmark reuses them across runs).
    `config` (a plain dict) is saved with each checkpoint, and a resumed run must match its `model`.
    """
    tx = optimizer(train)
    plan = plan_state(make_model, tx, mesh, rules, train.seed)
    tokens_sharding = sharding.batch_sharding(mesh, rules, (train.global_batch, train.seq_len + 1))
    tokens = load_tokens(data) if isinstance(data, DataConfig) else data
    batches = Batches(tokens, global_batch=train.global_batch, seq_len=train.seq_len, seed=train.seed,
                      sharding=tokens_sharding)
    say = log if progress and metrics.is_logger() else lambda _: None

    ckpt = Checkpointer(checkpoint_dir, checkpoint) if checkpoint_dir else None
    start = 0
    if ckpt and ckpt.latest_step() is not None:
        state, meta = ckpt.restore(plan.abstract, plan.shardings, config)
        start = meta["step"]
        batches.load_state_dict(meta["data"])
        say(f"resumed from {checkpoint_dir} at step {start}")
    else:
        state = init_state(make_model, tx, plan, train.seed)

    batch = next(batches)
    step, report = analysis.compile_report(make_step(plan, tokens_sharding, train), state, batch)
    report = {"mesh": dict(mesh.shape), "devices": mesh.size, "processes": jax.process_count(),
              "params": param_count(plan.abstract), **report}
    say(f"mesh {mesh_lib.describe(dict(mesh.shape))} on {mesh.size} devices, {jax.process_count()} process(es); "
        f"{report['params']:,} parameters; {report['memory_per_device']['arguments_bytes']:,} state bytes "
        f"per device; compiled in {report['compile_s']:.1f}s")

    tokens_per_step = train.global_batch * train.seq_len
    steplog = metrics.StepLog(train.steps, start, metrics_file, progress)
    blocked: list[float] = []  # how long each checkpoint save held up the loop
    pending, last_done = None, time.perf_counter()

    def record(number: int, out: dict[str, jax.Array]) -> None:
        nonlocal last_done
        loss, grad_norm = float(out["loss"]), float(out["grad_norm"])  # waits for that step only
        now = time.perf_counter()
        step_time, last_done = now - last_done, now
        steplog.write({"step": number, "loss": loss, "grad_norm": grad_norm, "step_time_s": step_time,
                       "tokens_per_s": tokens_per_step / step_time})

    try:
        for number in range(start + 1, train.steps + 1):
            state, out = step(state, batch)
            if ckpt and ckpt.due(number, train.steps):
                began = time.perf_counter()
                ckpt.save(number, state, {"data": batches.state_dict(), "config": config or {}})
                blocked.append(time.perf_counter() - began)
            if number < train.steps:
                batch = next(batches)
            if pending is not None:
                record(number - 1, pending)
            pending = out
        if pending is not None:
            record(train.steps, pending)
    finally:
        steplog.close()
        if ckpt:
            ckpt.wait()
            ckpt.close()
    report["step_time_s_median"] = steplog.median("step_time_s")
    report["tokens_per_s_median"] = steplog.median("tokens_per_s")
    if blocked:
        report["checkpoint_blocked_s_median"] = float(np.median(blocked))
    if report_file and metrics.is_logger():
        Path(report_file).parent.mkdir(parents=True, exist_ok=True)
        Path(report_file).write_text(json.dumps(report, indent=2) + "\n")
    return RunResult(state, steplog.records, report)
