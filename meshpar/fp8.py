"""FP8 matmuls with current scaling (`train.fp8`): e4m3 activations and weights, e5m2 gradients.

A matmul x [batch..., M..., K...] · w [batch..., K..., N...] runs on its operands cast to FP8, each divided
by a float32 scale first and the product multiplied by both scales after; its backward pass runs the two
gradient matmuls the same way, with the output gradient in e5m2 (wider range, for gradients' spread).
The scales are computed from the tensors at hand (current scaling, torchtitan's and Megatron's default), so
there is no state: nothing to checkpoint, nothing stale after a resume or onto another mesh.

- `tensorwise`: one scale per tensor. The backward pass reuses the forward's FP8 copies of x and w (the
  residuals kept are FP8: half of bf16), and a weight split over `fsdp` is gathered as FP8
  (`sharding.gathered(..., matmul=True)`).
- `rowwise`: one scale per row of each operand along the dimensions the matmul contracts (per token for
  x, per output column for w), finer where outliers sit in a few rows. Each of the three matmuls contracts
  other dimensions, so the backward pass quantises x and w again from the compute dtype, and weights are
  gathered in the compute dtype, as torchtitan's rowwise recipe does.
- A mixture's experts: one scale per tensor in both recipes (`grouped`; an expert's rows are spread over
  devices).

A tensor's scale is the whole tensor's, as one device would take it (its amax reduced over the devices that
hold its parts), so a layout computes what one device does; a microbatch (accumulation, a pipeline's) and
a data-parallel replica inside accumulation's vmap scale their own tensors. A scale is a power of two, the
smallest with amax / scale ≤ the format's largest value, and no smaller than 2^-63 (`scale`): dividing by
it is exact in any float dtype, so a tensor already quantised (an FP8-gathered weight) quantises to the same
FP8 values again, and x / scale loses nothing before the cast's own rounding.

The casts, the clip and the dequantisation are Flax's (`flax.linen.fp8_ops`). Flax's FP8 dot is delayed
scaling (an amax history per operand, updated through the gradients) and JAX's `jax.nn.scaled_dot_general`
is block scaling (MXFP8, NVFP4, on Blackwell's cuDNN): neither is tensorwise or rowwise current scaling,
which is this module's. XLA's GPU compiler turns each FP8 dot_general into a cuBLASLt FP8 GEMM
(`__cublas$lt$matmul$f8`) on Hopper and Blackwell; XLA:CPU runs the same program by widening the operands.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops

from meshpar import context
from meshpar.errors import InputError
from meshpar.hardware import Hardware, for_device_kind

RECIPES = ("none", "tensorwise", "rowwise")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The smallest scale, 2^-63: the product of two, what an FP8 GEMM's output is multiplied by, stays a float32 (and
# bfloat16) normal, ≥ 2^-126. A tensor of amax under the format's largest value · 2^-63 (5e-17 in e4m3) is quantised
# more coarsely than its own scale would (torchao's float8 floors the amax at 1e-12).
MIN_EXPONENT = -63


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a matmul's scales are taken: per row (`rowwise`) or per tensor, their amax also maximised over
    the manual mesh `axes` of an enclosing `shard_map` (whose arrays are one device's part of the tensor):
    over those an operand varies over where the shard_map tracks that (`checked`, its check_vma), else all."""

    rowwise: bool
    axes: tuple[str, ...] = ()
    checked: bool = True

    def devices(self, t: jax.Array) -> tuple[str, ...]:
        """The mesh axes t's amax is maximised over (none is needed where t is the same on every device)."""
        return tuple(a for a in self.axes if a in _varying(t)) if self.checked else self.axes


def unsupported(recipe: str, hw: Hardware, what: str) -> str | None:
    """Why `recipe` cannot run on `hw` (named `what`): FP8 matmuls need FP8 tensor cores (Hopper and later);
    without them XLA would run them widened, slower than bf16. None: it can."""
    if recipe == "none" or hw.fp8_flops:
        return None
    return (f"train.fp8 = '{recipe}' needs FP8 tensor cores (Hopper: H100, H200; Blackwell: B200); {what} has "
            f"none: set train.fp8 = none")


def check(recipe: str, device: jax.Device) -> None:
    """Refuse FP8 matmuls on a GPU without FP8 tensor cores (`unsupported`). XLA:CPU runs them widened, which is
    what the tests run; a GPU with no preset passes."""
    hw = for_device_kind(device.device_kind) if device.platform == "gpu" else None
    if hw is not None and (problem := unsupported(recipe, hw, device.device_kind)):
        raise InputError(problem)


def active() -> Recipe | None:
    """The active step's recipe (`train.fp8`); None: matmuls in the compute dtype, as outside a step."""
    compute = context.active()
    if compute is None or compute.fp8 == "none":
        return None
    return Recipe(rowwise=compute.fp8 == "rowwise")


def for_experts(axes: tuple[str, ...], checked: bool = True) -> Recipe | None:
    """The recipe of a mixture's expert matmuls inside the dispatch's `shard_map`, manual over the mesh `axes`
    (`checked`: its check_vma): one scale per tensor, its amax over every device's part (None: no FP8)."""
    return None if active() is None else Recipe(rowwise=False, axes=axes, checked=checked)


