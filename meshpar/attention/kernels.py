"""The attention kernels: one block of grouped-query attention, and the choice among them.

Shapes: B batch, T query positions, S key positions, N query heads, K kv heads, G = N / K query heads per
kv head, H head dim. Scores and softmax statistics are float32 whatever the compute dtype; the
probabilities are cast back to the compute dtype for the value matmul.

`block_attention` returns the f32 output and the log-sum-exp of each query row (what merging blocks
needs), with `kernel`:
- `dense`: the masked [T, S] scores in one piece (XLA keeps them, f32, for the backward pass);
- `blockwise`: `meshpar.attention.flash`, an online softmax over key blocks with a custom backward pass
  that recomputes block scores from the saved output and log-sum-exp: memory linear in T, fully masked
  blocks skipped;
- `cudnn` (GPUs): cuDNN's fused flash attention through `jax.nn.dot_product_attention`, for bf16/fp16
  with a head dim cuDNN supports, where the mask is plain causal or none (one device, Ulysses, a
  contiguous all-gather block), a sliding window included (its `local_window_size`). Where it cannot
  serve — another mask (zigzag order; documents: JAX's function takes one sequence length per row, or a
  dense mask it turns into a [B, T, S] bias, not the segment ids of packed rows), or a schedule that needs
  the log-sum-exp's gradient (the ring: JAX returns cuDNN's log-sum-exp under stop_gradient and in the
  compute dtype) — that attention runs `blockwise`;
- `auto`: the fastest for the platform and shape (`resolve_kernel`): on GPUs `cudnn` where it can run,
  else `blockwise`; elsewhere `dense` for short sequences, `blockwise` above.

Attention sinks (gpt-oss: a learned logit per head in every softmax's denominator) are one more key per
query, of logit `sinks_N` and value 0, which the block that holds them adds to its output and log-sum-exp
(`add_sinks`): any kernel that gives the log-sum-exp with its gradient serves, and a schedule that merges
blocks by their log-sum-exp (the ring) gives the sinks to one block only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshpar.attention import flash
from meshpar.divisors import largest_divisor
from meshpar.errors import InputError

KERNELS = ("auto", "dense", "blockwise", "cudnn")
# Blockwise tile edge per platform. CPU, measured (value and grads of one attention, B = 2, N = 8,
# H = 16 and 64): 128 beat 256 and 512 from T = 256 to 2048.
BLOCK = {"cpu": 128}
DEFAULT_BLOCK = 512
# cuDNN's fused attention (cuDNN 9 flash path): 16-bit inputs, head dim a multiple of 8 up to 128.
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDNN_MAX_HEAD_DIM = 128
# CPU, measured the same way: dense won only at T ≤ 128 (one tile), blockwise from T = 256 on.
DENSE_MAX_T = {"cpu": 128}


@dataclasses.dataclass(frozen=True)
class Causal:
    """The causal mask of one kernel call: query t sees key s iff 0 <= q_T[t] − k_S[s] < window (global
    positions; `window` None: no bound, plain causal) and, with `segments` (the document ids of the queries
    [B, T] and of the keys [B, S]: `meshpar.batch`), both belong to one document. A sliding window of W
    keeps the W latest keys, the query's own included (Mistral's `sliding_window`).

    `q_T`, `k_S` may be traced (a device's positions depend on its index in a shard_map); `layouts` are
    the same positions as numpy arrays for every variant the program runs (one per device when devices
    differ), from which the blockwise kernel decides, at trace time, which tiles to skip or leave unmasked.
    """

    q_T: jax.Array
    k_S: jax.Array
    layouts: tuple[tuple[np.ndarray, np.ndarray], ...]
    window: int | None = None
    segments: tuple[jax.Array, jax.Array] | None = None

    @classmethod
    def static(cls, q_T: np.ndarray, k_S: np.ndarray, window: int | None = None,
               segments: tuple[jax.Array, jax.Array] | None = None) -> Causal:
        return cls(jnp.asarray(q_T, jnp.int32), jnp.asarray(k_S, jnp.int32), ((q_T, k_S),), window, segments)

    def visible(self) -> jax.Array:
        """Which keys each query sees: [T, S], or [B, T, S] with documents."""
        return flash.visible(self.q_T, self.k_S, self.window, self.segments)


def platform_of(mesh: Mesh | None) -> str:
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def cudnn_unsupported(dtype, head_dim: int | None) -> str | None:
    """Why cuDNN's fused attention cannot take these inputs, or None if it can (a head dim of None:
    not known yet, not checked)."""
    if jnp.dtype(dtype) not in CUDNN_DTYPES:
        return f"it needs bfloat16 or float16 inputs, not {jnp.dtype(dtype).name} (train.compute_dtype)"
    if head_dim is not None and (head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8):
        return f"head dim {head_dim} is not a multiple of 8 up to {CUDNN_MAX_HEAD_DIM}"
    return None


def resolve_kernel(kernel: str, S: int, platform: str, dtype=jnp.float32, head_dim: int | None = None,
                   needs_lse: bool = False, softcap: float | None = None) -> str:
    """The kernel `block_attention` runs for S keys of `dtype`: `auto` becomes `cudnn` on GPUs where it
    can run, else `dense` up to the platform's measured length (`DENSE_MAX_T`) and `blockwise` above.
    `cudnn` is refused off GPUs and for inputs it cannot take; it falls back to `blockwise` where the
    caller needs the log-sum-exp's gradient (`needs_lse`: the ring's merge, attention sinks) or soft-caps the
    scores (JAX's call has neither)."""
    if kernel not in KERNELS:
        raise InputError(f"attention kernel '{kernel}' is not one of {', '.join(KERNELS)}")
    if kernel == "cudnn":
        if platform != "gpu":
            raise InputError(f"attention kernel 'cudnn' needs a GPU; this mesh runs on '{platform}' "
                             f"(use auto, dense or blockwise)")
        if reason := cudnn_unsupported(dtype, head_dim):
            raise InputError(f"attention kernel 'cudnn' cannot run this attention: {reason}")
    if kernel == "auto" and platform == "gpu" and cudnn_unsupported(dtype, head_dim) is None:
        kernel = "cudnn"
    if kernel == "cudnn":
        return "blockwise" if needs_lse or softcap else "cudnn"
    if kernel == "auto":
        return "dense" if S <= DENSE_MAX_T.get(platform, 0) else "blockwise"
    return kernel


def block_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, causal: Causal | None, *,
                    kernel: str = "auto", platform: str | None = None, needs_lse: bool = False,
                    softcap: float | None = None,
                    sinks_N: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """GQA attention of T queries over S keys: (out f32 [B, T, N, H], log-sum-exp f32 [B, T, N]).

    The log-sum-exp is None from the cuDNN kernel, which runs only where the caller does not need it
    (`needs_lse` False, no sinks) and the mask is plain causal, without documents, or none
    (`is_plain_causal`); elsewhere `cudnn` runs `blockwise`.

    `softcap` c: each scaled score s becomes c·tanh(s / c) before the mask (Gemma 2's attention logit
    soft-capping). `sinks_N`: each head's sink logit, added to this block (`add_sinks`). `causal` None: every
    key is visible to every query (a ring's off-diagonal block). The log-sum-exp lets partial results over
    disjoint key sets combine exactly (the ring's accumulator). A row with no visible key has out 0 and lse
    −inf (blockwise) — the schedules never produce one.
    """
    if sinks_N is not None:
        out_BTNH, lse_BTN = block_attention(q_BTNH, k_BSKH, v_BSKH, causal, kernel=kernel, platform=platform,
                                            needs_lse=True, softcap=softcap)
        return add_sinks(out_BTNH, lse_BTN, sinks_N)
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    platform = platform or jax.default_backend()
    kernel = resolve_kernel(kernel, S, platform, q_BTNH.dtype, q_BTNH.shape[3], needs_lse, softcap)
    if kernel == "cudnn" and (causal is None or causal.segments is None and is_plain_causal(causal, T, S)):
        return cudnn_attention(q_BTNH, k_BSKH, v_BSKH, causal), None
    if kernel == "dense":
        return _dense(q_BTNH, k_BSKH, v_BSKH, causal, softcap)
    bt = largest_divisor(T, BLOCK.get(platform, DEFAULT_BLOCK))
    bs = largest_divisor(S, BLOCK.get(platform, DEFAULT_BLOCK))
    if causal is None:
        pattern = np.full((T // bt, S // bs), flash.FULL, np.int8)
        q_T, k_S = jnp.zeros(T, jnp.int32), jnp.zeros(S, jnp.int32)
    else:
        pattern = flash.block_pattern([q for q, _ in causal.layouts], [k for _, k in causal.layouts], bt, bs,
                                      causal.window)
        q_T, k_S = causal.q_T, causal.k_S
    window, segments = (None, None) if causal is None else (causal.window, causal.segments)
    return flash.attention(q_BTNH, k_BSKH, v_BSKH, q_T, k_S, pattern, window, segments, softcap)


def add_sinks(out_BTNH: jax.Array, lse_BTN: jax.Array, sinks_N: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A block's (out, lse) with one more key per query, of logit sinks_N[n] and value 0, in every softmax's
    denominator: out · e^lse / (e^lse + e^sink), and lse ⊕ sink."""
    with_sink_BTN = jnp.logaddexp(lse_BTN, sinks_N.astype(jnp.float32))
    return out_BTNH * jnp.exp(lse_BTN - with_sink_BTN)[..., None], with_sink_BTN


def cudnn_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, causal: Causal | None,
                    implementation: str = "cudnn") -> jax.Array:
    """The cuDNN kernel's call: `jax.nn.dot_product_attention` of a mask that is plain causal (a sliding
    window included) or none, out f32 [B, T, N, H]. `implementation="xla"` runs the same call through JAX's
    XLA implementation, on any platform (the tests')."""
    out_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=causal is not None,
                                            local_window_size=cudnn_window(causal), implementation=implementation)
    return out_BTNH.astype(jnp.float32)


def cudnn_window(causal: Causal | None) -> tuple[int, int] | None:
    """`jax.nn.dot_product_attention`'s `local_window_size` for this mask: (keys before, keys after) each
    query sees besides its own position, or None (no window)."""
    return None if causal is None or causal.window is None else (causal.window - 1, 0)


def is_plain_causal(causal: Causal, T: int, S: int) -> bool:
    """Whether the mask is cuDNN's `is_causal` (query i sees keys 0..i) in every layout: T = S and
    positions that are the same contiguous run for queries and keys."""
    return T == S and all(np.array_equal(q, k) and np.array_equal(np.diff(q), np.ones(T - 1)) for q, k in causal.layouts)


def _dense(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, causal: Causal | None,
           softcap: float | None = None):
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = flash.soft_cap(jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
                                  / jnp.sqrt(H).astype(jnp.float32), softcap)
    if causal is not None:
        seen = causal.visible()
        scores_BKGTS = jnp.where(seen if seen.ndim == 2 else seen[:, None, None], scores_BKGTS, -jnp.inf)
    # One exp over the scores (softmax's), the log-sum-exp from its row sums: exp(scores − lse) would be a
    # second pass of transcendentals over the T×S square. The max only steadies the exp. A row that sees
    # no key (a ring's block beyond a sliding window) gets out 0 and lse −inf.
    max_BKGT = jax.lax.stop_gradient(jnp.max(scores_BKGTS, axis=-1))
    exp_BKGTS = jnp.exp(scores_BKGTS - jnp.where(max_BKGT == -jnp.inf, 0.0, max_BKGT)[..., None])
    sum_BKGT = jnp.sum(exp_BKGTS, axis=-1)
    seen_BKGT = sum_BKGT > 0
    probs_BKGTS = exp_BKGTS / jnp.where(seen_BKGT, sum_BKGT, 1.0)[..., None]
    lse_BKGT = jnp.where(seen_BKGT, max_BKGT + jnp.log(jnp.where(seen_BKGT, sum_BKGT, 1.0)), -jnp.inf)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS.astype(v_BSKH.dtype), v_BSKH,
                           preferred_element_type=jnp.float32)
    return out_BTKGH.reshape(B, T, N, H), jnp.moveaxis(lse_BKGT, -1, 1).reshape(B, T, N)


def causal_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, *, window: int | None = None,
                     segments_BT: jax.Array | None = None, kernel: str = "auto", platform: str | None = None,
                     softcap: float | None = None, sinks_N: jax.Array | None = None) -> jax.Array:
    """softmax(q kᵀ / √H + causal mask) v on one device, each group of G query heads sharing a kv head;
    with a sliding `window`, each query sees its `window` latest keys; with `segments_BT` (document ids
    of the T = S positions), only keys of its own document; with `softcap`, scores soft-capped; with
    `sinks_N`, each head's sink logit in the denominator."""
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    segments = None if segments_BT is None else (segments_BT, segments_BT)
    out_BTNH, _ = block_attention(q_BTNH, k_BSKH, v_BSKH,
                                  Causal.static(np.arange(T), np.arange(S), window, segments),
                                  kernel=kernel, platform=platform, softcap=softcap, sinks_N=sinks_N)
    return out_BTNH.astype(v_BSKH.dtype)


def cached_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, q_pos_T: jax.Array,
                     k_pos_S: jax.Array, window: int | None = None, softcap: float | None = None,
                     sinks_N: jax.Array | None = None) -> jax.Array:
    """Causal attention of T queries at positions `q_pos_T` over keys at positions `k_pos_S` (a KV cache's
    slots and the new keys), as generation runs it: keys after a query's position and, with a sliding
    `window`, keys `window` or more before it are masked. The dense kernel: after the prompt T = 1, so the
    scores are one row per head."""
    causal = Causal(q_pos_T.astype(jnp.int32), k_pos_S.astype(jnp.int32), layouts=(), window=window)
    out_BTNH, lse_BTN = _dense(q_BTNH, k_BSKH, v_BSKH, causal, softcap)
    if sinks_N is not None:
        out_BTNH, _ = add_sinks(out_BTNH, lse_BTN, sinks_N)
    return out_BTNH.astype(v_BSKH.dtype)
