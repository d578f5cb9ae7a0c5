"""Tokenise text into what training reads: the flat token file of `data.source=bin`, or, with `--format`, the
directory of `data.source=prepared` (tokens, documents, each token's weight as a target).

    python -m launch.prepare --tokenizer tokenizer.json --input corpus/ --out data/corpus.bin
    python -m launch.prepare --tokenizer tokenizer.json --input book.txt --out data/book.bin --eos "</s>"
    python -m launch.train --config small --set data.source=bin --set data.path=data/corpus.bin \
        --set data.token_dtype=uint16 --set model.vocab_size=32000
    python -m launch.prepare --tokenizer DIR/tokenizer.json --format jsonl --input chats.jsonl --out data/chats \
        --seq-len 2048
    python -m launch.train --config small --set data.source=prepared --set data.path=data/chats \
        --set data.packing=best_fit --set model.vocab_size=32000

Each text file is one document: a file, or every `--pattern` file under a directory (sorted relative paths,
recursively), encoded whole as transformers' tokenizer encodes it (`launch.tokenizer`): with the special
tokens the tokenizer.json's post-processor adds, so one BOS per document where the family has one
(Llama 3, Mistral) and none where it has not (Qwen). Documents end with the EOS token: `--eos`, else the
`eos_token` of the tokenizer_config.json beside the tokenizer, else a well-known EOS among its special
tokens; none found, documents are simply concatenated. Both are printed.

Without `--format`, the output is the tokens back to back with no header, an EOS between documents,
uint16 when the vocabulary fits (≤ 65536 entries), else uint32 — the layout `meshpar.data` memory-maps;
training must be told the dtype (`data.token_dtype`), which is printed at the end and written beside the
file (`DATA.bin.json`), where training checks it; the document offsets go beside it too
(`DATA.bin.documents.npy`; a document's EOS ends it).

With `--format text|jsonl|parquet`, `--out` is a directory (`meshpar.data.prepared`), written under a
temporary name and renamed when complete. `text`: text files as above, every token weight 1, each document
ending with EOS. `jsonl` / `parquet`: records read from local files with Hugging Face `datasets`, each a
document (`launch.records`): plain text, a prompt and its response (only the response and its EOS are
trained on), or a chat rendered with the tokenizer's chat template (only the assistant's turns are trained
on; `--train-on all` trains on every token), or a preference pair for DPO (`prompt`, `chosen`, `rejected`: two
documents, only the responses trained on; train with `data.packing=pairs`). At the end it prints the documents, tokens and trained tokens,
and with `--seq-len N` the rows and padding of each packer at that sequence length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from launch import records
from launch.tokenizer import HFTokenizer, load
from meshpar.data import BIN_DOCUMENTS_SUFFIX, PACKINGS, plan_rows, prepared
from meshpar.errors import InputError

# Text encoded per call: enough for the library's threads; its ids come back as Python ints (~36 bytes each).
BATCH_BYTES = 16 * 2**20
RECORDS_PER_CALL = 1024  # records of a JSON Lines or Parquet file encoded per call
FORMATS = ("text", "jsonl", "parquet")
PATTERNS = {None: "*.txt", "text": "*.txt", "jsonl": "*.jsonl", "parquet": "*.parquet"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json (and the tokenizer_config.json "
                                                      "beside it, if any)")
    p.add_argument("--input", required=True, help="a file, or a directory of them")
    p.add_argument("--out", required=True, help="the token file to write, e.g. data.bin; with --format, the "
                                                "directory to write")
    p.add_argument("--format", choices=FORMATS, help="write a prepared directory (data.source=prepared) from text "
                                                     "files, JSON Lines or Parquet records")
    p.add_argument("--pattern", help="which files of a directory to read (default: *.txt, as data.source=text "
                                     "reads; *.jsonl, *.parquet with those formats)")
    p.add_argument("--eos", help="the token that ends documents (default: the tokenizer's EOS, if any)")
    p.add_argument("--text-field", help="the records' text field (default: text)")
    p.add_argument("--prompt-field", help="the records' prompt field (default: prompt)")
    p.add_argument("--response-field", help="the records' response field (default: response)")
    p.add_argument("--messages-field", help="the records' chat messages field (default: messages)")
    p.add_argument("--chosen-field", help="preference records' chosen response field (default: chosen)")
    p.add_argument("--rejected-field", help="preference records' rejected response field (default: rejected)")
    p.add_argument("--train-on", choices=("assistant", "all"), default="assistant",
                   help="which tokens of prompt/response and chat records are targets (default: the response "
                        "and the assistant's turns)")
    p.add_argument("--seq-len", type=int, help="also print the rows and padding of each packer at this length")
    args = p.parse_args(argv)
    if args.seq_len is not None and args.seq_len <= 0:
        p.error(f"--seq-len must be positive, got {args.seq_len}")
    return args


def separator_id(tokenizer: HFTokenizer, tokenizer_path: str, eos: str | None) -> int | None:
    """The id of the document separator: `eos` if given, else the tokenizer's EOS if it has one."""
    if eos is None:
        return tokenizer.eos_id
    if tokenizer.backend.token_to_id(eos) is None:
        raise InputError(f"--eos {eos!r} is not a token of {tokenizer_path}")
    return tokenizer.backend.token_to_id(eos)


