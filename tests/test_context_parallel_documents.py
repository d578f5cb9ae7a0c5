"""Context-parallel attention (ring, all-gather, Ulysses) with the blockwise kernel and packed documents, in
both sequence orders, with and without a sliding window, against the textbook formula written here (values and
gradients, float32). Tiles of 4 positions cut each device's 16 (and each zigzag chunk of 8) into several query
and key tiles, so the kernel's tile patterns, its run-time skip of tiles no document spans, and rows that see
no key in a block (a document starting at a block's edge, a window ending before it) are all exercised. A row
that is one long document showed the ring (both orders) running tiles that a device's window cuts as if wholly
visible: the kernel crossed the key layouts of different devices (now each device's (query, key) pair has its
own tile pattern, `flash.block_pattern`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshpar.attention import kernels, zigzag
from meshpar.divisors import largest_divisor
from test_attention import FUNCTIONS, make_mesh, run_fast, value_and_grads

B, t, H = 3, 16, 8  # t: positions per device
TILE = 4


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """The blockwise kernel's tile edge on CPU is 4 here: a zigzag chunk of t/2 = 8 holds 2 tiles, a block 4."""
    monkeypatch.setitem(kernels.BLOCK, "cpu", TILE)
    assert largest_divisor(t // 2, TILE) * 2 <= t // 2


def document_ids(T: int) -> np.ndarray:
    """[3, T] ids 1, 2, … Row 0 starts a document at every 8th position (every device's block and zigzag
    chunk starts one: its rows see no key in any block but their own) and one inside a tile (at 5); row 1
    has documents across block edges, [0, 3), [3, 19), [19, 30), [30, 32), [32, 45), …; row 2 one document
    longer than any window, [0, T − 3), so that the window alone masks its far keys."""
    starts = [sorted({5, *range(8, T, 8)}), [s for s in (3, 19, 30, 32, 45, 61) if s < T], [T - 3]]
    return np.stack([np.searchsorted(s, np.arange(T), side="right") + 1 for s in starts]).astype(np.int32)


def reference_attention(q_BTNH, k_BTKH, v_BTKH, seg_BT, window):
    """softmax(q·kᵀ/√H + mask)·v, mask = causal & same document & within the window (query t sees key s iff
    0 <= t − s < window), query head n on kv head n // (N/K): the textbook formula, dense."""
    N, K, T = q_BTNH.shape[2], k_BTKH.shape[2], q_BTNH.shape[1]
    k_BTNH, v_BTNH = (jnp.repeat(x, N // K, axis=2) for x in (k_BTKH, v_BTKH))
    scores_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BTNH) / np.sqrt(q_BTNH.shape[-1])
    delta_TS = np.arange(T)[:, None] - np.arange(T)[None, :]
    seen_BTS = ((delta_TS >= 0) & (delta_TS < (window or T)))[None] & (seg_BT[:, :, None] == seg_BT[:, None, :])
    scores_BNTS = jnp.where(seen_BTS[:, None], scores_BNTS, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores_BNTS, axis=-1), v_BTNH)


# (mode, n, zigzag, window). Windows: 20 reaches 1–2 blocks back with tiles partly inside it; 40 (n = 4,
# contiguous) makes the ring run every step with the far steps' tiles partly outside it; 6 stops a contiguous
# ring after one shift and leaves most rows of that block with no key in the window.
CASES = [("ring", 2, False, None), ("ring", 2, True, None), ("ring", 2, True, 20), ("ring", 4, False, 40),
         ("ring", 4, False, 6), ("ring", 4, True, 20), ("allgather", 2, False, 20), ("allgather", 4, True, 20),
         ("ulysses", 2, True, 20), ("ulysses", 4, False, None)]


@pytest.mark.parametrize(("mode", "n", "balanced", "window"), CASES,
                         ids=[f"{m}-n{n}-{'zigzag' if z else 'contiguous'}-window{w}" for m, n, z, w in CASES])
def test_blockwise_schedules_with_documents_match_the_formula(mode, n, balanced, window):
    """sequence = n, T = 16·n, GQA with N = 2n query heads on K = n kv heads (Ulysses splits both over n):
    the output and dq, dk, dv of a random cotangent, in the natural order, within 1e-5."""
    T, N, K = t * n, 2 * n, n
    rng = np.random.default_rng(n)
    q, k, v, ct = (jnp.asarray(rng.standard_normal((B, T, heads, H)), jnp.float32) for heads in (N, K, K, N))
    seg = document_ids(T)
    want = value_and_grads(functools.partial(reference_attention, seg_BT=seg, window=window))(q, k, v, ct)

    mesh = make_mesh(f"sequence={n}")
    order = (lambda x: zigzag.zigzag(x, n)) if balanced else (lambda x: x)
    shard = lambda x: jax.device_put(order(x), NamedSharding(mesh, P(None, "sequence")))
    f = functools.partial(FUNCTIONS[mode], mesh=mesh, load_balanced=balanced, kernel="blockwise", window=window,
                          segments_BT=order(jnp.asarray(seg)))
    out, grads = run_fast(value_and_grads(f), *(shard(x) for x in (q, k, v, ct)))
    restore = (lambda x: zigzag.unzigzag(x, n)) if balanced else (lambda x: x)
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (want[0], *want[1])):
        np.testing.assert_allclose(restore(got), expected, rtol=1e-5, atol=1e-5, err_msg=name)
