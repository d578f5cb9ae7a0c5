"""The chunked cross-entropy against the whole-logits formula written here: loss and gradients (float32,
relative 1e-5) on one device and on meshes (vocab-parallel TP, FSDP, context parallelism, Megatron SP), with
soft-capped logits too;
the logits never whole in the compiled program; the head's gradient reduced once per step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from conftest import require_devices
from meshpar import compiler, context, loss, mesh as mesh_lib, rules as rules_lib
from meshpar.sharding import spec_for

B, T, D, V = 8, 64, 32, 512


def reference(hidden_BTD, head_DV, targets_BT, softcap: float | None = None):
    logits_BTV = jnp.einsum("btd,dv->btv", hidden_BTD, head_DV)
    if softcap is not None:  # Gemma 2's final soft-capping
        logits_BTV = softcap * jnp.tanh(logits_BTV / softcap)
    picked_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits_BTV, axis=-1) - picked_BT)


def inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((D, V)) / np.sqrt(D), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    return hidden, head, targets


def relative_error(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.fixture(scope="module")
def expected():
    hidden, head, targets = inputs()
    return jax.value_and_grad(reference, argnums=(0, 1))(hidden, head, targets)


def assert_matches(got, expected):
    (value, (d_hidden, d_head)), (ref_value, (ref_hidden, ref_head)) = got, expected
    assert abs(float(value) - float(ref_value)) / float(ref_value) < 1e-5
    assert relative_error(d_hidden, ref_hidden) < 1e-5
    assert relative_error(d_head, ref_head) < 1e-5


@pytest.mark.parametrize("chunk", [0, 64, 16, 7])
def test_one_device_matches_whole_logits(expected, chunk):
    """chunk 0: auto (one chunk at these sizes); 16: four chunks; 7: the largest divisor of T below it (4)."""
    hidden, head, targets = inputs()
    fn = jax.jit(jax.value_and_grad(lambda h, w: loss.chunked_cross_entropy(h, w, targets, chunk), argnums=(0, 1)))
    assert_matches(fn(hidden, head), expected)


def sharded_value_and_grads(spec: str, parallel: rules_lib.ParallelConfig, chunk: int, softcap: float | None = None):
    sizes = mesh_lib.parse(spec)
    n = int(np.prod(list(sizes.sizes().values())))
    require_devices(n)
    mesh, rules = mesh_lib.build(sizes, jax.devices()[:n]), rules_lib.make(parallel)
    place = lambda x, logical: jax.device_put(x, NamedSharding(mesh, spec_for(
        logical, x.shape, rules.table("activations"), mesh.shape, "test input")))
    hidden, head, targets = inputs()
    hidden, targets = place(hidden, ("batch", "resid_seq", "embed")), place(targets, ("batch", "seq"))
    head = place(head, ("embed", "vocab"))

    def fn(h, w, t):
        with context.use(context.Compute(mesh, rules)):
            return loss.chunked_cross_entropy(h, w, t, chunk, softcap=softcap)

    compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(hidden, head, targets).compile()
    return compiled(hidden, head, targets), compiled


@pytest.mark.parametrize(("spec", "sp"), [
    ("model=4", False), ("fsdp=8", False), ("data=2,fsdp=2,model=2", False), ("sequence=4,fsdp=2", False),
    ("fsdp=2,model=4", True), ("data=2,sequence=2,model=2", False)])
def test_sharded_matches_whole_logits(expected, spec, sp):
    got, _ = sharded_value_and_grads(spec, rules_lib.ParallelConfig(sequence_parallel=sp), chunk=8)
    assert_matches(got, expected)


@pytest.mark.parametrize("spec", ["", "model=4", "data=2,sequence=2,model=2"])
def test_soft_capped_logits_match_the_formula(spec):
    """Gemma 2's final soft-capping c·tanh(logits / c) inside the chunked loss (c = 1 bends most logits here):
    loss and gradients as the whole capped logits give them, on one device and vocab-split."""
    hidden, head, targets = inputs()
    expected = jax.value_and_grad(reference, argnums=(0, 1))(hidden, head, targets, 1.0)
    if spec:
        got, _ = sharded_value_and_grads(spec, rules_lib.ParallelConfig(), chunk=8, softcap=1.0)
    else:
        got = jax.jit(jax.value_and_grad(lambda h, w: loss.chunked_cross_entropy(h, w, targets, 16, softcap=1.0),
                                         argnums=(0, 1)))(hidden, head)
    assert_matches(got, expected)
    assert abs(float(got[0]) - float(reference(hidden, head, targets))) > 1e-2  # the cap changes the loss


def _largest_array(hlo: str) -> int:
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"f32\[([\d,]*)\]", hlo)]
    return max(sizes)


def test_the_logits_never_exist_whole():
    """model=4, chunks of 8 positions: the largest float32 array in the compiled program is the hidden
    states [B, T, D] or a chunk's logits [B, 8, V/4], a quarter of one device's share of the logits."""
    _, compiled = sharded_value_and_grads("model=4", rules_lib.ParallelConfig(), chunk=8)
    assert _largest_array(compiled.as_text()) == max(B * T * D, B * 8 * V // 4) <= B * T * V // 4 // 4


def test_the_head_gradient_is_reduced_once_not_per_chunk():
    """fsdp=8, 8 chunks: one reduce-scatter of the head's [D, V] gradient over the batch shards (summed in
    float32 in each device's loop first), not one per chunk."""
    _, compiled = sharded_value_and_grads("fsdp=8", rules_lib.ParallelConfig(), chunk=8)
    collectives = compiler.collectives(compiled.as_text())
    head_bytes = D * V * 4
    assert collectives["reduce-scatter"]["count"] == 1
    assert collectives["reduce-scatter"]["bytes"] == head_bytes // 8
    assert collectives.get("all-reduce", {"bytes": 0})["bytes"] < head_bytes


def test_chunk_length():
    assert loss.chunk_length(b=4, t=8192, v=128_256) == 128  # 4·128·128256·4 bytes ≤ 256 MiB
    assert loss.chunk_length(b=1, t=8192, v=128_256) == 512
    assert loss.chunk_length(b=1, t=8192, v=256) == 8192  # small vocabulary: one chunk
    assert loss.chunk_length(b=1, t=96, v=256, chunk=40) == 32  # a divisor of t, at most the request
