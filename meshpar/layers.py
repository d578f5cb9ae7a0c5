"""Run a stack of identical layers (or periods of a pattern of layers): one `lax.scan` over the leading
`layers` axis.

Compile time does not grow with depth, and the stacked axis is what the pipeline splits into stages.
With the mesh's `stage` axis > 1 the stack runs as a pipeline instead (`meshpar.pipeline`).
Rematerialisation is applied per layer, inside the scan, by the active policy (`meshpar.remat`); under
`none` only where a layer gathers weights itself, so that the backward pass gathers them again.
"""

from __future__ import annotations

import jax
from flax import nnx

from meshpar import context, pipeline, remat, sharding
from meshpar.pipeline import schedule


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
        P, parallel = compute.mesh.shape["stage"], compute.rules.parallel
        return pipeline.pipeline(stack, x, *args, mesh=compute.mesh, stages=P,
                                 microbatches=schedule.microbatches(parallel.microbatches, P),
                                 repeats=parallel.pipeline_repeats, remat=compute.remat)
    # `none` needs its policy only where a layer gathers weights: a checkpoint is not free (JAX rounds each
    # saved value with a `reduce_precision` that XLA:CPU keeps, and XLA fuses less across its boundary).
    if compute is not None and (compute.remat != "none"
                                or _gathers_weights(one_layer, x, jax.tree.map(lambda v: v[0], stacked))):
        one_layer = jax.checkpoint(one_layer, policy=remat.policy(compute.remat), prevent_cse=False)
    return jax.lax.scan(one_layer, x, stacked)[0]
