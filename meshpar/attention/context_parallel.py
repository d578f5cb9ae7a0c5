"""Context parallelism: causal attention with the sequence split over a mesh axis (default `sequence`).

Shapes: B batch, T query positions (the global sequence), S key positions, N query heads, K kv heads,
G = N / K, H head dim; `n` is the size of the axis that splits the sequence and t = T / n the positions
each device holds; with load balancing (`meshpar.attention.zigzag`) each device's t positions are two
chunks of c = t / 2. Every schedule computes its attention with ONE block kernel,
`meshpar.attention.kernels.block_attention`, which returns the f32 output and the log-sum-exp of each
query row (what merging blocks needs); the output has v's dtype.

There are three schedules, each a `jax.shard_map` that is manual over the sequence axis, so that the
other mesh axes (data, fsdp, model) stay with the compiler (GSPMD). (XLA's partitioner replicates the
operand of an all-gather or all-to-all in such a partially manual region over the automatic axes that
split it, so with the batch or heads also split, allgather and ulysses gather those first; the ring's
ppermutes are unaffected. `meshpar.attention.attend`, which knows the layout from the rules, goes manual
over those axes too.)

| mode      | collectives per layer (forward; backward)            | attention memory per device | needs       |
|-----------|-------------------------------------------------------|-----------------------------|-------------|
| allgather | all-gather K,V (2·B·T·K·H); reduce-scatter dK,dV      | K,V [T]; dense: scores [t, T]  | T % n      |
| ring      | n−1 collective-permutes of K,V (2·B·t·K·H each);      | K,V blocks; dense: [t, t]      | T % n (2n) |
|           | as many of dK,dV the other way                        |                                |            |
| ulysses   | all-to-all q,k,v (B·t·(N+2K)·H) and out (B·t·N·H); ×2 | N/n heads; dense: [T, T]       | N, K % n   |

(With the blockwise kernel no schedule keeps a score matrix: a [block, block] tile at a time.)

Documents (packed rows, `meshpar.batch`): the document ids of the positions [B, t] go where their keys
go — all-gathered with K and V, ppermuted round the ring beside each K/V block (4 bytes per position,
B·t·4 per step), all-gathered whole for Ulysses — and every block's mask includes them.

Per device, ring and all-gather receive the other devices' K and V, (n−1)·2·B·t·K·H elements (growing
with n at fixed t); Ulysses sends (n−1)/n of its q, k, v and output slices, B·t·2(N+K)·H elements (flat in
n), so it wins for large n unless K ≪ N.
Ring attention hides its transfers behind the block matmuls (the ppermute of step s+1 overlaps the
compute of step s) and is the only one whose memory does not grow with T² or t·T. Causal masking makes
the contiguous split unbalanced (the last device has ~2n−1 times the unmasked pairs of the first); the zigzag
order gives each device chunks i and 2n−1−i of 2n chunks, which balances the work exactly.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from meshpar import sharding
from meshpar.attention import zigzag
from meshpar.attention.kernels import Causal, block_attention, platform_of
from meshpar.errors import InputError


def _axis_size(mesh: Mesh, axis: str) -> int:
    if axis not in mesh.shape:
        raise InputError(f"mesh has no axis '{axis}'; its axes are {', '.join(mesh.axis_names)}")
    return mesh.shape[axis]


def check(mode: str, T: int, heads: tuple[int, int], n: int, *, balanced: bool, head_ways: tuple[int, int] = (1, 1),
          axis: str = "sequence") -> None:
    """Refuse what a schedule cannot run: T positions over n devices (2n chunks in zigzag order), and for
    Ulysses the (query, kv) `heads` per device, after `head_ways` splits over other axes (`model`), over n.
    The training step and the planner (`meshpar.plan`) both ask this."""
    if balanced:
        zigzag.check(T, n)
    elif T % n:
        raise InputError(f"sequence length T = {T} is not divisible by mesh axis '{axis}' of size {n}")
    if mode != "ulysses":
        return
    for what, count, ways in zip(("query heads N", "kv heads K"), heads, head_ways):
        if (count // ways) % n:
            per = f" ({count // ways} per device after a {ways}-way split)" if ways > 1 else ""
            raise InputError(f"ulysses attention splits heads over mesh axis '{axis}' of size {n}, "
                             f"but the {count} {what}{per} are not divisible by {n}")


def context_attention(mode: str, q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, mesh: Mesh,
                      axis: str, load_balanced: bool, kernel: str, q_spec: P | None = None, kv_spec: P | None = None,
                      vmapped: tuple[str, ...] = (), window: int | None = None,
                      segments_BT: jax.Array | None = None, softcap: float | None = None,
                      sinks_N: jax.Array | None = None) -> jax.Array:
    """Run one schedule in a shard_map over `axis` and the other axes that `q_spec` / `kv_spec` name.
    `segments_BT`: the document ids of the positions (laid out as q's first two dimensions), or None.
    `sinks_N`: each query head's sink logit (laid out as q's heads), or None (`kernels.add_sinks`).

    Default specs: P(None, axis, None, None), manual over `axis` alone (partial-manual: the other mesh
    axes stay with the compiler). `vmapped`: mesh axes that an enclosing `vmap(spmd_axis_name=...)` owns
    (gradient accumulation's replicas, the pipeline's stages); the shard_map must be manual over them too,
    or JAX cannot batch it.
    """
    n = _axis_size(mesh, axis)
    q_spec = P(None, axis, None, None) if q_spec is None else q_spec
    kv_spec = P(None, axis, None, None) if kv_spec is None else kv_spec
    if q_BTNH.ndim != 4 or k_BTKH.ndim != 4 or k_BTKH.shape != v_BTKH.shape:
        raise InputError(f"expected q [B, T, N, H] and k, v [B, T, K, H] of equal shapes, got "
                         f"{q_BTNH.shape}, {k_BTKH.shape}, {v_BTKH.shape}")
    (B, T, N, H), (Bk, Tk, K, Hk) = q_BTNH.shape, k_BTKH.shape
    if (B, T, H) != (Bk, Tk, Hk):
        raise InputError(f"q {q_BTNH.shape} and k {k_BTKH.shape} disagree in B, T or H")
    if N % K:
        raise InputError(f"{N} query heads are not divisible by {K} kv heads (grouped-query attention)")
    ways = lambda spec: math.prod(mesh.shape[a] for a in sharding.spec_axes(P(*spec[2:3])))
    check(mode, T, (N, K), n, balanced=load_balanced, head_ways=(ways(q_spec), ways(kv_spec)), axis=axis)
    local = {"allgather": _allgather_local, "ring": _ring_local, "ulysses": _ulysses_local}[mode]
    if kernel == "cudnn":
        raise InputError(f"attention kernel 'cudnn' cannot run {mode} attention over '{axis}': cuDNN's custom "
                         f"partitioner cannot be called inside this partly manual shard_map (use auto or blockwise)")
    # On GPUs `auto` would take cuDNN (kernels.resolve_kernel), which fails to compile here for that reason.
    body = functools.partial(local, axis=axis, n=n, balanced=load_balanced,
                             kernel="blockwise" if kernel == "auto" and platform_of(mesh) == "gpu" else kernel,
                             platform=platform_of(mesh), window=window, softcap=softcap)
    names = set(sharding.spec_axes(q_spec)) | set(sharding.spec_axes(kv_spec)) | set(vmapped)
    segments_spec = None if segments_BT is None else P(*q_spec[:2])
    sinks_spec = None if sinks_N is None else P(q_spec[2])
    return jax.shard_map(body, mesh=mesh, axis_names=names,
                         in_specs=(q_spec, kv_spec, kv_spec, segments_spec, sinks_spec),
                         out_specs=q_spec, check_vma=not vmapped)(q_BTNH, k_BTKH, v_BTKH, segments_BT, sinks_N)


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


def _allgather_local(q_BtNH, k_BtKH, v_BtKH, seg_Bt, sinks_N, *, axis: str, n: int, balanced: bool, kernel: str,
                     platform: str, window: int | None, softcap: float | None):
    t = q_BtNH.shape[1]
    k_BTKH, v_BTKH = _gather_sequence(k_BtKH, axis), _gather_sequence(v_BtKH, axis)
    pos_T = zigzag.global_positions(t * n, n, balanced)
    # The keys' document ids come with them.
    segments = None if seg_Bt is None else (seg_Bt, lax.all_gather(seg_Bt, axis, axis=1, tiled=True))
    # Device i's queries see a different part of the keys: a tile is skipped only if every device skips it.
    layouts = tuple((zigzag.local_positions(d, t, n, balanced, np), pos_T) for d in range(n))
    causal = Causal(zigzag.local_positions(lax.axis_index(axis), t, n, balanced), jnp.asarray(pos_T), layouts, window,
                    segments)
    out_BtNH, _ = block_attention(q_BtNH, k_BTKH, v_BTKH, causal, kernel=kernel, platform=platform, softcap=softcap,
                                  sinks_N=sinks_N)
    return out_BtNH.astype(v_BtKH.dtype)


def allgather_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, mesh: Mesh,
                        axis: str = "sequence", load_balanced: bool = False, kernel: str = "auto",
                        window: int | None = None, segments_BT: jax.Array | None = None,
                        softcap: float | None = None, sinks_N: jax.Array | None = None) -> jax.Array:
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
    return context_attention("allgather", q_BTNH, k_BTKH, v_BTKH, mesh=mesh, axis=axis, load_balanced=load_balanced,
                              kernel=kernel, window=window, segments_BT=segments_BT, softcap=softcap, sinks_N=sinks_N)


# --- ring -------------------------------------------------------------------------------------------------

# The ring accumulates, per query row, (o, m, l): o = Σ_b exp(lse_b − m)·out_b and l = Σ_b exp(lse_b − m)
# over the blocks b seen so far, with m their largest log-sum-exp under stop_gradient (the result o / l
# does not depend on m, so the gradient is exact). Each block costs two exps over [B, t, N] and a scaled
# add over the output; normalising at every block (a log-sum-exp merge) measured ~20% slower per ring layer
# at 16 positions per device. The schedules give every row a finite log-sum-exp (step 0 sees the diagonal);
# a later block where a row sees no key (documents, the window) gives it lse −inf, which adds nothing.


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


def _ring_local(q_BtNH, k_BtKH, v_BtKH, seg_Bt, sinks_N, *, axis: str, n: int, balanced: bool, kernel: str, platform: str,
                window: int | None, softcap: float | None):
    t = q_BtNH.shape[1]
    i = lax.axis_index(axis)
    attend = functools.partial(block_attention, kernel=kernel, platform=platform, needs_lse=True, softcap=softcap)
    positions = lambda d, xp=jnp: zigzag.local_positions(d, t, n, balanced, xp)
    # Step 0: the local (diagonal) block; every query sees itself, so the log-sum-exp starts finite. Its tile
    # pattern holds for every device's positions (`Causal.layouts`). The sinks join this block only.
    own = tuple((positions(d, np),) * 2 for d in range(n))
    diagonal = Causal(positions(i), positions(i), own, window, None if seg_Bt is None else (seg_Bt, seg_Bt))
    acc = _start(jax.checkpoint(lambda q, k, v, sinks: attend(q, k, v, diagonal, sinks_N=sinks))(
        q_BtNH, k_BtKH, v_BtKH, sinks_N))
    if balanced:  # the zigzag steps add blocks per chunk: o [2, B, c, N, H], m and l [2, B, c, N]
        acc = tuple(_halves(a) for a in acc)
    # With a sliding window and the contiguous order, the block from i − s has every key at least
    # (s − 1)·t + 1 before every query: the steps past the window's reach are not run at all.
    steps = n if window is None or balanced else min(n, 1 + math.ceil((window - 1) / t))
    if steps > 1:
        later = _zigzag_steps if balanced else _contiguous_steps
        compute = later(q_BtNH, seg_Bt, i=i, n=n, steps=steps, window=window, attend=attend)
        acc = _pass_blocks(acc, compute, (jnp.stack([k_BtKH, v_BtKH]), seg_Bt), axis=axis, n=n, steps=steps)
    out = _finish(acc)
    return (_whole(out) if balanced else out).astype(v_BtKH.dtype)


def _pass_blocks(acc, compute, block, *, axis: str, n: int, steps: int):
    """Steps 1 … steps − 1: every device hands its K/V `block` (with their document ids) to the next one
    and adds the block it holds, `compute(acc, block, s)`, the block of device i − s."""
    # The shift for step s+1 is issued before the compute of step s and does not depend on it, so the
    # transfer can overlap the block matmuls; the last step is peeled off so that exactly steps−1 shifts run.
    ring = [(j, (j + 1) % n) for j in range(n)]  # after s shifts device i holds the block of i − s

    def step(carry, s):
        acc, block = carry
        block_next = lax.ppermute(block, axis, ring)
        return (compute(acc, block, s), block_next), None

    # One ppermute per step for K and V together (and another, small, for their document ids).
    block = lax.ppermute(block, axis, ring)
    if steps > 2:
        (acc, block), _ = lax.scan(step, (acc, block), jnp.arange(1, steps - 1))
    return compute(acc, block, steps - 1)


# Without a window or documents every block a later step adds is either wholly visible or wholly masked (its
# positions are all before or all after the queries', in both orders), so it needs no mask; with them, a
# block is masked by the window from the positions of the device it came from and by the document ids that
# travel with its keys. A step's compute is rematerialised in the backward pass (jax.checkpoint), so only
# the step's inputs (the accumulators and the K/V block) are saved, never a score block.


def _contiguous_steps(q_BtNH, seg_Bt, *, i, n: int, steps: int, window: int | None, attend):
    """The contiguous order's later steps: `compute(acc, block, s)`, which adds the block of device i − s."""
    t = q_BtNH.shape[1]
    positions = lambda d, xp=jnp: zigzag.local_positions(d, t, n, False, xp)
    arriving = tuple((positions(d, np), positions(d - s, np)) for s in range(1, steps) for d in range(s, n))
    masked = window is not None or seg_Bt is not None

    def step(acc, q_BtNH, k_BtKH, v_BtKH, src, k_seg_Bt):
        segments = None if seg_Bt is None else (seg_Bt, k_seg_Bt)
        mask = Causal(positions(i), positions(src), arriving, window, segments) if masked else None
        return _accumulate(acc, attend(q_BtNH, k_BtKH, v_BtKH, mask))

    update = jax.checkpoint(step, prevent_cse=False)

    # The block from src = i − s is visible iff src < i, else skipped with lax.cond: the skip is a
    # data-dependent (per-device) branch, and a conditional is the only way to not do the work (arithmetic
    # selection would compute and discard it). The devices still wait for the busiest one (device n−1
    # computes every block), which is what zigzag fixes.
    def compute(acc, block, s):
        src, (kv_2BtKH, k_seg_Bt) = (i - s) % n, block
        return lax.cond(src < i, lambda a: update(a, q_BtNH, kv_2BtKH[0], kv_2BtKH[1], src, k_seg_Bt),
                        lambda a: a, acc)

    return compute


