"""A training run: sharded init (or resume), the compiled step and its report, then the loop.

The loop dispatches step s before it reads the metrics of step s - 1, so the host never waits for the
device except to read numbers that are already done. A step's time is the wall time between two
consecutive finished steps (less any evaluation in between); its tokens/s is the global batch's tokens
over that time. With a checkpoint directory the run resumes from its latest checkpoint, whatever mesh
wrote it, and saves every `checkpoint.every` steps and at the last one; `train.steps` counts from the
start of training.

Guards. A step whose loss or gradient norm is not finite stops the run (`train.on_nonfinite = "stop"`,
`TrainingStopped` names the step) or is skipped inside the step (`"skip"`: the state stays as it was).
A checkpoint is written only after its step's metrics are read and found finite, so no checkpoint holds
NaN and `checkpoint.keep` never deletes the last good one for a bad one.

Evaluation (`train.eval_every`): the mean loss over `train.eval_batches` fixed batches of the held-out
split (`meshpar.data.split`), with the training step's sharding and loss, compiled once
(`train.make_eval_step`); it and its perplexity join that step's metrics.
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
import optax
from flax import nnx
from jax.sharding import Mesh

from meshpar import analysis, mesh as mesh_lib, metrics, pipeline, sharding
from meshpar.checkpoint import CheckpointConfig, Checkpointer
from meshpar.data import Batches, DataConfig, load_tokens, split
from meshpar.errors import InputError, TrainingStopped
from meshpar.generate import generate
from meshpar.plan_cost import mfu
from meshpar.rules import Rules
from meshpar.train import (Loss, ModelFactory, TrainConfig, init_state, make_eval_step, make_step, optimizer,
                           plan_state, remat_candidates, schedule)

# `train.sample_every`: the first positions of the held-out tokens, continued greedily.
SAMPLE_PROMPT, SAMPLE_TOKENS = 16, 64


@dataclasses.dataclass
class RunResult:
    state: nnx.State  # the final state, the stacked layers in order (as checkpoints hold them)
    records: list[dict[str, Any]]
    report: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What MFU needs: the model's FLOPs per token and one device's peak FLOP/s (`meshpar.mfu`)."""

    flops_per_token: float
    peak_flops_per_device: float


def param_count(abstract_state: nnx.State) -> int:
    return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(abstract_state, nnx.Param)))


def parse_profile_steps(text: str) -> tuple[int, int]:
    """`A:B` (or `A`): the first and last step to trace."""
    first, _, last = text.partition(":")
    try:
        steps = int(first), int(last or first)
    except ValueError:
        raise InputError(f"--profile-steps '{text}': expected FIRST:LAST step numbers, e.g. 5:7") from None
    if not 1 <= steps[0] <= steps[1]:
        raise InputError(f"--profile-steps '{text}': need 1 <= FIRST <= LAST")
    return steps