def matmul(x: jax.Array, w: jax.Array, *, contract: int = 1, batch: int = 0,
           recipe: Recipe | None = None) -> jax.Array:
    """x [batch..., M..., K...] · w [batch..., K..., N...] → [batch..., M..., N...] in x's dtype, K the last
    `contract` axes of x, the leading `batch` axes shared: FP8 under `recipe` (where not given, the active
    one)."""
    recipe = recipe or active()
    dims = (tuple(range(x.ndim - contract, x.ndim)), tuple(range(batch, batch + contract)))
    if recipe is None:
        return jax.lax.dot_general(x, w, (dims, (tuple(range(batch)),) * 2)).astype(x.dtype)
    return _fp8_matmul(x, w, contract, batch, recipe, _varies(x, w))


def grouped(op: Callable[..., jax.Array], x: jax.Array, w: jax.Array, *args: jax.Array,
            recipe: Recipe) -> jax.Array:
    """`op(x, w, *args)`, an op linear in x and in w (a mixture's grouped matmul: `jax.lax.ragged_dot`), on x
    and w cast to FP8 with one scale each (whatever the recipe: an expert's rows are spread over devices),
    its backward pass JAX's own transposes of `op` on the FP8 operands and an e5m2 output gradient. XLA's
    GPU compiler turns a matmul of operands dequantised by a scalar into an FP8 GEMM."""
    return _grouped(op, recipe, _varies(x, w), x, w, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grouped(op, recipe, varies, x, w, *args):
    return _grouped_forward(op, recipe, varies, x, w, *args)[0]


def _grouped_forward(op, recipe, varies, x, w, *args):
    (qx, sx), (qw, sw) = (quantize(t, E4M3, tuple(range(t.ndim)), recipe.devices(t)) for t in (x, w))
    y = op(dequantize(qx, sx, x.dtype), dequantize(qw, sw, w.dtype), *args)
    return y, (_kept(qx), sx, jnp.zeros((), x.dtype), _kept(qw), sw, jnp.zeros((), w.dtype), args)


def _grouped_backward(op, recipe, varies, residuals, g):
    qx, sx, x_like, qw, sw, w_like, args = residuals
    qx, qw = _restored(qx, E4M3), _restored(qw, E4M3)
    qg, sg = quantize(g, E5M2, tuple(range(g.ndim)), recipe.devices(g))
    _, transpose = jax.vjp(lambda x, w: op(x, w, *args), dequantize(qx, sx, x_like.dtype),
                           dequantize(qw, sw, w_like.dtype))
    return (*_summed(transpose(dequantize(qg, sg, g.dtype)), varies), *(None for _ in args))


_grouped.defvjp(_grouped_forward, _grouped_backward)


def scale(t: jax.Array, fp8: jnp.dtype, over: tuple[int, ...], axes: tuple[str, ...] = ()) -> jax.Array:
    """The power-of-two scale of `t` for the `fp8` format, its amax taken over the dimensions `over` (kept as
    size 1) and the mesh `axes`: the smallest 2^k with amax / 2^k ≤ the format's largest value, at least
    2^MIN_EXPONENT (an amax / largest value below float32's normals would otherwise make a scale of 0 and
    quantise to 0/0); 1 where the amax is 0 or not finite.

    k is read from the exponents of amax and of the largest value, and 2^k built from its bits: exact on any
    backend (XLA:CPU computes log2 and exp2 through log and exp, a few ulps off, so each program, as fused,
    would round its own not-quite-power-of-two scales)."""
    amax = jnp.max(jnp.abs(t.astype(jnp.float32)), axis=over, keepdims=True)
    if axes:
        amax = jax.lax.pmax(amax, axes)
    top_mantissa, top_exponent = np.frexp(np.float32(jnp.finfo(fp8).max))
    mantissa, exponent = jnp.frexp(amax)  # amax = mantissa · 2^exponent, mantissa in [0.5, 1)
    k = jnp.maximum(exponent - top_exponent + (mantissa > top_mantissa), MIN_EXPONENT)
    power = jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)  # float32's biased exponent, no mantissa
    return jnp.where((amax > 0) & jnp.isfinite(amax), power, 1.0)


def quantize(t: jax.Array, fp8: jnp.dtype, over: tuple[int, ...], axes: tuple[str, ...] = ()
             ) -> tuple[jax.Array, jax.Array]:
    """`t` in `fp8` and its float32 scale (`scale`): t ≈ q · scale."""
    s = scale(t, fp8, over, axes)
    return fp8_ops.quantize(t, fp8, s, t.dtype), s


