"""The real training step compiled for a described GPU cluster: XLA's GPU compiler, with or without GPUs here.

JAX's CUDA plugin (jax 0.12) builds compile-only devices for a topology it is told of — a `GpuTarget`
(`meshpar.gpu_target`) and `slices x hosts x GPUs per host` — and `jit(step).lower(...).compile()` on a
mesh of them runs XLA's whole GPU pipeline: SPMD partitioning, GPU fusion, cuBLAS and cuDNN custom calls,
async collectives under the latency-hiding scheduler, host memory spaces. Nothing runs and nothing is
allocated: `memory_analysis()` is the GPU program's, `cost_analysis()` gives nothing in this mode (the
kernels' FLOPs are read from the program instead, `meshpar.compiler.gpu_program`). The compile applies
`meshpar.gpu_flags` as a GPU run does, as compile options (the user's XLA_FLAGS still win).

What it needs beside jax: the CUDA plugin and cuDNN's library (XLA asks cuDNN to build its fused attention
graphs), `--no-deps` (their CUDA dependencies are for running, gigabytes of them): `INSTALL`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

import jax

from meshpar import gpu_flags
from meshpar.errors import InputError
from meshpar.gpu_target import GpuTarget, get as get_target

# The cuDNN wheel the tests and CI compile with (any 9.x that jax's plugin accepts will do).
CUDNN_WHEEL = "nvidia-cudnn-cu12==9.28.0.42"


def install_command() -> str:
    """The pip command that makes this jax compile for GPUs: its own plugin version, and cuDNN."""
    version = jax.__version__
    return (f"pip install --no-deps jax-cuda12-plugin=={version} jax-cuda12-pjrt=={version} {CUDNN_WHEEL} "
            f"(`make gpu-compile-deps` does it in .venv312)")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """GPUs of one kind, `hosts` hosts of `devices_per_host` each (NVLink inside a host, the network across)."""
    target: GpuTarget
    hosts: int = 1
    devices_per_host: int = 8

    def __post_init__(self):
        for name in ("hosts", "devices_per_host"):
            if getattr(self, name) < 1:
                raise InputError(f"GPU cluster: {name} = {getattr(self, name)} must be >= 1")

    @classmethod
    def parse(cls, target: str, topology: str | None = None, hosts: int = 1, devices_per_host: int = 8) -> Cluster:
        """A target name and either a topology string `1xHxG` (one slice of H hosts of G GPUs) or the counts."""
        if topology is not None:
            found = re.fullmatch(r"1x(\d+)x(\d+)", topology.strip())
            if found is None:
                raise InputError(f"topology '{topology}': expected 1xHOSTSxGPUS_PER_HOST, e.g. 1x8x8 for 64 GPUs "
                                 f"on 8 hosts (one slice: GPUs have no multi-slice topologies)")
            hosts, devices_per_host = int(found[1]), int(found[2])
        return cls(get_target(target), hosts, devices_per_host)

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    def describe(self) -> str:
        return f"{self.devices} × {self.target.description} ({self.hosts} host{'s' * (self.hosts > 1)} of " \
               f"{self.devices_per_host})"


def devices(cluster: Cluster) -> list[jax.Device]:
    """Compile-only devices of the described cluster, host-major (device i is on host i // devices_per_host)."""
    if not gpu_flags.cuda_installed():
        raise InputError(f"compiling for GPUs needs jax's CUDA plugin: {install_command()}")
    if importlib.util.find_spec("nvidia.cudnn") is None:
        raise InputError(f"compiling for GPUs needs cuDNN's library (fused attention): {install_command()}")
    from jax.experimental import topologies

    # JAX's persistent cache cannot load what these devices compile (it needs a client to run it): no cache.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=cluster.target.config_text(),
                                                topology=f"1x{cluster.hosts}x{cluster.devices_per_host}")
    except Exception as err:  # the plugin's own words, e.g. a jax too old to describe GPU topologies
        raise InputError(f"jax {jax.__version__} could not describe {cluster.describe()}: {err} (compiling for a "
                         f"GPU target needs jax >= 0.12 with its CUDA plugin: {install_command()})") from None
    return list(topology.devices)


def compile_options() -> dict[str, bool | int | str]:
    """meshpar's GPU flags as compile options, less those the user's XLA_FLAGS set (those apply anyway)."""
    return gpu_flags.compile_options(os.environ.get("XLA_FLAGS", ""))


def memory_limit(target: GpuTarget) -> int:
    """Bytes XLA's allocator lets a step use on one such GPU: JAX's share of the memory CUDA reports,
    XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 unless set), what `memory_stats()["bytes_limit"]` reports there."""
    fraction = float(os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
                     or 0.75)
    return int(target.device_memory_size * fraction)
