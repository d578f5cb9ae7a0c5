"""What both pipeline schedules share: the stage weights in their compute layout, the batch shards, the
shift of activations between stages, the context a stage's layers run in, and the checks.

Each schedule runs every stage at once: a `jax.vmap` over the stage dimension with
`spmd_axis_name="stage"` (the compiler runs stage p on the devices of stage p) and, inside it, one over
the Z = data·fsdp batch shards (`spmd_axis_name` = those axes; a microbatch's rows are already split that
way, so nothing moves), with one copy of the stage weights per shard: each shard accumulates its own
weight gradients across the schedule, and the compiler has nothing to reduce inside the loop (left to
itself it all-reduces every layer's gradient over data × fsdp in every iteration).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar import context, sharding
from meshpar.errors import InputError
from meshpar.pipeline import order
from meshpar.rules import BATCH_AXES

U = P.UNCONSTRAINED


def constrain(x: jax.Array, mesh: Mesh, *spec: Any) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that split a batch: the active rules' `batch`, else `rules.BATCH_AXES`."""
    compute = context.active()
    axes = compute.rules.table("activations").get("batch", BATCH_AXES) if compute is not None else BATCH_AXES
    return tuple(axis for axis in axes if mesh.shape[axis] > 1)


def weight_spec(variable: nnx.Variable, mesh: Mesh, *, stacked: bool) -> tuple[Any, ...]:
    """The compute layout of a weight (of one layer: after the leading layers dim, where `stacked`): its
    FSDP-gathered form, the activation rules applied to its own logical names (what `sharding.gathered`
    does inside a layer: `embed` whole, `heads`/`mlp` over model); without an active Compute, the
    compiler's choice."""
    value = variable[...]
    shape = value.shape[1:] if stacked else value.shape
    compute = context.active()
    names = variable.get_metadata().get("out_sharding")
    if compute is None or names is None:
        return (U,) * len(shape)
    spec = sharding.spec_for(tuple(names)[len(names) - len(shape):], shape, compute.rules.table("activations"),
                             mesh.shape, "pipelined weight")
    return tuple(spec) + (None,) * (len(shape) - len(spec))


def lane_axes(batch: tuple[str, ...]) -> tuple[str, ...]:
    """The batch axes a schedule vmaps over with one copy of the stage weights per shard (its lanes): all but
    `expert`, which also splits a mixture of experts' weights, so the rows of a lane stay split over it."""
    return tuple(axis for axis in batch if axis != "expert")


def lane_context(lanes: tuple[str, ...] | None, batch: tuple[str, ...] = ()) -> context.Compute | None:
    """The active Compute as seen inside the vmaps over stages and batch shards (`lanes`): those mesh axes
    belong to the vmapped dimensions (the rows stay split over the other `batch` axes), the weights are
    already in their compute layout (their at-rest one there: jax 0.11 rejects a vmapped axis such as fsdp
    in a constraint), and each shard's weight gradients stay in the compute layout (reduced once, after
    the loop)."""
    compute = context.active()
    if compute is None:
        return None
    inside = tuple(axis for axis in batch if axis not in (lanes or ()))
    activations = tuple((name, inside if name == "batch" else axes) for name, axes in compute.rules.activations)
    return dataclasses.replace(compute, vmapped=compute.vmapped + ("stage",) + (lanes or ()),
                               rules=dataclasses.replace(compute.rules, params=activations,
                                                         activations=activations, grads=activations))


def shift(x_P: jax.Array, mesh: Mesh) -> jax.Array:
    """Move every stage's output one stage on, round the ring: `out[p] = x[p − 1 mod P]`.

    A `ppermute` over `stage` (the only manual axis; the others stay with the compiler): one
    collective-permute, and its transpose in the backward pass is one too. (As a roll of the stage-split
    buffer the partitioner also emits a collective-permute forward, but splits the transposed roll into
    two, the ring's wrap edge apart, in the backward pass.) With P / p stages per group of devices (p the
    mesh's stage size), only the last of each group's crosses devices.
    """
    p = mesh.shape["stage"]
    if p == 1:
        return jnp.roll(x_P, 1, axis=0)
    ring = [(i, (i + 1) % p) for i in range(p)]

    def local(block: jax.Array) -> jax.Array:
        incoming = jax.lax.ppermute(block[-1:], "stage", ring)
        return jnp.concatenate([incoming, block[:-1]], axis=0)

    compute = context.active()
    vmapped = set(compute.vmapped) if compute is not None else set()  # e.g. gradient accumulation's replicas
    return jax.shard_map(local, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"),
                         axis_names={"stage"} | vmapped)(x_P)


def row_args(args: tuple, rows: int) -> tuple:
    """Which of the layers' extra arguments belong to the rows of the batch (at least 2-D, `rows` first:
    packed documents' positions and ids [B, T]), each kept in its place, None for the others (the same
    for every row, e.g. positions [T]): the schedules hand a stage the rows of the microbatch it runs."""
    return tuple(a if a is not None and a.ndim >= 2 and a.shape[0] == rows else None for a in args)


def lane_args(args: tuple, rows: tuple) -> tuple:
    """A lane's arguments for its layers: its own rows of the per-row ones (`row_args`), the others as given."""
    return tuple(arg if row is None else row for arg, row in zip(args, rows))


def check(layers: int, rows: int, sizes: Mapping[str, int], *, stages: int, microbatches: int, repeats: int,
          batch: tuple[str, ...] = BATCH_AXES) -> None:
    """Refuse what the pipeline cannot run: L layers in P·R chunks, P stages over the mesh's stage axis,
    a batch of B rows into M microbatches whose rows divide over the `batch` mesh axes. The schedules and
    the planner (`meshpar.plan`) both ask this."""
    for name, value in (("stages", stages), ("microbatches", microbatches), ("repeats", repeats)):
        if value < 1:
            raise InputError(f"pipeline: {name} = {value} must be >= 1")
    order.refuse_uneven_chunks(layers, stages, repeats)
    if "stage" not in sizes:
        raise InputError(f"pipeline: the mesh has no 'stage' axis (axes: {', '.join(sizes)})")
    if stages % sizes["stage"]:
        raise InputError(f"pipeline: P = {stages} stages cannot be split over mesh axis stage={sizes['stage']}")
    if rows % microbatches:
        raise InputError(f"pipeline: the batch B = {rows} is not divisible into M = {microbatches} microbatches")
    axes = tuple(axis for axis in batch if sizes[axis] > 1)
    ways, b = math.prod(sizes[axis] for axis in axes), rows // microbatches
    if b % ways:
        split = " × ".join(f"{axis}={sizes[axis]}" for axis in axes)
        raise InputError(f"pipeline: a microbatch of B/M = {rows}/{microbatches} = {b} rows is not divisible by the "
                         f"batch mesh axes {split} = {ways}")
