"""Logical axis names → mesh axes: the tables that turn a model into a parallel layout.

Models name the dimensions of their parameters and activations with logical names (`embed`, `heads`,
`mlp`, ...). A `Rules` maps each name to the mesh axes that split it: for parameters at rest, for the
gradients that enter the optimizer, for the optimizer's moments, and for activations during compute.
Every strategy is a table or a mesh shape:

| logical      | params        | activations          | what it gives                                   |
|--------------|---------------|----------------------|-------------------------------------------------|
| batch        | –             | (data, fsdp, expert) | data parallelism; FSDP and EP split the batch too|
| seq          | –             | sequence             | context parallelism                             |
| resid_seq    | –             | sequence (+ model)   | the residual stream's T; + model with Megatron SP|
| embed        | fsdp, expert (ZeRO-3) | –            | sharded at rest, gathered for compute           |
| latent       | fsdp, expert (ZeRO-3) | –            | latent attention's low-rank dims, as `embed`     |
| expert_embed | fsdp (ZeRO-3) | –                    | the experts' D (`expert` splits their E)         |
| heads, kv_heads, mlp, vocab | model | model          | Megatron tensor parallelism                     |
| layers       | stage         | stage                | pipeline stages                                 |
| lead_layers  | –             | –                    | a `layer_prefix`'s stack: before the stages     |
| mtp_layers   | –             | –                    | the multi-token prediction modules: after them  |
| experts      | expert        | expert               | expert parallelism (a mixture of experts)       |
| expert_mlp   | model         | model                | tensor parallelism inside each expert           |
| head_dim     | –             | –                    | never split                                     |

ZeRO stages differ only in which tables split `embed` over `fsdp` (the batch is split over `fsdp` in
every stage, so `fsdp` is a data-parallel axis whose replicas share the model states). `expert` splits the
batch too, so its replicas of the weights outside the experts share their states as `fsdp`'s do (as MaxText
shards them): N below is fsdp × expert for those, fsdp for the experts, which `expert` already splits:

| zero_stage | optimizer moments | gradients | parameters |  per-device model states (Ψ params, N = fsdp) |
|-----------:|:-----------------:|:---------:|:----------:|-----------------------------------------------|
| 0          | –                 | –         | –          | params + grads + moments, all whole           |
| 1          | fsdp              | –         | –          | moments / N                                   |
| 2          | fsdp              | fsdp      | –          | (grads + moments) / N                         |
| 3 (FSDP)   | fsdp              | fsdp      | fsdp       | everything / N                                |

Megatron sequence parallelism (`sequence_parallel=True`) splits the residual stream's sequence over
`model` too: the norms and residual adds then work on T / model positions per device, and each TP
all-reduce becomes an all-gather (entering attention / MLP) plus a reduce-scatter (leaving them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from meshpar.errors import InputError
from meshpar.mesh import AXES

Table = tuple[tuple[str, tuple[str, ...]], ...]


# What splits a batch: data parallelism, FSDP (its replicas share the states) and expert parallelism (as in
# DeepSpeed-MoE and MaxText, so that no device idles outside the experts).
BATCH_AXES = ("data", "fsdp", "expert")
CONTEXT_ATTENTION = ("ring", "allgather", "ulysses")  # meshpar.attention.context_parallel
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "zero_bubble")  # meshpar.pipeline.gpipe (R > 1: circular), .one_f_one_b
# The schedules of meshpar.pipeline.one_f_one_b's slots, which run the loss inside the pipeline
SLOT_SCHEDULES = ("1f1b", "zero_bubble")
OFFLOAD = ("none", "optimizer", "optimizer+params")  # what lives in host memory: meshpar.offload


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Strategy settings beyond the mesh shape."""

    zero_stage: int = 3  # over `fsdp`: 0 replicate, 1 optimizer states, 2 + gradients, 3 + parameters
    sequence_parallel: bool = False  # Megatron SP over `model`
    context_attention: str = "ring"  # attention over a `sequence`-split T: ring, allgather or ulysses
    load_balance: bool = True  # zigzag the sequence so causal attention work is equal on every shard
    microbatches: int = 0  # pipeline microbatches M; 0: the default, meshpar.pipeline.schedule.microbatches
    pipeline_repeats: int = 1  # R > 1: circular (interleaved) pipeline, bubble (P-1)/(R·M+P-1)
    # gpipe; 1f1b: the same bubble, activation memory flat in M (R > 1: interleaved); zero_bubble: 1f1b with the
    # weights' gradients deferred into its idle slots
    pipeline_schedule: str = "gpipe"
    offload: str = "none"  # host memory: none, optimizer (Adam moments), optimizer+params (+ float32 weights)
    # Mixture of experts: 0 is dropless (every routed token computed); c > 0 caps what each expert takes from
    # a device's n tokens at ceil(c · n · k / E) and drops the rest (meshpar.moe.dispatch)
    expert_capacity: float = 0.0

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2, 3):
            raise InputError(f"parallel.zero_stage = {self.zero_stage} is not one of 0, 1, 2, 3")
        if self.context_attention not in CONTEXT_ATTENTION:
            raise InputError(f"parallel.context_attention = '{self.context_attention}' is not one of "
                             f"{', '.join(CONTEXT_ATTENTION)}")
        if self.microbatches < 0:
            raise InputError(f"parallel.microbatches = {self.microbatches} must be >= 0 (0: the default)")
        if self.pipeline_repeats < 1:
            raise InputError(f"parallel.pipeline_repeats = {self.pipeline_repeats} must be >= 1")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise InputError(f"parallel.pipeline_schedule = '{self.pipeline_schedule}' is not one of "
                             f"{', '.join(PIPELINE_SCHEDULES)}")
        if self.offload not in OFFLOAD:
            raise InputError(f"parallel.offload = '{self.offload}' is not one of {', '.join(OFFLOAD)}")
        if self.expert_capacity < 0:
            raise InputError(f"parallel.expert_capacity = {self.expert_capacity} must be >= 0 (0: dropless)")
        if self.pipeline_schedule in SLOT_SCHEDULES and self.offload == "optimizer+params":
            raise InputError(f"parallel.pipeline_schedule = {self.pipeline_schedule} does not fetch weights from "
                             "host memory: "
                             "parallel.offload = 'optimizer+params' is not supported with it ('optimizer' is)")


