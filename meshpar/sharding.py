"""Apply a `Rules` table: logical names → PartitionSpecs for a state and for activations.

meshpar resolves logical names itself (Flax would pass an unmapped name through as if it were a mesh
axis), so that every mistake fails loudly and names its culprit: the parameter path, its shape, the
dimension and the mesh axis.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshpar import context, fp8, offload
from meshpar.frozen import WEIGHTS
from meshpar.errors import InputError
from meshpar.rules import Rules

Logical = Sequence[str | None]


def spec_for(logical: Logical, shape: Sequence[int], table: Mapping[str, tuple[str, ...]],
             sizes: Mapping[str, int], what: str) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` whose dimensions have the `logical` names, on a mesh of
    these axis `sizes` (`mesh.shape`; the planner passes sizes of a mesh it only considers).

    Mesh axes of size 1 are left out of the spec (they split nothing). `what` names the array in errors.
    """
    if len(logical) != len(shape):
        raise InputError(f"{what}: {len(logical)} logical axes {tuple(logical)} for shape {tuple(shape)}")
    spec: list[str | tuple[str, ...] | None] = []
    owner: dict[str, int] = {}  # mesh axis → the dimension it already splits
    for dim, (name, size) in enumerate(zip(logical, shape)):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise InputError(f"{what}: unknown logical axis '{name}' on dimension {dim} of shape {tuple(shape)}; "
                             f"known: {', '.join(sorted(table))}")
        for axis in table[name]:  # checked whatever the axis size, so a bad table fails on any mesh
            if axis in owner:
                raise InputError(f"{what}: mesh axis '{axis}' would split dimension {owner[axis]} "
                                 f"('{logical[owner[axis]]}') and dimension {dim} ('{name}') of shape "
                                 f"{tuple(shape)}; one mesh axis can split one dimension only")
            owner[axis] = dim
        axes = tuple(axis for axis in table[name] if sizes[axis] > 1)
        ways = math.prod(sizes[axis] for axis in axes)
        if size % ways:
            split = " × ".join(f"{axis}={sizes[axis]}" for axis in axes)
            raise InputError(f"{what}: dimension {dim} ('{name}') of size {size} in shape {tuple(shape)} "
                             f"is not divisible by mesh axes {split}")
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec names, in order."""
    return tuple(a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,)))


def path_name(path: tuple) -> str:
    return "/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def logical_axes(variable: nnx.Variable, path: tuple) -> tuple[str | None, ...]:
    """A variable's logical names; a scalar (an optimizer step count) has none."""
    names = variable.get_metadata().get("out_sharding")
    if names is None and variable.shape:
        raise InputError(f"parameter '{path_name(path)}' of shape {tuple(variable.shape)} has no logical axes: "
                         f"declare them with out_sharding=(...)")
    return tuple(names or ())


def state_specs(abstract_state: nnx.State, mesh: Mesh, rules: Rules, kind: str | None = None) -> nnx.State:
    """Map each variable of an (abstract) NNX state to its PartitionSpec.

    Weights (trained or frozen) follow the `params` table and everything else (the optimizer's moments) the
    `optimizer` table, unless `kind` names one table for all (`"grads"` for a gradient tree).
    """
    specs = {}
    for path, variable in nnx.to_flat_state(abstract_state):
        table = rules.table(kind or ("params" if isinstance(variable, WEIGHTS) else "optimizer"))
        specs[path] = variable.replace(
            spec_for(logical_axes(variable, path), variable.shape, table, mesh.shape, f"parameter '{path_name(path)}'"))
    return nnx.from_flat_state(specs)


def axis_size(abstract_state: nnx.State, logical: str) -> int | None:
    """The size of the logical axis `logical` (e.g. "vocab") in the state's weights, if one names it."""
    for path, variable in nnx.to_flat_state(nnx.state(abstract_state, WEIGHTS)):
        names = logical_axes(variable, path)
        if logical in names:
            return int(variable.shape[names.index(logical)])
    return None


def placed_shapes(state: nnx.State, shardings: nnx.State) -> nnx.State:
    """The state described, not created: each leaf's shape and dtype with its sharding (`ShapeDtypeStruct`),
    what `jit(...).lower` compiles for and what a checkpoint restores into."""
    return jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), state, shardings)


