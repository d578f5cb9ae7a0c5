"""What a run tells its user: a progress bar, one JSON line per step, TensorBoard, and throughput.

Only process 0 shows progress and writes files, so a multi-host run logs once. The JSON lines are strict
JSON: a non-finite number (a diverged loss) is written as `null`. TensorBoard event files are written
with tensorboardX (`--tensorboard-dir`): scalars under `train/`, `eval/`, `perf/`, (a mixture of experts'
routing) `moe/` and (a DPO run's rewards and log-probabilities, TRL's names) `dpo/`, samples as text.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, TextIO

import jax
from tqdm import tqdm

from meshpar.dpo import METRICS as DPO_METRICS
from meshpar.moe.routing import ROUTER_METRICS

# metrics key → TensorBoard tag
TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "eval_loss": "eval/loss",
        "eval_perplexity": "eval/perplexity", "trained_tokens": "train/trained_tokens",
        "tokens_per_s": "perf/tokens_per_s", "mtp_loss": "train/mtp_loss", "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
        **{key: f"moe/{key}" for key in ROUTER_METRICS}, **{key: f"dpo/{key}" for key in DPO_METRICS}}


def is_logger() -> bool:
    return jax.process_index() == 0


def strict(record: dict[str, Any]) -> dict[str, Any]:
    """The record with non-finite floats as None, which JSON can hold."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


class StepLog:
    """Collects per-step metrics; writes them as JSONL, to TensorBoard and onto a tqdm progress bar."""

    def __init__(self, total_steps: int, first_step: int, path: str | None, progress: bool = True,
                 tensorboard_dir: str | None = None):
        self.records: list[dict[str, Any]] = []
        self._file: TextIO | None = None
        self._board = None
        if path and is_logger():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "w")
        if tensorboard_dir and is_logger():
            from tensorboardX import SummaryWriter

            self._board = SummaryWriter(tensorboard_dir)
        self._bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True,
                         disable=not (progress and is_logger()))
        self._eval: float | None = None

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(strict(record), allow_nan=False) + "\n")
            self._file.flush()
        if self._board:
            for key, tag in TAGS.items():
                if record.get(key) is not None:
                    self._board.add_scalar(tag, record[key], record["step"])
            if "sample" in record:
                self._board.add_text("train/sample", record["sample"], record["step"])
        self._eval = record.get("eval_loss", self._eval)
        shown = {"loss": f"{record['loss']:.4f}"}
        if self._eval is not None:
            shown["eval"] = f"{self._eval:.4f}"
        shown["tok_s"] = f"{record['tokens_per_s']:,.0f}"
        if record.get("mfu") is not None:
            shown["mfu"] = f"{record['mfu']:.1%}"
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(1)

    def median(self, key: str, skip_first: int = 1) -> float | None:
        """Median of `key` over the records, leaving out the first (it may include warm-up)."""
        values = [r[key] for r in self.records if key in r]
        values = values[skip_first:] or values
        return statistics.median(values) if values else None

    def close(self) -> None:
        self._bar.close()
        if self._file:
            self._file.close()
        if self._board:
            self._board.close()