def dequantize(q: jax.Array, s: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """q · scale in `dtype`: exact, the scale a power of two."""
    return fp8_ops.dequantize(q, dtype, s)


def _scaled_dot(qa: jax.Array, sa: jax.Array, a_contract: tuple[int, ...], qb: jax.Array, sb: jax.Array,
                b_contract: tuple[int, ...], batch: int, dtype: jnp.dtype) -> jax.Array:
    """The FP8 product of qa and qb (the shared leading `batch` axes; each one's own free axes in order) in
    `dtype` (the GEMM accumulates in float32), multiplied by both scales laid out on the output: [batch,
    a free, b free]. Scaling by powers of two after the rounding to `dtype` is exact, so a bf16 product is
    what a float32 one rounded would be, at half the bytes for the collectives that reduce it."""
    y = jax.lax.dot_general(qa, qb, ((a_contract, b_contract), (tuple(range(batch)),) * 2),
                            preferred_element_type=dtype)
    a_free, b_free = qa.ndim - batch - len(a_contract), qb.ndim - batch - len(b_contract)
    sa, sb = jnp.squeeze(sa, a_contract), jnp.squeeze(sb, b_contract)  # [batch, a free], [batch, b free]
    sa = sa.reshape(sa.shape + (1,) * b_free)
    sb = sb.reshape(sb.shape[:batch] + (1,) * a_free + sb.shape[batch:])
    return y * (sa * sb).astype(dtype)  # sa · sb ≥ 2^-126 (`MIN_EXPONENT`): a float32 normal


def _varying(t: jax.Array) -> frozenset[str]:
    """The manual mesh axes `t` varies over (inside a `shard_map`; none elsewhere)."""
    return frozenset(jax.typeof(t).manual_axis_type.varying)


def _varies(*operands: jax.Array) -> tuple[frozenset[str], ...]:
    return tuple(map(_varying, operands))


def _summed(grads: tuple[jax.Array, ...], varies: tuple[frozenset[str], ...]) -> tuple[jax.Array, ...]:
    """Each operand's gradient summed over the manual axes it varies over and its operand does not (a weight
    the same on every device of a token shard: its gradient from each shard's tokens), as JAX's own
    transposes do."""
    return tuple(jax.lax.psum(g, tuple(sorted(extra))) if (extra := _varying(g) - v) else g
                 for g, v in zip(grads, varies))


def _kept(q: jax.Array) -> jax.Array:
    """An FP8 residual as its bytes: a remat policy rounds the float values it saves with `reduce_precision`,
    which takes e4m3fn's top exponent for infinity (it has none) and makes every value above 240 a NaN."""
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _restored(kept: jax.Array, fp8: jnp.dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(kept, fp8)


def _axes(x: jax.Array, w: jax.Array, contract: int, batch: int):
    """The dimensions of x (M, K) and of w (K, N) the three matmuls contract."""
    x_M, x_K = tuple(range(batch, x.ndim - contract)), tuple(range(x.ndim - contract, x.ndim))
    w_K, w_N = tuple(range(batch, batch + contract)), tuple(range(batch + contract, w.ndim))
    return x_M, x_K, w_K, w_N


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fp8_matmul(x, w, contract: int, batch: int, recipe: Recipe, varies):
    return _forward(x, w, contract, batch, recipe, varies)[0]


def _forward(x, w, contract, batch, recipe, varies):
    _, x_K, w_K, _ = _axes(x, w, contract, batch)
    everything = lambda t: tuple(range(t.ndim))
    qx, sx = quantize(x, E4M3, x_K if recipe.rowwise else everything(x), recipe.devices(x))
    qw, sw = quantize(w, E4M3, w_K if recipe.rowwise else everything(w), recipe.devices(w))
    y = _scaled_dot(qx, sx, x_K, qw, sw, w_K, batch, x.dtype)
    # tensorwise: the FP8 operands serve the backward pass as they are; rowwise: it scales them otherwise
    kept = (x, w) if recipe.rowwise else (_kept(qx), sx, _kept(qw), sw)
    return y, (kept, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _backward(contract, batch, recipe, varies, residuals, g):
    kept, x_like, w_like = residuals
    if recipe.rowwise:
        x, w = kept
    else:
        qx, sx, qw, sw = kept
        qx, qw = x, w = _restored(qx, E4M3), _restored(qw, E4M3)
    x_M, _, _, w_N = _axes(x, w, contract, batch)
    g_M, g_N = x_M, tuple(range(len(x_M) + batch, g.ndim))
    if recipe.rowwise:  # each matmul's operands scaled along what it contracts
        (qx, sx), (qw, sw) = quantize(x, E4M3, x_M, recipe.devices(x)), quantize(w, E4M3, w_N, recipe.devices(w))
        qg_rows, sg_rows = quantize(g, E5M2, g_N, recipe.devices(g))  # for dx: g's rows, over N
        qg_cols, sg_cols = quantize(g, E5M2, g_M, recipe.devices(g))  # for dw: g's columns, over M
    else:
        qg_rows, sg_rows = qg_cols, sg_cols = quantize(g, E5M2, tuple(range(g.ndim)), recipe.devices(g))
    dx = _scaled_dot(qg_rows, sg_rows, g_N, qw, sw, w_N, batch, x_like.dtype)  # [batch, M, K]
    dw = _scaled_dot(qx, sx, x_M, qg_cols, sg_cols, g_M, batch, w_like.dtype)  # [batch, K, N]
    return _summed((dx, dw), varies)


_fp8_matmul.defvjp(_forward, _backward)
