"""Attention sinks (gpt-oss: a learned logit per head in every softmax's denominator) in every kernel and
context-parallel schedule against the textbook formula written here, values and gradients (q, k, v and the
sinks; float32, relative 1e-5), with and without a sliding window; generation's cached kernel too. The
model's sinks against transformers' gpt-oss are in test_hf_moe.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshpar.attention import context_parallel, kernels, zigzag
from test_attention import FUNCTIONS, heads_for, inputs, make_mesh, relative_error, run_fast


def textbook(q_BTNH, k_BTKH, v_BTKH, sinks_N, window: int | None):
    """softmax over [q·kᵀ/√H + causal (and window) mask, sink] of each query row, the sink's column then
    dropped, times v."""
    B, T, N, H = q_BTNH.shape
    k_BTNH, v_BTNH = (jnp.repeat(x, N // x.shape[2], axis=2) for x in (k_BTKH, v_BTKH))
    scores_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BTNH) / np.sqrt(H)
    delta_TS = np.arange(T)[:, None] - np.arange(T)[None, :]
    seen_TS = (delta_TS >= 0) & (delta_TS < (window or T + 1))
    scores_BNTS = jnp.where(seen_TS, scores_BNTS, -jnp.inf)
    with_sink = jnp.concatenate([scores_BNTS, jnp.broadcast_to(sinks_N[None, :, None, None], (B, N, T, 1))], -1)
    probs_BNTS = jax.nn.softmax(with_sink, axis=-1)[..., :T]
    return jnp.einsum("bnts,bsnh->btnh", probs_BNTS, v_BTNH)


def with_sink_grads(f):
    """(out, (dq, dk, dv, dsinks)) of f(q, k, v, sinks) for the cotangent ct."""
    def run(q, k, v, sinks, ct):
        out, vjp = jax.vjp(f, q, k, v, sinks)
        return out, vjp(ct)
    return run


def sink_inputs(N: int, K: int, T: int):
    q, k, v, ct = inputs(N, K, t=T)
    sinks_N = jnp.asarray(np.random.default_rng(7).normal(0.0, 1.5, N), jnp.float32)  # from a little to most
    return q, k, v, sinks_N, ct


@functools.lru_cache(maxsize=None)
def reference(N: int, K: int, T: int, window: int | None):
    q, k, v, sinks, ct = sink_inputs(N, K, T)
    out, grads = run_fast(with_sink_grads(functools.partial(textbook, window=window)), q, k, v, sinks, ct)
    return [np.asarray(x) for x in (out, *grads)]


def assert_matches(results, want, rtol=1e-5):
    for name, got, expected in zip(("out", "dq", "dk", "dv", "dsinks"), results, want):
        assert relative_error(got, expected) < rtol, f"{name}: relative error {relative_error(got, expected):.2e}"


def test_the_sinks_take_a_share_of_each_row():
    """The comparison can fail: without the sinks the output is another one."""
    q, k, v, sinks, _ = sink_inputs(8, 2, 16)
    plain = kernels.causal_attention(q, k, v, kernel="dense")
    assert relative_error(plain, reference(8, 2, 16, None)[0]) > 0.05


@pytest.mark.parametrize("window", [None, 40], ids=["full", "window-40"])
@pytest.mark.parametrize("kernel", ["dense", "blockwise"])
def test_one_device_kernels_match_the_formula(kernel, window):
    """T = 384: three 128-tiles per side, so the blockwise kernel skips, masks and fully computes tiles."""
    T = 384
    q, k, v, sinks, ct = sink_inputs(8, 2, T)
    f = lambda q, k, v, s: kernels.causal_attention(q, k, v, kernel=kernel, window=window, sinks_N=s)
    out, grads = run_fast(with_sink_grads(f), q, k, v, sinks, ct)
    assert_matches([np.asarray(x) for x in (out, *grads)], reference(8, 2, T, window))


def test_generation_kernel_matches_the_formula():
    """The cached kernel of generation: the last 5 queries over every key, at their positions."""
    T = 32
    q, k, v, sinks, _ = sink_inputs(8, 2, T)
    positions = jnp.arange(T)
    out = kernels.cached_attention(q[:, -5:], k, v, positions[-5:], positions, window=11, sinks_N=sinks)
    assert relative_error(out, reference(8, 2, T, 11)[0][:, -5:]) < 1e-5


CP_CASES = [("ring", False), ("ring", True), ("allgather", True), ("ulysses", True)]


@pytest.mark.parametrize("window", [None, 11], ids=["full", "window-11"])
@pytest.mark.parametrize("mode,balanced", CP_CASES, ids=[f"{m}-{'zigzag' if b else 'contiguous'}" for m, b in CP_CASES])
def test_context_parallel_schedules_match_the_formula(mode, balanced, window):
    """sequence=4, T = 32 (8 positions per device), the blockwise kernel: the ring adds the sinks to its
    diagonal block only, all-gather to its one block, Ulysses to the heads each device holds."""
    n, T = 4, 32
    N, K = heads_for(mode, n)
    mesh = make_mesh(f"sequence={n}")
    q, k, v, sinks, ct = sink_inputs(N, K, T)
    order = (lambda x: zigzag.zigzag(x, n)) if balanced else (lambda x: x)
    on_mesh = lambda x: jax.device_put(order(x), NamedSharding(mesh, P(None, "sequence")))
    f = lambda q, k, v, s: FUNCTIONS[mode](q, k, v, mesh=mesh, load_balanced=balanced, kernel="blockwise",
                                           window=window, sinks_N=s)
    out, grads = run_fast(with_sink_grads(f), on_mesh(q), on_mesh(k), on_mesh(v), sinks, on_mesh(ct))
    unorder = (lambda x: zigzag.unzigzag(x, n)) if balanced else (lambda x: x)
    results = [unorder(out), *(unorder(g) for g in grads[:3]), grads[3]]
    assert_matches([np.asarray(x) for x in results], reference(N, K, T, window))


def test_ulysses_with_heads_split_over_model_takes_each_devices_sinks():
    """sequence=2, model=2: the heads are split over `model` before Ulysses splits them over `sequence`; each
    device's sinks are those of the heads it holds."""
    mesh = make_mesh("sequence=2,model=2")
    q, k, v, sinks, ct = sink_inputs(8, 4, 32)
    spec = P(None, "sequence", "model", None)
    on_mesh = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
    f = lambda q, k, v, s: context_parallel.context_attention(
        "ulysses", q, k, v, mesh=mesh, axis="sequence", load_balanced=False, kernel="dense", q_spec=spec,
        kv_spec=spec, window=11, sinks_N=s)
    out, grads = run_fast(with_sink_grads(f), on_mesh(q), on_mesh(k), on_mesh(v),
                          jax.device_put(sinks, NamedSharding(mesh, P("model"))), on_mesh(ct))
    assert_matches([np.asarray(x) for x in (out, *grads)], reference(8, 4, 32, 11))
