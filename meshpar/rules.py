"""Logical axis names → mesh axes: the one table that turns a model into a parallel layout.

Models name the dimensions of their parameters and activations with logical names (`embed`, `heads`,
`mlp`, ...). A `Rules` maps each name to the mesh axes that split it, once for parameters at rest and
once for activations during compute. Every strategy is a table or a mesh shape:

| logical  | params | activations     | what it gives                                        |
|----------|--------|-----------------|------------------------------------------------------|
| batch    | –      | (data, fsdp)    | data parallelism; FSDP splits the batch too          |
| seq      | –      | sequence        | context parallelism                                  |
| embed    | fsdp   | –               | ZeRO-3 / FSDP: sharded at rest, gathered for compute |
| heads, kv_heads, mlp, vocab | model | model | Megatron tensor parallelism                  |
| layers   | stage  | stage           | pipeline stages                                      |
| head_dim | –      | –               | never split                                          |

With a mesh whose only axes > 1 are `data`/`fsdp`, this is DDP (`data`), FSDP (`fsdp`) or hybrid
sharded data parallelism (`data` × `fsdp`: shard within a group, replicate across groups).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

Table = tuple[tuple[str, tuple[str, ...]], ...]

PARAMS: Table = (
    ("batch", ()),
    ("seq", ()),
    ("embed", ("fsdp",)),
    ("heads", ("model",)),
    ("kv_heads", ("model",)),
    ("head_dim", ()),
    ("mlp", ("model",)),
    ("vocab", ("model",)),
    ("layers", ("stage",)),
)

ACTIVATIONS: Table = (
    ("batch", ("data", "fsdp")),
    ("seq", ("sequence",)),
    ("embed", ()),
    ("heads", ("model",)),
    ("kv_heads", ("model",)),
    ("head_dim", ()),
    ("mlp", ("model",)),
    ("vocab", ("model",)),
    ("layers", ("stage",)),
)


@dataclasses.dataclass(frozen=True)
class Rules:
    """Two tables, logical name → mesh axes (empty: replicated). Hashable, so it can be jit-static."""

    params: Table = PARAMS
    activations: Table = ACTIVATIONS

    def param_table(self) -> Mapping[str, tuple[str, ...]]:
        return dict(self.params)

    def activation_table(self) -> Mapping[str, tuple[str, ...]]:
        return dict(self.activations)


def default() -> Rules:
    """The table above: DP, FSDP, TP, context and pipeline parallelism chosen by the mesh alone."""
    return Rules()
