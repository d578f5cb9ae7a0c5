"""A training run: sharded init (or resume), the compiled step and its report, then the loop with its hooks.

`run` is three parts: the start (`_start`: resume from the latest checkpoint, whatever mesh wrote it, or
init, from given weights if any), compile-to-fit (`_compile_fitting`: `train.remat = auto` compiles its
platform's candidates in turn and keeps the first that fits the device), and the loop (`_Loop`), whose
hooks run at their steps: evaluation, samples, a profiler trace, checkpoints.

The loop dispatches step s before it reads the metrics of step s - 1, so the host never waits for the
device except to read numbers that are already done. A step's time is the wall time between two
consecutive finished steps (less the time hooks take in between); its tokens/s is the global batch's
tokens over that time, and `trained_tokens` the step's targets counted by their weights (`meshpar.batch`:
fewer than the batch's tokens where prompts, padding or document starts weigh 0). With a checkpoint
directory the run saves every `checkpoint.every` steps and at the last one; `train.steps` counts from the start of training. A stop request (SIGTERM, SIGINT, a time budget:
`meshpar.preemption`) ends the loop after the step in flight, on every process at the same step, with a
checkpoint of that step; the result says why it stopped.

Guards. A step whose loss or gradient norm is not finite stops the run (`train.on_nonfinite = "stop"`,
`TrainingStopped` names the step) or is skipped inside the step (`"skip"`: the state stays as it was).
A checkpoint is written only after its step's metrics are read and found finite, so no checkpoint holds
NaN and `checkpoint.keep` never deletes the last good one for a bad one.

Evaluation (`train.eval_every`): the weighted loss over `train.eval_batches` fixed batches of the held-out
split (`meshpar.data.split`), with the training step's sharding and loss, compiled once
(`train.make_eval_step`); it and its perplexity join that step's metrics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshpar import frozen, mesh as mesh_lib, metrics, pipeline, remat as remat_lib, sharding
from meshpar.checkpoint import CheckpointConfig, Checkpointer
from meshpar.compiler import compile_report
from meshpar.data import Batches, Corpus, DataConfig, load_corpus, split
from meshpar.dpo import METRICS as DPO_METRICS
from meshpar.errors import InputError, TrainingStopped
from meshpar.generate import generate
from meshpar.mfu import mfu
from meshpar.moe.routing import ROUTER_METRICS
from meshpar.preemption import StopRequests, Stopping
from meshpar.rules import Rules
from meshpar.train import (Loss, ModelFactory, Sharded, TrainConfig, init_state, make_eval_step, make_step, optimizer,
                           router_pools, schedule, sharded_abstract)

# `train.sample_every`: the first positions of the held-out tokens, continued greedily.
SAMPLE_PROMPT, SAMPLE_TOKENS = 16, 64


@dataclasses.dataclass(frozen=True)
class Outputs:
    """Where a run reports: the progress bar, one JSON line per step, the compiled step's report,
    TensorBoard, and a `jax.profiler` trace of steps `profile_steps` (first, last)."""

    metrics_file: str | None = None
    report_file: str | None = None
    tensorboard_dir: str | None = None
    profile_steps: tuple[int, int] | None = None
    profile_dir: str | None = None  # default: TENSORBOARD_DIR/profile, else runs/profile
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """Where a run saves and resumes: `directory` (none: no checkpoints), how often and how many, the run's
    `config` (a plain dict saved with each checkpoint: a resumed run must match its `model`, and its
    `train`/`data` settings unless `allow_config_change`)."""

    directory: str | None = None
    every: CheckpointConfig = CheckpointConfig()
    config: dict | None = None
    allow_config_change: bool = False


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What MFU needs: the model's FLOPs per token and one device's peak FLOP/s (`meshpar.mfu`)."""

    flops_per_token: float
    peak_flops_per_device: float