def text_files(path: str, pattern: str) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise InputError(f"--input {path}: no such file or directory")
    files = sorted((f for f in p.rglob(pattern) if f.is_file()), key=lambda f: f.relative_to(p).as_posix())
    if not files:
        raise InputError(f"--input {path}: no {pattern} files under it")
    return files


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def batches(files: list[Path]) -> list[list[Path]]:
    """Consecutive files, about BATCH_BYTES of text each (a larger file alone)."""
    out, size = [], BATCH_BYTES
    for f in files:
        if size + f.stat().st_size > BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(f)
        size += f.stat().st_size
    return out


def read_text(f: Path) -> str:
    try:
        return f.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{f} is not UTF-8 text (byte {err.start}); exclude it with --pattern") from None
    except OSError as err:
        raise InputError(f"cannot read {f}: {err.strerror}") from None


def prepare(tokenizer: HFTokenizer, files: list[Path], out: Path, eos: int | None,
            progress: bool = True) -> tuple[np.ndarray, np.dtype]:
    """Write the tokens of `files` to `out` and their document offsets beside it (via temporary files, so an
    interrupted run leaves no partial token file behind); returns (document offsets, dtype)."""
    from tqdm import tqdm

    vocab = tokenizer.backend.get_vocab_size()
    dtype = token_dtype(vocab)
    separator = np.array([] if eos is None else [eos], dtype)
    index = Path(f"{out}{BIN_DOCUMENTS_SUFFIX}")
    partial, partial_index = out.with_name(out.name + ".partial"), index.with_name(index.name + ".partial.npy")
    offsets, count, last = [0], 0, None
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, disable=not progress)
    try:
        with open(partial, "wb") as sink:
            for group in batches(files):
                for document in tokenizer.encode_batch([read_text(f) for f in group]):
                    ids = np.asarray(document, dtype)
                    # One EOS between documents, none more where the tokenizer ends each.
                    if len(offsets) > 1 and last != eos:
                        separator.tofile(sink)
                        count += separator.size
                        offsets[-1] = count  # the EOS ends the document before
                    ids.tofile(sink)
                    count, last = count + ids.size, ids[-1] if ids.size else last
                    offsets.append(count)
                bar.update(sum(f.stat().st_size for f in group))
                bar.set_postfix(files=f"{len(offsets) - 1}/{len(files)}", tokens=f"{count:,}")
        if count == 0:
            raise InputError(f"--input {files[0] if len(files) == 1 else files[0].parent}: no tokens (empty text)")
        documents = np.unique(np.array(offsets, np.int64))  # without empty documents
        np.save(partial_index, documents)
        os.replace(partial_index, index)
        os.replace(partial, out)
        # What the file holds, so that training refuses to read it as another token type (meshpar.data).
        Path(f"{out}.json").write_text(json.dumps({"token_dtype": dtype.name, "vocab_size": vocab}) + "\n")
    finally:
        bar.close()
        partial.unlink(missing_ok=True)
        partial_index.unlink(missing_ok=True)
    return documents, dtype


