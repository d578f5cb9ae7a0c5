"""Checkpoints with orbax: save asynchronously, resume onto any mesh, export parameters.

A checkpoint holds the whole training state (parameters, AdamW moments and counts, the step) as global
arrays, plus JSON metadata: the step, the data position, and the config the run was saved with. The
arrays are stored by their global shapes (layers stacked `[L, ...]` in layer order whatever the pipeline
does: `run` hands a training state over through `pipeline.to_layers`, and puts what it restores back
through `pipeline.to_rest`), so the layout on disk does not depend on the mesh: restoring reads each
array straight into the shardings of the mesh at hand, whether it has other axes, another device count
or another process count.

Saving is asynchronous: `save` waits only for the device-to-host copy, and the files are written in the
background while training goes on. orbax writes each step into a temporary directory and renames it
when complete, so a process killed mid-save leaves the previous checkpoints intact; the unfinished one
is removed the next time the directory is opened (where it was the first save, the run starts afresh:
`Checkpointer.cut_off` names what was removed). A save that fails (a full disk) stops the run with
`TrainingStopped`, naming the step that stays intact: orbax removes older steps only after a save commits.

Integrity: orbax keeps no checksums of the array files, and a damaged one fails deep inside tensorstore
with an error that names neither the file nor the step. So each step carries its own checksums: once
every process has written its files and before the step gets its final name, the primary process writes
`checksums.sha256` (the SHA-256 of every file of the step's items, in `sha256sum` format: `sha256sum -c
checksums.sha256` in the step's directory checks it by hand). A step is verified before it is read, by
every process; resuming falls back from a damaged step (a file missing, truncated or altered, or no
checksums) to the newest intact one with a warning, and moves the damaged one aside as `<step>.damaged`:
no checkpoint is ever deleted for being damaged, and one that is intact is never touched.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from meshpar.errors import InputError, TrainingStopped
from meshpar.sharding import placed_shapes

# orbax's name for a step still being written: `<step>.orbax-checkpoint-tmp-<timestamp>`.
_UNFINISHED = re.compile(r"^\d+\.orbax-checkpoint-tmp")
_DAMAGED = re.compile(r"^\d+\.damaged")  # a step moved aside by `Checkpointer.latest_intact`
CHECKSUMS = "checksums.sha256"
# Settings a resumed run may change freely: how the same training is laid out, run and logged. Any other
# change of `train` or `data` (batch, sequence, schedule, seed, data) makes a different training run,
# refused unless allowed; `model` must always match.
RESUMABLE_CHANGES = ("mesh.", "parallel.", "checkpoint.", "name", "train.steps", "train.remat",
                     "train.grad_accum", "train.attention_kernel", "train.loss_chunk", "train.eval_every",
                     "train.eval_batches", "train.on_nonfinite", "train.sample_every",
                     "train.fp8")  # FP8's scales are computed each step: no state to disagree with


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # save every this many steps, and at the last step
    keep: int = 3  # how many of the latest checkpoints to keep

    def __post_init__(self):
        for name in ("every", "keep"):
            if getattr(self, name) < 1:
                raise InputError(f"checkpoint.{name} = {getattr(self, name)} must be >= 1")


def _steps_on_disk(directory: Path) -> tuple[list[str], list[str], list[str]]:
    """(finished step dirs, unfinished step dirs, anything else but damaged steps) in `directory`."""
    finished, unfinished, other = [], [], []
    for entry in sorted(directory.iterdir()):
        if entry.is_dir() and entry.name.isdigit():
            finished.append(entry.name)
        elif _UNFINISHED.match(entry.name):
            unfinished.append(entry.name)
        elif not _DAMAGED.match(entry.name):
            other.append(entry.name)
    return finished, unfinished, other


def _item_files(step_dir: Path) -> list[str]:
    """The files of a step's items (its subdirectories), relative to it; orbax's step metadata at the top
    level is left out, as orbax rewrites it when the step commits."""
    return sorted(str(path.relative_to(step_dir)) for item in step_dir.iterdir() if item.is_dir()
                  for path in item.rglob("*") if path.is_file())


def _sha256(step_dir: Path, names: list[str]) -> list[str]:
    """The SHA-256 of each file, hashed in threads (hashlib lets go of the GIL)."""
    def one(name: str) -> str:
        with open(step_dir / name, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(one, names))


def seal(step_dir: Path) -> None:
    """Write `step_dir`'s checksums."""
    files = _item_files(step_dir)
    digests = _sha256(step_dir, files)
    (step_dir / CHECKSUMS).write_text("".join(f"{digest}  {name}\n" for digest, name in zip(digests, files)))


def _seal_unfinished(directory: Path, step: int) -> None:
    """orbax calls this (`post_finalization_callback`) on the primary process once every process has written
    `step`, before the step's directory gets its final name: the checksums commit with the step."""
    (unfinished,) = directory.glob(f"{step}.orbax-checkpoint-tmp*")
    seal(unfinished)


