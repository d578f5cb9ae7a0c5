"""Tests for meshpar.data.packing and packed batches: row plans, the batch contract of segments and weights,
determinism, exact resume mid-epoch and across epochs, and per-process rows."""

import time

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from conftest import require_devices
from meshpar.data import Batches, Corpus, contiguous_row_range, pack_rows, plan_rows
from meshpar.errors import InputError

ROW = 16  # seq_len + 1
PACKERS = ["concat", "best_fit"]


def positions_corpus(lengths, weights: bool = False, seed: int = 0) -> Corpus:
    """Documents of `lengths` whose tokens are their positions in the corpus (so a row tells where it came from)."""
    documents = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(documents[-1], dtype=np.uint32)
    token_weights = np.random.default_rng(seed).integers(0, 2, len(tokens)).astype(np.uint8) if weights else None
    return Corpus(tokens, documents, token_weights)


def random_corpus(n: int = 60, seed: int = 0, weights: bool = False) -> Corpus:
    """Mostly shorter than a row, some longer, a few empty."""
    lengths = np.random.default_rng(seed).integers(0, 2 * ROW, n)
    return positions_corpus(lengths, weights)


def all_rows(corpus: Corpus, packing: str, seed: int = 0, epoch: int = 0):
    plan = plan_rows(packing, corpus.documents, ROW, seed, epoch)
    return plan, *pack_rows(corpus, plan, np.arange(plan.num_rows))


def assert_contract(corpus: Corpus, tokens_RT, segments_RT, weights_RT) -> None:
    """Segment ids 1, 2, ... from column 0 then 0 for padding; weight 0 for padding and where the id changes
    after column 0, else the corpus's; every piece is consecutive tokens of one document."""
    doc_of = np.searchsorted(corpus.documents, np.arange(len(corpus.tokens)), side="right") - 1
    for tokens, segments, weights in zip(tokens_RT, segments_RT, weights_RT):
        used = int((segments > 0).sum())
        assert (segments[:used] > 0).all() and (segments[used:] == 0).all()
        assert (tokens[used:] == 0).all() and (weights[used:] == 0).all()
        changes = np.flatnonzero(np.diff(segments[:used])) + 1
        assert segments[0] == 1 and (np.diff(segments[:used]) <= 1).all()
        assert (weights[changes] == 0).all()
        expected = np.ones(used) if corpus.weights is None else corpus.weights[tokens[:used]].astype(np.float32)
        keep = np.setdiff1d(np.arange(used), changes)
        np.testing.assert_array_equal(weights[keep], expected[keep])
        for piece in np.split(tokens[:used], changes):
            assert (np.diff(piece) == 1).all() and len(set(doc_of[piece])) == 1


@pytest.mark.parametrize("packing", PACKERS)
@pytest.mark.parametrize("weights", [False, True])
def test_rows_keep_the_batch_contract(packing, weights):
    corpus = random_corpus(weights=weights)
    plan, tokens_RT, segments_RT, weights_RT = all_rows(corpus, packing)
    assert tokens_RT.shape == (plan.num_rows, ROW) and tokens_RT.dtype == segments_RT.dtype == np.int32
    assert weights_RT.dtype == np.float32
    assert_contract(corpus, tokens_RT, segments_RT, weights_RT)
    # Every token of the corpus is in exactly one row; the rest is padding, as the plan counts it.
    used = segments_RT > 0
    assert sorted(tokens_RT[used].tolist()) == list(range(len(corpus.tokens)))
    assert plan.padding_fraction() == pytest.approx(1 - used.sum() / used.size)


