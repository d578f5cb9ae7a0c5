"""Token sources (`DataConfig.source`), each giving a `Corpus`: the tokens and where its documents start.

- `stdlib`: the bytes of the Python standard library's `.py` files (under `sysconfig.get_paths()["stdlib"]`,
  without `site-packages`), in sorted relative-path order, joined by a newline and cut at `max_bytes`; each
  file is a document (the newline before it belongs to it). Byte-level tokens, vocab 256; needs no download
  and is deterministic on a given machine.
- `text`: one UTF-8 text file (one document), or every `*.txt` file under a directory (sorted relative
  paths, joined by a newline, one document each). Byte-level tokens, vocab 256.
- `bin`: a pre-tokenised flat file of `uint16` or `uint32` tokens, opened as a read-only `np.memmap` so only
  the rows a batch uses are read from disk; its documents are the offsets in `FILE.documents.npy` beside it
  (written by `launch.prepare`), else it is one document.
- `prepared`: a directory written by `launch.prepare --format ...` (`meshpar.data.prepared`): tokens,
  documents and each token's weight as a target.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meshpar.data import prepared
from meshpar.data.config import DataConfig
from meshpar.data.corpus import Corpus
from meshpar.errors import InputError

# Third-party packages live inside the stdlib directory on most installs; they are not stdlib.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
BIN_DOCUMENTS_SUFFIX = ".documents.npy"  # FILE.bin's document offsets: FILE.bin.documents.npy


def _join_files(root: Path, rel_paths: Sequence[str], max_bytes: int | None) -> Corpus:
    """Files, newline-separated, as uint8 tokens (one document each, from its separator on), stopping once
    `max_bytes` are read."""
    buf, starts = bytearray(), []
    for i, rel in enumerate(rel_paths):
        starts.append(len(buf))
        if i:
            buf += b"\n"
        buf += _read(root / rel)
        if max_bytes is not None and len(buf) >= max_bytes:
            del buf[max_bytes:]
            break
    # Empty files make empty documents: left out, the tokens stay the same.
    documents = np.unique(np.array([*starts, len(buf)], np.int64))
    return Corpus(np.frombuffer(buf, dtype=np.uint8), documents)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror}") from None


def stdlib_corpus(max_bytes: int) -> Corpus:
    """The standard library's `.py` files in sorted relative-path order, one document each, cut at `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]  # prune in place
        rel_dir = Path(dirpath).relative_to(root)
        rel_paths += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    if not rel_paths:
        raise InputError(f"empty corpus: no .py files under the stdlib directory {root}")
    return _join_files(root, sorted(rel_paths), max_bytes)


def stdlib_tokens(max_bytes: int) -> np.ndarray:
    """Bytes of the standard library's `.py` files in sorted relative-path order, cut at `max_bytes`."""
    return stdlib_corpus(max_bytes).tokens


def text_corpus(path: str) -> Corpus:
    """Byte-level tokens of one text file (one document), or of every `*.txt` file under a directory."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"data.path: text corpus not found: {path}")
    if p.is_dir():
        rel_paths = sorted(f.relative_to(p).as_posix() for f in p.rglob("*.txt") if f.is_file())
        if not rel_paths:
            raise InputError(f"empty corpus: no *.txt files under {path}")
        corpus = _join_files(p, rel_paths, None)
    else:
        corpus = Corpus.one_document(np.frombuffer(_read(p), dtype=np.uint8))
    if corpus.tokens.size == 0:
        raise InputError(f"empty corpus: {path} holds no bytes")
    return corpus


def text_tokens(path: str) -> np.ndarray:
    """Byte-level tokens of one text file, or of every `*.txt` file under a directory."""
    return text_corpus(path).tokens


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


def bin_corpus(path: str, token_dtype: str) -> Corpus:
    """A flat token file with the document offsets beside it (`FILE.documents.npy`), else one document."""
    tokens = bin_tokens(path, token_dtype)
    index = Path(path + BIN_DOCUMENTS_SUFFIX)
    if not index.is_file():
        return Corpus.one_document(tokens)
    try:
        documents = np.load(index)
    except (OSError, ValueError) as err:
        raise InputError(f"{index}: cannot read the document offsets ({err})") from None
    try:
        return Corpus(tokens, documents)
    except InputError as err:  # an index of another token file
        raise InputError(f"{index}: {err} ({path})") from None


def load_corpus(cfg: DataConfig) -> Corpus:
    """The corpus `cfg` names."""
    if cfg.source == "stdlib":
        return stdlib_corpus(cfg.max_bytes)
    if cfg.source == "text":
        return text_corpus(cfg.path)
    if cfg.source == "bin":
        return bin_corpus(cfg.path, cfg.token_dtype)
    return prepared.read(cfg.path)


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """The 1-D token array of the corpus `cfg` names."""
    return load_corpus(cfg).tokens