def damage(step_dir: Path) -> list[str]:
    """What is wrong with `step_dir`'s files against its checksums ([] when intact)."""
    if not (step_dir / CHECKSUMS).is_file():
        return [f"{CHECKSUMS} is missing"]
    expected = dict(reversed(line.split("  ", 1)) for line in (step_dir / CHECKSUMS).read_text().splitlines())
    problems = [f"{name} is missing" for name in expected if not (step_dir / name).is_file()]
    present = [name for name in sorted(expected) if (step_dir / name).is_file()]
    for name, digest in zip(present, _sha256(step_dir, present)):
        if digest != expected[name]:
            problems.append(f"{name} ({(step_dir / name).stat().st_size:,} bytes) is altered or truncated: "
                            f"its SHA-256 differs from the one written at save")
    return problems


def _barrier(name: str) -> None:
    """Wait until every process is here (the checkpoint directory is shared, and one process changes it)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _why(err: Exception) -> str:
    """The reason in an orbax/tensorstore error: the OS error where it names one, else its first line."""
    code = re.search(r"os_error_code='(\d+)'", str(err))
    return os.strerror(int(code.group(1))) if code else str(err).strip().splitlines()[0][:300]


def _differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(now), key=str):
        path = f"{prefix}{key}"
        if key not in saved or key not in now:
            out.append(f"{path}: {'missing in the checkpoint' if key not in saved else 'not in this run'}")
        elif isinstance(saved[key], dict) and isinstance(now[key], dict):
            out += _differences(saved[key], now[key], f"{path}.")
        elif saved[key] != now[key]:
            out.append(f"{path}: {saved[key]!r} in the checkpoint, {now[key]!r} now")
    return out


class Checkpointer:
    """Saves and restores one run's checkpoints in `directory`."""

    def __init__(self, directory: str | Path, config: CheckpointConfig = CheckpointConfig()):
        self.directory, self.config = Path(directory).absolute(), config
        if self.directory.exists() and not self.directory.is_dir():
            raise InputError(f"checkpoint directory {self.directory} is a file")
        try:  # fail now, not at the first save
            self.directory.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=self.directory).close()
        except OSError as err:
            raise InputError(f"checkpoint directory {self.directory} is not writable: {err.strerror}") from None
        finished, unfinished, other = _steps_on_disk(self.directory)
        self.cut_off = unfinished  # saves a killed process left unfinished; orbax removes them below
        if not finished and other:
            raise InputError(f"{self.directory} is not a checkpoint directory (it holds "
                             f"{', '.join(other[:5])}{' …' if len(other) > 5 else ''}) ")
        self._saving: int | None = None  # the step of the save in flight
        self._failed = False
        self._intact: set[int] = set()  # steps verified against their checksums
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.keep, create=True, cleanup_tmp_directories=True,
                async_options=ocp.AsyncOptions(post_finalization_callback=self._seal)),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

    def _seal(self) -> None:
        _seal_unfinished(self.directory, self._saving)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def latest_intact(self) -> int | None:
        """The newest step that matches its checksums, or None where there is no step. Each newer damaged
        step is moved aside as `<step>.damaged`, with a warning naming what is wrong; where every step is
        damaged, an error names them all (they stay on disk)."""
        damaged = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            problems = self._verify(step)
            if not problems:
                if damaged:
                    self._manager.reload()
                return step
            aside = self.directory / f"{step}.damaged"
            _barrier(f"meshpar: every process has verified step {step}")  # none reads it while it moves
            if jax.process_index() == 0:
                while aside.exists():
                    aside = aside.with_name(aside.name + "+")
                (self.directory / str(step)).rename(aside)
                _warn(f"{self.directory}: step {step} is damaged: {'; '.join(problems[:3])}"
                      f"{' …' if len(problems) > 3 else ''}. Moved aside to {aside.name}; trying the step before")
            _barrier(f"meshpar: damaged step {step} moved aside")
            damaged.append(f"step {step} ({'; '.join(problems[:3])})")
        if damaged:
            self._manager.reload()
            raise InputError(f"{self.directory}: no intact checkpoint: {', '.join(damaged)}; they are kept as "
                             f"<step>.damaged. Restore the files, or start afresh in another directory")
        return None

    def _verify(self, step: int) -> list[str]:
        """What is wrong with `step`. Every process checks every file, so all come to the same verdict with no
        exchange of verdicts."""
        if step in self._intact:
            return []
        problems = damage(self.directory / str(step))
        if not problems:
            self._intact.add(step)
        return problems

    def save(self, step: int, state: nnx.State, meta: dict[str, Any]) -> None:
        """Start saving `state` as `step` (returns once the arrays are copied off the devices)."""
        self.wait()  # the save before, whose failure must be told as its own
        self._saving = step
        try:
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(nnx.to_pure_dict(state)), meta=ocp.args.JsonSave({**meta, "step": step})))
        except Exception as err:
            self._fail(err)

    def due(self, step: int, last_step: int) -> bool:
        return step % self.config.every == 0 or step == last_step

    def restore(self, state: nnx.State, shardings: nnx.State, config: dict | None = None,
                step: int | None = None, allow_changes: bool = False, log=print) -> tuple[nnx.State, dict[str, Any]]:
        """Read `step` (default: the latest) into the structure of `state` laid out by `shardings`.

        `state` may be abstract. `config`, when given, is compared with the saved one first: a checkpoint
        of another model is refused with the fields that differ, and so are changed `train`/`data`
        settings outside `RESUMABLE_CHANGES`, unless `allow_changes` (then `log` lists them).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise InputError(f"{self.directory} holds no checkpoint")
        if problems := self._verify(step):
            raise InputError(f"{self.directory} step {step} is damaged: {'; '.join(problems)}")
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        saved = meta.get("config", {})
        config = None if config is None else json.loads(json.dumps(config))  # as saved: tuples become lists
        if config is not None and "model" in config and saved.get("model") != config["model"]:
            raise InputError(f"{self.directory} step {step} is a checkpoint of a different model: "
                             + "; ".join(_differences(saved["model"], config["model"], "model.")))
        if config is not None:
            then = {section: saved.get(section, {}) for section in ("train", "data")}
            now = {section: {k: v for k, v in config.get(section, {}).items() if k in then[section]}
                   for section in then}  # settings newer than the checkpoint are not changes
            changed = [d for d in _differences(then, now) if not d.startswith(RESUMABLE_CHANGES)]
            if changed and not allow_changes:
                raise InputError(f"{self.directory} step {step} was trained with other settings: "
                                 + "; ".join(changed) + ". Resume with the saved settings, or pass "
                                 "--allow-config-change (Python: allow_config_change=True) to go on with these")
            if changed:
                log(f"resuming with changed settings: {'; '.join(changed)}")
        self._check_shapes(step, state)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(nnx.to_pure_dict(placed_shapes(state, shardings)))))["state"]
        out = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(out, restored)
        return out, meta

    def _check_shapes(self, step: int, state: nnx.State) -> None:
        saved = self._manager.item_metadata(step)["state"].tree
        saved_shapes = jax.tree.map(lambda m: tuple(m.shape), saved, is_leaf=lambda m: hasattr(m, "shape"))
        now_shapes = jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(state))
        problems = _differences(_stringify(saved_shapes), _stringify(now_shapes))
        if problems:
            raise InputError(f"{self.directory} step {step} does not fit this model: " + "; ".join(problems[:8]))

    def wait(self) -> None:
        """Block until every started save is on disk."""
        if self._failed:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            self._fail(err)

    def _fail(self, err: Exception) -> None:
        self._failed = True
        intact = [int(name) for name in _steps_on_disk(self.directory)[0]]
        kept = f"the checkpoint of step {max(intact)} is intact" if intact else "no earlier checkpoint exists"
        raise TrainingStopped(f"saving step {self._saving} to {self.directory} failed: {_why(err)}. The run stopped; "
                              f"{kept}: make room and run again to resume") from err

    def close(self) -> None:
        try:
            self._manager.close()
        except Exception:
            if not self._failed:  # a failed save was told already
                raise


def _stringify(tree: Any) -> Any:
    """Dict keys as strings (orbax's metadata spells integer keys as strings)."""
    return {str(k): _stringify(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def export_params(directory: str | Path, params: nnx.State, config: dict | None = None) -> None:
    """Write the parameters alone (for evaluation or inference) with the config that made them, and their
    checksums."""
    directory = Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(create=True, async_options=ocp.AsyncOptions(
        post_finalization_callback=functools.partial(_seal_unfinished, directory, 0)))
    with ocp.CheckpointManager(directory, options=options) as mgr:
        mgr.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
                                            meta=ocp.args.JsonSave({"config": config or {}})))
        mgr.wait_until_finished()


def load_params(directory: str | Path, params: nnx.State, shardings: nnx.State) -> nnx.State:
    """Read exported parameters into the structure of `params`, laid out by `shardings` (any mesh), once
    their files match their checksums."""
    with ocp.CheckpointManager(Path(directory).absolute()) as mgr:
        if mgr.latest_step() is None:
            raise InputError(f"{directory} holds no exported parameters")
        if problems := damage(Path(directory) / str(mgr.latest_step())):
            raise InputError(f"{directory}: the exported parameters are damaged: {'; '.join(problems)}")
        restored = mgr.restore(mgr.latest_step(), args=ocp.args.Composite(
            params=ocp.args.StandardRestore(nnx.to_pure_dict(placed_shapes(params, shardings)))))["params"]
    out = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(out, restored)
    return out
