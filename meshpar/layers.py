"""Run a stack of identical layers (or periods of a pattern of layers): one `lax.scan` over the leading
`layers` axis.

Compile time does not grow with depth, and the stacked axis is what the pipeline splits into stages.
With the mesh's `stage` axis > 1 the stack runs as a pipeline instead (`meshpar.pipeline`).
Rematerialisation is applied per layer, inside the scan, by the active policy (`meshpar.remat`); under
`none` only where a layer gathers weights itself, so that the backward pass gathers them again.

Leading layers that differ from the stack (`model.layer_prefix`: DeepSeek-V3's 3 dense layers before 58
with experts) are a stack of their own, on the logical axis `lead_layers`, which no rule splits: `lead`
runs it, never as a pipeline, since a stage holds whole periods of one structure (a vmap over stages).
They run before the pipelined stack, as the embedding does. GPipe and circular: once, outside the
schedule, with the batch's rows split over `stage` too (where they divide), so each stage computes 1/p of
the rows instead of every stage all of them; the price is the prefix's weights whole over `stage` (split
over fsdp and model as ever), an all-gather over `stage` of its output (B·T·D, about the GPipe I/O
buffer's one all-reduce) and an all-reduce of its weights' gradients over `stage`. 1F1B and zero-bubble
take it in the first part (`stack_input`) on stage 0, per microbatch in each slot, inside the lockstep
slots: every slot is longer by the prefix's forward (and backward), as if each stage held its layers
too, but activation memory stays flat in M (the planner counts them so: `meshpar.plan`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

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


def scan(stack: nnx.Module, x: jax.Array, *args: jax.Array, pipelined: bool = True) -> jax.Array:
    """Apply each layer of `stack` (a module whose variables carry a leading layers axis) to `x` in turn;
    `args` (e.g. positions) are passed to every layer unchanged. `pipelined`: as a pipeline where the
    mesh has stages."""
    graphdef, stacked = nnx.split(stack)

    def one_layer(x: jax.Array, layer: nnx.State) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, layer)(x, *args), None

    compute = context.active()
    if pipelined and compute is not None and compute.mesh.shape["stage"] > 1:  # split into pipeline stages
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


def lead(stack: nnx.Module, x: jax.Array, *args: jax.Array) -> jax.Array:
    """`scan` of a prefix's stack (`lead_layers`), never pipelined; under a pipeline, outside its stages, with
    the rows split over `stage` too (module docstring)."""
    over_stage = _rows_over_stage(context.active(), jax.tree.leaves(x)[0].shape[0])
    with context.use(over_stage) if over_stage is not None else contextlib.nullcontext():
        return scan(stack, x, *args, pipelined=False)


def _rows_over_stage(compute: context.Compute | None, rows: int) -> context.Compute | None:
    """The active Compute with the batch split over `stage` too, where a pipeline's stages would otherwise
    each compute every row (stage > 1, not inside the stages' vmap) and the rows divide; else None."""
    if compute is None or compute.mesh.shape["stage"] == 1 or "stage" in compute.vmapped:
        return None
    activations = compute.rules.table("activations")
    batch = (*activations["batch"], "stage")
    if rows % math.prod(compute.mesh.shape[axis] for axis in batch):
        return None
    table = tuple((name, batch if name == "batch" else axes) for name, axes in compute.rules.activations)
    return dataclasses.replace(compute, rules=dataclasses.replace(compute.rules, activations=table))
