"""SIGTERM and SIGINT from a training process's first second. Until its first step is dispatched a run has
no work to lose, so a signal ends the process at once with `EXIT_REQUEUE`, the code a scheduler (or
`launch.local --max-restarts`) requeues on, whether it was starting, restoring a checkpoint or compiling;
run again, it resumes from its latest checkpoint, if it has one. From the first step on,
`meshpar.preemption` takes the signals over: a stop after the step in flight, with a checkpoint of it.

Python runs a signal handler in the main thread only, between two bytecodes: while that thread is in XLA's
compiler (minutes, at full size) the handler would wait. So the signal also goes down a pipe
(`signal.set_wakeup_fd`), and a thread of its own that reads the pipe ends the process at once.
No JAX here: this is installed before JAX loads.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_REQUEUE = 75  # sysexits.h EX_TEMPFAIL: stopped on request with the work saved; run again to resume
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_before_training() -> None:
    """From now until `meshpar.preemption` installs its handlers (and again once it gives them back), a
    SIGTERM or SIGINT ends this process with EXIT_REQUEUE. Call it in the main thread, first thing."""
    for signum in SIGNALS:
        signal.signal(signum, _exit)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the wakeup fd must not block the signal's delivery
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd,), name="meshpar-signals", daemon=True).start()


def _exit(signum: int, frame=None) -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    print(f"{signal.Signals(signum).name} before the first step: nothing to save, exiting with {EXIT_REQUEUE} "
          f"(run again to resume from the latest checkpoint, if there is one)", file=sys.stderr, flush=True)
    os._exit(EXIT_REQUEUE)  # at once, from either thread: nothing runs that could be lost


def _watch(read_fd: int) -> None:
    """Each signal's number comes down the pipe the moment it arrives; act on those still routed to `_exit`
    (the training loop's own handlers ignore this thread)."""
    while True:
        for signum in os.read(read_fd, 64):
            if signum in SIGNALS and signal.getsignal(signum) is _exit:
                _exit(signum)
