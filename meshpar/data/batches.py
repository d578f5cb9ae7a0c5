"""Deterministic, resumable, per-process batches of a corpus: one `meshpar.batch.Batch` per step.

Step `s` is `global_batch` rows of `seq_len + 1` tokens; the model reads `row[:-1]` and predicts `row[1:]`.

- `packing="none"`: each row is a window of consecutive tokens whose start comes from a generator seeded only
  by `(seed, s)`; a batch is `Batch(tokens)` (with the corpus's `weights` sliced alike where it has them).
- `concat` / `best_fit`: the rows of epoch e are those of `packing.plan_rows(..., seed, e)`, and step `s`
  takes rows `s·B .. (s + 1)·B − 1` of the endless sequence epoch 0, epoch 1, ...; a batch is
  `Batch(tokens, segments, weights)`.

So:
- determinism: the same seed gives the same batches on any machine with the same corpus;
- resume: `state_dict()` is just `{"step", "seed"}`; loading it continues with exactly the batches an
  uninterrupted run would have seen, mid-epoch or not;
- per-process reading: every process draws the offsets or plans the epoch (cheap), then reads tokens only
  for the contiguous block of rows its devices hold (`process_rows`), and
  `jax.make_array_from_process_local_data` assembles each global `[B, T + 1]` field.

Every batch is checked against the model's vocabulary (`vocab_size`): a token out of range is an error naming
the source and the step, not a silent embedding lookup of garbage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import numpy as np

from meshpar.batch import Batch
from meshpar.data.config import PACKINGS
from meshpar.data.corpus import Corpus
from meshpar.data.packing import RowPlan, pack_rows, plan_rows
from meshpar.errors import InputError

PLANS_KEPT = 2  # a batch that crosses an epoch's end needs two plans


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
    """Iterator of global `[global_batch, seq_len + 1]` batches (`meshpar.batch.Batch`), one per step, of a
    corpus (or a bare token array: one document)."""

    def __init__(
        self,
        corpus: Corpus | np.ndarray,
        *,
        global_batch: int,
        seq_len: int,
        seed: int,
        sharding: jax.sharding.Sharding,
        step: int = 0,
        vocab_size: int | None = None,
        source: str = "tokens",
        packing: str = "none",
    ) -> None:
        corpus = corpus if isinstance(corpus, Corpus) else Corpus.one_document(corpus)
        tokens = corpus.tokens
        if global_batch <= 0 or seq_len <= 0:
            raise InputError(f"global_batch and seq_len must be positive, got {global_batch}, {seq_len}")
        if packing not in PACKINGS:
            raise InputError(f"packing {packing!r} is not one of {', '.join(PACKINGS)}")
        if packing != "none" and len(tokens) == 0:
            raise InputError(f"{source}: the corpus holds no tokens to pack")
        if packing == "none" and len(tokens) < seq_len + 2:
            raise InputError(
                f"corpus of {len(tokens)} tokens is too short for seq_len={seq_len}: "
                f"need at least seq_len + 2 = {seq_len + 2}"
            )
        if seed < 0 or step < 0:
            raise InputError(f"seed and step must be non-negative, got seed={seed}, step={step}")
        self.corpus, self.tokens = corpus, tokens
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.seed = seed
        self.sharding = sharding
        self.step = step
        self.vocab_size, self.source, self.packing = vocab_size, source, packing
        self.global_shape = (global_batch, seq_len + 1)
        self._process_rows = self.process_rows()
        self._plans: dict[tuple[int, int], RowPlan] = {}
        # Every epoch of a packer has as many rows as the first (`meshpar.data.packing`).
        self.rows_per_epoch = self.plan(0).num_rows if packing != "none" else None

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of all `global_batch` windows of `step` (`packing="none"`); depends only on `(seed, step)`."""
        rng = np.random.default_rng([self.seed, step])
        # Every window [o, o + seq_len + 1) must fit in the corpus.
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch)

    def plan(self, epoch: int) -> RowPlan:
        """The row plan of `epoch` (a packer's), kept for the latest epochs asked for."""
        key = (self.seed, epoch)
        if key not in self._plans:
            if len(self._plans) == PLANS_KEPT:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan_rows(self.packing, self.corpus.documents, self.seq_len + 1, self.seed, epoch)
        return self._plans[key]

    def rows(self, step: int, row_indices: Sequence[int] | np.ndarray) -> Batch:
        """Rows `row_indices` of `step` as numpy arrays `[len(row_indices), seq_len + 1]` (tokens int32, segments
        int32, weights float32; None where the batch has none)."""
        idx = np.asarray(row_indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.global_batch):
            raise IndexError(f"row indices must lie in [0, {self.global_batch})")
        rows = self._windows(step, idx) if self.packing == "none" else self._packed(step, idx)
        if self.vocab_size is not None and rows.tokens.size and rows.tokens.max() >= self.vocab_size:
            raise InputError(f"{self.source}: token {int(rows.tokens.max())} in batch {step} is out of "
                             f"range for model.vocab_size = {self.vocab_size} (a tokenizer with a larger "
                             f"vocabulary, or the wrong data.token_dtype?)")
        return rows

    def _windows(self, step: int, idx: np.ndarray) -> Batch:
        starts_B = self.offsets(step)[idx]
        # Fancy indexing reads only these windows, which matters for a memmapped corpus.
        positions_BT = starts_B[:, None] + np.arange(self.seq_len + 1)
        tokens_BT = np.asarray(self.tokens[positions_BT]).astype(np.int32)
        if self.corpus.weights is None:
            return Batch(tokens_BT)
        return Batch(tokens_BT, weights=np.asarray(self.corpus.weights[positions_BT], np.float32))

    def _packed(self, step: int, idx: np.ndarray) -> Batch:
        shape = (len(idx), self.seq_len + 1)
        tokens_BT, segments_BT = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        weights_BT = np.zeros(shape, np.float32)
        epoch_B, row_B = np.divmod(step * self.global_batch + idx, self.rows_per_epoch)
        for epoch in np.unique(epoch_B).tolist():
            mine = epoch_B == epoch
            tokens_BT[mine], segments_BT[mine], weights_BT[mine] = pack_rows(self.corpus, self.plan(epoch),
                                                                             row_B[mine])
        return Batch(tokens_BT, segments_BT, weights_BT)

    def process_rows(self) -> range:
        """Contiguous batch rows held by this process's devices under `sharding`."""
        index_map = self.sharding.addressable_devices_indices_map(self.global_shape)
        return contiguous_row_range((index[0] for index in index_map.values()), self.global_batch)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Batch:
        local = self.rows(self.step, self._process_rows)
        # The full sequence is passed: a dimension equal to the global size is sliced per device.
        batch = Batch(*(None if field_BT is None else
                        jax.make_array_from_process_local_data(self.sharding, field_BT, self.global_shape)
                        for field_BT in local))
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.seed = int(state["seed"])
