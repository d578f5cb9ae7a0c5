"""LoRA: a trainable low-rank update s·A·B beside each targeted weight W of a frozen model (Hu et al., 2021).

A weight W [in..., out...] gets an `Adapter`: A [in..., R] and B [R, out...], R the rank, B starting at 0,
so training starts from the model as it is. The layer computes x·W + s·(x·A)·B, s = alpha / R (rsLoRA:
alpha / √R, Kalajdzievski 2023): the low-rank path never builds a W-sized array, and its backward pass has
no W-sized weight gradient. A mixture's experts [E, in, out] are the exception: the dispatch
(`meshpar.moe`) takes whole expert weights, so each layer merges W + s·A·B per expert as it runs, as PEFT
does for them.

The adapters carry the logical axes of the weight they adapt (A its input axes, B its output axes, the rank
none), so the rules lay them out on every mesh as they lay W out. Everything else of the model is frozen
(`meshpar.frozen`): no gradient, no optimizer state, held in `train.frozen_dtype`.

Targets (`train.lora_targets`): q, k, v, o (attention's projections), gate, up, down (the MLP's, and the
shared experts'), experts (every routed expert's gate, up and down). Latent attention (DeepSeek's MLA,
`models.latent_attention`) has other projections: q names its query's (W_q, or W_q_a and W_q_b), o its output's,
and k with v its two kv projections (W_kv_a, W_kv_b), each of which feeds both the keys and the values, so k
and v go together there; q_a, q_b, kv_a, kv_b name one of them each (PEFT's q_a_proj, q_b_proj,
kv_a_proj_with_mqa, kv_b_proj), and only they apply there.

Adapters can be switched off while a function is traced (`disabled`): a DPO run's reference model is the
base itself, with no second copy of its weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar import frozen
from meshpar.errors import InputError
from meshpar.sharding import gathered

LATENT = ("q_a", "q_b", "kv_a", "kv_b")  # latent attention's projections, one each
TARGETS = ("q", "k", "v", "o", *LATENT, "gate", "up", "down", "experts")
SUFFIX = "_lora"  # weight `w` has its adapter at `w_lora`


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False

    def __post_init__(self):
        if self.rank < 1:
            raise InputError(f"train.lora_rank = {self.rank} must be >= 1 (0: no adapters)")
        if not self.alpha > 0:
            raise InputError(f"train.lora_alpha = {self.alpha} must be > 0")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            culprit = f"{unknown[0]!r} is not" if unknown else "name at least"
            raise InputError(f"train.lora_targets = '{','.join(self.targets)}': {culprit} one of {', '.join(TARGETS)}")
        # in one order, however they are written: settings that name the same targets are equal
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in self.targets))

    @property
    def scale(self) -> float:
        """s: alpha / rank, or alpha / √rank with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class Adapter(nnx.Module):
    """The low-rank update of one weight [lead..., in..., out...]: `a` [lead..., in..., R] and `b` [lead..., R,
    out...], the lead axes (a mixture's experts) batching it. `a` starts uniform in ±1/√fan-in (PEFT's, from
    torch's Linear), `b` at 0."""

    def __init__(self, weight: nnx.Param, lead: int, inputs: int, cfg: LoraConfig, rngs: nnx.Rngs):
        shape, axes = weight.shape, weight.get_metadata()["out_sharding"]
        ins, R = lead + inputs, cfg.rank
        bound = math.prod(shape[lead:ins]) ** -0.5
        self.a = nnx.Param(jax.random.uniform(rngs.params(), (*shape[:ins], R), jnp.float32, -bound, bound),
                           out_sharding=(*axes[:ins], None))
        self.b = nnx.Param(jnp.zeros((*shape[:lead], R, *shape[ins:]), jnp.float32),
                           out_sharding=(*axes[:lead], None, *axes[ins:]))
        self.lead, self.scale = lead, cfg.scale

    def __call__(self, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """s·(x·A)·B for x [..., in...] (no lead axes). (x·A)·B runs as a batch of one matmul: the `dots` remat
        policies keep the outputs of unbatched matmuls for the backward pass, and this one is as large as the
        projection's own output, which they keep already; recomputing it costs a rank-R matmul."""
        a, b = gathered(self.a, dtype), gathered(self.b, dtype)
        xa = jnp.tensordot(x, a, axes=a.ndim - 1) * jnp.asarray(self.scale, dtype)  # [..., R]: small, kept
        R = a.shape[-1]
        update = jax.lax.dot_general(xa.reshape(1, -1, R), b.reshape(1, R, -1), (((2,), (1,)), ((0,), (0,))))
        return update.reshape(*xa.shape[:-1], *b.shape[1:])

    def delta(self, dtype: jnp.dtype) -> jax.Array:
        """s·A·B [lead..., in..., out...] (a batched matmul over the experts: recomputed, not kept, by `dots`)."""
        return delta(gathered(self.a, dtype), gathered(self.b, dtype), self.lead, self.scale)


def delta(a: jax.Array, b: jax.Array, lead: int, scale: float) -> jax.Array:
    """s·A·B of A [lead..., in..., R] and B [lead..., R, out...], batched over the `lead` axes."""
    lead_shape, in_shape, out_shape = a.shape[:lead], a.shape[lead:-1], b.shape[lead + 1:]
    a_LIR = a.reshape(*lead_shape, math.prod(in_shape), a.shape[-1])
    b_LRO = b.reshape(*lead_shape, b.shape[lead], math.prod(out_shape))
    return (jnp.matmul(a_LIR, b_LRO) * jnp.asarray(scale, a.dtype)).reshape(*lead_shape, *in_shape, *out_shape)


def attach(module: nnx.Module, weight: str, target: str | tuple[str, ...], cfg: LoraConfig | None,
           rngs: nnx.Rngs, *, inputs: int = 1, lead: int = 0) -> None:
    """Give `module.<weight>` an adapter (at `<weight>_lora`) if `target` (or one of a tuple of targets that
    name it) is one of `cfg`'s; `inputs` of its axes after `lead` batching ones are its input."""
    named = (target,) if isinstance(target, str) else target
    if cfg is not None and set(named) & set(cfg.targets):
        setattr(module, weight + SUFFIX, Adapter(getattr(module, weight), lead, inputs, cfg, rngs))


def on_frozen_base(make_model, dtype: jnp.dtype):
    """The factory of `make_model`'s model (built with adapters) with every weight but the adapters frozen in
    `dtype`."""
    return lambda rngs: frozen.freeze(make_model(rngs), dtype, keep=Adapter)


_enabled = contextvars.ContextVar("meshpar_lora_enabled", default=True)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Trace the model without its adapters: the base model (a DPO run's reference)."""
    token = _enabled.set(False)
    try:
        yield
    finally:
        _enabled.reset(token)


def _adapter(module: nnx.Module, weight: str) -> Adapter | None:
    return getattr(module, weight + SUFFIX, None) if _enabled.get() else None


def add(module: nnx.Module, weight: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """`y` = x·W plus W's low-rank update of `x`, where the module adapts W (and adapters are on)."""
    adapter = _adapter(module, weight)
    return y if adapter is None else y + adapter(x, y.dtype)


def weight(module: nnx.Module, name: str, dtype: jnp.dtype) -> jax.Array:
    """The weight `name` as a matmul takes it (`sharding.gathered`), its low-rank update merged in where adapted."""
    adapter = _adapter(module, name)
    w = gathered(getattr(module, name), dtype, matmul=adapter is None)
    return w if adapter is None else w + adapter.delta(dtype)


def merged(params: nnx.State, cfg: LoraConfig) -> nnx.State:
    """The model's weights (trained or frozen) with each adapter folded into its weight, W + s·A·B, as
    `nnx.Param`s in float32 and without the adapters: a plain model's parameters, for export or generation."""
    flat = dict(nnx.to_flat_state(params))
    out = {}
    for path, variable in flat.items():
        if _is_adapter(path):
            continue
        value = variable[...].astype(jnp.float32)
        adapter = path[:-1] + (path[-1] + SUFFIX,)
        if adapter + ("a",) in flat:
            a, b = flat[adapter + ("a",)][...], flat[adapter + ("b",)][...]
            lead = b.ndim - 1 - (value.ndim - (a.ndim - 1))  # the batching axes: stacked layers, experts
            value = value + delta(a.astype(jnp.float32), b.astype(jnp.float32), lead, cfg.scale)
        out[path] = nnx.Param(value, **variable.get_metadata())
    return nnx.from_flat_state(out)


def _is_adapter(path: tuple) -> bool:
    return any(str(key).endswith(SUFFIX) for key in path)


def adapters(params: nnx.State) -> nnx.State:
    """The adapters of a model's state (what `launch.convert to-peft` writes)."""
    return nnx.from_flat_state({path: v for path, v in nnx.to_flat_state(params) if _is_adapter(path)})


def base(params: nnx.State) -> nnx.State:
    """A model's state without its adapters: the weights they adapt (not merged), and the others."""
    return nnx.from_flat_state({path: v for path, v in nnx.to_flat_state(params) if not _is_adapter(path)})


def has_adapters(model: nnx.Module) -> bool:
    return any(isinstance(module, Adapter) for _, module in nnx.iter_modules(model))
