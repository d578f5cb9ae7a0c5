"""gpucheck's parent: jobs in child processes against the deadline, the record of what each gave, and the
files (gpucheck.json, gpucheck.md) rewritten after every job."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launch.gpucheck.jobs import ERROR, ERRORS, ROW
from launch.gpucheck.tables import find_row, markdown

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Job:
    """One measurement in a process of its own: `JOBS[function](**args)`."""

    label: str  # what the report calls it
    function: str
    args: dict
    estimate_s: float  # how long it may take: it starts only if that fits the time left
    gpu_flags: bool = True  # with meshpar's XLA flags (meshpar.gpu_flags)
    cpu_devices: int | None = None  # on this many fake CPU devices (launch.compile's check) instead of the GPUs

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "launch.gpucheck", "--job", self.function, "--job-args", json.dumps(self.args)]
        if not self.gpu_flags:
            argv.append("--no-gpu-flags")
        if self.cpu_devices:
            argv += ["--cpu-devices", str(self.cpu_devices)]
        return argv


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: str  # done, partial (some rows failed), failed, cut off (stopped at the deadline), skipped (not started)
    rows: list[dict]
    wall_s: float | None = None
    reason: str | None = None  # why not done, in one line


def run_in_process(job: Job, timeout_s: float, log: Path) -> Outcome:
    """Run `job` in a child process, stopped after `timeout_s`; its rows are those it printed, however it
    ended. Its command, stdout and stderr go to `log`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    began = time.monotonic()
    child = subprocess.Popen(job.command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = child.communicate(timeout=max(timeout_s, 0.01))
        status = "done" if child.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()  # what it printed before: nothing is lost (subprocess's docs)
        status = "cut off"
    wall_s = time.monotonic() - began
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"$ {' '.join(job.command())}\n\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    lines = stdout.split("\n")[:-1]  # whole lines only: a child stopped mid-line leaves a tail
    rows = [json.loads(line[len(ROW):]) for line in lines if line.startswith(ROW)]
    errors = [line[len(ERROR):] for line in lines if line.startswith(ERROR)]
    reason = {"done": None, "cut off": f"stopped at the deadline after {wall_s:.0f} s",
              "failed": (errors or [last_line(stderr) or f"exit status {child.returncode}"])[0]}[status]
    return Outcome(status, rows, wall_s, reason)


def last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")[:300]


class Check:
    """The run's record and its clock: jobs run (or skipped) against the deadline, their rows into the
    current section, and gpucheck.json and gpucheck.md rewritten after every job.

    `run_job(job, timeout_s, log)` runs one job (`run_in_process`; the tests pass a stand-in), `clock` is
    `time.monotonic`'s kind of seconds, `deadline` a time on it."""

    def __init__(self, out: Path, deadline: float, command: str,
                 run_job: Callable[[Job, float, Path], Outcome] = run_in_process,
                 clock: Callable[[], float] = time.monotonic):
        self.out, self.deadline, self.run_job, self.clock = out, deadline, run_job, clock
        self.started = clock()
        self.outcomes: dict[str, Outcome] = {}
        self.doc = {"command": command,
                    "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "budget_s": round(deadline - self.started), "elapsed_s": 0, "sections": []}

    def open_section(self, name: str, title: str) -> None:
        self.doc["sections"].append({"name": name, "title": title, "status": "running", "jobs": [],
                                     "rows": []})
        self.flush()

    def skip_section(self, reason: str) -> None:
        self.doc["sections"][-1].update(status="skipped", reason=reason)

    def close_section(self, error: str | None = None) -> None:
        """The section's status: failed with `error`, else its jobs' (one status shared by all, or partial)."""
        section = self.doc["sections"][-1]
        if error:
            section.update(status="failed", reason=error)
        elif section["status"] == "running":
            statuses = {job["status"] for job in section["jobs"]}
            section["status"] = statuses.pop() if len(statuses) == 1 else "partial"
        self.flush()

    def job(self, job: Job) -> Outcome:
        """Run `job` if its estimate fits the time left (stopped at the deadline), and record it."""
        left = self.deadline - self.clock()
        if job.estimate_s > left:
            outcome = Outcome("skipped", [], reason=f"needs up to {job.estimate_s:.0f} s, {max(left, 0):.0f} s left")
        else:
            number = sum(len(section["jobs"]) for section in self.doc["sections"])  # the machine's is 00
            log = self.out / "logs" / f"{number:02d}-{file_name(job.label)}.log"
            outcome = finite_errors(job, finite_losses(job, self.run_job(job, left, log)))
        self.record(job, outcome)
        return outcome

    def record(self, job: Job, outcome: Outcome) -> None:
        """Add `job`'s outcome and rows (each tagged with the job's label) to the current section; flush."""
        self.outcomes[job.label] = outcome
        section = self.doc["sections"][-1]
        wall = None if outcome.wall_s is None else round(outcome.wall_s, 1)
        section["jobs"].append({"job": job.label, "status": outcome.status, "wall_s": wall,
                                "estimate_s": job.estimate_s, "reason": outcome.reason})
        section["rows"] += [{"job": job.label, **row} for row in outcome.rows]
        print(f"[{self.clock() - self.started:5.0f} s] {section['name']} / {job.label}: {outcome.status}"
              + (f" ({outcome.reason})" if outcome.reason else ""), flush=True)
        self.flush()

    def measured_s(self, label: str, otherwise: float) -> float:
        """The wall time of the job `label` if it is done, else `otherwise`."""
        outcome = self.outcomes.get(label)
        return outcome.wall_s if outcome is not None and outcome.status == "done" else otherwise

    @property
    def machine(self) -> dict:
        return find_row(self.doc, "machine")

    def flush(self) -> None:
        self.doc["elapsed_s"] = round(self.clock() - self.started)
        write(self.out, self.doc)


def finite(value) -> bool:
    """A figure that is a finite number: the jobs print NaN and ∞ as None (`meshpar.metrics.strict`)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def finite_losses(job: Job, outcome: Outcome) -> Outcome:
    """A training job that ran to its end with a loss that is not finite failed: its step times and memory
    are those of a run that did not train. Its row is kept, as measured."""
    if job.function != "train" or outcome.status != "done":
        return outcome
    for row in outcome.rows:
        losses = [row.get(key) for key in ("loss_first", "loss_last")]
        if not all(finite(loss) for loss in losses):
            shown = " → ".join("not finite" if loss is None else str(loss) for loss in losses)
            return dataclasses.replace(outcome, status="failed", reason=f"the loss is not finite (loss {shown})")
    return outcome


def finite_errors(job: Job, outcome: Outcome) -> Outcome:
    """A kernel measured with an error against float32 that is not finite failed (a kernel not measured has
    no errors, and a note): its job is partial, or failed where no kernel's errors are all finite. The rows
    are kept, as measured."""
    if job.function != "attention_numerics" or outcome.status != "done":
        return outcome
    measured = [row for row in outcome.rows if all(key in row for key in ERRORS)]
    failed = []
    for row in measured:
        if not_finite := [key for key in ERRORS if not finite(row[key])]:
            failed.append(f"{row['kernel']}, head dim {row['head_dim']}: {', '.join(not_finite)}")
    if not failed:
        return outcome
    return dataclasses.replace(outcome, status="failed" if len(failed) == len(measured) else "partial",
                               reason=f"the error is not finite ({'; '.join(failed)})")


def file_name(label: str) -> str:
    return re.sub(r"[^\w.=-]+", "_", label)


def write(out: Path, doc: dict) -> None:
    """gpucheck.json and gpucheck.md in `out`, each replaced whole (a reader never sees half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpucheck.json", json.dumps(doc, indent=2, allow_nan=False) + "\n"),
                       ("gpucheck.md", markdown(doc))):
        partial = out / f".{name}.partial"
        partial.write_text(text)
        partial.replace(out / name)