def _zigzag_steps(q_BtNH, seg_Bt, *, i, n: int, steps: int, window: int | None, attend):
    """The zigzag order's later steps, on accumulators per chunk: `compute(acc, block, s)`, which adds the
    block of src = i − s. Queries (q0, q1) = chunks (i, 2n−1−i), keys (k0, k1) = chunks (src, 2n−1−src).
    If src < i, q0·k0 and q1·k0 are visible; if src > i, q1·k0 and q1·k1; the other two blocks are masked.
    So every step is q1·k0 plus qx·kx with x = [src > i]: two unmasked [c, c] blocks on every device, equal
    work, and the choice is a dynamic index (arithmetic), not a conditional: nothing masked is computed and
    no device runs a different program."""
    t = q_BtNH.shape[1]
    c = t // 2
    chunks = lambda d, xp=jnp: zigzag.local_positions(d, t, n, True, xp).reshape(2, c)
    arriving = []  # every (query chunk, key chunk) pair a step computes, on any device
    for s in range(1, steps):
        for d in range(n):
            src = (d - s) % n
            q_2c, k_2c, x = chunks(d, np), chunks(src, np), int(src > d)
            arriving += [(q_2c[1], k_2c[0]), (q_2c[x], k_2c[x])]
    arriving = tuple(arriving)
    masked = window is not None or seg_Bt is not None
    q_seg_2Bc = _halves(seg_Bt)

    def add(acc, q_2BcNH, x, keys, y):
        """acc with query chunk x over key chunk y of `keys` added to chunk x's part."""
        k_2BcKH, v_2BcKH, kpos_2c, k_seg_2Bc = keys
        segments = None if seg_Bt is None else (_at(q_seg_2Bc, x), _at(k_seg_2Bc, y))
        mask = Causal(_at(chunks(i), x), _at(kpos_2c, y), arriving, window, segments) if masked else None
        block = attend(_at(q_2BcNH, x), _at(k_2BcKH, y), _at(v_2BcKH, y), mask)
        return tuple(lax.dynamic_update_index_in_dim(a, a_x, x, 0)
                     for a, a_x in zip(acc, _accumulate(tuple(_at(a, x) for a in acc), block)))

    def step(acc, q_2BcNH, block, src):
        (kv_2BtKH, k_seg_Bt), x = block, (src > i).astype(jnp.int32)
        keys = (_halves(kv_2BtKH[0]), _halves(kv_2BtKH[1]), chunks(src), _halves(k_seg_Bt))
        return add(add(acc, q_2BcNH, 1, keys, 0), q_2BcNH, x, keys, x)

    update, q_2BcNH = jax.checkpoint(step, prevent_cse=False), _halves(q_BtNH)
    return lambda acc, block, s: update(acc, q_2BcNH, block, (i - s) % n)


