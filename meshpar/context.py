"""How the model's forward pass runs on the mesh, set while a step is traced.

Models call meshpar helpers (`sharding.constrain`, `sharding.gathered`, `layers.scan`) that read the
active `Compute`: the mesh, the rules and the rematerialisation policy. Outside a step (plain eager
use of a model) there is none, and the helpers do nothing special. A jitted function enters the
context inside its traced body, so the settings are part of what was traced, never stale.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from jax.sharding import Mesh

from meshpar.rules import Rules

REMAT_POLICIES = ("none", "full", "dots")


@dataclasses.dataclass(frozen=True)
class Compute:
    mesh: Mesh
    rules: Rules
    remat: str = "none"

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat policy '{self.remat}' is not one of {', '.join(REMAT_POLICIES)}")


_active: contextvars.ContextVar[Compute | None] = contextvars.ContextVar("meshpar_compute", default=None)


def active() -> Compute | None:
    return _active.get()


@contextlib.contextmanager
def use(compute: Compute) -> Iterator[Compute]:
    token = _active.set(compute)
    try:
        yield compute
    finally:
        _active.reset(token)
