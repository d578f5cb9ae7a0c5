"""Tests for meshpar.data: sources, deterministic/resumable batches, per-process row split."""

import os
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from conftest import require_devices
from meshpar.data import Batches, Corpus, DataConfig, contiguous_row_range, load_corpus, load_tokens, prepared, split
from meshpar.errors import InputError

B, T = 16, 7


def arange_bin(tmp_path: Path, n: int, dtype: str = "uint16") -> np.ndarray:
    path = tmp_path / f"tokens_{dtype}.bin"
    np.arange(n).astype(dtype).tofile(path)
    return load_tokens(DataConfig(source="bin", path=str(path), token_dtype=dtype))


def mesh_sharding(shape: tuple[int, ...], names: tuple[str, ...], spec: P) -> NamedSharding:
    require_devices(int(np.prod(shape)))
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
    return NamedSharding(mesh, spec)


def one_device_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"source": "hf"}, "valid sources: stdlib, text, bin, prepared"),
        ({"source": "text"}, "needs a path"),
        ({"source": "bin"}, "needs a path"),
        ({"source": "bin", "path": "x.bin", "token_dtype": "int8"}, "token_dtype 'int8'"),
        ({"max_bytes": 0}, "max_bytes must be positive"),
        ({"eval_fraction": 0.0}, r"data.eval_fraction = 0.0 must be in \(0, 0.5\)"),
        ({"source": "prepared"}, "needs a path"),
        ({"packing": "first_fit"}, "data.packing = 'first_fit' is not one of none, concat, best_fit"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


# ---------------------------------------------------------------- sources


def stdlib_py_files() -> tuple[Path, list[str]]:
    """The stdlib's .py files (site-packages excluded), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        rel = Path(dirpath).relative_to(root)
        rel_paths += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return root, sorted(rel_paths)


def test_stdlib_source_is_sorted_py_files_joined_and_capped():
    max_bytes = 300_000
    tokens = load_tokens(DataConfig(source="stdlib", max_bytes=max_bytes))
    assert tokens.dtype == np.uint8 and tokens.shape == (max_bytes,)

    root, rel_paths = stdlib_py_files()
    assert len(rel_paths) > 100 and not any("site-packages" in r for r in rel_paths)
    expected = b""
    for rel in rel_paths:
        expected += (b"\n" if expected else b"") + (root / rel).read_bytes()
        if len(expected) >= max_bytes:
            break
    assert tokens.tobytes() == expected[:max_bytes]
    # Deterministic: a second build is identical.
    assert load_tokens(DataConfig(source="stdlib", max_bytes=max_bytes)).tobytes() == tokens.tobytes()


def test_stdlib_documents_are_its_files():
    corpus = load_corpus(DataConfig(source="stdlib", max_bytes=300_000))
    root, rel_paths = stdlib_py_files()
    files = [(root / rel).read_bytes() for rel in rel_paths]
    # The newline between two files starts the second one's document; empty files make none.
    expected = [(b"\n" if i else b"") + f for i, f in enumerate(files) if i or f]
    documents = [corpus.tokens[a:b].tobytes() for a, b in zip(corpus.documents[:-1], corpus.documents[1:])]
    assert documents[:-1] == expected[:len(documents) - 1]
    assert expected[len(documents) - 1].startswith(documents[-1])  # the last one cut at max_bytes
    assert corpus.documents[-1] == 300_000 and corpus.weights is None


def test_text_file_source(tmp_path):
    data = "héllo wörld\nzweite Zeile\n".encode()
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    tokens = load_tokens(DataConfig(source="text", path=str(path)))
    assert tokens.dtype == np.uint8
    np.testing.assert_array_equal(tokens, np.frombuffer(data, dtype=np.uint8))


def test_text_directory_source_sorted_and_recursive(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"bbb")
    (tmp_path / "a.txt").write_bytes(b"aa")
    (tmp_path / "sub" / "c.txt").write_bytes(b"c")
    (tmp_path / "ignored.md").write_bytes(b"not text corpus")
    tokens = load_tokens(DataConfig(source="text", path=str(tmp_path)))
    assert tokens.tobytes() == b"aa\nbbb\nc"
    assert load_corpus(DataConfig(source="text", path=str(tmp_path))).documents.tolist() == [0, 2, 6, 8]
    assert load_corpus(DataConfig(source="text", path=str(tmp_path / "b.txt"))).documents.tolist() == [0, 3]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_source_is_memmap_with_file_tokens(tmp_path, dtype):
    n = 70_000 if dtype == "uint32" else 1000  # uint32 values above the uint16 range
    tokens = arange_bin(tmp_path, n, dtype)
    assert isinstance(tokens, np.memmap)
    assert tokens.dtype == np.dtype(dtype) and tokens.shape == (n,)
    np.testing.assert_array_equal(tokens, np.arange(n).astype(dtype))


def test_bin_documents_come_from_the_index_beside_it(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    config = DataConfig(source="bin", path=str(path))
    assert load_corpus(config).documents.tolist() == [0, 100]  # no index: one document
    np.save(f"{path}.documents.npy", np.array([0, 30, 70, 100], np.int64))
    corpus = load_corpus(config)
    assert corpus.documents.tolist() == [0, 30, 70, 100] and isinstance(corpus.tokens, np.memmap)
    np.save(f"{path}.documents.npy", np.array([0, 30, 90], np.int64))  # the index of another file
    with pytest.raises(InputError, match=r"tokens.bin.documents.npy: document offsets must rise from 0 to the "
                                         r"token count 100, got 0 .. 90 \(.*tokens.bin\)"):
        load_corpus(config)


def test_source_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(InputError, match="data.path: text corpus not found: .*nope.txt"):
        load_tokens(DataConfig(source="text", path=str(missing)))
    with pytest.raises(InputError, match="data.path: token file not found: .*nope.bin"):
        load_tokens(DataConfig(source="bin", path=str(tmp_path / "nope.bin")))

    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty corpus: .*empty.txt"):
        load_tokens(DataConfig(source="text", path=str(empty)))

    no_txt = tmp_path / "no_txt"
    no_txt.mkdir()
    (no_txt / "x.md").write_bytes(b"x")
    with pytest.raises(ValueError, match="no \\*.txt files under .*no_txt"):
        load_tokens(DataConfig(source="text", path=str(no_txt)))

    empty_bin = tmp_path / "empty.bin"
    empty_bin.write_bytes(b"")
    with pytest.raises(ValueError, match="empty corpus: .*empty.bin"):
        load_tokens(DataConfig(source="bin", path=str(empty_bin)))

    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(InputError, match=r"odd.bin: size 7 bytes is not a multiple of 2 \(data.token_dtype = uint16\)"):
        load_tokens(DataConfig(source="bin", path=str(odd), token_dtype="uint16"))
    with pytest.raises(InputError, match="odd.bin.*not a multiple of 4 .*uint32"):
        load_tokens(DataConfig(source="bin", path=str(odd), token_dtype="uint32"))


# ---------------------------------------------------------------- batches


def test_corpus_too_short_names_sizes():
    with pytest.raises(ValueError, match="corpus of 8 tokens .* seq_len=7.* 9"):
        Batches(np.arange(8), global_batch=2, seq_len=7, seed=0, sharding=one_device_sharding())
    # The minimum size works: exactly two windows fit, and both get drawn, never one past the end.
    batches = Batches(np.arange(9), global_batch=4, seq_len=7, seed=0, sharding=one_device_sharding())
    starts = np.concatenate([batches.rows(step, range(4)).tokens[:, 0] for step in range(10)])
    assert set(starts.tolist()) == {0, 1}


def test_rows_are_corpus_windows(tmp_path):
    tokens = arange_bin(tmp_path, 5000)
    batches = Batches(tokens, global_batch=B, seq_len=T, seed=3, sharding=one_device_sharding())
    for step in range(4):
        rows_BT = batches.rows(step, range(B)).tokens
        assert rows_BT.shape == (B, T + 1) and rows_BT.dtype == np.int32
        # With an arange corpus, a window is consecutive integers starting at its offset.
        np.testing.assert_array_equal(rows_BT - rows_BT[:, :1], np.broadcast_to(np.arange(T + 1), (B, T + 1)))
        assert rows_BT.min() >= 0 and rows_BT.max() < len(tokens)
    assert len(np.unique(batches.rows(0, range(B)).tokens[:, 0])) > 1  # offsets actually vary


def test_rows_can_be_drawn_individually(tmp_path):
    tokens = arange_bin(tmp_path, 5000)
    batches = Batches(tokens, global_batch=B, seq_len=T, seed=1, sharding=one_device_sharding())
    full_BT = batches.rows(5, range(B)).tokens
    np.testing.assert_array_equal(batches.rows(5, [3, 11]).tokens, full_BT[[3, 11]])
    assert batches.rows(5, []).tokens.shape == (0, T + 1)
    with pytest.raises(IndexError, match="row indices"):
        batches.rows(5, [B])


def test_determinism_same_seed_same_batches_different_seed_different(tmp_path):
    tokens = arange_bin(tmp_path, 5000)
    sharding = one_device_sharding()
    a = Batches(tokens, global_batch=B, seq_len=T, seed=7, sharding=sharding)
    b = Batches(tokens, global_batch=B, seq_len=T, seed=7, sharding=sharding)
    c = Batches(tokens, global_batch=B, seq_len=T, seed=8, sharding=sharding)
    steps_a = [np.asarray(next(a).tokens) for _ in range(4)]
    steps_b = [np.asarray(next(b).tokens) for _ in range(4)]
    steps_c = [np.asarray(next(c).tokens) for _ in range(4)]
    for x, y, z in zip(steps_a, steps_b, steps_c):
        np.testing.assert_array_equal(x, y)
        assert not np.array_equal(x, z)
    assert not np.array_equal(steps_a[0], steps_a[1])  # steps differ from each other


def test_resume_from_state_dict(tmp_path):
    tokens = arange_bin(tmp_path, 5000)
    sharding = one_device_sharding()
    uninterrupted = Batches(tokens, global_batch=B, seq_len=T, seed=5, sharding=sharding)
    expected = [np.asarray(x.tokens) for _, x in zip(range(5), uninterrupted)]

    first = Batches(tokens, global_batch=B, seq_len=T, seed=5, sharding=sharding)
    for _ in range(3):
        next(first)
    state = first.state_dict()
    assert state == {"step": 3, "seed": 5}

    resumed = Batches(tokens, global_batch=B, seq_len=T, seed=0, sharding=sharding)
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(np.asarray(next(resumed).tokens), expected[3])
    np.testing.assert_array_equal(np.asarray(next(resumed).tokens), expected[4])
    # Starting at a step directly gives the same batch as well.
    at_step = Batches(tokens, global_batch=B, seq_len=T, seed=5, sharding=sharding, step=4)
    np.testing.assert_array_equal(np.asarray(next(at_step).tokens), expected[4])


@pytest.mark.parametrize(
    "shape, names, spec",
    [
        ((8,), ("data",), P("data", None)),
        ((2, 4), ("data", "fsdp"), P(("data", "fsdp"), None)),
        ((2, 4), ("data", "sequence"), P("data", "sequence")),  # sequence dim sharded too
    ],
)
def test_global_array_sharding_and_values(tmp_path, shape, names, spec):
    sharding = mesh_sharding(shape, names, spec)
    tokens = arange_bin(tmp_path, 5000)
    batches = Batches(tokens, global_batch=B, seq_len=T, seed=2, sharding=sharding)
    assert batches.process_rows() == range(B)  # one process holds every row
    for step in range(2):
        tokens_BT = next(batches).tokens
        assert tokens_BT.shape == (B, T + 1) and tokens_BT.dtype == np.int32
        assert tokens_BT.sharding == sharding
        np.testing.assert_array_equal(np.asarray(tokens_BT), batches.rows(step, range(B)).tokens)
        # Each device holds exactly its slice of the batch.
        for shard in tokens_BT.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), batches.rows(step, range(B)).tokens[shard.index])
    assert batches.state_dict()["step"] == 2


def test_stdlib_batches_end_to_end():
    sharding = mesh_sharding((8,), ("data",), P("data", None))
    tokens = load_tokens(DataConfig(source="stdlib", max_bytes=100_000))
    batches = Batches(tokens, global_batch=8, seq_len=32, seed=0, sharding=sharding)
    tokens_BT = np.asarray(next(batches).tokens)
    assert tokens_BT.shape == (8, 33) and tokens_BT.max() < 256
    corpus = tokens.tobytes()
    for row in tokens_BT:
        assert bytes(row.astype(np.uint8)) in corpus


# ---------------------------------------------------------------- per-process split


def simulated_process_slices(sharding: NamedSharding, devices_per_process: int) -> list[list[slice]]:
    """Batch-dim slices per simulated process, assigning mesh devices to processes in id order."""
    index_map = sharding.devices_indices_map((B, T + 1))
    per_process: dict[int, list[slice]] = {}
    for device, index in index_map.items():
        per_process.setdefault(device.id // devices_per_process, []).append(index[0])
    return [per_process[p] for p in sorted(per_process)]


@pytest.mark.parametrize("num_processes", [2, 4])
@pytest.mark.parametrize(
    "shape, names, spec",
    [
        ((8,), ("data",), P("data", None)),
        ((2, 4), ("data", "fsdp"), P(("data", "fsdp"), None)),
    ],
)
def test_simulated_processes_split_rows_disjointly(tmp_path, num_processes, shape, names, spec):
    sharding = mesh_sharding(shape, names, spec)
    ranges = [
        contiguous_row_range(slices, B)
        for slices in simulated_process_slices(sharding, 8 // num_processes)
    ]
    assert len(ranges) == num_processes
    covered = sorted(r for rng in ranges for r in rng)
    assert covered == list(range(B))  # disjoint and covering
    assert all(len(r) == B // num_processes for r in ranges)

    # The rows each process would produce, put together, are the whole batch.
    tokens = arange_bin(tmp_path, 5000)
    batches = Batches(tokens, global_batch=B, seq_len=T, seed=9, sharding=sharding)
    pieces = [batches.rows(3, rng).tokens for rng in sorted(ranges, key=lambda r: r.start)]
    np.testing.assert_array_equal(np.concatenate(pieces), batches.rows(3, range(B)).tokens)


def test_row_range_from_synthetic_slices():
    # 2 processes x 4 devices, 2 rows per device.
    two = [[slice(8 * p + 2 * d, 8 * p + 2 * d + 2) for d in range(4)] for p in range(2)]
    assert [contiguous_row_range(s, B) for s in two] == [range(0, 8), range(8, 16)]
    # 4 processes x 2 devices, each device pair replicating the same rows (e.g. a model axis).
    four = [[slice(4 * p, 4 * p + 4)] * 2 for p in range(4)]
    assert [contiguous_row_range(s, B) for s in four] == [range(4 * p, 4 * p + 4) for p in range(4)]
    # Batch replicated on every device: the process holds everything.
    assert contiguous_row_range([slice(None)] * 4, B) == range(B)


def test_row_range_rejects_non_contiguous_and_empty():
    with pytest.raises(ValueError, match="not contiguous: 4 rows spread over \\[0, 6\\)"):
        contiguous_row_range([slice(0, 2), slice(4, 6)], B)
    with pytest.raises(ValueError, match="no batch rows"):
        contiguous_row_range([], B)


# ---------------------------------------------------------------- held-out split, vocabulary, unreadable files


def test_held_out_split_is_the_tail_and_no_window_crosses_it(tmp_path):
    tokens = arange_bin(tmp_path, 10_000)
    train, held_out = split(tokens, 0.05, seq_len=T)
    assert len(held_out) == 500 and held_out[0] == 9_500 and len(train) == 9_500
    assert split(tokens, 0.05, seq_len=T)[1][0] == held_out[0]  # deterministic
    train_rows = Batches(train, global_batch=B, seq_len=T, seed=0, sharding=one_device_sharding())
    eval_rows = Batches(held_out, global_batch=B, seq_len=T, seed=0, sharding=one_device_sharding())
    seen_in_training = np.concatenate([train_rows.rows(step, range(B)).tokens.ravel() for step in range(200)])
    seen_in_eval = np.concatenate([eval_rows.rows(step, range(B)).tokens.ravel() for step in range(20)])
    assert seen_in_training.max() < 9_500 <= seen_in_eval.min()  # an arange corpus: tokens are positions
    with pytest.raises(InputError, match="corpus of 15 tokens is too short for seq_len = 7 with a held-out split"):
        split(np.arange(15), 0.01, seq_len=T)


def test_out_of_range_tokens_are_refused_with_the_source(tmp_path):
    tokens = arange_bin(tmp_path, 1000)  # tokens 0..999 against a vocabulary of 256
    batches = Batches(tokens, global_batch=B, seq_len=T, seed=0, sharding=one_device_sharding(), vocab_size=256,
                      source="data.bin (bin, uint16)")
    with pytest.raises(InputError, match=r"data.bin \(bin, uint16\): token \d+ in batch 0 is out of range for "
                                         r"model.vocab_size = 256 .*data.token_dtype"):
        next(batches)
    # a uint16 file read as uint32 pairs its tokens into huge numbers: caught the same way
    path = tmp_path / "small.bin"
    np.full(1000, 7, np.uint16).tofile(path)
    wrong = load_tokens(DataConfig(source="bin", path=str(path), token_dtype="uint32"))
    with pytest.raises(InputError, match="token 458759 in batch 0 is out of range"):
        Batches(wrong, global_batch=B, seq_len=T, seed=0, sharding=one_device_sharding(), vocab_size=256).rows(0, [0])


def test_unreadable_file_is_named(tmp_path, monkeypatch):
    path = tmp_path / "secret.txt"
    path.write_text("x" * 100)

    def refuse(self):  # what an unreadable file does (chmod cannot stop root, who runs CI)
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(InputError, match="cannot read .*secret.txt: Permission denied"):
        load_tokens(DataConfig(source="text", path=str(path)))


# ---------------------------------------------------------------- documents: split, prepared directory


def positions_corpus(lengths) -> Corpus:
    documents = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Corpus(np.arange(documents[-1], dtype=np.uint32), documents)


def test_held_out_split_is_whole_documents_at_the_end():
    lengths = np.random.default_rng(0).integers(1, 40, 200)
    corpus = positions_corpus(lengths)
    train, held_out = split(corpus, 0.05, seq_len=T)
    assert held_out.num_documents == 10 and train.num_documents == 190
    assert held_out.lengths().tolist() == lengths[-10:].tolist() and train.lengths().tolist() == lengths[:-10].tolist()
    assert train.tokens[-1] + 1 == held_out.tokens[0]  # tokens are positions: nothing lost, nothing in both
    assert held_out.documents[0] == 0 and held_out.documents[-1] == len(held_out.tokens)
    # At least one window of seq_len + 2 tokens is held out, however few documents that takes.
    _, long_held_out = split(corpus, 0.001, seq_len=100)
    assert len(long_held_out.tokens) >= 102 and len(long_held_out.tokens) - long_held_out.lengths()[0] < 102
    # Weights follow their tokens; a one-document corpus keeps the token tail.
    one = Corpus.one_document(np.arange(1000, dtype=np.uint16), np.ones(1000, np.uint8))
    one_train, one_held_out = split(one, 0.05, seq_len=T)
    assert one_held_out.tokens[0] == 950 and len(one_held_out.weights) == 50 and len(one_train.weights) == 950
    with pytest.raises(InputError, match="corpus of 3 documents .* too short for seq_len = 7: holding out its last 2 "
                                         "documents .* leaves 4 for training, fewer than 9"):
        split(positions_corpus([4, 5, 5]), 0.1, seq_len=T)


def test_prepared_directory_reads_back(tmp_path):
    documents = np.array([0, 3, 10, 12], np.int64)
    with prepared.writing(tmp_path / "corpus") as directory:
        np.arange(12, dtype=np.uint32).tofile(directory / prepared.TOKENS)
        np.array([0, 1, 1] * 4, np.uint8).tofile(directory / prepared.WEIGHTS)
        prepared.write_info(directory, documents, np.dtype(np.uint32), vocab_size=70_000, weighted_tokens=8)
    corpus = load_corpus(DataConfig(source="prepared", path=str(tmp_path / "corpus")))
    assert corpus.tokens.dtype == np.uint32 and corpus.tokens.tolist() == list(range(12))
    assert corpus.documents.tolist() == documents.tolist() and corpus.weights.tolist() == [0, 1, 1] * 4
    assert not list(tmp_path.glob(".corpus.partial-*"))
    with pytest.raises(InputError, match="corpus already exists"), prepared.writing(tmp_path / "corpus"):
        pass


def test_prepared_directory_errors_name_the_file(tmp_path):
    with pytest.raises(InputError, match="prepared directory not found: .*nope"):
        load_corpus(DataConfig(source="prepared", path=str(tmp_path / "nope")))
    with pytest.raises(InputError, match="is not a prepared directory \\(no corpus.json"):
        load_corpus(DataConfig(source="prepared", path=str(tmp_path)))
    # An interrupted write leaves nothing behind.
    with pytest.raises(RuntimeError, match="interrupted"), prepared.writing(tmp_path / "half") as directory:
        np.arange(5, dtype=np.uint16).tofile(directory / prepared.TOKENS)
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with prepared.writing(tmp_path / "short") as directory:
        np.arange(5, dtype=np.uint16).tofile(directory / prepared.TOKENS)
        prepared.write_info(directory, np.array([0, 6], np.int64), np.dtype(np.uint16), 256, 6)
    with pytest.raises(InputError, match=r"short/tokens.bin: 10 bytes, but corpus.json says 6 uint16 values"):
        load_corpus(DataConfig(source="prepared", path=str(tmp_path / "short")))