def run(make_model: ModelFactory, train: TrainConfig, data: DataConfig | np.ndarray, mesh: Mesh, rules: Rules, *,
        metrics_file: str | None = None, report_file: str | None = None, checkpoint_dir: str | None = None,
        checkpoint: CheckpointConfig = CheckpointConfig(), config: dict | None = None, progress: bool = True,
        log=print, tensorboard_dir: str | None = None, profile_steps: tuple[int, int] | None = None,
        profile_dir: str | None = None, loss: Loss | None = None, tx: optax.GradientTransformation | None = None,
        throughput: Throughput | None = None, allow_config_change: bool = False,
        init_params: nnx.State | None = None) -> RunResult:
    """Train `make_model`'s model up to step `train.steps` on `mesh`; return the state and metrics.

    `data` is a source to load, or tokens already loaded (a benchmark reuses them across runs); either is
    split into training and held-out tokens. `config` (a plain dict) is saved with each checkpoint; a
    resumed run must match its `model`, and its `train`/`data` settings unless `allow_config_change`.
    `loss(model, tokens)` defaults to next-token cross-entropy and `tx` to `train.optimizer(train)` (the
    metrics show the learning rate only for that one). `throughput` adds MFU to the metrics.
    `profile_steps` (first, last) writes a `jax.profiler` trace of those steps to `profile_dir`.
    `init_params` (the model's parameters, laid out on `mesh` by `rules`) start a new run from given weights
    (a fresh optimizer state); a run that resumes from a checkpoint ignores them.
    """
    learning_rate = schedule(train) if tx is None else None  # the default optimizer's
    tx = tx or optimizer(train)
    plan = plan_state(make_model, tx, mesh, rules, train.seed)
    repeats = rules.parallel.pipeline_repeats  # the state's stacked layers are in the pipeline's order at rest
    tokens_sharding = sharding.batch_sharding(mesh, rules, (train.global_batch, train.seq_len + 1))
    if isinstance(data, DataConfig):
        source, tokens, fraction = data.describe(), load_tokens(data), data.eval_fraction
    else:
        source, tokens, fraction = "tokens", data, DataConfig.eval_fraction
    train_tokens, eval_tokens = split(tokens, fraction, train.seq_len)
    vocab = sharding.axis_size(plan.abstract, "vocab")  # every token must index the embedding
    batches = Batches(train_tokens, global_batch=train.global_batch, seq_len=train.seq_len, seed=train.seed,
                      sharding=tokens_sharding, vocab_size=vocab, source=source)
    say = log if progress and metrics.is_logger() else lambda _: None

    ckpt = Checkpointer(checkpoint_dir, checkpoint) if checkpoint_dir else None
    start = 0
    if ckpt and ckpt.latest_step() is not None:
        try:
            if ckpt.latest_step() >= train.steps:
                raise InputError(f"{checkpoint_dir} is at step {ckpt.latest_step()}, and train.steps = {train.steps} "
                                 f"counts from the start of training: nothing to do; pass --steps > "
                                 f"{ckpt.latest_step()} to train on")
            state, meta = ckpt.restore(plan.abstract, plan.shardings, config, allow_changes=allow_config_change,
                                       log=say)
        except Exception:
            ckpt.close()  # the checkpoints on disk stay as they were
            raise
        state = pipeline.to_rest(state, mesh, repeats)  # checkpoints hold the layers in order
        start = meta["step"]
        batches.load_state_dict(meta["data"])
        say(f"resumed from {checkpoint_dir} at step {start}")
    else:
        state = init_state(make_model, tx, plan, train.seed)
        if init_params is not None:
            nnx.replace_by_pure_dict(state["model"], nnx.to_pure_dict(pipeline.to_rest(init_params, mesh, repeats)))
            say("parameters from the given weights; optimizer state fresh")

    batch = next(batches)
    train, step, report = _compile_fitting(plan, tokens_sharding, train, loss, state, batch, say)
    report = {"mesh": dict(mesh.shape), "devices": mesh.size, "processes": jax.process_count(),
              "params": param_count(plan.abstract), "remat": train.remat, **report}
    memory = report["memory_per_device"]
    host = f" (+ {memory['host_arguments_bytes']:,} in host memory)" if memory["host_arguments_bytes"] else ""
    say(f"mesh {mesh_lib.describe(dict(mesh.shape))} on {mesh.size} devices, {jax.process_count()} process(es); "
        f"{report['params']:,} parameters; {memory['arguments_bytes']:,} state bytes per device{host}; "
        f"compiled in {report['compile_s']:.1f}s")

    evaluate = None
    if train.eval_every:
        eval_step = make_eval_step(plan, tokens_sharding, train, loss)
        held_out = Batches(eval_tokens, global_batch=train.global_batch, seq_len=train.seq_len, seed=train.seed,
                           sharding=tokens_sharding, vocab_size=vocab, source=f"{source} (held out)")

        def evaluate(current: nnx.State) -> float:
            held_out.step = 0  # the same batches every time
            return float(np.mean([float(eval_step(current, next(held_out))) for _ in range(train.eval_batches)]))

    sample = None
    if train.sample_every:
        if not hasattr(nnx.merge(plan.graphdef, state).model, "decode"):
            raise InputError("train.sample_every needs a model that generates (init_cache and decode, as "
                             "meshpar's transformer has)")
        prompt_1P = eval_tokens[None, :SAMPLE_PROMPT]  # the same held-out prompt every time

        def sample(current: nnx.State) -> str:
            ids = generate(nnx.merge(plan.graphdef, current).model, prompt_1P, SAMPLE_TOKENS, mesh, rules)[0].tolist()
            # The built-in corpus's tokens are bytes; other vocabularies are shown as ids.
            return bytes(ids).decode("utf-8", errors="replace") if vocab <= 256 else str(ids)

    tokens_per_step = train.global_batch * train.seq_len
    steplog = metrics.StepLog(train.steps, start, metrics_file, progress, tensorboard_dir)
    blocked: list[float] = []  # how long each checkpoint save held up the loop
    pending: tuple[int, dict] | None = None
    last_done = time.perf_counter()
    profiling = False
    profile_dir = profile_dir or str(Path(tensorboard_dir or "runs") / "profile")

    def finish(number: int, out: dict[str, jax.Array]) -> dict[str, Any]:
        """Wait for step `number` (only) and turn its outputs into its metrics record."""
        nonlocal last_done
        values = {k: float(v) for k, v in out.items()}
        now = time.perf_counter()
        step_time, last_done = now - last_done, now
        entry = {"step": number, "loss": values["loss"], "grad_norm": values["grad_norm"], "step_time_s": step_time,
                 "tokens_per_s": tokens_per_step / step_time}
        if learning_rate is not None:
            entry["lr"] = float(learning_rate(number - 1))
        if throughput:
            entry["mfu"] = mfu(throughput.flops_per_token, entry["tokens_per_s"], mesh.size,
                               throughput.peak_flops_per_device)
        if "skipped" in values:
            entry["skipped"] = int(values["skipped"])
        return entry

    def publish(entry: dict[str, Any]) -> None:
        steplog.write(entry)
        stop_if_not_finite(entry, train, ckpt)

    try:
        for number in range(start + 1, train.steps + 1):
            if profile_steps and number == profile_steps[0]:
                jax.profiler.start_trace(profile_dir)
                profiling = True
            state, out = step(state, batch)
            if pending is not None:
                publish(finish(*pending))
                pending = None
            tracing_ends = profiling and number == profile_steps[1]
            evaluating = evaluate is not None and (number % train.eval_every == 0 or number == train.steps)
            sampling = sample is not None and (number % train.sample_every == 0 or number == train.steps)
            saving = ckpt is not None and ckpt.due(number, train.steps)
            if tracing_ends or evaluating or sampling or saving:
                entry = finish(number, out)
                if tracing_ends:
                    began = time.perf_counter()
                    jax.profiler.stop_trace()
                    profiling = False
                    last_done += time.perf_counter() - began
                    say(f"profile of steps {profile_steps[0]}-{profile_steps[1]} written to {profile_dir}")
                if evaluating:
                    began = time.perf_counter()
                    entry["eval_loss"] = evaluate(state)
                    entry["eval_perplexity"] = math.exp(min(entry["eval_loss"], 700.0))
                    last_done += time.perf_counter() - began  # not part of the next step's time
                if sampling:
                    began = time.perf_counter()
                    entry["sample"] = sample(state)
                    say(f"step {number} sample: {entry['sample']!r}")
                    last_done += time.perf_counter() - began
                publish(entry)  # stops the run before a non-finite state is saved
                if saving:
                    began = time.perf_counter()
                    ckpt.save(number, pipeline.to_layers(state, mesh, repeats),
                              {"data": batches.state_dict(), "config": config or {}})
                    blocked.append(time.perf_counter() - began)
            else:
                pending = (number, out)
            if number < train.steps:
                batch = next(batches)
        if pending is not None:
            publish(finish(*pending))
    finally:
        if profiling:
            jax.profiler.stop_trace()
        steplog.close()
        if ckpt:
            ckpt.wait()
            ckpt.close()
    report["step_time_s_median"] = steplog.median("step_time_s")
    report["tokens_per_s_median"] = steplog.median("tokens_per_s")
    if throughput:
        report["mfu_median"] = steplog.median("mfu")
    if evals := [r["eval_loss"] for r in steplog.records if "eval_loss" in r]:
        report["eval_loss_last"] = evals[-1]
    if blocked:
        report["checkpoint_blocked_s_median"] = float(np.median(blocked))
    if report_file and metrics.is_logger():
        Path(report_file).parent.mkdir(parents=True, exist_ok=True)
        Path(report_file).write_text(json.dumps(metrics.strict(report), indent=2, allow_nan=False) + "\n")
    return RunResult(pipeline.to_layers(state, mesh, repeats), steplog.records, report)


