"""Packing documents into rows of `row_len` tokens: a row plan per epoch, and the rows it makes.

A `RowPlan` says which piece of which document goes where in each row of one epoch; it is a function of the
document offsets, the seed and the epoch only, so every process computes the same plan and then reads just
its own rows (`pack_rows`). Three packers (`DataConfig.packing`):

- `concat`: the documents in a seeded shuffled order, back to back, cut into consecutive rows; a document
  that does not fit continues on the next row; the last row is padded.
- `best_fit`: documents longer than a row are cut into row-long pieces first (each a row of its own) and
  their rest is packed like any shorter document; then, longest first (equal lengths in a seeded shuffled
  order), each goes into the row it fills most tightly, or a new row when none has room. No document
  shorter than a row is split; rows are in a seeded shuffled order and what is left of a row is padding.
- `pairs`: DPO's preference pairs (`launch.prepare` writes a pair as documents 2j, 2j + 1): each document a row
  of its own, cut to its first `row_len` tokens, the rest padding; the pairs in a seeded shuffled order, the
  two of a pair in rows 2i, 2i + 1, so that an even number of rows never splits one.

All give the same number of rows every epoch (`concat`: the token count over `row_len`, rounded up;
`best_fit`: the lengths alone decide which rows fill how, the shuffle only which equal-length documents go
where), so a global row index maps to (epoch, row) by division. Planning is numpy, except best fit's one
step per document, a bisection over at most `row_len` distinct free spaces: O(n log row_len).

A packed row is `tokens` (padding 0), `segments` (1, 2, 3, ... for the pieces of documents in the row,
0 for padding) and `weights` (the corpus's, else 1; 0 for padding and for the first token of every piece
after the row's first, which would otherwise be predicted from the piece before it).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

from meshpar.data.corpus import Corpus
from meshpar.errors import InputError


@dataclass(frozen=True)
class RowPlan:
    """Row r of an epoch holds pieces `row_pieces[r]:row_pieces[r + 1]`, in that order from column 0;
    piece p is the corpus tokens `piece_starts[p] .. piece_starts[p] + piece_lengths[p] - 1`."""

    row_len: int
    row_pieces: np.ndarray  # int64 [rows + 1]
    piece_starts: np.ndarray  # int64 [pieces]
    piece_lengths: np.ndarray  # int64 [pieces]

    @property
    def num_rows(self) -> int:
        return len(self.row_pieces) - 1

    def padding_fraction(self) -> float:
        """The share of the rows' tokens that are padding."""
        return 1.0 - float(self.piece_lengths.sum()) / (self.num_rows * self.row_len)


def plan_rows(packing: str, documents: np.ndarray, row_len: int, seed: int, epoch: int) -> RowPlan:
    """The row plan of `epoch` for documents at `documents` offsets (`Corpus.documents`)."""
    rng = np.random.default_rng([seed, epoch])
    if packing == "concat":
        return _concat(documents, row_len, rng)
    if packing == "best_fit":
        return _best_fit(documents, row_len, rng)
    if packing == "pairs":
        return _pairs(documents, row_len, rng)
    raise ValueError(f"no row plan for packing {packing!r}")


