"""The device mesh: five named axes, ordered from least to most communication-hungry.

`data` (replicas), `stage` (pipeline stages), `fsdp` (ZeRO/FSDP shards), `sequence` (context
parallelism) and `model` (tensor parallelism), outer to inner. The inner axes exchange the most bytes
per step, so they get the devices that sit closest together (NVLink within a host); `jax.make_mesh`
lays devices out that way. Size-1 axes are kept so that every layout runs the same code path.

Axes are `AxisType.Auto`: shardings are chosen by the compiler (GSPMD) from the arrays' shardings
and `with_sharding_constraint` hints, which works with stock Flax and optax (see the field notes).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "stage", "fsdp", "sequence", "model")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the five mesh axes; one of them may be -1, meaning "all the devices left"."""

    data: int = 1
    stage: int = 1
    fsdp: int = 1
    sequence: int = 1
    model: int = 1

    def __post_init__(self):
        sizes = self.sizes()
        for axis, size in sizes.items():
            if not isinstance(size, int) or (size < 1 and size != -1):
                raise ValueError(f"mesh axis '{axis}' has size {size!r}: sizes are integers >= 1, or -1 for the rest")
        filled = [axis for axis, size in sizes.items() if size == -1]
        if len(filled) > 1:
            raise ValueError(f"mesh axes {filled} are all -1: at most one axis may take the remaining devices")

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    def resolve(self, n_devices: int) -> MeshConfig:
        """The same mesh with a -1 replaced by what the device count leaves; checks the product."""
        sizes = self.sizes()
        known = math.prod(size for size in sizes.values() if size != -1)
        for axis, size in sizes.items():
            if size == -1:
                if n_devices % known:
                    raise ValueError(f"mesh axis '{axis}' = -1 cannot fill {n_devices} devices: "
                                     f"the other axes multiply to {known}, which does not divide {n_devices}")
                sizes[axis] = n_devices // known
        if math.prod(sizes.values()) != n_devices:
            raise ValueError(f"mesh {describe(sizes)} has {math.prod(sizes.values())} devices, "
                             f"but {n_devices} are present")
        return MeshConfig(**sizes)


def parse(text: str) -> MeshConfig:
    """`"data=2,fsdp=4"` → MeshConfig(data=2, fsdp=4); unnamed axes are 1."""
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"malformed mesh item '{item}' in '{text}': expected AXIS=SIZE, e.g. data=2,fsdp=4")
        if name not in AXES:
            raise ValueError(f"unknown mesh axis '{name}' in '{text}': the axes are {', '.join(AXES)}")
        if name in sizes:
            raise ValueError(f"mesh axis '{name}' is given twice in '{text}'")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh axis '{name}' has size '{value.strip()}' in '{text}': not an integer") from None
    return MeshConfig(**sizes)


def describe(sizes: dict[str, int] | MeshConfig) -> str:
    """`data=2,fsdp=4`: the axes larger than 1 (or `data=1` for a single device)."""
    if isinstance(sizes, MeshConfig):
        sizes = sizes.sizes()
    return ",".join(f"{axis}={size}" for axis, size in sizes.items() if size != 1) or "data=1"


def build(config: MeshConfig, devices: list | None = None) -> Mesh:
    """A jax Mesh with the five axes, over `devices` (default: all devices of all processes)."""
    devices = jax.devices() if devices is None else devices
    sizes = config.resolve(len(devices)).sizes()
    return jax.make_mesh(tuple(sizes.values()), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
