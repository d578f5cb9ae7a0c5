"""The cuDNN kernel's call (`kernels.cudnn_attention`), run on CPU: the arguments meshpar builds for
`jax.nn.dot_product_attention` (`is_causal`, `local_window_size`) given to JAX's XLA implementation of the
same function, against the textbook formula (values and gradients, float32, GQA). cuDNN itself needs a GPU;
that a GPU program holds cuDNN's call with the window is in test_gpu_compile.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar.attention import kernels
from test_attention import inputs, relative_error, run_fast, value_and_grads


def textbook_attention(q_BTNH, k_BSKH, v_BSKH, causal: bool, window: int | None):
    """softmax(q·kᵀ/√H + mask)·v, query head n on kv head n // (N/K); with `causal`, query t sees key s iff
    0 <= t − s < window (no window: no bound): a window of W keeps the W latest keys, the query's own included."""
    N, K, T, S = q_BTNH.shape[2], k_BSKH.shape[2], q_BTNH.shape[1], k_BSKH.shape[1]
    k_BSNH, v_BSNH = (jnp.repeat(x, N // K, axis=2) for x in (k_BSKH, v_BSKH))
    scores_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH) / np.sqrt(q_BTNH.shape[-1])
    if causal:
        delta_TS = np.arange(T)[:, None] - np.arange(S)[None, :]
        scores_BNTS = jnp.where((delta_TS >= 0) & (delta_TS < (window or T)), scores_BNTS, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores_BNTS, axis=-1), v_BSNH)


# (causal, window): no mask (what the kernel gets for causal=None), plain causal, a window of the query's own
# key and the one before it (an off-by-one would see one or three), a window of 5 of T = 32 keys
MASKS = [(False, None), (True, None), (True, 2), (True, 5)]


@pytest.mark.parametrize("causal,window", MASKS, ids=["none", "causal", "window=2", "window=5"])
def test_cudnn_call_arguments_give_the_formula_under_xla(causal, window):
    """GQA (8 query heads on 2 kv heads), T = 32: meshpar's window of W keys as `local_window_size`, values
    and gradients to 1e-5."""
    T = 32
    q, k, v, ct = inputs(8, 2, t=T)
    mask = kernels.Causal.static(np.arange(T), np.arange(T), window) if causal else None
    got = run_fast(value_and_grads(lambda q, k, v: kernels.cudnn_attention(q, k, v, mask, implementation="xla")),
                   q, k, v, ct)
    want = run_fast(value_and_grads(lambda q, k, v: textbook_attention(q, k, v, causal, window)), q, k, v, ct)
    out, grads = got
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (want[0], *want[1])):
        assert a.shape == b.shape and a.dtype == jnp.float32, name
        assert relative_error(a, b) < 1e-5, f"{name}: relative error {relative_error(a, b):.2e}"
