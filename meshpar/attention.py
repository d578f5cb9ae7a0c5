"""Causal grouped-query attention, on one device and on a sequence split over a mesh axis.

Shapes: B batch, T query positions (the global sequence), S key positions, N query heads, K kv heads,
G = N / K query heads per kv head, H head dim. On a mesh, `n` is the size of the axis that splits the
sequence (default `sequence`) and t = T / n the positions each device holds; with load balancing each
device's t positions are two chunks of c = t / 2. Scores and softmax statistics are float32 whatever
the compute dtype; the probabilities are cast back to the compute dtype for the value matmul; the
output has v's dtype.

Every schedule below computes its attention with ONE block kernel, `block_attention`, which returns the
f32 output and the log-sum-exp of each query row (what merging blocks needs), with `kernel`:
- `dense`: the masked [T, S] scores in one piece (XLA keeps them, f32, for the backward pass);
- `blockwise`: `meshpar.flash`, an online softmax over key blocks with a custom backward pass that
  recomputes block scores from the saved output and log-sum-exp: memory linear in T, fully masked
  blocks skipped;
- `cudnn` (GPUs): cuDNN's fused flash attention through `jax.nn.dot_product_attention`, for bf16/fp16
  with a head dim cuDNN supports, where the mask is plain causal or none (one device, Ulysses, a
  contiguous all-gather block). Where it cannot serve — another mask (zigzag order), or a schedule that
  needs the log-sum-exp's gradient (the ring: JAX returns cuDNN's log-sum-exp under stop_gradient and in
  the compute dtype) — that attention runs `blockwise`;
- `auto`: the fastest for the platform and shape (`resolve_kernel`): on GPUs `cudnn` where it can run,
  else `blockwise`; elsewhere `dense` for short sequences, `blockwise` above.

With heads split over `model` (K divisible by the axis) each device attends over its own heads and no
collective runs; with the batch split, likewise. With the sequence split there are three schedules
(context parallelism), each a `jax.shard_map` that is manual over the one sequence axis only, so that
the other mesh axes (data, fsdp, model) stay with the compiler (GSPMD). (XLA's partitioner replicates the
operand of an all-gather or all-to-all in such a partially manual region over the automatic axes that
split it, so with the batch or heads also split, allgather and ulysses gather those first; the ring's
ppermutes are unaffected. `attend`, which knows the layout from the rules, goes manual over those axes too.)

| mode      | collectives per layer (forward; backward)            | attention memory per device | needs       |
|-----------|-------------------------------------------------------|-----------------------------|-------------|
| allgather | all-gather K,V (2·B·T·K·H); reduce-scatter dK,dV      | K,V [T]; dense: scores [t, T]  | T % n      |
| ring      | n−1 collective-permutes of K,V (2·B·t·K·H each);      | K,V blocks; dense: [t, t]      | T % n (2n) |
|           | as many of dK,dV the other way                        |                                |            |
| ulysses   | all-to-all q,k,v (B·t·(N+2K)·H) and out (B·t·N·H); ×2 | N/n heads; dense: [T, T]       | N, K % n   |

(With the blockwise kernel no schedule keeps a score matrix: a [block, block] tile at a time.)

Per device, ring and all-gather receive the other devices' K and V, (n−1)·2·B·t·K·H elements (growing
with n at fixed t); Ulysses sends (n−1)/n of its q, k, v and output slices, B·t·2(N+K)·H elements (flat in
n), so it wins for large n unless K ≪ N.
Ring attention hides its transfers behind the block matmuls (the ppermute of step s+1 overlaps the
compute of step s) and is the only one whose memory does not grow with T² or t·T. Causal masking makes
the contiguous split unbalanced (the last device has ~2n−1 times the unmasked pairs of the first); the zigzag
order (`zigzag`) gives each device chunks i and 2n−1−i of 2n chunks, which balances the work exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from meshpar import context, flash, sharding
from meshpar.errors import InputError

MODES = ("allgather", "ring", "ulysses")
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


# --- the block kernel ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Causal:
    """The causal mask of one kernel call: query t sees key s iff q_T[t] >= k_S[s] (global positions).

    `q_T`, `k_S` may be traced (a device's positions depend on its index in a shard_map); `layouts` are
    the same positions as numpy arrays for every variant the program runs (one per device when devices
    differ), from which the blockwise kernel decides, at trace time, which tiles to skip or leave unmasked.
    """

    q_T: jax.Array
    k_S: jax.Array
    layouts: tuple[tuple[np.ndarray, np.ndarray], ...]

    @classmethod
    def static(cls, q_T: np.ndarray, k_S: np.ndarray) -> Causal:
        return cls(jnp.asarray(q_T, jnp.int32), jnp.asarray(k_S, jnp.int32), ((q_T, k_S),))


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
                   needs_lse: bool = False) -> str:
    """The kernel `block_attention` runs for S keys of `dtype`: `auto` becomes `cudnn` on GPUs where it
    can run, else `dense` up to the platform's measured length (`DENSE_MAX_T`) and `blockwise` above.
    `cudnn` is refused off GPUs and for inputs it cannot take; it falls back to `blockwise` where the
    caller needs the log-sum-exp's gradient (`needs_lse`)."""
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
        return "blockwise" if needs_lse else "cudnn"
    if kernel == "auto":
        return "dense" if S <= DENSE_MAX_T.get(platform, 0) else "blockwise"
    return kernel


def block_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, causal: Causal | None, *,
                    kernel: str = "auto", platform: str | None = None,
                    needs_lse: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """GQA attention of T queries over S keys: (out f32 [B, T, N, H], log-sum-exp f32 [B, T, N]).

    The log-sum-exp is None from the cuDNN kernel, which runs only where the caller does not need it
    (`needs_lse` False) and the mask is plain causal or none (`_plain_causal`); elsewhere `cudnn` runs
    `blockwise`.

    `causal` None: every key is visible to every query (a ring's off-diagonal block). The log-sum-exp
    lets partial results over disjoint key sets combine exactly (the ring's accumulator). A row with no
    visible key has out 0 and lse −inf (blockwise) — the schedules never produce one.
    """
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    platform = platform or jax.default_backend()
    kernel = resolve_kernel(kernel, S, platform, q_BTNH.dtype, q_BTNH.shape[3], needs_lse)
    if kernel == "cudnn" and (causal is None or _plain_causal(causal, T, S)):
        out_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=causal is not None,
                                                implementation="cudnn")
        return out_BTNH.astype(jnp.float32), None
    if kernel == "dense":
        return _dense(q_BTNH, k_BSKH, v_BSKH, causal)
    bt = flash.block_size(T, BLOCK.get(platform, DEFAULT_BLOCK))
    bs = flash.block_size(S, BLOCK.get(platform, DEFAULT_BLOCK))
    if causal is None:
        pattern = np.full((T // bt, S // bs), flash.FULL, np.int8)
        q_T, k_S = jnp.zeros(T, jnp.int32), jnp.zeros(S, jnp.int32)
    else:
        pattern = flash.block_pattern([q for q, _ in causal.layouts], causal.layouts[0][1], bt, bs)
        for _, k in causal.layouts[1:]:  # the key layout differs by device too: a tile skipped by all
            pattern = np.maximum(pattern, flash.block_pattern([q for q, _ in causal.layouts], k, bt, bs))
        q_T, k_S = causal.q_T, causal.k_S
    return flash.attention(q_BTNH, k_BSKH, v_BSKH, q_T, k_S, pattern)


def _plain_causal(causal: Causal, T: int, S: int) -> bool:
    """Whether the mask is cuDNN's `is_causal` (query i sees keys 0..i) in every layout: T = S and
    positions that are the same contiguous run for queries and keys."""
    return T == S and all(np.array_equal(q, k) and np.array_equal(np.diff(q), np.ones(T - 1)) for q, k in causal.layouts)


def _dense(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, causal: Causal | None):
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH,
                              preferred_element_type=jnp.float32) / jnp.sqrt(H).astype(jnp.float32)
    if causal is not None:
        scores_BKGTS = jnp.where(causal.q_T[:, None] >= causal.k_S[None, :], scores_BKGTS, -jnp.inf)
    # One exp over the scores (softmax's), the log-sum-exp from its row sums: exp(scores − lse) would be a
    # second pass of transcendentals over the T×S square. The max only steadies the exp.
    max_BKGT = jax.lax.stop_gradient(jnp.max(scores_BKGTS, axis=-1))
    exp_BKGTS = jnp.exp(scores_BKGTS - max_BKGT[..., None])
    sum_BKGT = jnp.sum(exp_BKGTS, axis=-1)
    probs_BKGTS = exp_BKGTS / sum_BKGT[..., None]
    lse_BKGT = max_BKGT + jnp.log(sum_BKGT)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS.astype(v_BSKH.dtype), v_BSKH,
                           preferred_element_type=jnp.float32)
    return out_BTKGH.reshape(B, T, N, H), jnp.moveaxis(lse_BKGT, -1, 1).reshape(B, T, N)