@dataclasses.dataclass(frozen=True)
class Rules:
    """Four tables, logical name → mesh axes (empty: replicated), and the settings that made them.

    Hashable, so it can be jit-static.
    """

    params: Table
    grads: Table
    optimizer: Table
    activations: Table
    parallel: ParallelConfig = ParallelConfig()

    def __post_init__(self):
        for kind in ("params", "grads", "optimizer", "activations"):  # a mistyped mesh axis fails here
            for name, axes in getattr(self, kind):
                unknown = [axis for axis in axes if axis not in AXES]
                if unknown:
                    raise InputError(f"rules.{kind}: logical axis '{name}' maps to unknown mesh axes {unknown}; "
                                     f"the mesh axes are {', '.join(AXES)}")

    def table(self, kind: str) -> Mapping[str, tuple[str, ...]]:
        return dict(getattr(self, kind))


def _weights(embed: tuple[str, ...]) -> Table:
    expert_embed = tuple(axis for axis in embed if axis != "expert")
    return (("embed", embed), ("latent", embed), ("expert_embed", expert_embed),
            ("heads", ("model",)), ("kv_heads", ("model",)), ("head_dim", ()),
            ("mlp", ("model",)), ("vocab", ("model",)), ("layers", ("stage",)), ("lead_layers", ()),
            ("mtp_layers", ()),
            ("experts", ("expert",)),
            ("expert_mlp", ("model",)))


def make(parallel: ParallelConfig = ParallelConfig()) -> Rules:
    """The rules of a strategy: the table above, with `embed` and `resid_seq` set by the settings."""
    over_fsdp = lambda stage: ("fsdp", "expert") if parallel.zero_stage >= stage else ()
    resid_seq = ("sequence", "model") if parallel.sequence_parallel else ("sequence",)
    activations = (("batch", BATCH_AXES), ("seq", ("sequence",)), ("resid_seq", resid_seq),
                   *_weights(()))
    return Rules(params=_weights(over_fsdp(3)), grads=_weights(over_fsdp(2)), optimizer=_weights(over_fsdp(1)),
                 activations=activations, parallel=parallel)


def default() -> Rules:
    """ZeRO-3 over `fsdp`, no sequence parallelism: DP, FSDP, TP, CP and PP chosen by the mesh alone."""
    return make()