def state_shardings(abstract_state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """NamedShardings for every variable: the `out_shardings` of init and the step's state shardings.

    Under `parallel.offload` the offloaded variables get the same sharding in host memory (meshpar.offload).
    """
    specs = dict(nnx.to_flat_state(state_specs(abstract_state, mesh, rules)))
    shardings = {}
    for path, variable in nnx.to_flat_state(abstract_state):
        kind = offload.HOST if offload.in_host_memory(variable, rules.parallel) else None
        shardings[path] = variable.replace(NamedSharding(mesh, specs[path].get_value(), memory_kind=kind))
    return nnx.from_flat_state(shardings)


def sharding_table(abstract_state: nnx.State, mesh: Mesh, rules: Rules) -> str:
    """A text table: path, shape, logical axes, PartitionSpec, per-device shard shape, bytes per device."""
    specs = dict(nnx.to_flat_state(state_specs(abstract_state, mesh, rules)))
    rows = [("path", "shape", "logical", "spec", "shard", "bytes/device")]
    total = 0
    for path, variable in nnx.to_flat_state(abstract_state):
        sharding = NamedSharding(mesh, specs[path].get_value())
        shard = sharding.shard_shape(variable.shape)
        nbytes = math.prod(shard) * np.dtype(variable.dtype).itemsize
        total += nbytes
        rows.append((path_name(path), str(tuple(variable.shape)), str(logical_axes(variable, path)),
                     str(tuple(sharding.spec)), str(shard), f"{nbytes:,}"))
    rows.append(("total", "", "", "", "", f"{total:,}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def _activation_layout(compute: context.Compute, logical: Logical, shape: Sequence[int]) -> NamedSharding:
    spec = spec_for(logical, shape, compute.rules.table("activations"), compute.mesh.shape, f"activation {tuple(logical)}")
    return NamedSharding(compute.mesh, spec)


def constrain(x: jax.Array, logical: Logical) -> jax.Array:
    """Hint the compiler to lay `x` out by its logical names; a no-op outside a step (`context.use`)."""
    compute = context.active()
    if compute is None:
        return x
    return jax.lax.with_sharding_constraint(x, _activation_layout(compute, logical, x.shape))


def relayout(x: jax.Array, source: Logical, target: Logical) -> jax.Array:
    """`constrain(x, target)` for an `x` laid out by `source`; `x` itself where the two layouts agree. Not
    only tidier: autodiff keeps a constraint's output beside its input when both feed the backward pass
    (a norm's output feeding its scale's gradient and the projections), a second copy of the activation."""
    compute = context.active()
    if compute is None:
        return x
    layout = _activation_layout(compute, target, x.shape)
    return x if _activation_layout(compute, source, x.shape) == layout else jax.lax.with_sharding_constraint(x, layout)


def project(x_BTD: jax.Array, weights: Sequence[jax.Array], outputs: Sequence[Logical]) -> list[jax.Array]:
    """`x · w` for each weight `w` [D, O, ...] (compute layout; FP8 under `train.fp8`: `meshpar.fp8`),
    constrained to its `outputs` layout.

    Where the O axes are split M ways over the same devices (tensor parallelism: q, k, v over heads; gate
    and up over mlp) it is ONE matmul: each weight cut into its M shards along O and the cuts concatenated
    shard by shard, so the concatenation stays on the devices. Then the backward pass all-reduces x's
    gradient once instead of once per weight (the partitioner reduces each matmul's partial gradient by
    itself; XLA:CPU does not sum them first). Only under a remat policy that recomputes the concatenated
    weight (`dots`, `full`, `offload`): with `none` the backward pass would keep it, a whole layer's
    weights more per layer; and not in FP8, where each weight has a scale of its own. Elsewhere, one matmul
    per weight, as written.
    """
    compute = context.active()
    B, T, D = x_BTD.shape
    shapes = [(B, T, *w.shape[1:]) for w in weights]
    ways = {1}  # how many shards each output's O axis has
    if compute is not None and compute.remat != "none" and fp8.active() is None:
        ways = {shape[2] // _activation_layout(compute, logical, shape).shard_shape(shape)[2]
                for logical, shape in zip(outputs, shapes)}
    if len(ways) > 1 or (M := ways.pop()) == 1:
        return [constrain(fp8.matmul(x_BTD, w), logical) for w, logical in zip(weights, outputs)]
    cuts = [w.reshape(D, M, w.shape[1] // M, *w.shape[2:]) for w in weights]
    w_DMC = jnp.concatenate(cuts, axis=2)
    y_BTMC = jnp.tensordot(x_BTD, w_DMC, axes=1)
    parts = jnp.split(y_BTMC, np.cumsum([cut.shape[2] for cut in cuts])[:-1], axis=3)
    return [constrain(y.reshape(shape), logical) for y, shape, logical in zip(parts, shapes, outputs)]


def constrain_grads(grads: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """Lay gradients out by the `grads` table: split over `fsdp` from ZeRO-2 on (a reduce-scatter)."""
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(grads, mesh, rules, "grads"),
                             is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.lax.with_sharding_constraint(grads, shardings)


def gathered(param: nnx.Variable, dtype: jax.typing.DTypeLike, *, lookup: bool = False,
             matmul: bool = False) -> jax.Array:
    """A parameter as compute uses it: cast to `dtype`, then laid out by the ACTIVATION rules.

    That is where FSDP's all-gather happens (`embed` is split over `fsdp` at rest, whole in compute)
    when the weight is cast or its gradient has a layout of its own (ZeRO-2); otherwise the parameter is
    returned as it is and the partitioner gathers it. Tensor-parallel dimensions stay split. The cast
    comes first, pinned to the parameter's own layout behind an optimization barrier: otherwise sharding
    propagation gives the cast's input the gathered layout, and the partitioner gathers float32 and casts
    after. So a bf16 run gathers bf16 weights (after SPMD partitioning; XLA:CPU, which has no bf16
    collectives, widens them again later).
    In the backward pass the gradient is laid out by the `grads` rules right here, where it is made
    (FSDP's reduce-scatter; on CPU an all-reduce and a slice), so the whole gradient of a weight lives
    only until its reduction, not until the end of the backward pass. `lookup=True` for a table that is
    indexed (an embedding), not multiplied: its gradient, a scatter of rows, is reduced whole first and
    split after (constrained straight to the split layout, the partitioner would move every row instead).
    `matmul=True` for a weight that goes into a matmul as it is: under `train.fp8 = tensorwise` it is cast to
    FP8 at rest (its scale from the whole weight) and gathered as FP8, then returned in `dtype` exactly (the
    scale is a power of two), for the FP8 matmul to cast back losslessly (`meshpar.fp8`).
    The logical names are the parameter's own; inside the layer scan the leading `layers` name has
    been sliced off the value, so the last `ndim` names are the ones that apply.
    """
    value = param[...]
    compute = context.active()
    if compute is None:
        return value.astype(dtype)
    if offload.weights_offloaded(compute.rules.parallel):  # this layer's weights, fetched from host memory
        value = offload.to_device(value)
    names = param.get_metadata()["out_sharding"][-value.ndim:] if value.ndim else ()
    what = f"parameter {tuple(names)}"
    layout = lambda kind: NamedSharding(compute.mesh, spec_for(names, value.shape, compute.rules.table(kind),
                                                               compute.mesh.shape, what))
    at_rest, in_compute = layout("params"), layout("activations")
    grads = (in_compute, layout("grads")) if lookup else (layout("grads"),)
    in_fp8 = matmul and compute.fp8 == "tensorwise" and at_rest != in_compute
    # Where the cast changes the dtype it is pinned to the layout at rest (less the axes an enclosing vmap
    # owns, which a constraint inside it may not name).
    owned = lambda entry: entry in compute.vmapped or (isinstance(entry, tuple) and set(entry) & set(compute.vmapped))
    rest = None if jnp.dtype(dtype) == value.dtype and not in_fp8 else NamedSharding(
        compute.mesh, PartitionSpec(*(None if owned(e) else e for e in at_rest.spec)))
    if rest is None and all(g == at_rest for g in grads):
        # Nothing to cast and the gradient keeps the layout at rest: the weight as it is. Where `fsdp` splits
        # it, the partitioner gathers it for the matmul, as in a plain SPMD step, and the backward pass keeps
        # the split weight (a layer scan's own input), not a gathered copy, with no remat policy needed.
        return value
    return _gather(value, jnp.dtype(dtype), rest, in_compute, grads, in_fp8)


_GATHERED = "meshpar_gathered_weight"


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gather(value: jax.Array, dtype: jnp.dtype, rest: NamedSharding | None, compute: NamedSharding,
            grads: tuple[NamedSharding, ...], in_fp8: bool) -> jax.Array:
    if in_fp8:
        cast, scale = fp8.quantize(value, fp8.E4M3, tuple(range(value.ndim)))
    else:
        cast = value.astype(dtype)
    if rest is not None:
        cast = jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(cast, rest))
    cast = checkpoint_name(jax.lax.with_sharding_constraint(cast, compute), _GATHERED)
    return cast.astype(dtype) * scale.astype(dtype) if in_fp8 else cast


def is_weight_gather(prim: jax.extend.core.Primitive, params: dict) -> bool:
    """Whether a remat policy is looking at `gathered`'s custom-VJP call (found by the name it carries)."""
    return prim.name == "custom_vjp_call" and any(
        eqn.primitive.name == "name" and eqn.params.get("name") == _GATHERED for eqn in params["call_jaxpr"].jaxpr.eqns)


def _gather_fwd(value, dtype, rest, compute, grads, in_fp8):
    return _gather(value, dtype, rest, compute, grads, in_fp8), jnp.zeros((), value.dtype)


def _gather_bwd(dtype, rest, compute, grads, in_fp8, like, g):  # FP8 or not: the gradient passes straight
    g = g.astype(like.dtype)
    for layout in grads:  # the gradient's layouts, in turn
        g = jax.lax.with_sharding_constraint(g, layout)
    return (g,)


_gather.defvjp(_gather_fwd, _gather_bwd)


def batch_sharding(mesh: Mesh, rules: Rules, shape: Sequence[int]) -> NamedSharding:
    """The sharding of a token batch `[B, T+1]`: rows by the `batch` rule; the model splits T itself."""
    return NamedSharding(mesh, spec_for(("batch", None), shape, rules.table("activations"), mesh.shape,
                                        f"token batch of shape {tuple(shape)}"))
