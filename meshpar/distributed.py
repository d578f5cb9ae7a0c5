"""Multi-process start-up: one JAX process per host (or per GPU), joined into one set of global devices.

Settings come, in this order, from explicit arguments (`launch.train --coordinator ...`), from the
environment (`MESHPAR_COORDINATOR`, `MESHPAR_NUM_PROCESSES`, `MESHPAR_PROCESS_ID`, as set by
`launch.local`), or from a cluster JAX detects by itself (SLURM, Open MPI, Kubernetes); with none of
them the run is one process and nothing is initialised. The three explicit settings come together or
not at all: a half-given setting is an error, not a silent single-process run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time

import jax

from meshpar.errors import InputError

ENV = {"coordinator": "MESHPAR_COORDINATOR", "num_processes": "MESHPAR_NUM_PROCESSES",
       "process_id": "MESHPAR_PROCESS_ID"}
# What JAX's own cluster detection looks for (jax/_src/clusters/).
CLUSTER_MARKERS = {"SLURM": ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID"),
                   "Open MPI": ("OMPI_MCA_orte_hnp_uri",), "Kubernetes": ("KUBERNETES_SERVICE_HOST",)}


@dataclasses.dataclass(frozen=True)
class Settings:
    coordinator: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None

    def explicit(self) -> bool:
        given = {name: getattr(self, name) is not None for name in ENV}
        if any(given.values()) and not all(given.values()):
            missing = [f"{name} ({ENV[name]})" for name, ok in given.items() if not ok]
            present = [name for name, ok in given.items() if ok]
            raise InputError(f"distributed settings are half given: {', '.join(present)} set but "
                             f"{', '.join(missing)} missing; give all three, or none for one process")
        if all(given.values()):
            if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
                raise InputError(f"process_id = {self.process_id} is not in 0..{self.num_processes - 1}")
            if ":" not in self.coordinator:
                raise InputError(f"coordinator '{self.coordinator}' must be host:port")
        return all(given.values())


def from_environment(**overrides: str | int | None) -> Settings:
    """Settings from the explicit `overrides` (flags) where given, else from MESHPAR_* variables."""
    values = {}
    for name, var in ENV.items():
        value = overrides.get(name)
        if value is None:
            value = os.environ.get(var)
        if value is not None and name != "coordinator":
            try:
                value = int(value)
            except ValueError:
                raise InputError(f"{var} = '{value}' is not an integer") from None
        values[name] = value
    return Settings(**values)


def detected_cluster() -> str | None:
    for name, markers in CLUSTER_MARKERS.items():
        if all(var in os.environ for var in markers):
            return name
    return None


def check_coordinator(coordinator: str, process_id: int, timeout_s: float) -> None:
    """Fail with a message, not a crash inside JAX (which aborts the process when it cannot register):
    process 0 must be able to listen on the port; the others must reach it within `timeout_s`."""
    host, _, port_text = coordinator.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        raise InputError(f"coordinator '{coordinator}': port '{port_text}' is not a number") from None
    if process_id == 0:
        try:
            with socket.create_server(("", port)):
                return
        except OSError as err:
            raise InputError(f"coordinator '{coordinator}': process 0 cannot listen on port {port} "
                             f"({os.strerror(err.errno)}); choose a free port") from None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise InputError(f"coordinator '{coordinator}' unreachable after {timeout_s:.0f} s ({err.strerror or err}); "
                                 f"is process 0 running, and is the address right?") from None
            time.sleep(0.5)


def initialize(settings: Settings, timeout_s: float = 300, heartbeat_timeout_s: float = 100) -> str:
    """Join the processes (or do nothing for one); returns how, for the log ("" for one process).
    `timeout_s`: how long a process waits for the coordinator to answer. `heartbeat_timeout_s`: a process
    that sends no heartbeat for this long (dead, or stalled: a paused host sends none) ends the job: JAX's
    coordination service names it and stops every process, instead of leaving them waiting in a collective
    forever."""
    # SIGTERM is meshpar's (meshpar.preemption): JAX's preemption notifier would otherwise catch it first.
    jax.config.update("jax_enable_preemption_service", False)
    if settings.explicit():
        check_coordinator(settings.coordinator, settings.process_id, timeout_s)
        jax.distributed.initialize(coordinator_address=settings.coordinator, num_processes=settings.num_processes,
                                   process_id=settings.process_id, initialization_timeout=int(timeout_s),
                                   heartbeat_timeout_seconds=math.ceil(heartbeat_timeout_s))
        how = f"explicit coordinator {settings.coordinator}"
    elif cluster := detected_cluster():
        jax.distributed.initialize(heartbeat_timeout_seconds=math.ceil(heartbeat_timeout_s))
        how = f"{cluster} (detected)"
    else:
        return ""
    return f"{how}: process {jax.process_index()} of {jax.process_count()} on {socket.gethostname()}, " \
           f"{jax.local_device_count()} local of {jax.device_count()} devices"
