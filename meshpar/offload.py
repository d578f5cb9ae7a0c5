"""Host offload: the optimizer state, and optionally the float32 weights, kept in host memory (ZeRO-Offload).

`parallel.offload` chooses what lives in the host memory of each device's host ("pinned_host" memory
kind), in the same sharding it would have on the devices:

| offload          | in host memory, per device                     | device bytes saved (Ψ parameters) |
|------------------|------------------------------------------------|-----------------------------------|
| none             | –                                              | –                                 |
| optimizer        | the Adam moments                               | 8Ψ / N_opt                        |
| optimizer+params | the moments and the float32 weights            | 8Ψ / N_opt + 4Ψ / N_params        |

(N_opt, N_params: the ways the `optimizer` / `params` rules split them: ZeRO stage, FSDP, TP, PP.)

Where things run. The forward and backward passes and the update run on the devices; host memory only
stores. Under `optimizer+params` each weight is fetched to the device where a layer uses it
(`sharding.gathered`, inside the layer scan: one layer at a time) and its gradient, the transpose of
that fetch, lands in host memory. The update (`update`) streams: a loop over the stacked `[L, ...]`
weights brings one layer's moments (and weights and gradients) to the devices, updates them and writes
them back to host memory over that layer of the donated stacks, so the devices hold one layer's share at
a time, never a whole stack of old or new values; the embedding, head and final norm follow in one more
pass. Host↔device traffic per step and device: 16Ψ/N_opt for `optimizer` (moments in and out);
`optimizer+params` adds 8Ψ/N_params of weight fetches (forward and backward), 4Ψ/N of gradients out, and
the weights and gradients in and weights out for the update (12Ψ/N).
`optimizer+params` needs the backward pass to fetch the weights again, so `train.remat=none`, which
would keep every layer's fetched weights on the device until the backward pass, is refused with it.

The step count and other scalars stay on the devices. On XLA:CPU host and device memory are the same
RAM (the placement is recorded and honoured, the copies are no-ops), so tests here prove the numbers
and the memory accounting (`meshpar.compiler.memory_per_device` reads the placement from the compiled
program); the speed is a GPU's to measure.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshpar.errors import InputError
from meshpar.frozen import WEIGHTS
from meshpar.moe import routing
from meshpar.rules import ParallelConfig

HOST = "pinned_host"


def in_host_memory(variable: nnx.Variable, parallel: ParallelConfig) -> bool:
    """Whether this state variable lives in host memory under `parallel.offload`."""
    if parallel.offload == "none" or not variable.shape or isinstance(variable, routing.SelectionBias):
        return False  # scalars (step counts) and the selection biases (E floats, moved by the step) stay
    return parallel.offload == "optimizer+params" or not isinstance(variable, WEIGHTS)


def weights_offloaded(parallel: ParallelConfig) -> bool:
    return parallel.offload == "optimizer+params"


def to_device(tree):
    """Each array of `tree` in device memory, moved one by one (a no-op for arrays already there)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def check(parallel: ParallelConfig, remat: str) -> None:
    """Refuse what host offload cannot run (the remat policy is the one the step runs)."""
    if weights_offloaded(parallel) and remat == "none":
        raise InputError("parallel.offload = 'optimizer+params' with train.remat = 'none' would keep every "
                         "layer's fetched weights on the devices until the backward pass: use train.remat = "
                         "dots, full or offload")


def _layered(model: nnx.Module) -> Any:
    """The model's weights as a tree of bools: True for a stacked `[L, ...]` weight (`layers` first)."""
    return jax.tree.map(lambda v: (v.get_metadata().get("out_sharding") or (None,))[0] == "layers",
                        nnx.state(model, routing.TRAINED), is_leaf=lambda v: isinstance(v, nnx.Variable))


def global_norm(model: nnx.Module, grads: nnx.State) -> jax.Array:
    """The gradient's global norm (what clipping uses), the stacked gradients read a layer at a time."""
    leaves, structure = jax.tree.flatten(nnx.as_pure(grads))
    marks = structure.flatten_up_to(_layered(model))
    squares = lambda gs: sum(jnp.sum(jnp.square(g)) for g in to_device(gs))
    stacked = jax.lax.scan(lambda total, layer: (total + squares(layer), None), jnp.zeros((), jnp.float32),
                           [g for g, m in zip(leaves, marks) if m])[0]
    return jnp.sqrt(stacked + squares([g for g, m in zip(leaves, marks) if not m]))


def _like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """`x` in the memory `ref` lives in (host memory for an offloaded array)."""
    return jax.device_put(x, jax.typeof(ref).memory_space)


