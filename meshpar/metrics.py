"""What a run tells its user: a progress bar, one JSON line per step, and throughput.

Only process 0 shows progress and writes files, so a multi-host run logs once.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, TextIO

import jax
from tqdm import tqdm


def is_logger() -> bool:
    return jax.process_index() == 0


class StepLog:
    """Collects per-step metrics; writes them as JSONL and onto a tqdm progress bar."""

    def __init__(self, total_steps: int, first_step: int, path: str | None, progress: bool = True):
        self.records: list[dict[str, Any]] = []
        self._file: TextIO | None = None
        if path and is_logger():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "w")
        self._bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True,
                         disable=not (progress and is_logger()))

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
        self._bar.update(1)

    def median(self, key: str, skip_first: int = 1) -> float | None:
        """Median of `key` over the records, leaving out the first (it may include warm-up)."""
        values = [r[key] for r in self.records[skip_first:]] or [r[key] for r in self.records]
        return statistics.median(values) if values else None

    def close(self) -> None:
        self._bar.close()
        if self._file:
            self._file.close()
