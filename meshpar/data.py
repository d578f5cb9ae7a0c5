"""Token sources and deterministic, resumable, per-process batches.

Sources (``DataConfig.source``), each giving a 1-D numpy integer array of tokens:

- ``stdlib``: the bytes of the Python standard library's ``.py`` files (under
  ``sysconfig.get_paths()["stdlib"]``, without ``site-packages``), in sorted relative-path
  order, joined by a newline and cut at ``max_bytes``. Byte-level tokens, vocab 256; needs no
  download and is deterministic on a given machine.
- ``text``: one UTF-8 text file, or every ``*.txt`` file under a directory (sorted relative
  paths, joined by a newline). Byte-level tokens, vocab 256.
- ``bin``: a pre-tokenised flat file of ``uint16`` or ``uint32`` tokens, opened as a read-only
  ``np.memmap`` so only the windows a batch uses are read from disk.

Drawing a batch: step ``s`` is ``global_batch`` rows of ``seq_len + 1`` consecutive tokens; the
model's inputs are ``row[:-1]`` and its next-token targets ``row[1:]``. The start offsets of all
rows of step ``s`` come from a generator seeded only by ``(seed, s)``, so:

- determinism: the same seed gives the same batches on any machine with the same corpus;
- resume: ``state_dict()`` is just ``{"step", "seed"}``; loading it continues with exactly the
  batches an uninterrupted run would have seen;
- per-process reading: drawing all offsets is cheap, so every process draws them and then reads
  tokens only for the contiguous block of rows its devices hold (``process_rows``), and
  ``jax.make_array_from_process_local_data`` assembles one global ``[B, T + 1]`` ``jax.Array``.

Held-out split (``split``): the last ``eval_fraction`` of every source's tokens is for evaluation only.
Training windows lie wholly before it and evaluation windows wholly inside it, so no token is in both;
the split depends only on the corpus and the fraction, so it is the same on every run, with or without
evaluation. Every batch is checked against the model's vocabulary (``Batches(vocab_size=...)``): a
token out of range is an error naming the source and the step, not a silent embedding lookup of garbage.
"""

from __future__ import annotations

import json
import math
import os
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from meshpar.errors import InputError

SOURCES = ("stdlib", "text", "bin")
TOKEN_DTYPES = ("uint16", "uint32")
# Third-party packages live inside the stdlib directory on most installs; they are not stdlib.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class DataConfig:
    """Which token source to load and how."""

    source: str = "stdlib"
    path: str = ""
    token_dtype: str = "uint16"
    max_bytes: int = 16_000_000
    eval_fraction: float = 0.01  # the held-out tail of the tokens (see `split`)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise InputError(f"unknown data source {self.source!r}; valid sources: {', '.join(SOURCES)}")
        if self.source in ("text", "bin") and not self.path:
            raise InputError(f"data source {self.source!r} needs a path")
        if self.token_dtype not in TOKEN_DTYPES:
            raise InputError(f"token_dtype {self.token_dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
        if self.max_bytes <= 0:
            raise InputError(f"max_bytes must be positive, got {self.max_bytes}")
        if not 0 < self.eval_fraction < 0.5:
            raise InputError(f"data.eval_fraction = {self.eval_fraction} must be in (0, 0.5)")

    def describe(self) -> str:
        """The source as messages name it: `stdlib`, or the path and its kind."""
        if self.source == "stdlib":
            return "stdlib"
        return f"{self.path} ({'bin, ' + self.token_dtype if self.source == 'bin' else 'text'})"


def _join_files(root: Path, rel_paths: Sequence[str], max_bytes: int | None) -> np.ndarray:
    """Concatenate files (newline-separated) as uint8 tokens, stopping once `max_bytes` are read."""
    buf = bytearray()
    for i, rel in enumerate(rel_paths):
        if i:
            buf += b"\n"
        buf += _read(root / rel)
        if max_bytes is not None and len(buf) >= max_bytes:
            del buf[max_bytes:]
            break
    return np.frombuffer(buf, dtype=np.uint8)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror}") from None


def stdlib_tokens(max_bytes: int) -> np.ndarray:
    """Bytes of the standard library's `.py` files in sorted relative-path order, cut at `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]  # prune in place
        rel_dir = Path(dirpath).relative_to(root)
        rel_paths += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    if not rel_paths:
        raise InputError(f"empty corpus: no .py files under the stdlib directory {root}")
    return _join_files(root, sorted(rel_paths), max_bytes)


def text_tokens(path: str) -> np.ndarray:
    """Byte-level tokens of one text file, or of every `*.txt` file under a directory."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"data.path: text corpus not found: {path}")
    if p.is_dir():
        rel_paths = sorted(f.relative_to(p).as_posix() for f in p.rglob("*.txt") if f.is_file())
        if not rel_paths:
            raise InputError(f"empty corpus: no *.txt files under {path}")
        tokens = _join_files(p, rel_paths, None)
    else:
        tokens = np.frombuffer(_read(p), dtype=np.uint8)
    if tokens.size == 0:
        raise InputError(f"empty corpus: {path} holds no bytes")
    return tokens