def update(opt: nnx.Optimizer, model: nnx.Module, grads: nnx.State, clip_scale: jax.Array,
           keep: jax.Array | None = None) -> None:
    """`opt.update(model, grads)` with the offloaded arrays brought to the devices a layer at a time.

    A loop over the stacked `[L, ...]` weights moves one layer's weights, gradients and moments in,
    updates them and writes them back where they live, over that layer of the stacks it carries, so the
    devices hold one layer's share, not a whole stack; the other weights (embedding, head, final norm)
    are updated in a second pass. The optimizer may clip only by the global norm (as `train.optimizer`
    does): the gradients are multiplied by the whole tree's `clip_scale` (`train.clip_scale`) first, so
    each pass's own clip lets them through. Where `keep` (a scalar bool) is true, every value stays as it was.
    """
    tx = opt.tx
    params = nnx.as_pure(nnx.state(model, routing.TRAINED))
    p_def = jax.tree.structure(params)
    p_marks = p_def.flatten_up_to(_layered(model))
    p_leaves, g_leaves = jax.tree.leaves(params), p_def.flatten_up_to(nnx.as_pure(grads))
    opt_state = nnx.as_pure(opt.opt_state)
    is_params = lambda x: jax.tree.structure(x) == p_def  # the moments: trees shaped like the params
    marks = jax.tree.map(lambda x: jax.tree.unflatten(p_def, p_marks) if is_params(x) else None, opt_state,
                         is_leaf=is_params)
    s_marks = jax.tree.leaves(marks, is_leaf=lambda x: x is None)  # True / False per moment, None: a count
    s_leaves, s_def = jax.tree.flatten(opt_state)
    empty = jnp.zeros((0,), jnp.float32)  # a pass sees the other group's leaves as empty arrays

    def one_pass(p_in: list, g_in: list, s_in: list) -> tuple[list, list]:
        p = jax.tree.unflatten(p_def, to_device(p_in))
        g = jax.tree.unflatten(p_def, [x * clip_scale.astype(x.dtype) for x in to_device(g_in)])
        s = jax.tree.unflatten(s_def, to_device(s_in))
        updates, s_new = tx.update(g, s, p)
        p_new, s_new = jax.tree.leaves(optax.apply_updates(p, updates)), jax.tree.leaves(s_new)
        if keep is not None:
            p_new = [jnp.where(keep, old, new) for old, new in zip(jax.tree.leaves(p), p_new)]
            s_new = [jnp.where(keep, old, new) for old, new in zip(jax.tree.leaves(s), s_new)]
        return p_new, s_new

    def group(leaves: list, marks: list, layer: list | None = None) -> list:
        """One pass's leaves: this layer's slices of the stacks (`layer`), or the rest; counts always."""
        if layer is None:
            return [empty if m is True else x for x, m in zip(leaves, marks)]
        sliced = iter(layer)
        return [next(sliced) if m is True else x if m is None else empty for x, m in zip(leaves, marks)]

    stacks = lambda leaves, marks: [x for x, m in zip(leaves, marks) if m is True]
    g_stacks = stacks(g_leaves, p_marks)

    def one_layer(i, carry):
        # layer i's new values overwrite it in the carried stacks, where they live: the loop updates the donated
        # stacks in place (a scan's stacked outputs would be a second, whole stack of new values on the device)
        p_stacks, s_stacks = carry
        take = lambda xs: [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs]
        p_new, s_new = one_pass(group(p_leaves, p_marks, take(p_stacks)), group(g_leaves, p_marks, take(g_stacks)),
                                group(s_leaves, s_marks, take(s_stacks)))
        put = lambda xs, new: [jax.lax.dynamic_update_index_in_dim(x, _like(n, x), i, 0) for x, n in zip(xs, new)]
        return put(p_stacks, stacks(p_new, p_marks)), put(s_stacks, stacks(s_new, s_marks))

    p_stacked, s_stacked = jax.lax.fori_loop(0, g_stacks[0].shape[0], one_layer,
                                             (stacks(p_leaves, p_marks), stacks(s_leaves, s_marks)))
    p_rest, s_rest = one_pass(group(p_leaves, p_marks), group(g_leaves, p_marks), group(s_leaves, s_marks))
    p_stacked, s_stacked = iter(p_stacked), iter(s_stacked)
    new_p = [next(p_stacked) if m is True else _like(x, ref) for x, ref, m in zip(p_rest, p_leaves, p_marks)]
    new_s = [next(s_stacked) if m is True else _like(x, ref) for x, ref, m in zip(s_rest, s_leaves, s_marks)]
    nnx.update(model, jax.tree.unflatten(p_def, new_p))
    nnx.update(opt.opt_state, nnx.state(jax.tree.unflatten(s_def, new_s)))
    opt.step[...] += 1 if keep is None else jnp.where(keep, 0, 1)
