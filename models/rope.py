"""Rotary positions (RoPE) and the ways open models stretch them to longer contexts.

Each head's pairs (i, i + H/2) ("rotate half") turn by position × a frequency per pair: θ^(−2i/H). A
scaling changes those frequencies once, at trace time, as the model family's config says:
- `linear` (position interpolation): every frequency / factor;
- `llama3` (Llama 3.1+): wavelengths shorter than original_max_seq_len / high_freq_factor keep their
  frequency, longer than original_max_seq_len / low_freq_factor divide it by factor, and those between
  blend the two smoothly;
- `yarn` (Qwen 2.5 long context, DeepSeek): per pair, a ramp between the interpolated frequency (/ factor)
  and the original one, set by how many turns the pair makes within original_max_seq_len (beta_fast and
  beta_slow bound the ramp, its ends rounded out to whole pairs unless `truncate` is off); cosines and sines
  are multiplied by an attention factor (0.1·ln(factor) + 1 unless given), which scales every attention
  score by its square.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from meshpar.errors import InputError

SCALINGS = ("none", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # SCALINGS
    factor: float = 1.0  # linear, llama3, yarn: how much longer the context is than the one pre-trained for
    original_max_seq_len: int = 0  # llama3, yarn: the context the model was pre-trained for
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: pairs turning more often than this within the original context keep their frequency
    beta_slow: float = 1.0  # yarn: pairs turning less often than this are interpolated in full
    attention_factor: float = 0.0  # yarn: what cosines and sines are multiplied by; 0: 0.1·ln(factor) + 1
    truncate: bool = True  # yarn: the ramp's ends rounded out to whole pairs (gpt-oss: false, as they fall)

    def __post_init__(self):
        if self.kind not in SCALINGS:
            raise InputError(f"model.rope_scaling.kind = '{self.kind}' is not one of {', '.join(SCALINGS)}")
        if self.kind != "none" and not self.factor > 0:
            raise InputError(f"model.rope_scaling.factor = {self.factor} must be > 0")
        if self.kind in ("llama3", "yarn") and self.original_max_seq_len < 1:
            raise InputError(f"model.rope_scaling.kind = '{self.kind}' needs model.rope_scaling.original_max_seq_len "
                             f"(the pre-training context), got {self.original_max_seq_len}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise InputError(f"model.rope_scaling.high_freq_factor = {self.high_freq_factor} must exceed "
                             f"low_freq_factor = {self.low_freq_factor}")


@functools.lru_cache(maxsize=64)
def frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[tuple[float, ...], float]:
    """(the frequency of each of the H/2 pairs, the factor cosines and sines are multiplied by)."""
    inv_freq_h = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    s, scale = scaling, 1.0
    if s.kind == "linear":
        inv_freq_h = inv_freq_h / s.factor
    elif s.kind == "llama3":
        wavelen_h = 2 * math.pi / inv_freq_h
        smooth_h = np.clip((s.original_max_seq_len / wavelen_h - s.low_freq_factor)
                           / (s.high_freq_factor - s.low_freq_factor), 0.0, 1.0)  # 0: long waves, 1: short ones
        inv_freq_h = (1 - smooth_h) * inv_freq_h / s.factor + smooth_h * inv_freq_h
    elif s.kind == "yarn":
        # the pair index at which a pair turns `turns` times within the original context
        def pair(turns: float) -> float:
            return head_dim * math.log(s.original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = pair(s.beta_fast), pair(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp_h = np.clip((np.arange(head_dim // 2) - low) / max(high - low, 1e-3), 0.0, 1.0)  # 1: interpolate
        inv_freq_h = inv_freq_h / s.factor * ramp_h + inv_freq_h * (1 - ramp_h)
        scale = s.attention_factor or yarn_mscale(s.factor)
    return tuple(inv_freq_h.astype(np.float32).tolist()), scale


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's mscale, 0.1·m·ln(factor) + 1 (1 where the context is not stretched): its attention factor (m = 1),
    and, with DeepSeek's `mscale_all_dim` as m, the root of what its softmax scale is multiplied by."""
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def rotate(x_BTNH: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling, dims: int = 0) -> jax.Array:
    """Rotate pairs (i, i + H/2) of each head by angles set by each token's position: `positions` [T], the
    same for every row, or [B, T] (packed documents: each row's own). With `dims` < H, only the leading
    `dims` of each head turn, as a head of that size would (GLM-4.5's partial rotary); the rest pass."""
    if dims and dims < x_BTNH.shape[3]:
        return jnp.concatenate([rotate(x_BTNH[..., :dims], positions, theta, scaling), x_BTNH[..., dims:]], axis=-1)
    inv_freq, scale = frequencies(x_BTNH.shape[3], theta, scaling)
    angles_Th = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos_T1h, sin_T1h = (scale * jnp.cos(angles_Th))[..., None, :], (scale * jnp.sin(angles_Th))[..., None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos_T1h - x2 * sin_T1h, x2 * cos_T1h + x1 * sin_T1h], axis=-1)
    return rotated.astype(x_BTNH.dtype)


def halves_from_pairs(x: np.ndarray, n: int) -> np.ndarray:
    """`x` with the last `n` entries of its last axis, rotary dims laid out in interleaved pairs (x0, x1), (x2,
    x3), … (DeepSeek's checkpoints), reordered evens then odds: the halves (i, i + n/2) `rotate` turns."""
    if not n:
        return x
    head = x.shape[-1] - n
    order = np.concatenate([np.arange(head), head + np.arange(0, n, 2), head + np.arange(1, n, 2)])
    return np.ascontiguousarray(x[..., order])


def pairs_from_halves(x: np.ndarray, n: int) -> np.ndarray:
    """The inverse of `halves_from_pairs`: rotary halves back into interleaved pairs."""
    if not n:
        return x
    head = x.shape[-1] - n
    out = x.copy()
    out[..., head::2], out[..., head + 1::2] = x[..., head:head + n // 2], x[..., head + n // 2:]
    return out
