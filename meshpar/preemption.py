"""A graceful stop: on SIGTERM or SIGINT, or when a wall-clock budget runs out, a run finishes the step in
flight, saves a checkpoint, waits for it to commit and ends; `launch.train` then exits with `EXIT_REQUEUE`,
the code a scheduler (or `launch.local`) can requeue on. A second signal ends the process at once, by that
signal: the checkpoint before it stays intact, as orbax commits a save only when it is whole.

A signal may reach only some processes, or reach them at different steps; all must stop after the same
step, or the others would wait forever in the next step's collectives. So each process votes: its request
goes into the training step as one more input (an integer on each of its devices), and the step returns the
largest vote. The vote cast into step s is read after step s + 1 has been dispatched, when the host waits
for step s anyway: every process reads the same value after the same step, and the check adds no wait.
The vote is reduced inside the step's own program, not by a program of its own: a separate program has no
data dependence on the step, so nothing would order its collective with the step's on every process. With
one process the request is read at once.

meshpar owns these signals: `meshpar.distributed` turns off JAX's own preemption notifier, which would take
SIGTERM for itself.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.signals import SIGNALS


@dataclasses.dataclass(frozen=True)
class Stopping:
    """When a run stops early: on SIGTERM / SIGINT (`signals`; from the first step on: before it, while the
    run starts and compiles, there is no work to save, and the signal does what the handler before says:
    `launch.train`'s, from `meshpar.signals`, exits with EXIT_REQUEUE), and after `exit_after_s` seconds of
    the run (counted from the start of `meshpar.run.run`, compilation included)."""

    signals: bool = True
    exit_after_s: float | None = None


def votes_sharding(mesh: Mesh) -> NamedSharding:
    """The layout of the stop votes: one integer per device of `mesh` (each process's devices hold its vote)."""
    return NamedSharding(mesh, P(mesh.axis_names))


class StopRequests:
    """The stop requests of this process (signals, the budget) and their agreement over all processes."""

    def __init__(self, stopping: Stopping, mesh: Mesh):
        self.stopping = stopping
        self.deadline = None if stopping.exit_after_s is None else time.monotonic() + stopping.exit_after_s
        self.signal: str | None = None
        self.previous: dict[int, object] = {}
        self.sharding = votes_sharding(mesh) if jax.process_count() > 1 else None  # the training step's votes
        self.agreed: jax.Array | None = None  # the largest vote of the step before, not read yet

    def listen(self) -> None:
        """Take SIGTERM and SIGINT until `close`. Python runs signal handlers in the main thread only, and only
        it may install them: elsewhere only the budget stops the run."""
        if self.stopping.signals and threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self._on_signal) for signum in SIGNALS}

    def _on_signal(self, signum: int, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            print(f"{self.signal}: stopping after the step in flight, saving it where the run has a checkpoint "
                  f"directory (a second signal ends the process at once)", file=sys.stderr, flush=True)
            return
        signal.signal(signum, signal.SIG_DFL)  # the second: end now, by this signal
        os.kill(os.getpid(), signum)

    def _local(self) -> str | None:
        if self.signal:
            return self.signal
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "time budget (--exit-after-s) spent"
        return None

    def votes(self) -> tuple[jax.Array, ...]:
        """The training step's last arguments: this process's vote on each of its devices; none with one process."""
        if self.sharding is None:
            return ()
        vote = np.array([self._local() is not None], np.int32)
        return (jax.make_array_from_callback((self.sharding.mesh.size,), self.sharding, lambda _: vote),)

    def after(self, metrics: dict[str, jax.Array]) -> str | None:
        """Called once a step is dispatched, with its metrics (its `stop` is taken out): why every process
        stops after this step, or None to go on."""
        if self.sharding is None:
            return self._local()
        previous, self.agreed = self.agreed, metrics.pop("stop")
        if previous is None or not int(previous):
            return None
        return self._local() or "another process was asked to stop"

    def close(self) -> None:
        """Give SIGTERM and SIGINT back to the handlers they had."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}
