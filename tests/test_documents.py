"""Packed documents (`meshpar.batch`: segment ids and target weights): attention stays inside each document
and positions restart at each one, so a packed row computes what each of its documents computes alone.

Kernels and every context-parallel schedule (both orders) against the textbook formula with a document
mask (values and gradients, float32); the blockwise kernel's run-time skip of the tile pairs no document
spans; a packed batch's logits equal those of its documents run one per row; its weighted loss and every
gradient equal that reference's on ring, all-gather and Ulysses meshes (zigzag), GPipe and 1F1B, and with
gradient accumulation where the weights fall unevenly over the devices."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import require_devices
from layouts import CORPUS, MODEL, TRAIN, max_relative_error, shared_run
from meshpar import context, train
from meshpar.attention import flash, kernels, zigzag
from meshpar.batch import Batch, document_positions
from meshpar.rules import ParallelConfig
from test_attention import FUNCTIONS, inputs, make_mesh, relative_error, run_fast, value_and_grads

DOCUMENTS = MODEL


def random_segments(B: int, T: int, documents: int, seed: int = 0) -> np.ndarray:
    """[B, T] ids 1, 2, … of `documents` documents of random lengths per row."""
    rng = np.random.default_rng(seed)
    out = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), documents - 1, replace=False))
        out[b] = np.searchsorted(cuts, np.arange(T), side="right") + 1
    return out


def reference_document_attention(q_BTNH, k_BTKH, v_BTKH, segments_BT):
    """softmax(q·kᵀ/√H + mask)·v where query t sees keys s <= t of its own document: the textbook formula."""
    N, K, T = q_BTNH.shape[2], k_BTKH.shape[2], q_BTNH.shape[1]
    k_BTNH, v_BTNH = (jnp.repeat(x, N // K, axis=2) for x in (k_BTKH, v_BTKH))
    scores_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BTNH) / np.sqrt(q_BTNH.shape[-1])
    seen_BTS = np.tril(np.ones((T, T), bool)) & (segments_BT[:, :, None] == segments_BT[:, None, :])
    scores_BNTS = jnp.where(seen_BTS[:, None], scores_BNTS, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores_BNTS, axis=-1), v_BTNH)


@functools.lru_cache(maxsize=None)
def reference(N: int, K: int, T: int, documents: int):
    q, k, v, ct = inputs(N, K, t=T)
    segments = random_segments(q.shape[0], T, documents)
    out, grads = run_fast(value_and_grads(lambda q, k, v: reference_document_attention(q, k, v, segments)), q, k, v, ct)
    return segments, [np.asarray(x) for x in (out, *grads)]


def assert_matches(results, want, rtol=1e-5):
    out, grads = results
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        assert relative_error(got, expected) < rtol, f"{name}: relative error {relative_error(got, expected):.2e}"


@pytest.mark.parametrize("kernel", ["dense", "blockwise"])
def test_one_device_kernels_match_the_formula(kernel):
    """T = 384 in 6 documents: three 128-tiles per side, some spanned by no document."""
    segments, want = reference(8, 2, 384, 6)
    q, k, v, ct = inputs(8, 2, t=384)
    f = lambda q, k, v: kernels.causal_attention(q, k, v, segments_BT=jnp.asarray(segments), kernel=kernel)
    assert_matches(run_fast(value_and_grads(f), q, k, v, ct), want)


CP_CASES = [(mode, balanced) for mode in ("ring", "allgather", "ulysses") for balanced in (True, False)]


@pytest.mark.parametrize("mode,balanced", CP_CASES, ids=[f"{m}-{'zigzag' if b else 'contiguous'}" for m, b in CP_CASES])
def test_context_parallel_schedules_match_the_formula(mode, balanced):
    """sequence=4, T = 64 in 5 documents: the ids travel with their keys; values and gradients at 1e-5."""
    mesh = make_mesh("sequence=4")
    segments, want = reference(4, 4, 64, 5)
    q, k, v, ct = inputs(4, 4, t=64)
    order = (lambda x: zigzag.zigzag(x, 4)) if balanced else (lambda x: x)
    restore = (lambda x: zigzag.unzigzag(x, 4)) if balanced else (lambda x: x)
    f = lambda q, k, v: restore(FUNCTIONS[mode](order(q), order(k), order(v), mesh=mesh, load_balanced=balanced,
                                                kernel="dense", segments_BT=order(jnp.asarray(segments))))
    assert_matches(run_fast(value_and_grads(f), q, k, v, ct), want)


def test_tile_pairs_no_document_spans_are_skipped_at_run_time():
    """T = 512 (four 128-tiles): one row of documents [0, 200), [200, 512) and one of [0, 100), [100, 300),
    [300, 512). Of the 10 causal tile pairs, a pair runs where some row has a document in both tiles: the
    query tile 3 × key tile 0 pair is spanned by none (the skip is decided per call, from the ids)."""
    bounds = [(200,), (100, 300)]
    segments = np.stack([np.searchsorted(np.array(b), np.arange(512), side="right") + 1 for b in bounds])
    pattern = flash.block_pattern(np.arange(512), np.arange(512), 128, 128)
    pairs = tuple((i, j) for i in range(4) for j in range(4) if pattern[i, j] != flash.SKIP)
    live = np.asarray(flash._live_pairs((jnp.asarray(segments), jnp.asarray(segments)), pairs, 128, 128))
    assert len(pairs) == 10
    assert [pair for pair, run in zip(pairs, live) if not run] == [(3, 0)]


# --- a packed batch against its documents run alone -------------------------------------------------------


def packed_batch(cfg: train.TrainConfig, seed: int = 0) -> tuple[Batch, list[tuple[int, int, int]]]:
    """Rows of real text packed with documents of 3 to 20 tokens, some rows ending in padding (id 0), and
    prompt-like masks falling unevenly: the first half of the rows weighs only their documents' second
    halves. Returns the batch (numpy) and its documents as (row, start, end)."""
    rng = np.random.default_rng(seed)
    B, T1 = cfg.global_batch, cfg.seq_len + 1
    starts = rng.integers(0, len(CORPUS) - T1, B)
    tokens = np.stack([CORPUS[s:s + T1] for s in starts]).astype(np.int32)
    segments, weights, documents = np.zeros((B, T1), np.int32), np.zeros((B, T1), np.float32), []
    for b in range(B):
        at, end = 0, T1 - (rng.integers(1, 6) if b % 3 == 0 else 0)  # every third row ends in padding
        while at < end:
            n = min(int(rng.integers(3, 21)), end - at)
            segments[b, at:at + n] = segments[b, :at].max(initial=0) + 1
            weights[b, at + 1:at + n] = 1.0  # the first token of a document is no target
            if b < B // 2:
                weights[b, at + 1:at + n // 2 + 1] = 0.0  # a prompt
            documents.append((b, at, at + n))
            at += n
    tokens[segments == 0] = 0
    return Batch(tokens, segments, weights), documents


def alone(batch: Batch, documents, T1: int) -> Batch:
    """Every document at the start of its own row, padded after its end (which a causal model never sees),
    weighted as in the packed batch: the reference, with no segment ids at all."""
    tokens, weights = np.zeros((len(documents), T1), np.int32), np.zeros((len(documents), T1), np.float32)
    for d, (b, start, end) in enumerate(documents):
        tokens[d, :end - start] = batch.tokens[b, start:end]
        weights[d, :end - start] = batch.weights[b, start:end]
    return Batch(tokens, None, weights)


CFG = dataclasses.replace(TRAIN, global_batch=8, seq_len=32)


@pytest.fixture(scope="module")
def reference_run():
    """(packed batch, its documents, the loss and gradients of the documents run one per row on one device)."""
    batch, documents = packed_batch(CFG)
    rows = len(documents) + (-len(documents)) % CFG.global_batch  # whole batches of rows (empty rows weigh 0)
    single = shared_run("single", dataclasses.replace(CFG, global_batch=rows), DOCUMENTS)
    reference = alone(batch, documents + [(0, 0, 0)] * (rows - len(documents)), CFG.seq_len + 1)
    loss, grads = train.loss_and_grads(single.sharded, single.tokens_sharding, single.cfg)(single.state, reference)
    return batch, documents, float(loss), jax.tree.map(np.asarray, grads)


def test_packed_logits_equal_each_document_alone(reference_run):
    """One device: the logits of every document's positions in the packed rows are those of the document at
    the start of its own row (float32, 1e-5), with the dense and the blockwise kernel; without the ids
    the packed rows give other logits (the check can fail)."""
    batch, documents, _, _ = reference_run
    single = shared_run("single", CFG, DOCUMENTS)
    model = nnx.merge(single.sharded.graphdef, single.state).model
    inputs_BT, segments_BT = jnp.asarray(batch.tokens[:, :-1]), jnp.asarray(batch.segments[:, :-1])
    positions_BT = document_positions(segments_BT)
    want = np.asarray(model(jnp.asarray(alone(batch, documents, CFG.seq_len + 1).tokens[:, :-1])))
    for kernel in ("dense", "blockwise"):
        with context.use(context.Compute(single.mesh, single.rules, attention_kernel=kernel)):
            got = np.asarray(model(inputs_BT, positions_BT, segments_BT))
        for d, (b, start, end) in enumerate(documents):
            end = min(end, CFG.seq_len)
            assert relative_error(got[b, start:end], want[d, :end - start]) < 1e-5, (kernel, d)
    mixed = np.asarray(model(inputs_BT))
    b, start, end = next(doc for doc in documents if doc[1] > 0)
    assert relative_error(mixed[b, start:end], want[documents.index((b, start, end)), :end - start]) > 1e-2


LAYOUTS = {
    "one device": ("single", ParallelConfig(), 1),
    "ring-zigzag": ("sequence=4,data=2", ParallelConfig(context_attention="ring"), 1),
    "allgather-zigzag": ("sequence=2,data=2,model=2", ParallelConfig(context_attention="allgather"), 1),
    "ulysses-zigzag": ("sequence=2,fsdp=2,model=2", ParallelConfig(context_attention="ulysses"), 1),
    "gpipe": ("stage=2,data=2,fsdp=2", ParallelConfig(microbatches=2), 1),
    "1f1b": ("stage=2,data=2,model=2", ParallelConfig(microbatches=2, pipeline_schedule="1f1b"), 1),
    "accumulation": ("data=2,fsdp=2,model=2", ParallelConfig(), 2),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_packed_batch_trains_as_its_documents_alone(reference_run, layout):
    """The packed batch's weighted loss (Σ w·loss / Σ w over the global batch) and every gradient equal
    those of its documents run one per row on one device (float32, 1e-5). The weights fall unevenly: the
    first half of the rows (the first devices' under data and fsdp) holds far fewer targets, so a mean per
    device, per microbatch or per accumulation step would differ."""
    spec, parallel, accumulation = LAYOUTS[layout]
    require_devices(1 if spec == "single" else 8)
    batch, _, ref_loss, ref_grads = reference_run
    run = shared_run(spec, dataclasses.replace(CFG, grad_accum=accumulation), DOCUMENTS, parallel)
    placed = jax.tree.map(lambda x: jax.device_put(x, run.tokens_sharding), batch)
    loss, grads = train.loss_and_grads(run.sharded, run.tokens_sharding, run.cfg)(run.state, placed)
    assert abs(float(loss) - ref_loss) / ref_loss < 1e-5
    assert max_relative_error(grads, ref_grads) < 1e-5