def causal_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, *, kernel: str = "auto",
                     platform: str | None = None) -> jax.Array:
    """softmax(q kᵀ / √H + causal mask) v on one device, each group of G query heads sharing a kv head."""
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    out_BTNH, _ = block_attention(q_BTNH, k_BSKH, v_BSKH, Causal.static(np.arange(T), np.arange(S)),
                                  kernel=kernel, platform=platform)
    return out_BTNH.astype(v_BSKH.dtype)


def cached_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, q_pos_T: jax.Array) -> jax.Array:
    """Causal attention of T queries at positions `q_pos_T` over a KV cache of positions 0..S−1, as
    generation runs it: keys after a query's position (those not yet written included) are masked. The
    dense kernel: after the prompt T = 1, so the scores are one row per head."""
    S = k_BSKH.shape[1]
    causal = Causal(q_pos_T.astype(jnp.int32), jnp.arange(S, dtype=jnp.int32), layouts=())
    out_BTNH, _ = _dense(q_BTNH, k_BSKH, v_BSKH, causal)
    return out_BTNH.astype(v_BSKH.dtype)


# --- zigzag (load-balanced) sequence order -------------------------------------------------------------


def _zigzag_order(n_shards: int) -> np.ndarray:
    """Chunk order: shard i holds chunks i and 2n−1−i, e.g. n=2 → [0, 3, 1, 2]."""
    return np.array([c for i in range(n_shards) for c in (i, 2 * n_shards - 1 - i)])