@dataclasses.dataclass
class RunResult:
    state: nnx.State  # the final state, the stacked layers in order (as checkpoints hold them)
    records: list[dict[str, Any]]
    report: dict[str, Any]
    stopped: str | None = None  # why the run stopped before train.steps (a signal, the time budget)


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
        outputs: Outputs = Outputs(), checkpoints: Checkpoints = Checkpoints(), loss: Loss | None = None,
        tx: optax.GradientTransformation | None = None, throughput: Throughput | None = None,
        init_params: nnx.State | None = None, stopping: Stopping = Stopping(),
        log: Callable[[str], None] = print) -> RunResult:
    """Train `make_model`'s model up to step `train.steps` on `mesh`; return the state and metrics.

    `data` is a source to load, or tokens already loaded (a benchmark reuses them across runs); either is
    split into training and held-out documents (`meshpar.data.split`), drawn as `data.packing` says.
    `loss(model, batch)` defaults to next-token cross-entropy and `tx` to `train.optimizer(train)` (the
    metrics show the learning rate only for that one).
    `throughput` adds MFU to the metrics. `init_params` (the model's parameters, laid out on `mesh` by
    `rules`) start a new run from given weights (a fresh optimizer state); a run that resumes from a
    checkpoint ignores them. `stopping` says when to stop early (`meshpar.preemption`).
    """
    requests = StopRequests(stopping, mesh)  # the time budget counts from here
    learning_rate = schedule(train) if tx is None else None  # the default optimizer's
    tx = tx or optimizer(train)
    sharded = sharded_abstract(make_model, tx, mesh, rules, train.seed, train.reference)
    tokens_sharding = sharding.batch_sharding(mesh, rules, (train.global_batch, train.seq_len + 1))
    source, corpus, fraction, packing = ((data.describe(), load_corpus(data), data.eval_fraction, data.packing)
                                         if isinstance(data, DataConfig) else
                                         ("tokens", Corpus.one_document(data), DataConfig.eval_fraction, "none"))
    if train.objective == "dpo" and packing != "pairs":
        raise InputError(f"train.objective = dpo trains on preference pairs: data.packing must be pairs (rows 2i and "
                         f"2i + 1 a pair's chosen and rejected response; launch.prepare writes them), not {packing}")
    train_corpus, eval_corpus = split(corpus, fraction, train.seq_len, group=2 if packing == "pairs" else 1)
    vocab = sharding.axis_size(sharded.abstract, "vocab")  # every token must index the embedding
    batches = Batches(train_corpus, global_batch=train.global_batch, seq_len=train.seq_len, seed=train.seed,
                      sharding=tokens_sharding, vocab_size=vocab, source=source, packing=packing)
    say = log if outputs.progress and metrics.is_logger() else lambda _: None
    ckpt = Checkpointer(checkpoints.directory, checkpoints.every) if checkpoints.directory else None
    state, start = _start(make_model, tx, sharded, train, batches, ckpt, checkpoints, init_params, say)

    batch = next(batches)
    if sharding.axis_size(sharded.abstract, "experts"):
        pools = router_pools(train.router_loss_scope, sharded.rules.parallel, mesh.shape["stage"])
        say(f"router losses (train.router_loss_scope={train.router_loss_scope}): pooled over "
            + ("each batch" if pools == 1 else f"each of the {pools} pipeline microbatches, averaged"))
    train, step, report = _compile_fitting(sharded, tokens_sharding, train, loss, state, batch, requests, say)
    report = {"mesh": dict(mesh.shape), "devices": mesh.size, "processes": jax.process_count(),
              "params": param_count(sharded.abstract), "remat": train.remat, **report}
    memory = report["memory_per_device"]
    host = f" (+ {memory['host_arguments_bytes']:,} in host memory)" if memory["host_arguments_bytes"] else ""
    say(f"mesh {mesh_lib.describe(dict(mesh.shape))} on {mesh.size} devices, {jax.process_count()} process(es); "
        f"{report['params']:,} parameters; {memory['arguments_bytes']:,} state bytes per device{host}; "
        f"compiled in {report['compile_s']:.1f}s")

    hooks = [hook for hook in (
        _Profile(outputs) if outputs.profile_steps else None,
        _Evaluation(sharded, tokens_sharding, train, loss, eval_corpus, vocab, source, packing)
        if train.eval_every else None,
        _Sampling(sharded, state, eval_corpus.tokens, vocab, train) if train.sample_every else None,
    ) if hook is not None]
    saving = _Saving(ckpt, batches, checkpoints.config, mesh, rules, state) if ckpt else None
    steplog = metrics.StepLog(train.steps, start, outputs.metrics_file, outputs.progress, outputs.tensorboard_dir)
    loop = _Loop(step, train, batches, steplog, hooks, saving, say, learning_rate, throughput, mesh.size, ckpt,
                 requests)
    try:
        requests.listen()
        state = loop.run(state, batch, start)
    finally:
        for hook in hooks:
            hook.close()
        steplog.close()
        if ckpt:
            ckpt.wait()
            ckpt.close()
        requests.close()
    if loop.stopped:
        number, why = loop.stopped
        kept = (f"checkpoint of step {number} saved in {checkpoints.directory}: run again to resume" if ckpt
                else "no checkpoint directory: nothing was saved")
        say(f"stopped after step {number} ({why}); {kept}")
    report.update(_summary(steplog, saving, throughput))
    if outputs.report_file and metrics.is_logger():
        Path(outputs.report_file).parent.mkdir(parents=True, exist_ok=True)
        Path(outputs.report_file).write_text(json.dumps(metrics.strict(report), indent=2, allow_nan=False) + "\n")
    return RunResult(pipeline.to_layers(state, mesh, rules.parallel.pipeline_repeats), steplog.records, report,
                     loop.stopped and loop.stopped[1])


