"""The device mesh: six named axes, ordered from least to most communication-hungry.

`data` (replicas), `stage` (pipeline stages), `fsdp` (ZeRO/FSDP shards), `expert` (expert parallelism:
a mixture of experts' experts, and the batch), `sequence` (context parallelism) and `model` (tensor
parallelism), outer to inner. The inner axes exchange the most bytes
per step, so they get the devices that sit closest together. With several processes (hosts) each axis
is split into a part inside a host (ICI: NVLink) and a part across hosts (DCN: the network), filling a
host from the innermost axis out: `model` and `sequence` stay inside a host whenever they fit, and
`data`/`stage` go across hosts first (a hybrid DCN × ICI mesh). A layout that makes `model` or
`sequence` span hosts gets a warning. Size-1 axes are kept so that every layout runs the same code path.

Axes are `AxisType.Auto`: shardings are chosen by the compiler (GSPMD) from the arrays' shardings
and `with_sharding_constraint` hints, which works with stock Flax and optax (see the field notes).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import defaultdict

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from meshpar.errors import InputError

AXES = ("data", "stage", "fsdp", "expert", "sequence", "model")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the six mesh axes; one of them may be -1, meaning "all the devices left"."""

    data: int = 1
    stage: int = 1
    fsdp: int = 1
    expert: int = 1
    sequence: int = 1
    model: int = 1

    def __post_init__(self):
        sizes = self.sizes()
        for axis, size in sizes.items():
            if not isinstance(size, int) or (size < 1 and size != -1):
                raise InputError(f"mesh axis '{axis}' has size {size!r}: sizes are integers >= 1, or -1 for the rest")
        filled = [axis for axis, size in sizes.items() if size == -1]
        if len(filled) > 1:
            raise InputError(f"mesh axes {filled} are all -1: at most one axis may take the remaining devices")

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    def resolve(self, n_devices: int) -> MeshConfig:
        """The same mesh with a -1 replaced by what the device count leaves; checks the product."""
        sizes = self.sizes()
        known = math.prod(size for size in sizes.values() if size != -1)
        for axis, size in sizes.items():
            if size == -1:
                if n_devices % known:
                    raise InputError(f"mesh axis '{axis}' = -1 cannot fill {n_devices} devices: "
                                     f"the other axes multiply to {known}, which does not divide {n_devices}")
                sizes[axis] = n_devices // known
        if math.prod(sizes.values()) != n_devices:
            raise InputError(f"mesh {describe(sizes)} has {math.prod(sizes.values())} devices, "
                             f"but {n_devices} are present")
        return MeshConfig(**sizes)


def parse(text: str) -> MeshConfig:
    """`"data=2,fsdp=4"` → MeshConfig(data=2, fsdp=4); unnamed axes are 1."""
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise InputError(f"malformed mesh item '{item}' in '{text}': expected AXIS=SIZE, e.g. data=2,fsdp=4")
        if name not in AXES:
            raise InputError(f"unknown mesh axis '{name}' in '{text}': the axes are {', '.join(AXES)}")
        if name in sizes:
            raise InputError(f"mesh axis '{name}' is given twice in '{text}'")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise InputError(f"mesh axis '{name}' has size '{value.strip()}' in '{text}': not an integer") from None
    return MeshConfig(**sizes)


def describe(sizes: dict[str, int] | MeshConfig) -> str:
    """`data=2,fsdp=4`: the axes larger than 1 (or `data=1` for a single device)."""
    if isinstance(sizes, MeshConfig):
        sizes = sizes.sizes()
    return ",".join(f"{axis}={size}" for axis, size in sizes.items() if size != 1) or "data=1"


def host_split(sizes: dict[str, int], devices_per_host: int) -> tuple[dict[str, int], dict[str, int]]:
    """Each axis's size inside a host (ICI) and across hosts (DCN), filling a host innermost axis first."""
    inside, room = {}, devices_per_host
    for axis in reversed(AXES):
        inside[axis] = math.gcd(sizes[axis], room)
        room //= inside[axis]
    if room != 1:
        raise InputError(f"mesh {describe(sizes)} cannot be laid out on hosts of {devices_per_host} devices: "
                         f"the axes do not factor into whole hosts")
    return inside, {axis: sizes[axis] // inside[axis] for axis in AXES}


def device_grid(sizes: dict[str, int], devices: list) -> np.ndarray:
    """The devices arranged in the six axes: a host's devices fill the inner part of each axis."""
    by_process = defaultdict(list)
    for device in devices:
        by_process[device.process_index].append(device)
    counts = {len(local) for local in by_process.values()}
    if len(counts) != 1:
        raise InputError(f"processes hold different numbers of devices ({sorted(counts)}); a mesh needs equal hosts")
    inside, across = host_split(sizes, counts.pop())
    grid = np.empty([sizes[axis] for axis in AXES], dtype=object)
    inside_shape, across_shape = [inside[a] for a in AXES], [across[a] for a in AXES]
    for host, process in enumerate(sorted(by_process)):
        host_at = np.unravel_index(host, across_shape)
        for index, device in enumerate(sorted(by_process[process], key=lambda d: d.id)):
            local_at = np.unravel_index(index, inside_shape)
            grid[tuple(h * n + l for h, n, l in zip(host_at, inside_shape, local_at))] = device
    return grid


def build(config: MeshConfig, devices: list | None = None) -> Mesh:
    """A jax Mesh with the six axes over `devices` (default: all devices of all processes)."""
    devices = jax.devices() if devices is None else devices
    sizes = config.resolve(len(devices)).sizes()
    grid = device_grid(sizes, devices)
    hosts = len({d.process_index for d in devices})
    _, across = host_split(sizes, len(devices) // hosts)
    for axis in ("model", "sequence"):
        if across[axis] > 1:
            warnings.warn(f"mesh axis '{axis}' = {sizes[axis]} spans {across[axis]} hosts: its per-layer "
                          f"collectives will cross the network; put data, stage or fsdp across hosts instead",
                          stacklevel=2)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