def _concat(documents: np.ndarray, row_len: int, rng: np.random.Generator) -> RowPlan:
    order_N = rng.permutation(len(documents) - 1)
    order_N = order_N[documents[order_N + 1] > documents[order_N]]  # empty documents make no piece
    lengths_N = documents[order_N + 1] - documents[order_N]
    begins_N = np.cumsum(lengths_N) - lengths_N  # where each document begins in the stream
    total = int(lengths_N.sum())
    # A document is one piece, and one more for every row that begins inside it.
    pieces_N = (begins_N + lengths_N - 1) // row_len - begins_N // row_len + 1
    nth = _ranks_within(pieces_N)
    document_begin = np.repeat(begins_N, pieces_N)
    cuts = np.where(nth == 0, document_begin, (document_begin // row_len + nth) * row_len)
    piece_starts = np.repeat(documents[order_N], pieces_N) + (cuts - document_begin)
    num_rows = -(-total // row_len)
    row_pieces = np.searchsorted(cuts // row_len, np.arange(num_rows + 1))
    return RowPlan(row_len, row_pieces, piece_starts, np.diff(np.append(cuts, total)))


def _pairs(documents: np.ndarray, row_len: int, rng: np.random.Generator) -> RowPlan:
    n = len(documents) - 1
    if n % 2:
        raise InputError(f"data.packing = pairs takes the documents two by two (a preference pair: launch.prepare "
                         f"writes them from prompt/chosen/rejected records), and there are {n}")
    order_N = (2 * rng.permutation(n // 2)[:, None] + np.arange(2)).reshape(-1)
    lengths_N = np.minimum(documents[order_N + 1] - documents[order_N], row_len)
    return RowPlan(row_len, np.arange(n + 1), documents[order_N], lengths_N)


def _best_fit(documents: np.ndarray, row_len: int, rng: np.random.Generator) -> RowPlan:
    lengths_N = np.diff(documents)
    # Documents longer than a row: whole rows of their own first, then the rest packed like a short document.
    full_rows_N = lengths_N // row_len
    full_starts = np.repeat(documents[:-1], full_rows_N) + row_len * _ranks_within(full_rows_N)
    rests_N = lengths_N - full_rows_N * row_len
    ties_N = rng.permutation(len(lengths_N))
    order = np.lexsort((ties_N, -rests_N))  # longest first, equal lengths shuffled
    order = order[rests_N[order] > 0]
    rest_rows, num_rest_rows = _best_fit_rows(rests_N[order], row_len)
    piece_rows = np.concatenate([np.arange(len(full_starts)), len(full_starts) + rest_rows])
    piece_starts = np.concatenate([full_starts, documents[order] + full_rows_N[order] * row_len])
    piece_lengths = np.concatenate([np.full(len(full_starts), row_len), rests_N[order]])
    num_rows = len(full_starts) + num_rest_rows
    # Rows in a shuffled order; stable, so the pieces of a row stay in the order they went in.
    shuffled_rows = rng.permutation(num_rows)[piece_rows]
    by_row = np.argsort(shuffled_rows, kind="stable")
    row_pieces = np.searchsorted(shuffled_rows[by_row], np.arange(num_rows + 1))
    return RowPlan(row_len, row_pieces, piece_starts[by_row], piece_lengths[by_row])


def _best_fit_rows(sizes: np.ndarray, row_len: int) -> tuple[np.ndarray, int]:
    """(the row of each size, the number of rows): sizes, longest first, each go into the open row they
    leave least room in, else into a new one."""
    rows_by_free: list[list[int]] = [[] for _ in range(row_len + 1)]  # open rows, by their free space
    free_spaces: list[int] = []  # the free spaces that some open row has, sorted
    row_of, num_rows = [], 0
    for size in sizes.tolist():
        k = bisect_left(free_spaces, size)
        if k == len(free_spaces):
            row, free = num_rows, row_len
            num_rows += 1
        else:
            free = free_spaces[k]
            row = rows_by_free[free].pop()
            if not rows_by_free[free]:
                del free_spaces[k]
        row_of.append(row)
        free -= size
        if free:  # a full row takes no more
            if not rows_by_free[free]:
                insort(free_spaces, free)
            rows_by_free[free].append(row)
    return np.array(row_of, np.int64), num_rows


def _ranks_within(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., counts[i] - 1 for every i, back to back."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


def pack_rows(corpus: Corpus, plan: RowPlan, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, segments, weights) of the plan's `rows`, each `[len(rows), row_len]`: int32, int32, float32.

    Only these rows' tokens are read from the corpus (a memory-mapped corpus stays on disk)."""
    rows = np.asarray(rows, np.int64)
    counts_R = plan.row_pieces[rows + 1] - plan.row_pieces[rows]
    pieces = np.repeat(plan.row_pieces[rows], counts_R) + _ranks_within(counts_R)
    lengths = plan.piece_lengths[pieces]
    local_row = np.repeat(np.arange(len(rows)), counts_R)
    segment = _ranks_within(counts_R) + 1
    # Each piece's first column: the lengths of the pieces before it in its row.
    starts = np.cumsum(lengths) - lengths
    column = starts - starts[np.repeat(np.cumsum(counts_R) - counts_R, counts_R)]
    # Every token of the rows: its piece, its place in the corpus and in the rows.
    token_piece = np.repeat(np.arange(len(pieces)), lengths)
    offset = _ranks_within(lengths)
    source = plan.piece_starts[pieces][token_piece] + offset
    at = (local_row[token_piece], column[token_piece] + offset)
    shape = (len(rows), plan.row_len)
    tokens_RT, segments_RT = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    weights_RT = np.zeros(shape, np.float32)
    tokens_RT[at] = corpus.tokens[source]
    segments_RT[at] = segment[token_piece]
    weights_RT[at] = 1.0 if corpus.weights is None else corpus.weights[source]
    later = column > 0  # a piece's first token after another piece would be predicted from that one
    weights_RT[local_row[later], column[later]] = 0.0
    return tokens_RT, segments_RT, weights_RT