def test_a_row_by_hand():
    # Documents of 10, 4 and 5 tokens into rows of 16, best fit: 10 + 5 in one row, 4 in another.
    corpus = positions_corpus([10, 4, 5])
    plan, tokens_RT, segments_RT, weights_RT = all_rows(corpus, "best_fit")
    assert plan.num_rows == 2
    full = int(np.argmax((segments_RT > 0).sum(1)))
    np.testing.assert_array_equal(tokens_RT[full], [*range(10), 14, 15, 16, 17, 18, 0])
    np.testing.assert_array_equal(segments_RT[full], [1] * 10 + [2] * 5 + [0])
    np.testing.assert_array_equal(weights_RT[full], [1] * 10 + [0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(tokens_RT[1 - full], [10, 11, 12, 13] + [0] * 12)
    np.testing.assert_array_equal(weights_RT[1 - full], [1] * 4 + [0] * 12)
    assert plan.padding_fraction() == pytest.approx(13 / 32)


def test_best_fit_splits_only_documents_longer_than_a_row():
    corpus = random_corpus(200, seed=1)
    plan = plan_rows("best_fit", corpus.documents, ROW, seed=3, epoch=0)
    # A piece is a whole document, a row-long part of one, or the rest of one after its row-long parts.
    lengths = corpus.lengths()
    doc = np.searchsorted(corpus.documents, plan.piece_starts, side="right") - 1
    offset_in_doc = plan.piece_starts - corpus.documents[doc]
    assert (offset_in_doc % ROW == 0).all()
    whole = lengths[doc] < ROW
    assert (offset_in_doc[whole] == 0).all() and (plan.piece_lengths[whole] == lengths[doc][whole]).all()
    assert (plan.piece_lengths[~whole] == np.minimum(ROW, lengths[doc][~whole] - offset_in_doc[~whole])).all()
    # No row overflows, and rows are shared: fewer rows than pieces.
    row_totals = np.add.reduceat(plan.piece_lengths, plan.row_pieces[:-1])
    assert (row_totals <= ROW).all() and plan.num_rows < len(plan.piece_lengths)


def test_concat_rows_are_the_shuffled_documents_back_to_back():
    corpus = random_corpus(100, seed=2)
    streams = []
    for epoch in range(2):
        plan, tokens_RT, segments_RT, _ = all_rows(corpus, "concat", seed=4, epoch=epoch)
        assert plan.num_rows == -(-len(corpus.tokens) // ROW)
        assert (segments_RT[:-1] > 0).all()  # only the last row is padded
        stream = tokens_RT[segments_RT > 0]
        # Tokens are positions: the stream is whole documents, each once, in some order.
        starts = np.flatnonzero(np.diff(stream) != 1) + 1
        runs = np.split(stream, starts)
        documents = [(int(d[0]), int(d[-1]) + 1) for d in runs]
        nonempty = [(int(a), int(b)) for a, b in zip(corpus.documents[:-1], corpus.documents[1:]) if b > a]
        # Consecutive documents in the shuffled order may be consecutive in the corpus too: split runs there.
        bounds = set(corpus.documents.tolist())
        pieces = sorted((a, b) for lo, hi in documents for a, b in _split_at(lo, hi, bounds))
        assert pieces == nonempty
        streams.append(stream)
    assert not np.array_equal(streams[0], streams[1])  # every epoch its own order


def _split_at(lo, hi, bounds):
    cuts = [lo, *sorted(b for b in bounds if lo < b < hi), hi]
    return list(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("packing", PACKERS)
def test_every_epoch_has_as_many_rows(packing):
    corpus = random_corpus(300, seed=5)
    counts = {plan_rows(packing, corpus.documents, ROW, seed, epoch).num_rows
              for seed in range(3) for epoch in range(4)}
    assert len(counts) == 1


def test_planning_a_million_documents_takes_seconds():
    lengths = np.random.default_rng(0).integers(1, 4000, 1_000_000)
    documents = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for packing in PACKERS:
        start = time.perf_counter()
        plan = plan_rows(packing, documents, 2049, seed=0, epoch=0)
        assert time.perf_counter() - start < 10
        assert plan.padding_fraction() < 0.001


# ---------------------------------------------------------------- packed batches


def one_device_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def crossing_batch(corpus: Corpus, packing: str) -> int:
    """A batch size that does not divide an epoch's rows: some batch holds the end of one epoch and the start of
    the next."""
    rows = plan_rows(packing, corpus.documents, ROW, 0, 0).num_rows
    return next(b for b in (4, 3, 5, 7) if rows % b)


def packed_batches(corpus: Corpus, packing: str, seed: int = 0, **kwargs) -> Batches:
    B = crossing_batch(corpus, packing) if packing in PACKERS else 4
    return Batches(corpus, global_batch=B, seq_len=ROW - 1, seed=seed, sharding=one_device_sharding(),
                   packing=packing, **kwargs)


def host(batch):
    return tuple(None if field is None else np.asarray(field) for field in batch)


@pytest.mark.parametrize("packing", PACKERS)
def test_batches_are_the_plan_s_rows_epoch_after_epoch(packing):
    corpus = random_corpus(40, seed=6, weights=True)
    batches = packed_batches(corpus, packing, seed=2)
    per_epoch, B = batches.rows_per_epoch, batches.global_batch
    steps = [host(next(batches)) for _ in range(3 * per_epoch // B + 1)]
    stream = [np.concatenate([s[field] for s in steps]) for field in range(3)]
    for epoch in range(3):
        expected = pack_rows(corpus, plan_rows(packing, corpus.documents, ROW, 2, epoch), np.arange(per_epoch))
        for field, rows in zip(stream, expected):
            np.testing.assert_array_equal(field[epoch * per_epoch:(epoch + 1) * per_epoch], rows)
    assert not np.array_equal(stream[0][:per_epoch], stream[0][per_epoch:2 * per_epoch])  # reshuffled
    for step in steps:
        assert_contract(corpus, *step[:3])  # the loader's fields (a DPO step adds the reference's later)


@pytest.mark.parametrize("packing", PACKERS)
def test_same_seed_same_batches_and_exact_resume(packing):
    corpus = random_corpus(40, seed=7)
    uninterrupted = packed_batches(corpus, packing, seed=5)
    per_epoch, B = uninterrupted.rows_per_epoch, uninterrupted.global_batch
    expected = [host(next(uninterrupted)) for _ in range(2 * per_epoch // B + 2)]
    other_seed = packed_batches(corpus, packing, seed=6)
    assert not np.array_equal(host(next(other_seed))[0], expected[0][0])
    # Resume mid-epoch, at the step that crosses the epoch's end, and after it.
    crossing = per_epoch // B  # its rows end epoch 0 and start epoch 1
    for stop in (1, crossing, crossing + 1):
        first = packed_batches(corpus, packing, seed=5)
        for _ in range(stop):
            next(first)
        resumed = packed_batches(corpus, packing, seed=0)
        resumed.load_state_dict(first.state_dict())
        for step in range(stop, len(expected)):
            for got, want in zip(host(next(resumed)), expected[step]):
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("packing", PACKERS)
@pytest.mark.parametrize("num_processes", [2, 4])
def test_each_process_s_rows_make_the_global_batch(packing, num_processes):
    require_devices(8)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    sharding = NamedSharding(mesh, P("data", None))
    corpus = random_corpus(40, seed=8, weights=True)
    batches = Batches(corpus, global_batch=16, seq_len=ROW - 1, seed=1, sharding=sharding, packing=packing)
    per_process = {}
    for device, index in sharding.devices_indices_map((16, ROW)).items():
        per_process.setdefault(device.id // (8 // num_processes), []).append(index[0])
    ranges = [contiguous_row_range(slices, 16) for slices in per_process.values()]
    for step in (0, 3):
        whole = batches.rows(step, range(16))
        pieces = [batches.rows(step, rows) for rows in sorted(ranges, key=lambda r: r.start)]
        for field in range(3):
            np.testing.assert_array_equal(np.concatenate([p[field] for p in pieces]), whole[field])
    batch = next(batches)
    for field, rows in zip(batch[:3], batches.rows(0, range(16))):
        assert field.sharding == sharding and field.shape == (16, ROW)
        for shard in field.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), rows[shard.index])


def test_windows_carry_the_corpus_s_weights():
    corpus = random_corpus(40, seed=9, weights=True)
    batches = packed_batches(corpus, "none")
    batch = host(next(batches))
    assert batch[1] is None  # no segments: windows run across documents, as before
    np.testing.assert_array_equal(batch[2], corpus.weights[batch[0]])  # tokens are positions
    assert host(next(packed_batches(random_corpus(40), "none")))[2] is None


def test_packed_tokens_out_of_the_vocabulary_are_refused():
    corpus = random_corpus(40, seed=10)
    with pytest.raises(InputError, match=r"docs: token \d+ in batch 0 is out of range for model.vocab_size = 8"):
        next(packed_batches(corpus, "best_fit", vocab_size=8, source="docs"))
    with pytest.raises(InputError, match="packing 'first_fit' is not one of none, concat, best_fit"):
        packed_batches(corpus, "first_fit")
