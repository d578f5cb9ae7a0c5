"""The order a pipelined layer stack is kept in at rest, and back to layer order for checkpoints.

At rest the `[L, ...]` stack is split over the mesh's `stage` axis in p (its size) contiguous blocks. With
R > 1 (the circular schedule: each of P stages runs R chunks of J = L/(P·R) layers) it is kept in the
order that puts each stage group's R chunks in its own block: block g holds chunk r of group g, r = 0 …
R−1, in turn, so the schedule's view [R, P, J] is a local reshape and no weight, nor gradient, crosses
stages in a step (kept in layer order, it took an all-to-all of every stacked weight per step and one of
its gradient back). Init and restore put the layers in that order (`to_rest`); checkpoints hold them in
layer order (`to_layers`, one all-to-all over `stage` per stacked array at each save, into a copy that
lives until the save has it on the host), so any layout resumes any other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.errors import InputError


def to_rest(state: nnx.State, mesh: Mesh, repeats: int) -> nnx.State:
    """`state` (arrays laid out on `mesh`) with each stacked variable's `layers` axis from layer order into
    the pipeline's order at rest; each array keeps its sharding. The identity unless stage > 1 and R > 1.

    Position (g, r, j) holds layer (r·p + g)·J + j (p the mesh's stage size, J = L/(p·R)), so the
    interleaved view [R, P, L/(R·P)] is a local reshape for any P divisible by p."""
    return _reordered(state, mesh, repeats, to_rest=True)


def to_layers(state: nnx.State, mesh: Mesh, repeats: int) -> nnx.State:
    """The inverse of `to_rest`: stacked variables (and their gradients) back in layer order."""
    return _reordered(state, mesh, repeats, to_rest=False)


def _reordered(state: nnx.State, mesh: Mesh, repeats: int, *, to_rest: bool) -> nnx.State:
    if mesh.shape["stage"] == 1 or repeats == 1:
        return state

    def one(variable: nnx.Variable) -> nnx.Variable:
        names = tuple(variable.get_metadata().get("out_sharding") or ())
        if "layers" not in names:
            return variable
        value = variable[...]
        layout = value.sharding if isinstance(value.sharding, NamedSharding) else NamedSharding(mesh, P())
        return variable.replace(swap_chunks(value, layout, names.index("layers"), repeats, to_rest))

    return jax.tree.map(one, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def refuse_uneven_chunks(L: int, stages: int, repeats: int) -> None:
    """Refuse a stack of L entries that P stages × R repeats cannot split into equal chunks."""
    if L % (stages * repeats):
        raise InputError(f"pipeline: L = {L} stacked layers are not divisible by P = {stages} stages × R = {repeats} "
                         f"repeats (with model.layer_pattern, L counts its periods: a chunk holds whole ones)")


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def swap_chunks(x: jax.Array, layout: NamedSharding, dim: int, repeats: int, to_rest: bool) -> jax.Array:
    """Axis `dim` of `x` viewed as [R, p, J] (layer order) → [p, R, J] (at rest), or back; laid out as `x`.

    The p blocks stay on `stage` through the swap, so the exchange is one all-to-all over `stage` (into
    the view for `to_rest`, out of it for `to_layers`), never a gather of the whole stack.
    """
    mesh, p, L = layout.mesh, layout.mesh.shape["stage"], x.shape[dim]
    refuse_uneven_chunks(L, p, repeats)
    spec = (*layout.spec, *(None,) * (x.ndim - len(layout.spec)))
    before, after = spec[:dim], spec[dim + 1:]

    def blocks(y: jax.Array, p_at: int) -> jax.Array:  # the layers axis as 3 dims, the p blocks on `stage`
        view = tuple("stage" if i == p_at else None for i in range(3))
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(*before, *view, *after),
                                                                 memory_kind=layout.memory_kind))

    source, p_at = ((repeats, p), 1) if to_rest else ((p, repeats), 0)
    y = blocks(x.reshape(*x.shape[:dim], *source, L // (p * repeats), *x.shape[dim + 1:]), p_at)
    y = blocks(jnp.swapaxes(y, dim, dim + 1), 1 - p_at)
    return jax.lax.with_sharding_constraint(y.reshape(x.shape), layout)
