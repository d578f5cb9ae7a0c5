"""The prepared directory (`data.source=prepared`): what `launch.prepare --format ...` writes and training reads.

    DIR/tokens.bin      the tokens back to back, uint16 or uint32 (memory-mapped when read)
    DIR/documents.npy   int64 offsets [n + 1]: document i is tokens[documents[i]:documents[i + 1]]
    DIR/weights.bin     uint8, each token's weight as a target (absent: every token counts)
    DIR/corpus.json     {"token_dtype", "vocab_size", "documents", "tokens", "weighted_tokens", ...}

A directory is written whole under a temporary name beside it and renamed into place, so an interrupted run
leaves no directory that training could take for a complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from meshpar.data.corpus import Corpus
from meshpar.errors import InputError

TOKENS, DOCUMENTS, WEIGHTS, INFO = "tokens.bin", "documents.npy", "weights.bin", "corpus.json"


@contextmanager
def writing(directory: Path) -> Iterator[Path]:
    """A temporary directory beside `directory` to write into; renamed to `directory` when the block ends
    without an error, removed otherwise. `directory` must not exist yet."""
    if directory.exists():
        raise InputError(f"{directory} already exists; remove it or write another directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o777 & ~umask)  # as a directory made by mkdir, not mkdtemp's owner-only one
    try:
        yield partial
        os.replace(partial, directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def write_info(directory: Path, documents: np.ndarray, token_dtype: np.dtype, vocab_size: int,
               weighted_tokens: int, **extra) -> dict:
    """Write `documents.npy` and `corpus.json` (the tokens and weights are streamed in by the writer)."""
    np.save(directory / DOCUMENTS, documents.astype(np.int64))
    info = {"token_dtype": np.dtype(token_dtype).name, "vocab_size": vocab_size,
            "documents": len(documents) - 1, "tokens": int(documents[-1]), "weighted_tokens": weighted_tokens,
            "weights": (directory / WEIGHTS).is_file(), **extra}
    (directory / INFO).write_text(json.dumps(info, indent=1) + "\n")
    return info


def read_info(directory: str) -> dict:
    """The `corpus.json` of a prepared directory."""
    info_file = Path(directory) / INFO
    if not Path(directory).is_dir():
        raise InputError(f"data.path: prepared directory not found: {directory}")
    try:
        info = json.loads(info_file.read_text())
    except FileNotFoundError:
        raise InputError(f"data.path: {directory} is not a prepared directory (no {INFO}; written by "
                         f"python -m launch.prepare --format ...)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{info_file}: cannot read it as JSON ({err})") from None
    missing = [key for key in ("token_dtype", "tokens", "documents") if key not in info]
    if missing or info["token_dtype"] not in ("uint16", "uint32"):
        raise InputError(f"{info_file}: needs token_dtype (uint16 or uint32), tokens and documents; got {info}")
    return info


def read(directory: str) -> Corpus:
    """The corpus of a prepared directory: tokens and weights memory-mapped, offsets checked against them."""
    info, root = read_info(directory), Path(directory)
    tokens = _memmap(root / TOKENS, np.dtype(info["token_dtype"]), info["tokens"])
    weights = _memmap(root / WEIGHTS, np.dtype(np.uint8), info["tokens"]) if info.get("weights") else None
    try:
        documents = np.load(root / DOCUMENTS)
    except (OSError, ValueError) as err:
        raise InputError(f"{root / DOCUMENTS}: cannot read the document offsets ({err})") from None
    if documents.shape != (info["documents"] + 1,) or documents.dtype != np.int64:
        raise InputError(f"{root / DOCUMENTS}: expected {info['documents'] + 1} int64 offsets ({INFO}), got "
                         f"shape {documents.shape}, {documents.dtype}")
    try:
        return Corpus(tokens, documents, weights)
    except InputError as err:
        raise InputError(f"{root / DOCUMENTS}: {err}") from None


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if not path.is_file():
        raise InputError(f"data.path: {path} is missing")
    size = path.stat().st_size
    if size != count * dtype.itemsize:
        raise InputError(f"{path}: {size} bytes, but {INFO} says {count} {dtype.name} values "
                         f"({count * dtype.itemsize} bytes)")
    if count == 0:
        raise InputError(f"empty corpus: {path} holds no tokens")
    return np.memmap(path, dtype=dtype, mode="r")