def _halves(x_Bt):
    """[B, t, ...] → [2, B, c, ...]: the two zigzag chunks a device holds (None stays None)."""
    return None if x_Bt is None else jnp.moveaxis(x_Bt.reshape(x_Bt.shape[:1] + (2, -1) + x_Bt.shape[2:]), 1, 0)


def _whole(x_2Bc):
    """The inverse of `_halves`."""
    return jnp.moveaxis(x_2Bc, 0, 1).reshape((x_2Bc.shape[1], -1) + x_2Bc.shape[3:])


def _at(x, j):
    """x[j] along the first axis, j static or traced (None stays None)."""
    return None if x is None else lax.dynamic_index_in_dim(x, j, 0, keepdims=False)


def ring_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, mesh: Mesh,
                   axis: str = "sequence", load_balanced: bool = False, kernel: str = "auto",
                   window: int | None = None, segments_BT: jax.Array | None = None,
                   softcap: float | None = None, sinks_N: jax.Array | None = None) -> jax.Array:
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
    return context_attention("ring", q_BTNH, k_BTKH, v_BTKH, mesh=mesh, axis=axis, load_balanced=load_balanced,
                              kernel=kernel, window=window, segments_BT=segments_BT, softcap=softcap, sinks_N=sinks_N)


# --- Ulysses (all-to-all: sequence-sharded → head-sharded) -----------------------------------------------