def bin_tokens(path: str, token_dtype: str) -> np.ndarray:
    """Memory-map a flat pre-tokenised file; nothing is read until rows are sliced from it."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"data.path: token file not found: {path}")
    if not os.access(p, os.R_OK):
        raise InputError(f"data.path: cannot read {path} (permission denied)")
    size = p.stat().st_size
    sidecar = Path(f"{path}.json")  # written by launch.prepare: what the file holds
    if sidecar.is_file():
        written = json.loads(sidecar.read_text()).get("token_dtype", token_dtype)
        if written != token_dtype:
            raise InputError(f"{path} holds {written} tokens ({sidecar.name}), but data.token_dtype = {token_dtype}")
    itemsize = np.dtype(token_dtype).itemsize
    if size == 0:
        raise InputError(f"empty corpus: {path} holds no tokens")
    if size % itemsize:
        raise InputError(f"{path}: size {size} bytes is not a multiple of {itemsize} (data.token_dtype = "
                         f"{token_dtype}); is it a file of another token type?")
    return np.memmap(p, dtype=token_dtype, mode="r")


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """The 1-D token array for `cfg`."""
    if cfg.source == "stdlib":
        return stdlib_tokens(cfg.max_bytes)
    if cfg.source == "text":
        return text_tokens(cfg.path)
    return bin_tokens(cfg.path, cfg.token_dtype)


def split(tokens: np.ndarray, eval_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): the held-out part is the last `eval_fraction` of the corpus,
    and at least one window of `seq_len + 2` tokens (views: a memory-mapped corpus stays on disk)."""
    held_out = max(math.ceil(len(tokens) * eval_fraction), seq_len + 2)
    if len(tokens) - held_out < seq_len + 2:
        raise InputError(f"corpus of {len(tokens)} tokens is too short for seq_len = {seq_len} with a held-out "
                         f"split of {held_out} tokens: need at least {held_out + seq_len + 2}")
    return tokens[:-held_out], tokens[-held_out:]


def contiguous_row_range(batch_slices: Iterable[slice], num_rows: int) -> range:
    """Union of batch-dimension slices (one per device of a process) as one contiguous range.

    Devices that replicate the same rows contribute the same slice, so the union, not the sum,
    is what the process must supply.
    """
    rows: set[int] = set()
    for s in batch_slices:
        rows.update(range(*s.indices(num_rows)))
    if not rows:
        raise InputError("this process's devices hold no batch rows")
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise InputError(
            f"batch rows held by this process are not contiguous: {len(rows)} rows spread over "
            f"[{lo}, {hi}); order the mesh so each process holds one block of the batch dimension"
        )
    return range(lo, hi)


class Batches:
    """Iterator of global `[global_batch, seq_len + 1]` int32 token batches, one per step."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        global_batch: int,
        seq_len: int,
        seed: int,
        sharding: jax.sharding.Sharding,
        step: int = 0,
        vocab_size: int | None = None,
        source: str = "tokens",
    ) -> None:
        if tokens.ndim != 1:
            raise InputError(f"tokens must be 1-D, got shape {tokens.shape}")
        if global_batch <= 0 or seq_len <= 0:
            raise InputError(f"global_batch and seq_len must be positive, got {global_batch}, {seq_len}")
        if len(tokens) < seq_len + 2:
            raise InputError(
                f"corpus of {len(tokens)} tokens is too short for seq_len={seq_len}: "
                f"need at least seq_len + 2 = {seq_len + 2}"
            )
        if seed < 0 or step < 0:
            raise InputError(f"seed and step must be non-negative, got seed={seed}, step={step}")
        self.tokens = tokens
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.seed = seed
        self.sharding = sharding
        self.step = step
        self.vocab_size, self.source = vocab_size, source
        self.global_shape = (global_batch, seq_len + 1)
        self._process_rows = self.process_rows()

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of all `global_batch` rows of `step`; depends only on `(seed, step)`."""
        rng = np.random.default_rng([self.seed, step])
        # Every window [o, o + seq_len + 1) must fit in the corpus.
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch)

    def rows(self, step: int, row_indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token rows `row_indices` of `step`, shape `[len(row_indices), seq_len + 1]`, int32."""
        idx = np.asarray(row_indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.global_batch):
            raise IndexError(f"row indices must lie in [0, {self.global_batch})")
        starts_B = self.offsets(step)[idx]
        # Fancy indexing reads only these windows, which matters for a memmapped corpus.
        positions_BT = starts_B[:, None] + np.arange(self.seq_len + 1)
        rows_BT = np.asarray(self.tokens[positions_BT])
        if self.vocab_size is not None and rows_BT.size and rows_BT.max() >= self.vocab_size:
            raise InputError(f"{self.source}: token {int(rows_BT.max())} in batch {step} is out of "
                             f"range for model.vocab_size = {self.vocab_size} (a tokenizer with a larger "
                             f"vocabulary, or the wrong data.token_dtype?)")
        return rows_BT.astype(np.int32)

    def process_rows(self) -> range:
        """Contiguous batch rows held by this process's devices under `sharding`."""
        index_map = self.sharding.addressable_devices_indices_map(self.global_shape)
        return contiguous_row_range((index[0] for index in index_map.values()), self.global_batch)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> jax.Array:
        local_tokens_BT = self.rows(self.step, self._process_rows)
        # The full sequence is passed: a dimension equal to the global size is sliced per device.
        tokens_BT = jax.make_array_from_process_local_data(self.sharding, local_tokens_BT, self.global_shape)
        self.step += 1
        return tokens_BT

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.seed = int(state["seed"])
