"""Run a stack of identical layers: one `lax.scan` over the leading `layers` axis.

Compile time does not grow with depth, and the stacked axis is what the pipeline splits into stages.
With the mesh's `stage` axis > 1 the stack runs as a pipeline instead (`meshpar.pipeline`).
Rematerialisation is applied per layer, inside the scan, by the active policy:

- `none`: keep every intermediate of every layer for the backward pass (fastest, most memory), but
  not the weights `sharding.gathered` gathered (cast to bf16 under FSDP): the backward pass gathers them
  again; a layer that gathers none runs with no checkpoint at all;
- `dots`: keep only the outputs of matmuls against weights (projections and MLP; not the attention
  scores, whose size grows with T²), recompute the rest (norms, activations, softmax);
- `full`: keep only each layer's input; recompute the whole layer in the backward pass (about one more
  forward pass of compute, activation memory of one layer plus the layer inputs).
- `offload`: what `dots` keeps, kept in host memory instead (copied out in the forward pass, back in
  the backward pass); the devices keep what `full` keeps. On XLA:CPU, where host memory is device
  memory, it compiles to `dots`.
"""

from __future__ import annotations

import jax
from flax import nnx

from meshpar import context, pipeline, sharding


def _all_but_gathered_weights(prim, *_, **params) -> bool:
    """`none`: keep every value the layer computes but its gathered weights (`sharding.gathered`), which
    the backward pass gathers again, as a plain step does. Kept, the scan would stack every layer's
    gathered weights ([L, D, F] whole per device under FSDP) for the backward pass."""
    return not sharding.is_weight_gather(prim, params)


_POLICIES = {
    "none": _all_but_gathered_weights,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def _gathers_weights(fn, *args) -> bool:
    """Whether `fn(*args)` passes a weight through `sharding.gathered`'s gather (a cast, or a gradient
    layout of its own), found by tracing it (nested jaxprs included)."""

    def found(jaxpr) -> bool:
        return any(sharding.is_weight_gather(eqn.primitive, eqn.params)
                   or any(hasattr(inner := getattr(p, "jaxpr", p), "eqns") and found(inner) for p in eqn.params.values())
                   for eqn in jaxpr.eqns)

    return found(jax.make_jaxpr(fn)(*args).jaxpr)


def scan(stack: nnx.Module, x: jax.Array, *args: jax.Array) -> jax.Array:
    """Apply each layer of `stack` (a module whose variables carry a leading layers axis) to `x` in turn;
    `args` (e.g. positions) are passed to every layer unchanged."""
    graphdef, stacked = nnx.split(stack)

    def one_layer(x: jax.Array, layer: nnx.State) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, layer)(x, *args), None

    compute = context.active()
    if compute is not None and compute.mesh.shape["stage"] > 1:  # split into pipeline stages
        S, parallel = compute.mesh.shape["stage"], compute.rules.parallel
        return pipeline.pipeline(stack, x, *args, mesh=compute.mesh, stages=S,
                                 microbatches=parallel.microbatches or 2 * S, repeats=parallel.pipeline_repeats,
                                 remat=compute.remat)
    # `none` needs its policy only where a layer gathers weights: a checkpoint is not free (JAX rounds each
    # saved value with a `reduce_precision` that XLA:CPU keeps, and XLA fuses less across its boundary).
    if compute is not None and (compute.remat != "none"
                                or _gathers_weights(one_layer, x, jax.tree.map(lambda v: v[0], stacked))):
        one_layer = jax.checkpoint(one_layer, policy=_POLICIES[compute.remat], prevent_cse=False)
    return jax.lax.scan(one_layer, x, stacked)[0]
