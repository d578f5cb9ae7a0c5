"""Data: token sources as corpora of documents, their held-out split, packing into rows, and deterministic,
resumable, per-process batches.

    config.py    DataConfig: source, path, packing, held-out fraction
    corpus.py    Corpus (tokens, document offsets, per-token weights) and `split` by whole documents
    sources.py   stdlib, text, bin (+ its document index) and prepared corpora: `load_corpus(cfg)`
    prepared.py  the directory `launch.prepare --format ...` writes and `data.source=prepared` reads
    packing.py   the row plans of `concat` and `best_fit` packing, and the rows they make
    batches.py   Batches: one `meshpar.batch.Batch` of global arrays per step, each process reading its rows

In a run: `corpus = load_corpus(cfg.data)`, `train, held_out = split(corpus, cfg.data.eval_fraction,
seq_len)`, then `Batches(train, ..., packing=cfg.data.packing)` and the same for `held_out`.

Why not Grain: its packers (`FirstFitPackIterDataset`, `BestFitPackIterDataset`, `ConcatThenSplitIterDataset`)
pack a stream a few bins at a time on each process, from the records that process was given
(`ShardByJaxProcess`), so the global batch depends on the number of processes and a process cannot read
just its block of rows of one global plan; they take documents already cut to the row length (no split of a
long document into row-long pieces); and resuming restores an iterator's state. Here a row plan is a pure
function of (corpus, seed, epoch), best fit is over the whole corpus, any process reads any rows, and the
resume state is the step number; all in a few hundred lines of numpy, with no compiled dependency.
"""

from meshpar.data.batches import Batches, contiguous_row_range
from meshpar.data.config import PACKINGS, SOURCES, TOKEN_DTYPES, DataConfig
from meshpar.data.corpus import Corpus, split
from meshpar.data.packing import RowPlan, pack_rows, plan_rows
from meshpar.data.sources import (BIN_DOCUMENTS_SUFFIX, bin_corpus, bin_tokens, load_corpus, load_tokens,
                                  stdlib_corpus, stdlib_tokens, text_corpus, text_tokens)

__all__ = ["BIN_DOCUMENTS_SUFFIX", "PACKINGS", "SOURCES", "TOKEN_DTYPES", "Batches", "Corpus", "DataConfig",
           "RowPlan", "bin_corpus", "bin_tokens", "contiguous_row_range", "load_corpus", "load_tokens", "pack_rows",
           "plan_rows", "split", "stdlib_corpus", "stdlib_tokens", "text_corpus", "text_tokens"]