def _ulysses_local(q_BtNH, k_BtKH, v_BtKH, seg_Bt, sinks_N, *, axis: str, n: int, balanced: bool, kernel: str,
                   platform: str, window: int | None, softcap: float | None):
    to_heads = lambda x: lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)  # [B, T, ·/n, H]
    q_BTnH, k_BTkH, v_BTkH = to_heads(q_BtNH), to_heads(k_BtKH), to_heads(v_BtKH)
    pos_T = zigzag.global_positions(q_BTnH.shape[1], n, balanced)
    seg_BT = None if seg_Bt is None else lax.all_gather(seg_Bt, axis, axis=1, tiled=True)  # every position's
    segments = None if seg_BT is None else (seg_BT, seg_BT)
    if sinks_N is not None:  # this device's heads: block i of its N heads, as the all-to-all split them
        heads = q_BTnH.shape[2]
        sinks_N = lax.dynamic_slice_in_dim(sinks_N, lax.axis_index(axis) * heads, heads)
    out_BTnH, _ = block_attention(q_BTnH, k_BTkH, v_BTkH, Causal.static(pos_T, pos_T, window, segments),
                                  kernel=kernel, platform=platform, softcap=softcap, sinks_N=sinks_N)
    return lax.all_to_all(out_BTnH.astype(v_BtKH.dtype), axis, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, mesh: Mesh,
                      axis: str = "sequence", load_balanced: bool = False, kernel: str = "auto",
                      window: int | None = None, segments_BT: jax.Array | None = None,
                      softcap: float | None = None, sinks_N: jax.Array | None = None) -> jax.Array:
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
    return context_attention("ulysses", q_BTNH, k_BTKH, v_BTKH, mesh=mesh, axis=axis, load_balanced=load_balanced,
                              kernel=kernel, window=window, segments_BT=segments_BT, softcap=softcap, sinks_N=sinks_N)