def _check_zigzag(T: int, n_shards: int) -> None:
    if n_shards < 1:
        raise InputError(f"zigzag needs n_shards >= 1, got {n_shards}")
    if T % (2 * n_shards):
        raise InputError(f"load-balanced (zigzag) order splits the sequence into 2·n = {2 * n_shards} chunks, "
                         f"but T = {T} is not divisible by {2 * n_shards}")


def _permute_chunks(x: jax.Array, order: np.ndarray, axis: int) -> jax.Array:
    axis = axis % x.ndim
    T = x.shape[axis]
    chunks = x.reshape(x.shape[:axis] + (len(order), T // len(order)) + x.shape[axis + 1:])
    return jnp.take(chunks, jnp.asarray(order), axis=axis).reshape(x.shape)


def zigzag(x: jax.Array, n_shards: int, axis: int = 1) -> jax.Array:
    """Reorder the sequence `axis` into the load-balanced order for `n_shards` shards.

    The sequence is cut into 2·n equal chunks; shard i (the i-th contiguous slice of t = T/n once the
    result is split over n devices) holds chunks i and 2n−1−i, so under a causal mask every shard has
    the same number of (query, key) pairs to compute. `unzigzag` is the inverse.
    """
    _check_zigzag(x.shape[axis], n_shards)
    return _permute_chunks(x, _zigzag_order(n_shards), axis)


def unzigzag(x: jax.Array, n_shards: int, axis: int = 1) -> jax.Array:
    """The inverse of `zigzag`: back to the natural sequence order."""
    _check_zigzag(x.shape[axis], n_shards)
    return _permute_chunks(x, np.argsort(_zigzag_order(n_shards)), axis)


def zigzag_positions(T: int, n_shards: int) -> jax.Array:
    """The global positions of the zigzag order (int32 [T]): `zigzag(arange(T), n_shards, axis=0)`."""
    return zigzag(jnp.arange(T, dtype=jnp.int32), n_shards, axis=0)


def _local_positions(i, t: int, n: int, balanced: bool, xp=jnp):
    """Global positions of the t positions device i holds (contiguous or zigzag); `xp=np` for a static i."""
    if not balanced:
        return i * t + xp.arange(t, dtype=np.int32)
    c = t // 2
    return xp.concatenate([i * c + xp.arange(c, dtype=np.int32), (2 * n - 1 - i) * c + xp.arange(c, dtype=np.int32)])


def _global_positions(T: int, n: int, balanced: bool) -> np.ndarray:
    return np.concatenate([_local_positions(i, T // n, n, balanced, np) for i in range(n)])


# --- checks and the shard_map wrapper -------------------------------------------------------------------


def _axis_size(mesh: Mesh, axis: str) -> int:
    if axis not in mesh.shape:
        raise InputError(f"mesh has no axis '{axis}'; its axes are {', '.join(mesh.axis_names)}")
    return mesh.shape[axis]


def _check(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, n: int, axis: str, balanced: bool) -> None:
    if q_BTNH.ndim != 4 or k_BTKH.ndim != 4 or k_BTKH.shape != v_BTKH.shape:
        raise InputError(f"expected q [B, T, N, H] and k, v [B, T, K, H] of equal shapes, got "
                         f"{q_BTNH.shape}, {k_BTKH.shape}, {v_BTKH.shape}")
    (B, T, N, H), (Bk, Tk, K, Hk) = q_BTNH.shape, k_BTKH.shape
    if (B, T, H) != (Bk, Tk, Hk):
        raise InputError(f"q {q_BTNH.shape} and k {k_BTKH.shape} disagree in B, T or H")
    if N % K:
        raise InputError(f"{N} query heads are not divisible by {K} kv heads (grouped-query attention)")
    if balanced:
        _check_zigzag(T, n)
    elif T % n:
        raise InputError(f"sequence length T = {T} is not divisible by mesh axis '{axis}' of size {n}")


def _spec_axes(spec: P) -> list[str]:
    return [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]


def _context_attention(mode: str, q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, mesh: Mesh,
                       axis: str, load_balanced: bool, kernel: str, q_spec: P | None = None, kv_spec: P | None = None,
                       vmapped: tuple[str, ...] = ()) -> jax.Array:
    """Run one schedule in a shard_map over `axis` and the other axes that `q_spec` / `kv_spec` name.

    Default specs: P(None, axis, None, None), manual over `axis` alone (partial-manual: the other mesh
    axes stay with the compiler). `vmapped`: mesh axes that an enclosing `vmap(spmd_axis_name=...)` owns
    (gradient accumulation's replicas, the pipeline's stages); the shard_map must be manual over them too,
    or JAX cannot batch it.
    """
    n = _axis_size(mesh, axis)
    q_spec = P(None, axis, None, None) if q_spec is None else q_spec
    kv_spec = P(None, axis, None, None) if kv_spec is None else kv_spec
    _check(q_BTNH, k_BTKH, v_BTKH, n, axis, load_balanced)
    if mode == "ulysses":
        # Heads per device before the all-to-all (after any split over other manual axes, e.g. model).
        for what, heads, spec in (("query heads N", q_BTNH.shape[2], q_spec), ("kv heads K", k_BTKH.shape[2], kv_spec)):
            ways = math.prod(mesh.shape[a] for a in _spec_axes(P(*spec[2:3])))
            if (heads // ways) % n:
                per = f" ({heads // ways} per device after the split over {spec[2]})" if ways > 1 else ""
                raise InputError(f"ulysses attention splits heads over mesh axis '{axis}' of size {n}, "
                                 f"but the {heads} {what}{per} are not divisible by {n}")
    local = {"allgather": _allgather_local, "ring": _ring_local, "ulysses": _ulysses_local}[mode]
    body = functools.partial(local, axis=axis, n=n, balanced=load_balanced, kernel=kernel,
                             platform=platform_of(mesh))
    names = set(_spec_axes(q_spec)) | set(_spec_axes(kv_spec)) | set(vmapped)
    return jax.shard_map(body, mesh=mesh, axis_names=names, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=not vmapped)(q_BTNH, k_BTKH, v_BTKH)


# --- all-gather K/V ---------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_sequence(x_BtKH: jax.Array, axis: str) -> jax.Array:
    """All-gather along T; the gradient is reduce-scattered back in float32 whatever x's dtype (more
    exact, and XLA's CPU backend cannot compile the bfloat16 reduce-scatter)."""
    return lax.all_gather(x_BtKH, axis, axis=1, tiled=True)


def _gather_sequence_fwd(x_BtKH, axis):
    return _gather_sequence(x_BtKH, axis), None


def _gather_sequence_bwd(axis, _, g_BTKH):
    return (lax.psum_scatter(g_BTKH.astype(jnp.float32), axis, scatter_dimension=1, tiled=True).astype(g_BTKH.dtype),)


_gather_sequence.defvjp(_gather_sequence_fwd, _gather_sequence_bwd)


def _allgather_local(q_BtNH, k_BtKH, v_BtKH, *, axis: str, n: int, balanced: bool, kernel: str, platform: str):
    t = q_BtNH.shape[1]
    k_BTKH, v_BTKH = _gather_sequence(k_BtKH, axis), _gather_sequence(v_BtKH, axis)
    pos_T = _global_positions(t * n, n, balanced)
    # Device i's queries see a different part of the keys: a tile is skipped only if every device skips it.
    layouts = tuple((_local_positions(d, t, n, balanced, np), pos_T) for d in range(n))
    causal = Causal(_local_positions(lax.axis_index(axis), t, n, balanced), jnp.asarray(pos_T), layouts)
    out_BtNH, _ = block_attention(q_BtNH, k_BTKH, v_BTKH, causal, kernel=kernel, platform=platform)
    return out_BtNH.astype(v_BtKH.dtype)


def allgather_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, mesh: Mesh,
                        axis: str = "sequence", load_balanced: bool = False, kernel: str = "auto") -> jax.Array:
    """Causal GQA attention with T split over `axis` (size n): queries stay, K and V are all-gathered.

    Sharded: q, k, v and the output along T ([B, t, ·, H] per device, t = T/n); other mesh axes are
    the compiler's. Each device gathers the whole K and V, scores its t queries against all T keys
    with the causal mask of global positions, and keeps its t outputs.
    Collectives per layer: forward, 2 all-gathers over `axis` (K and V, B·T·K·H·bytes each received);
    backward, 2 reduce-scatters of dK, dV (same sizes in, B·t·K·H out).
    Memory per device: K, V of the whole sequence (2·B·T·K·H); with the dense kernel also the f32
    scores [B, N, t, T] (kept for the backward pass): t·T, i.e. T²/n, which blockwise and ring avoid.
    With the batch or heads also split over other (automatic) axes, XLA gathers those dimensions
    before the all-gather (a partially manual region); `attend` avoids that.
    Work: the dense kernel computes all t·T scores, masked or not; the blockwise kernel skips the tiles
    that every device skips (the program is the same on every device), so with zigzag little is saved.
    `load_balanced=True` tells it that q, k, v (and the output) are in zigzag order.
    """
    return _context_attention("allgather", q_BTNH, k_BTKH, v_BTKH, mesh=mesh, axis=axis, load_balanced=load_balanced,
                              kernel=kernel)


# --- ring -------------------------------------------------------------------------------------------------

# The ring accumulates, per query row, (o, m, l): o = Σ_b exp(lse_b − m)·out_b and l = Σ_b exp(lse_b − m)
# over the blocks b seen so far, with m their largest log-sum-exp under stop_gradient (the result o / l
# does not depend on m, so the gradient is exact). Each block costs two exps over [B, t, N] and a scaled
# add over the output; normalising at every block (a log-sum-exp merge) measured ~20% slower per ring layer
# at 16 positions per device. The schedules give every row a finite log-sum-exp (step 0 sees the diagonal).


def _start(block: tuple[jax.Array, jax.Array]):
    out_BtNH, lse_BtN = block
    m_BtN = lax.stop_gradient(lse_BtN)
    e_BtN = jnp.exp(lse_BtN - m_BtN)  # 1, but carrying lse's gradient
    return out_BtNH * e_BtN[..., None], m_BtN, e_BtN


def _accumulate(acc, block: tuple[jax.Array, jax.Array]):
    (o_BtNH, m_BtN, l_BtN), (out_BtNH, lse_BtN) = acc, block
    m_new = lax.stop_gradient(jnp.maximum(m_BtN, lse_BtN))
    a_BtN, e_BtN = jnp.exp(m_BtN - m_new), jnp.exp(lse_BtN - m_new)
    return o_BtNH * a_BtN[..., None] + out_BtNH * e_BtN[..., None], m_new, l_BtN * a_BtN + e_BtN


def _finish(acc) -> jax.Array:
    o_BtNH, _, l_BtN = acc
    return o_BtNH / l_BtN[..., None]


def _ring_local(q_BtNH, k_BtKH, v_BtKH, *, axis: str, n: int, balanced: bool, kernel: str, platform: str):
    B, t, N, H = q_BtNH.shape
    i = lax.axis_index(axis)
    attend_block = functools.partial(block_attention, kernel=kernel, platform=platform, needs_lse=True)

    # Step 0: the local (diagonal) block, the only one that needs a mask; every query sees itself, so
    # the log-sum-exp starts finite. Its tile pattern is the same on every device (`Causal.layouts`).
    pos_t = _local_positions(i, t, n, balanced)
    layouts = tuple((p, p) for p in (_local_positions(d, t, n, balanced, np) for d in range(n)))
    diagonal = Causal(pos_t, pos_t, layouts)
    acc = _start(jax.checkpoint(lambda q, k, v: attend_block(q, k, v, diagonal))(q_BtNH, k_BtKH, v_BtKH))
    if n == 1:
        return _finish(acc).astype(v_BtKH.dtype)

    def add(acc, q, k, v):
        return _accumulate(acc, attend_block(q, k, v, None))

    # Every block that arrives is either fully visible or fully masked (its positions are all before
    # or all after this device's, in both orders), so no mask is built after step 0. The compute of a
    # step is rematerialised in the backward pass (jax.checkpoint), so only the step's inputs (the
    # accumulators and the K/V block) are saved, never a score block.
    if not balanced:
        # Contiguous order: the block from src = i − s is visible iff src < i, else skipped with
        # lax.cond: the skip is a data-dependent (per-device) branch, and a conditional is the only way
        # to not do the work (arithmetic selection would compute and discard it). The devices still
        # wait for the busiest one (device n−1 computes every block), which is what zigzag fixes.
        update = jax.checkpoint(add, prevent_cse=False)

        def compute(acc, kv_2BtKH, s):
            visible = (i - s) % n < i
            return lax.cond(visible, lambda a: update(a, q_BtNH, kv_2BtKH[0], kv_2BtKH[1]), lambda a: a, acc)
    else:
        # Zigzag order: queries (q0, q1) = chunks (i, 2n−1−i), keys (k0, k1) = chunks (src, 2n−1−src).
        # If src < i, q0·k0 and q1·k0 are visible; if src > i, q1·k0 and q1·k1; the other two blocks are
        # masked. So every step is q1·k0 plus (qx·kx with x = [src > i]): two unmasked [c, c] blocks on
        # every device, equal work, and the choice is a dynamic index (arithmetic), not a conditional:
        # nothing masked is computed and no device runs a different program.
        c = t // 2
        halves = lambda a: jnp.moveaxis(a.reshape(a.shape[:1] + (2, c) + a.shape[2:]), 1, 0)  # T → [2, ..c..]
        q_2BcNH = halves(q_BtNH)
        acc = tuple(halves(a) for a in acc)  # o [2, B, c, N, H], m and l [2, B, c, N]

        def balanced_step(acc, q_2BcNH, kv_2BtKH, x):
            k_2BcKH, v_2BcKH = halves(kv_2BtKH[0]), halves(kv_2BtKH[1])
            pick = lambda a: lax.dynamic_index_in_dim(a, x, 0, keepdims=False)
            acc1 = add(tuple(a[1] for a in acc), q_2BcNH[1], k_2BcKH[0], v_2BcKH[0])
            acc = tuple(a.at[1].set(a1) for a, a1 in zip(acc, acc1))
            accx = add(tuple(pick(a) for a in acc), pick(q_2BcNH), pick(k_2BcKH), pick(v_2BcKH))
            return tuple(lax.dynamic_update_index_in_dim(a, ax, x, 0) for a, ax in zip(acc, accx))

        update = jax.checkpoint(balanced_step, prevent_cse=False)

        def compute(acc, kv_2BtKH, s):
            return update(acc, q_2BcNH, kv_2BtKH, ((i - s) % n > i).astype(jnp.int32))

    # The shift for step s+1 is issued before the compute of step s and does not depend on it, so the
    # transfer can overlap the block matmuls; the last step is peeled off so that exactly n−1 shifts run.
    ring = [(j, (j + 1) % n) for j in range(n)]  # after s shifts device i holds the block of i − s

    def step(carry, s):
        acc, kv_2BtKH = carry
        kv_next = lax.ppermute(kv_2BtKH, axis, ring)
        return (compute(acc, kv_2BtKH, s), kv_next), None

    kv_2BtKH = lax.ppermute(jnp.stack([k_BtKH, v_BtKH]), axis, ring)  # one ppermute per step for both
    if n > 2:
        (acc, kv_2BtKH), _ = lax.scan(step, (acc, kv_2BtKH), jnp.arange(1, n - 1))
    out = _finish(compute(acc, kv_2BtKH, n - 1))
    if balanced:
        out = jnp.moveaxis(out, 0, 1).reshape(B, t, N, H)
    return out.astype(v_BtKH.dtype)


def ring_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, mesh: Mesh,
                   axis: str = "sequence", load_balanced: bool = False, kernel: str = "auto") -> jax.Array:
    """Causal GQA attention with T split over `axis` (size n): K/V blocks travel around a ring.

    Sharded: q, k, v and the output along T ([B, t, ·, H] per device, t = T/n); other mesh axes are
    the compiler's. Each device keeps its queries and, over n steps (a `lax.scan` of n−1 shifts after
    the local block), sees every K/V block once, merging each block's (output, log-sum-exp) from the
    block kernel into its running f32 accumulator. Fully masked blocks are skipped: with the contiguous
    order by `lax.cond` (device i computes i+1 blocks), with `load_balanced=True` (zigzag order, see
    `zigzag`) every step is two unmasked half blocks on every device (equal work, no conditional).
    Collectives per layer: forward, n−1 collective-permutes of the stacked K,V block (2·B·t·K·H·bytes
    each, 2·(n−1)/n·B·T·K·H in all, as much as an all-gather of K and V, but overlappable with the
    block matmuls); backward, the same for the dK, dV accumulators flowing the other way.
    Memory per device: one block's scores at a time, forward and backward — [B, N, t, t] f32 with the
    dense kernel, a [block, block] tile with the blockwise one (the step's compute is rematerialised by
    `jax.checkpoint` in the backward pass, ~1/3 more attention FLOPs), plus the saved step inputs:
    n·(accumulators + K/V block) = O(B·T·(N+K)·H) — linear in T.
    Compute-bound when a step's matmuls (4·B·t²·N·H FLOPs for a whole block, half that for the two
    zigzag half blocks) outlast a permute of 2·B·t·K·H·bytes: t ≳ (K/N)·bytes·(peak FLOP/s)/(link B/s)
    with zigzag (half that contiguous, but there the busiest device does every block).
    """
    return _context_attention("ring", q_BTNH, k_BTKH, v_BTKH, mesh=mesh, axis=axis, load_balanced=load_balanced,
                              kernel=kernel)


# --- Ulysses (all-to-all: sequence-sharded → head-sharded) -----------------------------------------------


def _ulysses_local(q_BtNH, k_BtKH, v_BtKH, *, axis: str, n: int, balanced: bool, kernel: str, platform: str):
    to_heads = lambda x: lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)  # [B, T, ·/n, H]
    q_BTnH, k_BTkH, v_BTkH = to_heads(q_BtNH), to_heads(k_BtKH), to_heads(v_BtKH)
    pos_T = _global_positions(q_BTnH.shape[1], n, balanced)
    out_BTnH, _ = block_attention(q_BTnH, k_BTkH, v_BTkH, Causal.static(pos_T, pos_T), kernel=kernel,
                                  platform=platform)
    return lax.all_to_all(out_BTnH.astype(v_BtKH.dtype), axis, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, mesh: Mesh,
                      axis: str = "sequence", load_balanced: bool = False, kernel: str = "auto") -> jax.Array:
    """Causal GQA attention with T split over `axis` (size n), computed head-parallel (DeepSpeed Ulysses).

    Sharded: q, k, v and the output along T outside; inside, an all-to-all turns [B, t, N, H] into
    [B, T, N/n, H] (and K/V into [B, T, K/n, H]): each device attends over the whole sequence for its
    N/n query heads and their K/n kv heads (contiguous heads, so the GQA groups stay together), and an
    all-to-all turns the output back. N and K must be divisible by n.
    Collectives per layer: forward, 4 all-to-alls (q, k, v in: B·t·(N+2K)·H·bytes per device, of which
    (n−1)/n leave it; out: B·t·N·H); backward, 4 more of the same sizes. The bytes per device do not grow
    with n at fixed t, unlike ring / all-gather, whose K/V traffic is (n−1)·2·B·t·K·H.
    Memory per device: q, k, v of the whole sequence for N/n heads, and with the dense kernel the f32
    scores [B, N/n, T, T] (kept for the backward pass): T²·N/n, the same as all-gather's [B, N, t, T]. The work is the full
    causal square for every device, so the zigzag order changes nothing; `load_balanced=True` only
    says the inputs (and output) are zigzagged. With the batch or heads also split over other
    (automatic) axes, XLA gathers those before the all-to-all (a partially manual region); `attend`
    avoids that.
    """
    return _context_attention("ulysses", q_BTNH, k_BTKH, v_BTKH, mesh=mesh, axis=axis, load_balanced=load_balanced,
                              kernel=kernel)


# --- the model's entry point ------------------------------------------------------------------------------


def _setting(compute: context.Compute, name: str, default):
    """`compute.<name>` if the Compute has that field, else `compute.rules.parallel.<name>`, else `default`."""
    if hasattr(compute, name):
        return getattr(compute, name)
    return getattr(getattr(compute.rules, "parallel", None), name, default)


def attend(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """Causal GQA attention as the model calls it, with T maybe split over the mesh axis `sequence`.

    Reads the active `meshpar.context.Compute`: its `attention_kernel` is the block kernel (`auto` with
    none). With none (eager use of a model), or when its mesh's `sequence` axis has size 1, this is
    `causal_attention` (batch / head sharding need no collective). Otherwise the schedule comes from two
    settings, each read from the `Compute` object if it has the field, else from
    `compute.rules.parallel` (`rules.ParallelConfig`), else these defaults:

    - `context_attention: str = "ring"` — one of "allgather", "ring", "ulysses" (see those functions);
      anything else is a ValueError.
    - `load_balance: bool = True` — the activations are in ZIGZAG order (`zigzag`): the training step
      reorders tokens, targets and rotary positions once (`zigzag`, `zigzag_positions`, as
      `meshpar.loss.next_token_loss` does), every per-token layer is indifferent to the order, and
      attention masks by the zigzag positions (`load_balanced=True` for every mode). The ring then does
      equal work on every device; allgather and ulysses do the same work either way. T must be divisible
      by 2·n. A caller that sets it must feed zigzagged activations, or the mask is wrong.

    Layout: q is laid out by the activation rules as ("batch", "seq", "heads", None) and k, v as
    ("batch", "seq", "kv_heads", None); `seq` must map to `sequence`. The shard_map is manual over every
    mesh axis those specs name (data, fsdp, model as well as sequence), not just `sequence`: XLA's
    partitioner replicates the operand of an all-gather or all-to-all in a partially manual region over
    the automatic axes (measured: a data=2,sequence=2,model=2 mesh gathers batch and heads first), which
    would undo data and tensor parallelism; per-device blocks avoid that. Ulysses then needs the heads
    per `model` shard divisible by the `sequence` size.
    """
    compute = context.active()
    axis = "sequence"
    if compute is None:
        return causal_attention(q_BTNH, k_BTKH, v_BTKH)
    kernel = compute.attention_kernel
    if compute.mesh.shape.get(axis, 1) == 1:
        return causal_attention(q_BTNH, k_BTKH, v_BTKH, kernel=kernel, platform=platform_of(compute.mesh))
    mode = _setting(compute, "context_attention", "ring")
    if mode not in MODES:
        raise InputError(f"context_attention = {mode!r} is not one of {', '.join(MODES)}")
    balanced = bool(_setting(compute, "load_balance", True))
    mesh, table = compute.mesh, compute.rules.table("activations")
    q_spec = sharding.spec_for(("batch", "seq", "heads", None), q_BTNH.shape, table, mesh, "attention q [B, T, N, H]")
    kv_spec = sharding.spec_for(("batch", "seq", "kv_heads", None), k_BTKH.shape, table, mesh,
                                "attention k, v [B, T, K, H]")
    if q_spec[1] != axis or kv_spec[1] != axis:
        raise InputError(f"context-parallel attention needs the activation rule 'seq' to map to mesh axis "
                         f"'{axis}' alone; it gives {q_spec[1]!r}")
    return _context_attention(mode, q_BTNH, k_BTKH, v_BTKH, mesh=mesh, axis=axis, load_balanced=balanced,
                              kernel=kernel, q_spec=q_spec, kv_spec=kv_spec, vmapped=compute.vmapped)