def _start(make_model: ModelFactory, tx: optax.GradientTransformation, sharded: Sharded, train: TrainConfig,
           batches: Batches, ckpt: Checkpointer | None, checkpoints: Checkpoints, init_params: nnx.State | None,
           say: Callable[[str], None]) -> tuple[nnx.State, int]:
    """(the state, the step it is at): resumed from the latest checkpoint (and the data position with it),
    else created, from `init_params` if given."""
    repeats = sharded.rules.parallel.pipeline_repeats  # the state's stacked layers are in the pipeline's order
    try:
        latest = ckpt.latest_intact() if ckpt else None
        if latest is not None and latest >= train.steps:
            raise InputError(f"{checkpoints.directory} is at step {latest}, and train.steps = {train.steps} counts "
                             f"from the start of training: nothing to do; pass --steps > {latest} to train on")
        if latest is not None:  # a checkpoint holds no frozen weights (`_Saving`)
            saved, frozen_weights = frozen.split(sharded.abstract)
            state, meta = ckpt.restore(saved, frozen.split(sharded.shardings)[0], checkpoints.config, step=latest,
                                       allow_changes=checkpoints.allow_config_change, log=say)
            state = pipeline.to_rest(state, sharded.mesh, repeats)  # checkpoints hold the layers in order
            if jax.tree.leaves(frozen_weights):
                state = _with_frozen(state, meta, make_model, tx, sharded, train, init_params,
                                     f"{checkpoints.directory} step {latest}")
    except Exception:
        ckpt.close()  # the checkpoints on disk stay as they were
        raise
    if latest is not None:
        batches.load_state_dict(meta["data"])
        why = f" (saved {meta['saved']})" if "saved" in meta else ""
        say(f"resumed from {checkpoints.directory} at step {meta['step']}{why}")
        return state, meta["step"]
    if ckpt and ckpt.cut_off:
        say(f"{checkpoints.directory}: no finished checkpoint, only one cut off mid-save ({', '.join(ckpt.cut_off)}), "
            f"removed; training starts afresh")
    if init_params is not None:
        say("parameters from the given weights; optimizer state fresh")
    return init_state(make_model, tx, sharded, train.seed, init_params, train.reference), 0


