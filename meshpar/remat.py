"""Rematerialisation: what the backward pass keeps of each layer, and what it computes again.

The policies, per layer (`train.remat`):

| policy    | kept for the backward pass                                 | recomputed                      |
|-----------|------------------------------------------------------------|---------------------------------|
| `none`    | every intermediate, but the weights `sharding.gathered`    | nothing (the gathered weights   |
|           | gathered (a layer that gathers none runs unwrapped)        | are gathered again)             |
| `dots`    | the outputs of matmuls against weights (projections, MLP)  | norms, activations, attention   |
|           | — not the attention scores, which grow with T²             | scores and softmax              |
| `full`    | each layer's input                                         | the whole layer (one more       |
|           |                                                            | forward pass of compute)        |
| `offload` | what `dots` keeps, in host memory; on the devices what     | as `dots`                       |
|           | `full` keeps (on XLA:CPU, where host memory is device      |                                 |
|           | memory, it compiles to `dots`)                             |                                 |

`auto` (the default) takes the platform's fastest policy that fits (`candidates`; `meshpar.run` compiles
them in turn and checks each against the device's memory).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import Offloadable

from meshpar import offload, sharding
from meshpar.errors import InputError
from meshpar.rules import ParallelConfig

POLICIES = ("none", "dots", "full", "offload")
# `auto`: the policies to try on a platform, fastest first; a run takes the first whose compiled step fits
# the device memory. CPU, measured (`launch.bench`, d_model 256, 4 layers, T 128, batch 16, fsdp=8): dots
# 607 ms, full 666 ms, none 1,012 ms (750 ms against dots' 599 in `launch.peers` since none lost its
# overheads) — keeping fewer activations costs less memory traffic than the recompute. GPUs: nothing
# recomputed is fastest when it fits.
AUTO = {"cpu": ("dots",)}
AUTO_DEFAULT = ("none", "dots", "full")


def check(name: str, *, auto: bool = False) -> None:
    """Refuse an unknown policy name (`auto` too, where `auto` is allowed)."""
    if name not in POLICIES and not (auto and name == "auto"):
        allowed = ("auto", *POLICIES) if auto else POLICIES
        raise InputError(f"remat policy '{name}' is not one of {', '.join(allowed)}")


def candidates(name: str, platform: str, parallel: ParallelConfig | None = None) -> tuple[str, ...]:
    """The policies `name` may run as on `platform`: itself, or `auto`'s candidates (less `none` where
    `parallel` offloads the weights: meshpar.offload)."""
    if name != "auto":
        return (name,)
    found = AUTO.get(platform, AUTO_DEFAULT)
    if parallel is not None and offload.weights_offloaded(parallel):
        found = tuple(policy for policy in found if policy != "none")
    return found


def _all_but_gathered_weights(prim: Any, *_, **params: Any) -> bool:
    """`none`: keep every value the layer computes but its gathered weights (`sharding.gathered`), which
    the backward pass gathers again, as a plain step does. Kept, the scan would stack every layer's
    gathered weights ([L, D, F] whole per device under FSDP) for the backward pass."""
    return not sharding.is_weight_gather(prim, params)


def _projections_saveable(prim: Any, *_, **params: Any) -> bool:
    """`dots_with_no_batch_dims_saveable` for a body vmapped over stages and batch shards (the pipeline).

    Under the two vmaps a projection `x @ w` (both operands per stage and per shard) becomes a dot_general
    with TWO batch dimensions, stage and shard; attention's score and value matmuls have more (batch,
    heads too). Save the former, recompute the latter, as the plain policy does outside a vmap (where it
    would save nothing here: every dot has batch dimensions).
    """
    if prim is jax.lax.dot_general_p:
        (_, _), (lhs_batch, _) = params["dimension_numbers"]
        return len(lhs_batch) <= 2
    return False


def _projections_offloaded(prim: Any, *args: Any, **params: Any) -> Any:
    """`_projections_saveable`, saving to host memory (`offload`)."""
    return _projections_saveable(prim, *args, **params) and Offloadable("device", "pinned_host")


_LAYER = {"none": _all_but_gathered_weights, "full": jax.checkpoint_policies.nothing_saveable,
          "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
          "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")}
_VMAPPED = {"full": jax.checkpoint_policies.nothing_saveable, "dots": _projections_saveable,
            "offload": _projections_offloaded}


def policy(name: str, *, vmapped: bool = False) -> Any:
    """The JAX checkpoint policy of `name` for a layer differentiated as it is traced, or (`vmapped`) for
    a body that is differentiated outside the pipeline's vmaps over stages and batch shards, whose
    projections then carry two batch dimensions. `none` has no vmapped policy: the pipeline runs such a
    body unwrapped."""
    check(name)
    table = _VMAPPED if vmapped else _LAYER
    if name not in table:
        raise InputError(f"remat policy '{name}' has no policy for a vmapped body: run it without a checkpoint")
    return table[name]
