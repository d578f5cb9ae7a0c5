"""Run a command as P real JAX processes on this machine, each with D fake CPU devices.

    python -m launch.local --processes 2 --devices-per-process 4 -- \\
        python -m launch.train --config tiny --mesh data=2,fsdp=2,model=2 --steps 20

Every process gets MESHPAR_COORDINATOR (127.0.0.1 and a free port), MESHPAR_NUM_PROCESSES and
MESHPAR_PROCESS_ID, plus JAX_PLATFORMS=cpu and JAX_NUM_CPU_DEVICES=D; `meshpar.distributed` joins them
into one set of P × D devices (collectives over gloo). Their output is printed line by line behind
`[pN]`. If a process fails, the others are stopped (SIGTERM, then SIGKILL) and the launcher exits with
that process's code: a dead peer never leaves the rest hanging in a collective.
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

GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping the survivors


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _relay(index: int, stream) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"[p{index}] {line}")
        sys.stdout.flush()


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launch(command: list[str], processes: int, devices_per_process: int) -> int:
    """Start the processes, relay their output, and return 0 or the first failure's exit code."""
    port = free_port()
    procs, relays = [], []
    for index in range(processes):
        env = {**os.environ, "MESHPAR_COORDINATOR": f"127.0.0.1:{port}", "MESHPAR_NUM_PROCESSES": str(processes),
               "MESHPAR_PROCESS_ID": str(index), "JAX_PLATFORMS": "cpu",
               "JAX_NUM_CPU_DEVICES": str(devices_per_process), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        relay = threading.Thread(target=_relay, args=(index, proc.stdout), daemon=True)
        relay.start()
        procs.append(proc)
        relays.append(relay)
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                index, code = failed[0]
                print(f"launch.local: process {index} exited with code {code}; stopping the others", file=sys.stderr)
                _stop(procs)
                return code if code > 0 else 128 - code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    finally:
        for relay in relays:
            relay.join(timeout=1.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.local", description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=4)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each process runs, after --")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given: put it after --")
    if args.processes < 1 or args.devices_per_process < 1:
        p.error("--processes and --devices-per-process must be >= 1")
    sys.exit(launch(command, args.processes, args.devices_per_process))


if __name__ == "__main__":
    main()
