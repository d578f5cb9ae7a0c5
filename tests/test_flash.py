"""The blockwise ("flash") attention kernel against dense attention written here: output, log-sum-exp and
gradients (float32, relative 1e-5) for GQA, several lengths and block sizes, contiguous and zigzag
positions; the tiles it skips; and its memory from the compiler, linear in T (the README's table)."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import readme_figure, require_devices
from meshpar import mesh as mesh_lib
from meshpar.attention import context_parallel, flash, kernels, zigzag
from meshpar.divisors import largest_divisor

H = 8
ROOT = Path(__file__).resolve().parents[1]


def dense_reference(q_BTNH, k_BSKH, v_BSKH, q_pos, k_pos):
    """softmax(q·kᵀ/√H, causal by position)·v and the log-sum-exp of each row: the textbook formula."""
    B, T, N, _ = q_BTNH.shape
    K = k_BSKH.shape[2]
    k_BSNH, v_BSNH = (jnp.repeat(x, N // K, axis=2) for x in (k_BSKH, v_BSKH))  # head n uses kv head n // G
    scores_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH) / np.sqrt(q_BTNH.shape[-1])
    scores_BNTS = jnp.where(q_pos[:, None] >= k_pos[None, :], scores_BNTS, -jnp.inf)
    lse_BNT = jax.nn.logsumexp(scores_BNTS, axis=-1)
    out_BTNH = jnp.einsum("bnts,bsnh->btnh", jnp.exp(scores_BNTS - lse_BNT[..., None]), v_BSNH)
    return out_BTNH, jnp.moveaxis(lse_BNT, 1, 2)


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def inputs(T: int, N: int, K: int, B: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H), (B, T, N)]
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def positions(T: int, order: str) -> np.ndarray:
    return np.arange(T) if order == "natural" else np.asarray(zigzag.positions(T, int(order[-1])))


@pytest.mark.parametrize(("T", "block", "N", "K", "order"), [
    (64, 16, 8, 2, "natural"), (96, 32, 8, 1, "natural"), (64, 64, 8, 2, "natural"), (128, 16, 4, 4, "natural"),
    (64, 8, 4, 4, "zigzag2"), (48, 8, 6, 3, "zigzag2"), (128, 16, 8, 2, "zigzag4")])
def test_matches_dense_attention(T, block, N, K, order):
    """Values, log-sum-exp and the gradients of both (cotangents for out AND lse, as the ring accumulator needs)."""
    q, k, v, d_out, d_lse = inputs(T, N, K)
    pos = positions(T, order)
    pattern = flash.block_pattern(pos, pos, block, block)
    kernel = jax.jit(lambda q, k, v: flash.attention(q, k, v, jnp.asarray(pos), jnp.asarray(pos), pattern))
    (out, lse), vjp = jax.vjp(kernel, q, k, v)
    (ref_out, ref_lse), ref_vjp = jax.vjp(functools.partial(dense_reference, q_pos=pos, k_pos=pos), q, k, v)
    assert relative_error(out, ref_out) < 1e-5
    assert relative_error(lse, ref_lse) < 1e-5
    for name, got, want in zip(("dq", "dk", "dv"), vjp((d_out, d_lse)), ref_vjp((d_out, d_lse))):
        assert relative_error(got, want) < 1e-5, name


def test_query_and_key_blocks_of_different_sizes():
    q, k, v, d_out, _ = inputs(64, 4, 2)
    pos = np.arange(64)
    pattern = flash.block_pattern(pos, pos, 8, 32)
    out, lse = flash.attention(q, k, v, jnp.asarray(pos), jnp.asarray(pos), pattern)
    ref_out, ref_lse = dense_reference(q, k, v, pos, pos)
    assert relative_error(out, ref_out) < 1e-5 and relative_error(lse, ref_lse) < 1e-5


def test_causal_tiles_are_skipped_and_only_the_diagonal_is_masked():
    pattern = flash.block_pattern(np.arange(64), np.arange(64), 16, 16)
    assert (pattern == flash.SKIP).sum() == 6 and (pattern == flash.MASKED).sum() == 4  # n(n−1)/2, n
    np.testing.assert_array_equal(np.diag(pattern), [flash.MASKED] * 4)
    assert (np.tril(pattern, -1)[np.tril_indices(4, -1)] == flash.FULL).all()
    # zigzag on 2 shards: shard 0 holds chunks 0 and 3 of 4 — the pattern still skips what no query sees
    zig = positions(64, "zigzag2")
    pattern = flash.block_pattern(zig, zig, 16, 16)
    visible = (zig.reshape(4, 16).max(1)[:, None] >= zig.reshape(4, 16).min(1)[None, :])
    np.testing.assert_array_equal(pattern != flash.SKIP, visible)
    # several layouts (devices) at once: skipped only where every layout skips, FULL only where all are
    alone = flash.block_pattern(np.arange(32), np.arange(32), 16, 16)
    union = flash.block_pattern([np.arange(32), np.arange(32, 64)], np.arange(32), 16, 16)
    assert alone[0, 1] == flash.SKIP and union[0, 1] == flash.MASKED and union[1, 0] == flash.FULL


def test_bfloat16_is_close_to_float32():
    q, k, v, _, _ = inputs(64, 8, 2)
    pos = jnp.arange(64)
    pattern = flash.block_pattern(np.arange(64), np.arange(64), 16, 16)
    out16, _ = flash.attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), pos, pos, pattern)
    assert out16.dtype == jnp.float32  # the accumulator; callers cast
    assert relative_error(out16, dense_reference(q, k, v, np.arange(64), np.arange(64))[0]) < 2e-2


def test_tiles_cut_the_sequence_exactly():
    assert largest_divisor(8192, 512) == 512 and largest_divisor(96, 64) == 48 and largest_divisor(7, 4) == 1
    with pytest.raises(ValueError, match="pattern does not tile T = 60"):
        flash.attention(*inputs(60, 4, 2)[:3], jnp.arange(60), jnp.arange(60), np.ones((7, 4), np.int8))


def _scans(jaxpr) -> list[tuple[int, list]]:
    """Every scan anywhere in a jaxpr: (its length, the float stacks it hands out per iteration, `ys`)."""
    from jax.extend import core

    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            # jax 0.10 counts the carries (`num_carry`); 0.12 gives the outputs' (carry, ys) tree (`ft_out`)
            params = eqn.params
            carries = params["num_carry"] if "num_carry" in params else len(params["ft_out"].unpack()[0])
            found.append((params["length"], [v.aval for v in eqn.outvars[carries:]
                                             if jnp.issubdtype(v.aval.dtype, jnp.floating)]))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, core.ClosedJaxpr):
                    found += _scans(sub.jaxpr)
                elif isinstance(sub, core.Jaxpr):
                    found += _scans(sub)
    return found


def test_an_enclosing_loop_does_not_stack_the_kernel_per_tile():
    """Under a rematerialised step of an enclosing scan (a ring, a layer stack), JAX's partial evaluation
    could hoist what depends only on the loop's constants (here: the queries) and stack it per tile pair —
    memory quadratic in T. No scan of the differentiated program hands out a stack of 36 (the tile pairs),
    and the kernel's own loops over the 36 pairs are among those looked at (the check sees inside it)."""
    q, k, v, _, _ = inputs(64, 4, 2, B=1)
    pattern = flash.block_pattern(np.arange(64), np.arange(64), 8, 8)  # 36 tile pairs

    def ring_like(q, k, v):
        def step(acc, scale):
            block = jax.checkpoint(lambda q, k: flash.attention(q, k * scale, v, jnp.arange(64), jnp.arange(64),
                                                                 pattern)[0])
            return acc + block(q, k), None

        return jax.lax.scan(step, jnp.zeros_like(q), jnp.arange(1.0, 4.0))[0].sum()

    scans = _scans(jax.make_jaxpr(jax.grad(ring_like))(q, k, v).jaxpr)
    assert sum(length == 36 for length, _ in scans) >= 2, scans  # the kernel's forward and backward pair loops
    assert all(aval.shape[0] != 36 for _, stacks in scans for aval in stacks), scans