def _with_frozen(state: nnx.State, meta: dict, make_model: ModelFactory, tx: optax.GradientTransformation,
                 sharded: Sharded, train: TrainConfig, init_params: nnx.State | None, where: str) -> nnx.State:
    """A restored state with the frozen weights it was trained over (a LoRA run's base, a DPO run's reference)
    made again as the run first made them, from `init_params` or the seed, and checked against the
    checkpoint's fingerprint of them."""
    base = frozen.split(init_state(make_model, tx, sharded, train.seed, init_params, train.reference))[1]
    frozen.check(meta.get("frozen", {}), frozen.fingerprint(base), where)
    return nnx.merge_state(state, base)


def device_memory_limit() -> int | None:
    """Bytes one device can hold (what XLA's allocator may use); None where unknown (CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def _compile_fitting(sharded: Sharded, tokens_sharding: NamedSharding, train: TrainConfig, loss: Loss | None,
                     state: nnx.State, batch: jax.Array, requests: StopRequests, say: Callable[[str], None]):
    """(train with a concrete remat policy, the compiled step, its report): `remat = auto` compiles its
    platform's candidates (`meshpar.remat.candidates`) in turn and keeps the first that fits the device.
    With several processes the step takes the stop votes of `requests` too (`meshpar.preemption`)."""
    platform = sharded.mesh.devices.flat[0].platform
    candidates = remat_lib.candidates(train.remat, platform, sharded.rules.parallel)
    limit = device_memory_limit()
    for remat in candidates:
        chosen = dataclasses.replace(train, remat=remat)
        say(f"compiling the step (remat={remat})")
        step, report = compile_report(make_step(sharded, tokens_sharding, chosen, loss, requests.sharding), state,
                                      batch, *requests.votes())
        peak = report["memory_per_device"]["peak_bytes"]
        if limit is None or peak <= limit or remat == candidates[-1]:
            break
        say(f"remat={remat} needs {peak / 1e9:.1f} GB per device, over the {limit / 1e9:.1f} GB there is; trying the next")
    if train.remat == "auto":
        say(f"remat=auto chose {remat}: the fastest that fits of {', '.join(candidates)} on {platform}")
    return chosen, step, report


class _Hook:
    """Something the loop does at some steps, with that step's state and metrics record."""

    def begin(self, number: int) -> None:
        """Before step `number` is dispatched."""

    def due(self, number: int) -> bool:
        raise NotImplementedError

    def __call__(self, number: int, state: nnx.State, entry: dict[str, Any], say: Callable[[str], None]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """When the run ends, however it ends."""


class _Profile(_Hook):
    """A `jax.profiler` trace from the first of `profile_steps` to the last."""

    def __init__(self, outputs: Outputs):
        self.first, self.last = outputs.profile_steps
        self.directory = outputs.profile_dir or str(Path(outputs.tensorboard_dir or "runs") / "profile")
        self.tracing = False

    def begin(self, number: int) -> None:
        if number == self.first:
            jax.profiler.start_trace(self.directory)
            self.tracing = True

    def due(self, number: int) -> bool:
        return self.tracing and number == self.last

    def __call__(self, number: int, state: nnx.State, entry: dict[str, Any], say: Callable[[str], None]) -> None:
        self.close()
        say(f"profile of steps {self.first}-{self.last} written to {self.directory}")

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


class _Evaluation(_Hook):
    """The loss over `train.eval_batches` fixed held-out batches (weighted over all their targets together,
as training weighs a batch), and its perplexity."""

    def __init__(self, sharded: Sharded, tokens_sharding: NamedSharding, train: TrainConfig, loss: Loss | None,
                 eval_corpus: Corpus, vocab: int | None, source: str, packing: str):
        self.step = make_eval_step(sharded, tokens_sharding, train, loss)
        self.held_out = Batches(eval_corpus, global_batch=train.global_batch, seq_len=train.seq_len,
                                seed=train.seed, sharding=tokens_sharding, vocab_size=vocab,
                                source=f"{source} (held out)", packing=packing)
        self.every, self.last, self.batches = train.eval_every, train.steps, train.eval_batches
        self.perplexity = train.objective == "lm"

    def due(self, number: int) -> bool:
        return number % self.every == 0 or number == self.last

    def __call__(self, number: int, state: nnx.State, entry: dict[str, Any], say: Callable[[str], None]) -> None:
        self.held_out.step = 0  # the same batches every time
        losses, counts = np.array([[float(x) for x in self.step(state, next(self.held_out))]
                                   for _ in range(self.batches)]).T
        if not self.perplexity:  # a DPO loss is a mean over pairs, and every batch holds as many
            counts = np.ones_like(counts)
        entry["eval_loss"] = float((losses * counts).sum() / max(counts.sum(), 1.0))
        if self.perplexity:  # of a language model's loss (a DPO loss has none)
            entry["eval_perplexity"] = math.exp(min(entry["eval_loss"], 700.0))


class _Sampling(_Hook):
    """The first held-out tokens continued greedily (`meshpar.generate`), on the run's mesh."""

    def __init__(self, sharded: Sharded, state: nnx.State, eval_tokens: np.ndarray, vocab: int | None,
                 train: TrainConfig):
        if not hasattr(nnx.merge(sharded.graphdef, state).model, "decode"):
            raise InputError("train.sample_every needs a model that generates (init_cache and decode, as "
                             "meshpar's transformer has)")
        self.sharded, self.every, self.last, self.vocab = sharded, train.sample_every, train.steps, vocab
        self.prompt_1T = eval_tokens[None, :SAMPLE_PROMPT]  # the same held-out prompt every time

    def due(self, number: int) -> bool:
        return number % self.every == 0 or number == self.last

    def __call__(self, number: int, state: nnx.State, entry: dict[str, Any], say: Callable[[str], None]) -> None:
        model = nnx.merge(self.sharded.graphdef, state).model
        ids = generate(model, self.prompt_1T, SAMPLE_TOKENS, self.sharded.mesh, self.sharded.rules)[0].tolist()
        # The built-in corpus's tokens are bytes; other vocabularies are shown as ids.
        entry["sample"] = bytes(ids).decode("utf-8", errors="replace") if self.vocab <= 256 else str(ids)
        say(f"step {number} sample: {entry['sample']!r}")


class _Saving:
    """A checkpoint every `checkpoint.every` steps and at the last, the layers in order (`pipeline.to_layers`),
    with the data position and the run's config. Frozen weights (a LoRA run's base, a DPO run's reference) do
    not change: the checkpoint leaves them out and keeps their fingerprint (`meshpar.frozen`), which a
    resumed run checks against the ones it is given."""

    def __init__(self, ckpt: Checkpointer, batches: Batches, config: dict | None, mesh: Mesh, rules: Rules,
                 state: nnx.State):
        self.ckpt, self.batches, self.config, self.mesh = ckpt, batches, config or {}, mesh
        self.repeats = rules.parallel.pipeline_repeats
        self.frozen = frozen.fingerprint(frozen.split(state)[1])
        self.blocked: list[float] = []  # how long each save held up the loop

    def __call__(self, number: int, state: nnx.State, why: str) -> None:
        """Save step `number`; `why` (for the stop, the last step, or every N steps) goes into its metadata."""
        began = time.perf_counter()
        saved = frozen.split(pipeline.to_layers(state, self.mesh, self.repeats))[0]
        self.ckpt.save(number, saved, {"data": self.batches.state_dict(), "config": self.config, "saved": why,
                                       **({"frozen": self.frozen} if self.frozen else {})})
        self.blocked.append(time.perf_counter() - began)


class _Loop:
    """The steps, each dispatched before the previous one's metrics are read; at the steps where hooks are
    due, the step's metrics are read at once, the hooks add theirs (their time is not the next step's),
    the record is published (a non-finite one stops the run here), and then a checkpoint is saved. A stop
    request agreed after a step makes it one where a checkpoint is due, and the last."""

    def __init__(self, step, train: TrainConfig, batches: Batches, steplog: metrics.StepLog, hooks: list[_Hook],
                 saving: _Saving | None, say: Callable[[str], None], learning_rate: optax.Schedule | None,
                 throughput: Throughput | None, devices: int, ckpt: Checkpointer | None, requests: StopRequests):
        self.step, self.train, self.batches, self.steplog, self.hooks = step, train, batches, steplog, hooks
        self.saving, self.say, self.learning_rate, self.throughput = saving, say, learning_rate, throughput
        self.devices, self.ckpt, self.requests = devices, ckpt, requests
        self.stopped: tuple[int, str] | None = None  # (the last step, why) when a stop request ended the loop
        self.last_done = time.perf_counter()

    def run(self, state: nnx.State, batch: jax.Array, start: int) -> nnx.State:
        last, pending = self.train.steps, None
        for number in range(start + 1, last + 1):
            for hook in self.hooks:
                hook.begin(number)
            state, out = self.step(state, batch, *self.requests.votes())
            stop = self.requests.after(out)
            if pending is not None:
                self._publish(self._record(*pending))
                pending = None
            due = [hook for hook in self.hooks if hook.due(number)]
            saving = self.saving is not None and (self.ckpt.due(number, last) or stop is not None)
            if due or saving:
                entry = self._record(number, out)
                for hook in due:
                    began = time.perf_counter()
                    hook(number, state, entry, self.say)
                    self.last_done += time.perf_counter() - began  # not part of the next step's time
                self._publish(entry)  # stops the run before a non-finite state is saved
                if saving:
                    self.saving(number, state, f"for the stop: {stop}" if stop else
                                "for the last step" if number == last else f"every {self.ckpt.config.every} steps")
            else:
                pending = (number, out)
            if stop is not None and number < last:
                self.stopped = number, stop
                break
            if number < last:
                batch = next(self.batches)
        if pending is not None:
            self._publish(self._record(*pending))
        return state

    def _record(self, number: int, out: dict[str, jax.Array]) -> dict[str, Any]:
        """Wait for step `number` (only) and turn its outputs into its metrics record."""
        values = {k: float(v) for k, v in out.items()}
        now = time.perf_counter()
        step_time, self.last_done = now - self.last_done, now
        tokens_per_s = self.train.global_batch * self.train.seq_len / step_time
        entry = {"step": number, "loss": values["loss"], "grad_norm": values["grad_norm"], "step_time_s": step_time,
                 "tokens_per_s": tokens_per_s, "trained_tokens": int(values["tokens"])}
        if self.learning_rate is not None:
            entry["lr"] = float(self.learning_rate(number - 1))
        if self.throughput:
            entry["mfu"] = mfu(self.throughput.flops_per_token, tokens_per_s, self.devices,
                               self.throughput.peak_flops_per_device)
        if "skipped" in values:
            entry["skipped"] = int(values["skipped"])
        entry |= {key: values[key] for key in (*ROUTER_METRICS, *DPO_METRICS, "mtp_loss") if key in values}
        return entry

    def _publish(self, entry: dict[str, Any]) -> None:
        self.steplog.write(entry)
        stop_if_not_finite(entry, self.train, self.ckpt)


def _summary(steplog: metrics.StepLog, saving: _Saving | None, throughput: Throughput | None) -> dict[str, Any]:
    """The run's medians, the last evaluation, and how long saves held up the loop, for the report."""
    out = {"step_time_s_median": steplog.median("step_time_s"), "tokens_per_s_median": steplog.median("tokens_per_s")}
    if throughput:
        out["mfu_median"] = steplog.median("mfu")
    if evals := [r["eval_loss"] for r in steplog.records if "eval_loss" in r]:
        out["eval_loss_last"] = evals[-1]
    if saving is not None and saving.blocked:
        out["checkpoint_blocked_s_median"] = float(np.median(saving.blocked))
    return out


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
