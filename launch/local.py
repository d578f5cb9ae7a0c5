"""Run a command as P real JAX processes on this machine, each with D fake CPU devices.

    python -m launch.local --processes 2 --devices-per-process 4 -- \\
        python -m launch.train --config tiny --mesh data=2,fsdp=2,model=2 --steps 20

Every process gets MESHPAR_COORDINATOR (127.0.0.1 and a free port), MESHPAR_NUM_PROCESSES and
MESHPAR_PROCESS_ID, plus JAX_PLATFORMS=cpu and JAX_NUM_CPU_DEVICES=D; `meshpar.distributed` joins them
into one set of P × D devices (collectives over gloo). Their output is printed line by line behind
`[pN]`. If a process fails, the others are killed (they can finish neither a step nor a save without it)
and the launcher exits with that process's code: a dead peer never leaves the rest hanging in a collective.

SIGTERM or SIGINT (Ctrl-C) to the launcher is passed on to every process once, as SIGTERM: the run stops
after the step in flight with a checkpoint, each process exits with 75 (`meshpar.signals.EXIT_REQUEUE`),
and so does the launcher. A second signal is passed on too, and ends the processes at once. The processes
run in sessions of their own, so a terminal's Ctrl-C reaches them through the launcher only, once.

`--max-restarts N` starts the whole job again (a new coordinator port, the same command, which resumes
from its latest checkpoint) when a process dies or the run stops on a signal sent to its processes and
not to the launcher, up to N times; each restart is logged with its reason.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from meshpar.signals import EXIT_REQUEUE  # (no JAX: the launcher never loads it)

STOPPING_S = 300.0  # how long the others may take to stop and save once one process has


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _relay(index: int, stream) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"[p{index}] {line}")
        sys.stdout.flush()


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


class _Job:
    """One start of the P processes: their output relayed, SIGTERM / SIGINT to the launcher passed on."""

    def __init__(self, command: list[str], processes: int, devices_per_process: int):
        port = free_port()
        self.procs, self.relays = [], []
        for index in range(processes):
            env = {**os.environ, "MESHPAR_COORDINATOR": f"127.0.0.1:{port}", "MESHPAR_NUM_PROCESSES": str(processes),
                   "MESHPAR_PROCESS_ID": str(index), "JAX_PLATFORMS": "cpu",
                   "JAX_NUM_CPU_DEVICES": str(devices_per_process), "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            relay = threading.Thread(target=_relay, args=(index, proc.stdout), daemon=True)
            relay.start()
            self.procs.append(proc)
            self.relays.append(relay)

    def forward(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def wait(self) -> tuple[int, str]:
        """(the job's exit code: 0, EXIT_REQUEUE or the first failure's; why it ended, for the log)."""
        stopping_since = None
        try:
            while True:
                codes = [proc.poll() for proc in self.procs]
                failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0, EXIT_REQUEUE)]
                if stopping_since is None and EXIT_REQUEUE in codes:
                    stopping_since = time.monotonic()  # one stopped on request: the others stop at the same step
                if not failed and stopping_since is not None and time.monotonic() - stopping_since > STOPPING_S:
                    failed = [(codes.index(None), None)]
                if failed:
                    index, code = failed[0]
                    why = f"exited with code {code}" if code is not None else f"did not stop within {STOPPING_S:.0f} s"
                    print(f"launch.local: process {index} {why}; stopping the others", file=sys.stderr)
                    _kill(self.procs)
                    return 1 if code is None else code if code > 0 else 128 - code, f"process {index} {why}"
                if None not in codes:
                    return (EXIT_REQUEUE, "the run stopped on request and saved") if EXIT_REQUEUE in codes else (0, "")
                time.sleep(0.1)
        finally:
            for relay in self.relays:
                relay.join(timeout=1.0)


def launch(command: list[str], processes: int, devices_per_process: int, max_restarts: int = 0) -> int:
    """Run the job, restarting it up to `max_restarts` times when a process fails or the run stops on
    request (a signal the launcher did not get); return its last exit code."""
    job, asked = None, []

    def forward(signum, frame):
        asked.append(signum)  # the launcher's own stop: pass it on, and start nothing more
        if job is not None:
            job.forward(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        restarts = 0
        while True:
            job = _Job(command, processes, devices_per_process)
            code, why = job.wait()
            if code == 0 or asked or restarts == max_restarts:
                return code
            restarts += 1
            print(f"launch.local: restart {restarts} of {max_restarts}: {why}", file=sys.stderr, flush=True)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.local", description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=4)
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart the whole job up to N times when a process dies or the run stops on request "
                        "(exit 75); the command must resume by itself, as launch.train --checkpoint-dir does")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each process runs, after --")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given: put it after --")
    if args.processes < 1 or args.devices_per_process < 1:
        p.error("--processes and --devices-per-process must be >= 1")
    if args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    sys.exit(launch(command, args.processes, args.devices_per_process, args.max_restarts))


if __name__ == "__main__":
    main()