def test_ring_attention_memory_grows_linearly_in_T():
    """The blockwise kernel inside the ring's rematerialised steps (zigzag order, 2 devices): temp bytes per
    token of the value and gradients within 25% across T = 1k, 2k, 4k (a stack per tile pair, or a [t, t]
    score block kept per step, would grow them with T)."""
    require_devices(2)
    mesh = mesh_lib.build(mesh_lib.parse("sequence=2"), jax.devices()[:2])

    def temp(T: int) -> int:
        args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(1, T, 8, 64), (1, T, 2, 64), (1, T, 2, 64)]]
        loss = lambda q, k, v: context_parallel.ring_attention(q, k, v, mesh=mesh, load_balanced=True,
                                                               kernel="blockwise").sum()
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile(
            compiler_options={"xla_backend_optimization_level": 0})
        return compiled.memory_analysis().temp_size_in_bytes

    per_token = [temp(T) / T for T in (1024, 2048, 4096)]
    assert max(per_token) < 1.25 * min(per_token), per_token


def _layer_temp_bytes(T: int, kernel: str) -> int:
    """XLA's temp bytes of value-and-grad of one llama_8b attention (B = 1, 32 heads, 8 kv heads, H = 128,
    bfloat16), compiled for abstract inputs."""
    B, N, K, Hd = 1, 32, 8, 128
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(B, T, N, Hd), (B, T, K, Hd), (B, T, K, Hd)]]
    loss = lambda q, k, v: kernels.causal_attention(q, k, v, kernel=kernel, platform="cpu").astype(jnp.float32).sum()
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile(
        compiler_options={"xla_backend_optimization_level": 0})
    return compiled.memory_analysis().temp_size_in_bytes


