"""Weights that do not train: a LoRA run's base model (`meshpar.lora`), a DPO run's reference model.

A frozen weight is a `Frozen` variable, not an `nnx.Param`. Everything in meshpar that trains takes the
`nnx.Param`s (the step's `jax.value_and_grad`, the optimizer's state and update, clipping's norm, the
pipeline's and offload's gradient paths), so a frozen weight gets no gradient and no optimizer state by
its type alone. Everything that places, gathers or saves weights takes both (`WEIGHTS`): the rules shard a
frozen weight as the parameter it was, FSDP gathers it, checkpoints and exports read it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshpar.errors import InputError


class Frozen(nnx.Variable):
    """A weight that is read, never trained."""


WEIGHTS = (nnx.Param, Frozen)  # an nnx filter: the model's weights, trained or not


def freeze(model: nnx.Module, dtype: jnp.dtype, keep: type[nnx.Module] | None = None) -> nnx.Module:
    """`model` with every `nnx.Param` made `Frozen` in `dtype` (its metadata, logical axes included, kept),
    but those inside modules of type `keep` (a LoRA run's adapters), which stay trainable."""
    for _, module in nnx.iter_modules(model):
        if keep is not None and isinstance(module, keep):
            continue
        for name, value in list(vars(module).items()):
            if type(value) is nnx.Param:  # a module's own weights; a kept module's are its own
                setattr(module, name, Frozen(value[...].astype(dtype), **value.get_metadata()))
    return model


def load(model: nnx.Module, params: nnx.State) -> None:
    """`nnx.update(model, params)`, each value cast to the dtype the model holds it in (a frozen weight's)."""
    held = dict(nnx.to_flat_state(nnx.state(model)))
    nnx.update(model, nnx.from_flat_state({path: v.replace(v[...].astype(held[path].dtype))
                                           for path, v in nnx.to_flat_state(params)}))


def split(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(everything else, the frozen weights) of a state: what a checkpoint saves, and what it leaves out."""
    frozen, rest = nnx.split_state(state, Frozen, ...)
    return rest, frozen


def as_params(state: nnx.State) -> nnx.State:
    """Frozen weights as `nnx.Param`s in float32: a plain model's parameters."""
    return nnx.from_flat_state({path: nnx.Param(v[...].astype(jnp.float32), **v.get_metadata())
                                for path, v in nnx.to_flat_state(state)})


def fingerprint(state: nnx.State) -> dict[str, list[float]]:
    """Each frozen weight's Σ|x| and Σx² (float32): what a checkpoint that leaves the frozen weights out keeps of
    them, so that a resumed run can tell it has the same ones."""
    def sums(x):
        x = x.astype(jnp.float32)
        return jnp.stack([jnp.abs(x).sum(), jnp.square(x).sum()])

    flat = {"/".join(map(str, path)): v[...] for path, v in nnx.to_flat_state(state)}
    if not flat:  # nothing frozen: no program to compile at every run's start
        return {}
    pairs = jax.jit(lambda tree: jax.tree.map(sums, tree))(flat)  # replicated: every process reads its own copy
    return {path: [float(s) for s in np.asarray(pair.addressable_data(0))] for path, pair in pairs.items()}


def check(saved: dict[str, list[float]], now: dict[str, list[float]], where: str, rtol: float = 1e-4,
          fix: str = "start it from the weights it began from (--init-from)") -> None:
    """Refuse frozen weights other than those a checkpoint was trained over: their sums must agree to `rtol` (a
    mesh of another shape adds them up in another order). `fix` says what to do instead."""
    if set(saved) != set(now):
        raise InputError(f"{where} was trained over other frozen weights: {sorted(set(saved) ^ set(now))[0]} is in "
                         f"one and not the other; {fix}")
    for path, sums in saved.items():
        if any(abs(a - b) > rtol * abs(b) for a, b in zip(now[path], sums)):
            raise InputError(f"{where} was trained over other frozen weights: {path} differs (Σ|x|, Σx² "
                             f"{sums[0]:.6g}, {sums[1]:.6g} saved; {now[path][0]:.6g}, {now[path][1]:.6g} now); "
                             f"{fix}")
