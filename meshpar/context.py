"""How the model's forward pass runs on the mesh, set while a step is traced.

Models call meshpar helpers (`sharding.constrain`, `sharding.gathered`, `layers.scan`, `attention.attend`)
that read the active `Compute`: the mesh, the rules, the rematerialisation policy and the attention
kernel. Outside a step (plain eager use of a model) there is none, and the helpers do nothing special.
A jitted function enters the context inside its traced body, so the settings are part of what was
traced, never stale.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from jax.sharding import Mesh

from meshpar.rules import Rules


@dataclasses.dataclass(frozen=True)
class Compute:
    """`remat`: the policy a layer runs under (`meshpar.remat`); `attention_kernel`: the block kernel
    (`meshpar.attention.kernels`); `fp8`: the matmuls' recipe (`meshpar.fp8`); `vmapped`: mesh axes that an
    enclosing `vmap(spmd_axis_name=...)` owns (gradient accumulation's replicas, the pipeline's stages and
    batch shards): a `shard_map` opened inside must be manual over them too, or JAX cannot batch it."""

    mesh: Mesh
    rules: Rules
    remat: str = "none"
    attention_kernel: str = "auto"
    fp8: str = "none"  # the matmuls' FP8 recipe (`meshpar.fp8`)
    vmapped: tuple[str, ...] = ()


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
