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
`Checkpointer.cut_off` names what was removed).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from meshpar.errors import InputError
from meshpar.sharding import placed_shapes

# orbax's name for a step still being written: `<step>.orbax-checkpoint-tmp-<timestamp>`.
_UNFINISHED = re.compile(r"^\d+\.orbax-checkpoint-tmp")
# Settings a resumed run may change freely: how the same training is laid out, run and logged. Any other
# change of `train` or `data` (batch, sequence, schedule, seed, data) makes a different training run,
# refused unless allowed; `model` must always match.
RESUMABLE_CHANGES = ("mesh.", "parallel.", "checkpoint.", "name", "train.steps", "train.remat",
                     "train.grad_accum", "train.attention_kernel", "train.loss_chunk", "train.eval_every",
                     "train.eval_batches", "train.on_nonfinite", "train.sample_every")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # save every this many steps, and at the last step
    keep: int = 3  # how many of the latest checkpoints to keep

    def __post_init__(self):
        for name in ("every", "keep"):
            if getattr(self, name) < 1:
                raise InputError(f"checkpoint.{name} = {getattr(self, name)} must be >= 1")


def _steps_on_disk(directory: Path) -> tuple[list[str], list[str], list[str]]:
    """(finished step dirs, unfinished step dirs, anything else) in `directory`."""
    finished, unfinished, other = [], [], []
    for entry in sorted(directory.iterdir()):
        if entry.is_dir() and entry.name.isdigit():
            finished.append(entry.name)
        elif _UNFINISHED.match(entry.name):
            unfinished.append(entry.name)
        else:
            other.append(entry.name)
    return finished, unfinished, other


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
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=config.keep, create=True, cleanup_tmp_directories=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: nnx.State, meta: dict[str, Any]) -> None:
        """Start saving `state` as `step` (returns once the arrays are copied off the devices)."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(nnx.to_pure_dict(state)),
                                                         meta=ocp.args.JsonSave({**meta, "step": step})))

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
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        saved = meta.get("config", {})
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
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def _stringify(tree: Any) -> Any:
    """Dict keys as strings (orbax's metadata spells integer keys as strings)."""
    return {str(k): _stringify(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def export_params(directory: str | Path, params: nnx.State, config: dict | None = None) -> None:
    """Write the parameters alone (for evaluation or inference) with the config that made them."""
    with ocp.CheckpointManager(Path(directory).absolute(), options=ocp.CheckpointManagerOptions(create=True)) as mgr:
        mgr.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
                                            meta=ocp.args.JsonSave({"config": config or {}})))
        mgr.wait_until_finished()


def load_params(directory: str | Path, params: nnx.State, shardings: nnx.State) -> nnx.State:
    """Read exported parameters into the structure of `params`, laid out by `shardings` (any mesh)."""
    with ocp.CheckpointManager(Path(directory).absolute()) as mgr:
        if mgr.latest_step() is None:
            raise InputError(f"{directory} holds no exported parameters")
        restored = mgr.restore(mgr.latest_step(), args=ocp.args.Composite(
            params=ocp.args.StandardRestore(nnx.to_pure_dict(placed_shapes(params, shardings)))))["params"]
    out = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(out, restored)
    return out
