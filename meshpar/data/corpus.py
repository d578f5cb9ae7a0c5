"""A corpus: tokens back to back, where each document starts and ends, and how much each token counts as a
target; and its held-out split by whole documents.

`Corpus.tokens` may be a read-only `np.memmap`: nothing here reads it whole, and a split is two views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from meshpar.errors import InputError

WEIGHT_DTYPES = (np.dtype(np.uint8), np.dtype(np.float32))


@dataclass(frozen=True)
class Corpus:
    """`tokens` (1-D integers); document i is `tokens[documents[i]:documents[i + 1]]` (`documents`: int64
    offsets `[n + 1]` from 0 to `len(tokens)`); `weights` (1-D uint8 or float32, one per token) is each
    token's weight as a target, None where every token counts 1."""

    tokens: np.ndarray
    documents: np.ndarray
    weights: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1:
            raise InputError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        offsets = self.documents
        if offsets.ndim != 1 or offsets.dtype != np.int64 or len(offsets) < 2:
            raise InputError(f"document offsets must be 1-D int64 with at least 2 entries, got shape "
                             f"{offsets.shape}, {offsets.dtype}")
        if offsets[0] != 0 or offsets[-1] != len(self.tokens) or np.any(np.diff(offsets) < 0):
            raise InputError(f"document offsets must rise from 0 to the token count {len(self.tokens)}, got "
                             f"{offsets[0]} .. {offsets[-1]}" + (" (decreasing somewhere)"
                                                                 if np.any(np.diff(offsets) < 0) else ""))
        if self.weights is not None and (self.weights.shape != self.tokens.shape
                                         or self.weights.dtype not in WEIGHT_DTYPES):
            raise InputError(f"weights must be uint8 or float32, one per token ({len(self.tokens)}), got "
                             f"shape {self.weights.shape}, {self.weights.dtype}")

    @classmethod
    def one_document(cls, tokens: np.ndarray, weights: np.ndarray | None = None) -> Corpus:
        """All of `tokens` as a single document."""
        return cls(tokens, np.array([0, len(tokens)], np.int64), weights)

    @property
    def num_documents(self) -> int:
        return len(self.documents) - 1

    def lengths(self) -> np.ndarray:
        """The token count of every document `[n]`."""
        return np.diff(self.documents)

    def documents_between(self, first: int, stop: int) -> Corpus:
        """Documents `first .. stop - 1` as a corpus of their own (views, offsets from 0)."""
        lo, hi = int(self.documents[first]), int(self.documents[stop])
        weights = None if self.weights is None else self.weights[lo:hi]
        return Corpus(self.tokens[lo:hi], self.documents[first:stop + 1] - lo, weights)

    def tokens_between(self, lo: int, hi: int) -> Corpus:
        """Tokens `lo .. hi - 1` of a one-document corpus, as one document."""
        return Corpus.one_document(self.tokens[lo:hi], None if self.weights is None else self.weights[lo:hi])


def split(data: Corpus | np.ndarray, eval_fraction: float, seq_len: int, group: int = 1) -> tuple:
    """(training part, held-out part) of a corpus, or of a bare token array (then arrays, as views).

    Several documents: the held-out part is the last `eval_fraction` of the documents, and at least as many
    as hold one window of `seq_len + 2` tokens, in whole groups of `group` (DPO's pairs: 2); no document is in
    both. One document (or bare tokens): the
    last `eval_fraction` of its tokens, at least `seq_len + 2`. Either way it depends only on the corpus and
    the fraction, so it is the same on every run."""
    corpus = data if isinstance(data, Corpus) else Corpus.one_document(data)
    window = seq_len + 2
    if corpus.num_documents == 1:
        n = len(corpus.tokens)
        held_out = max(math.ceil(n * eval_fraction), window)
        if n - held_out < window:
            raise InputError(f"corpus of {n} tokens is too short for seq_len = {seq_len} with a held-out "
                             f"split of {held_out} tokens: need at least {held_out + window}")
        train, evaluation = corpus.tokens_between(0, n - held_out), corpus.tokens_between(n - held_out, n)
    else:
        n, offsets = corpus.num_documents, corpus.documents
        # The most documents that leave a window's worth of tokens at the end.
        by_tokens = n - int(np.searchsorted(offsets, offsets[-1] - window, side="right")) + 1
        held_out = min(-(-max(math.ceil(n * eval_fraction), by_tokens) // group) * group, n)
        first = n - held_out
        if first == 0 or offsets[first] < window:
            raise InputError(f"corpus of {n} documents ({offsets[-1]} tokens) is too short for seq_len = "
                             f"{seq_len}: holding out its last {held_out} documents ({offsets[-1] - offsets[first]} "
                             f"tokens) leaves {offsets[first]} for training, fewer than {window}")
        train, evaluation = corpus.documents_between(0, first), corpus.documents_between(first, n)
    if isinstance(data, Corpus):
        return train, evaluation
    return train.tokens, evaluation.tokens