def text_documents(tokenizer: HFTokenizer, files: list[Path],
                   eos: int | None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each text file as (ids ending with EOS, weights all 1)."""
    encoder = records.Encoder(tokenizer, records.Fields("text"), eos)
    for group in batches(files):
        yield from encoder.encode([{"text": read_text(f)} for f in group])


def read_records(files: list[Path], format: str) -> Iterator[dict]:
    """The records of local JSON Lines or Parquet files, streamed by Hugging Face `datasets` (nothing cached)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # local files only, whatever the paths look like
    try:
        import datasets
    except ImportError:
        raise InputError(f"--format {format} reads records with Hugging Face datasets: pip install -e '.[prepare]'")
    names = [str(f) for f in files]
    try:
        yield from datasets.load_dataset("json" if format == "jsonl" else "parquet", data_files=names, split="train",
                                         streaming=True)
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as err:
        raise InputError(f"--input {', '.join(names)}: cannot read it as {format} ({err})") from None


def record_fields(args: argparse.Namespace, files: list[Path]) -> records.Fields:
    """What kind the records are (`launch.records.detect`), from the first one."""
    first = next(read_records(files, args.format), None)
    if first is None:
        raise InputError(f"--input {args.input}: no records")
    return records.detect(first, str(args.input), args.text_field, args.prompt_field, args.response_field,
                          args.messages_field, args.chosen_field, args.rejected_field)


def record_documents(tokenizer: HFTokenizer, args: argparse.Namespace, files: list[Path], eos: int | None,
                     fields: records.Fields) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each record as (ids, weights), of the kind `fields` says (`launch.records`); a preference record as two."""
    source = str(args.input)
    stream = read_records(files, args.format)
    first = next(stream)
    template = None
    if fields.kind == "chat" or fields.kind == "preference" and not isinstance(first[fields.prompt], str):
        from launch import chat_template  # jinja2, only for chats

        template = chat_template.load(tokenizer, args.tokenizer)
    encoder = records.Encoder(tokenizer, fields, eos, args.train_on, template)
    group = [first]
    for index, record in enumerate(stream, start=1):
        records.check(record, fields, source, index)
        group.append(record)
        if len(group) == RECORDS_PER_CALL:
            yield from encoder.encode(group)
            group = []
    yield from encoder.encode(group)


def write_directory(documents: Iterable[tuple[np.ndarray, np.ndarray]], out: Path, vocab: int, total: int | None,
                    progress: bool = True, **info) -> tuple[np.ndarray, dict]:
    """Write the documents to a prepared directory `out` (`meshpar.data.prepared`), atomically; returns (document
    offsets, what corpus.json says)."""
    from tqdm import tqdm

    dtype, offsets, weighted = token_dtype(vocab), [0], 0
    bar = tqdm(total=total, unit=" documents", disable=not progress)
    try:
        with prepared.writing(out) as directory:
            with (open(directory / prepared.TOKENS, "wb") as tokens,
                  open(directory / prepared.WEIGHTS, "wb") as weights):
                for ids, ids_weights in documents:
                    ids.astype(dtype).tofile(tokens)
                    ids_weights.tofile(weights)
                    offsets.append(offsets[-1] + len(ids))
                    weighted += int(ids_weights.sum())
                    bar.update()
                    bar.set_postfix(tokens=f"{offsets[-1]:,}", trained=f"{weighted:,}", refresh=False)
            if offsets[-1] == 0:
                raise InputError(f"{out}: no tokens to write (empty texts)")
            if weighted == offsets[-1]:  # every token counts: training needs no weights
                (directory / prepared.WEIGHTS).unlink()
            documents_N = np.unique(np.array(offsets, np.int64))  # without empty documents
            written = prepared.write_info(directory, documents_N, dtype, vocab, weighted, **info)
    finally:
        bar.close()
    return documents_N, written


def packing_summary(documents: np.ndarray, seq_len: int) -> list[str]:
    """For each packer, the rows of seq_len + 1 tokens it makes of `documents` and the share that is padding."""
    plans = {packing: plan_rows(packing, documents, seq_len + 1, seed=0, epoch=0) for packing in PACKINGS[1:]
             if packing != "pairs" or (len(documents) - 1) % 2 == 0}
    return [f"data.packing={packing}: {plan.num_rows:,} rows of seq_len + 1 = {seq_len + 1} tokens, "
            f"{plan.padding_fraction():.2%} padding" for packing, plan in plans.items()]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        tokenizer = load(args.tokenizer)
        eos = separator_id(tokenizer, args.tokenizer, args.eos)
        files = text_files(args.input, args.pattern or PATTERNS[args.format])
        vocab = tokenizer.backend.get_vocab_size()
        if args.format is None:
            documents, dtype = prepare(tokenizer, files, Path(args.out), eos)
            weighted = int(documents[-1])
        else:
            fields = None if args.format == "text" else record_fields(args, files)
            stream = (text_documents(tokenizer, files, eos) if fields is None
                      else record_documents(tokenizer, args, files, eos, fields))
            total = len(files) if args.format == "text" else None  # records are counted as they stream in
            pairs = fields is not None and fields.kind == "preference"  # documents two by two: data.packing=pairs
            documents, info = write_directory(stream, Path(args.out), vocab, total, tokenizer=str(args.tokenizer),
                                              format=args.format, train_on=args.train_on, pairs=pairs)
            dtype, weighted = np.dtype(info["token_dtype"]), info["weighted_tokens"]
        summary = packing_summary(documents, args.seq_len) if args.seq_len else []
    except InputError as err:
        sys.exit(f"error: {err}")
    count = int(documents[-1])
    print(f"{len(documents) - 1:,} documents, {count:,} tokens ({weighted:,} trained on) of {len(files)} file(s) → "
          f"{args.out}: {dtype.name}, vocabulary {vocab:,}")
    separator = "nothing" if eos is None else repr(tokenizer.backend.id_to_token(eos))
    ending = {None: f"documents are separated by {separator}", "text": f"documents end with {separator}"}.get(
        args.format, f"text and prompt/response records end with {separator}, chats as their template renders them")
    print(f"BOS/EOS: each document gets {' '.join(tokenizer.added_tokens()) or 'no special token'} from the "
          f"tokenizer; {ending}")
    for line in summary:
        print(line)
    if args.format is None:
        print(f"train on it: --set data.source=bin --set data.path={args.out} --set data.token_dtype={dtype.name} "
              f"--set model.vocab_size={vocab}")
    else:
        packing = "--set data.packing=pairs --set train.objective=dpo" if info.get("pairs") else \
            "[--set data.packing=best_fit]"
        print(f"train on it: --set data.source=prepared --set data.path={args.out} --set model.vocab_size={vocab} "
              f"{packing}")


if __name__ == "__main__":
    main()