def device_memory_limit() -> int | None:
    """Bytes one device can hold (what XLA's allocator may use); None where unknown (CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def _compile_fitting(plan, tokens_sharding, train: TrainConfig, loss, state, batch, say):
    """(train with a concrete remat policy, the compiled step, its report): `remat = auto` compiles its
    platform's candidates (`train.remat_candidates`) in turn and keeps the first that fits the device."""
    candidates = remat_candidates(train, plan.mesh.devices.flat[0].platform, plan.rules.parallel)
    limit = device_memory_limit()
    for remat in candidates:
        chosen = dataclasses.replace(train, remat=remat)
        step, report = analysis.compile_report(make_step(plan, tokens_sharding, chosen, loss), state, batch)
        peak = report["memory_per_device"]["peak_bytes"]
        if limit is None or peak <= limit or remat == candidates[-1]:
            break
        say(f"remat={remat} needs {peak / 1e9:.1f} GB per device, over the {limit / 1e9:.1f} GB there is; trying the next")
    if train.remat == "auto":
        say(f"remat=auto chose {remat}: the fastest that fits of {', '.join(candidates)} on "
            f"{plan.mesh.devices.flat[0].platform}")
    return chosen, step, report


def stop_if_not_finite(entry: dict[str, Any], train: TrainConfig, ckpt: Checkpointer | None) -> None:
    """Under `on_nonfinite = "stop"`, raise `TrainingStopped` for a non-finite loss or gradient norm."""
    loss, norm = entry["loss"], entry["grad_norm"]
    if train.on_nonfinite != "stop" or (math.isfinite(loss) and math.isfinite(norm)):
        return
    latest = ckpt.latest_step() if ckpt else None
    kept = "no checkpoint was written" if latest is None else f"the last checkpoint (step {latest}) is kept"
    raise TrainingStopped(f"step {entry['step']}: loss {loss}, gradient norm {norm}: not finite. The run stopped "
                          f"and {kept}; lower train.lr or train.clip_norm, or set train.on_nonfinite=skip to skip "
                          f"such steps")
