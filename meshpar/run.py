"""A training run: sharded init, the compiled step and its report, then the loop.

The loop dispatches step s before it reads the metrics of step s - 1, so the host never waits for the
device except to read numbers that are already done. A step's time is the wall time between two
consecutive finished steps; its tokens/s is the global batch's tokens over that time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from meshpar import analysis, mesh as mesh_lib, metrics, sharding
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


def run(make_model: ModelFactory, train: TrainConfig, data: DataConfig, mesh: Mesh, rules: Rules, *,
        metrics_file: str | None = None, report_file: str | None = None, log=print) -> RunResult:
    """Train `make_model`'s model for `train.steps` steps on `mesh`; return the state and metrics."""
    tx = optimizer(train)
    plan = plan_state(make_model, tx, mesh, rules, train.seed)
    tokens_sharding = sharding.batch_sharding(mesh, rules, (train.global_batch, train.seq_len + 1))
    batches = Batches(load_tokens(data), global_batch=train.global_batch, seq_len=train.seq_len,
                      seed=train.seed, sharding=tokens_sharding)
    state = init_state(make_model, tx, plan, train.seed)
    first = next(batches)
    step, report = analysis.compile_report(make_step(plan, tokens_sharding, train), state, first)
    report = {"mesh": dict(mesh.shape), "devices": mesh.size, "processes": jax.process_count(),
              "params": param_count(plan.abstract), **report}
    if metrics.is_logger():
        log(f"mesh {mesh_lib.describe(dict(mesh.shape))} on {mesh.size} devices, {jax.process_count()} process(es); "
            f"{report['params']:,} parameters; {report['memory_per_device']['arguments_bytes']:,} state bytes "
            f"per device; compiled in {report['compile_s']:.1f}s")

    tokens_per_step = train.global_batch * train.seq_len
    steplog = metrics.StepLog(train.steps, 0, metrics_file)
    pending, batch, last_done = None, first, time.perf_counter()
    try:
        for index in range(train.steps + 1):
            if index < train.steps:
                state, out = step(state, batch)
                batch = next(batches) if index + 1 < train.steps else None
            if pending is not None:  # read step index - 1 while step index runs
                loss, grad_norm = float(pending["loss"]), float(pending["grad_norm"])
                now = time.perf_counter()
                step_time, last_done = now - last_done, now
                steplog.write({"step": index, "loss": loss, "grad_norm": grad_norm, "step_time_s": step_time,
                               "tokens_per_s": tokens_per_step / step_time})
            pending = out
    finally:
        steplog.close()
    report["step_time_s_median"] = steplog.median("step_time_s")
    report["tokens_per_s_median"] = steplog.median("tokens_per_s")
    if report_file and metrics.is_logger():
        Path(report_file).parent.mkdir(parents=True, exist_ok=True)
        Path(report_file).write_text(json.dumps(report, indent=2) + "\n")
    return RunResult(state, steplog.records, report)