def readme_temp_table() -> dict[tuple[str, int], float]:
    """(kernel, T) → MiB, from the README's table of one attention's temp bytes ("–": not given)."""
    section = (ROOT / "README.md").read_text().split("Temp bytes of one `llama_8b` attention", 1)[1]
    header, _, *rows = section.split("\n\n", 2)[1].splitlines()
    cells = lambda line: [cell.strip().strip("`").replace(",", "") for cell in line.strip("|").split("|")]
    lengths = [int(T) for T in cells(header)[1:]]
    return {(kernel, T): readme_figure(mib) for kernel, *values in map(cells, rows)
            for T, mib in zip(lengths, values) if mib != "–"}


def test_memory_grows_linearly_in_T():
    """T = 2k, 4k, 8k, 16k: the blockwise kernel's temp bytes per token stay within 25% of each other
    (linear in T: the [T, S] scores never exist), where the dense kernel's quadruple with each doubling;
    and the README's table of them holds to 5%."""
    measured = {(kernel, T): _layer_temp_bytes(T, kernel) / 2**20 for kernel, T in readme_temp_table()}
    blockwise = {T: mib for (kernel, T), mib in measured.items() if kernel == "blockwise"}
    dense = {T: mib for (kernel, T), mib in measured.items() if kernel == "dense"}
    assert sorted(blockwise) == [2048, 4096, 8192, 16384] and {2048, 4096} <= dense.keys()
    per_token = [blockwise[T] / T for T in blockwise]
    assert max(per_token) < 1.25 * min(per_token), blockwise
    assert dense[4096] > 3.5 * dense[2048], dense
    assert blockwise[16384] < dense[2048], (blockwise, dense)
    for cell, mib in readme_temp_table().items():
        assert measured[cell] == pytest.approx(mib, rel=0.05), (cell, measured[cell])
