"""Tokenise text into the flat token file that training reads (`data.source=bin`).

    python -m launch.prepare --tokenizer tokenizer.json --input corpus/ --out data/corpus.bin
    python -m launch.prepare --tokenizer tokenizer.json --input book.txt --out data/book.bin --eos "</s>"
    python -m launch.train --config small --set data.source=bin --set data.path=data/corpus.bin \
        --set data.token_dtype=uint16 --set model.vocab_size=32000

Each file is one document: a file, or every `--pattern` file under a directory (sorted relative paths,
recursively), encoded whole as transformers' tokenizer encodes it (`launch.tokenizer`): with the special
tokens the tokenizer.json's post-processor adds, so one BOS per document where the family has one
(Llama 3, Mistral) and none where it has not (Qwen). Documents are separated by the EOS token: `--eos`,
else the `eos_token` of the tokenizer_config.json beside the tokenizer, else a well-known EOS among its
special tokens; none found, documents are simply concatenated. Both are printed. The output is the tokens
back to back with no header, uint16 when the vocabulary fits (≤ 65536 entries), else uint32 — the layout
`meshpar.data` memory-maps; training must be told the dtype (`data.token_dtype`), which is printed at the
end and written beside the file (`DATA.bin.json`), where training checks it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from launch.tokenizer import HFTokenizer, load
from meshpar.errors import InputError

# Text encoded per call: enough for the library's threads; its ids come back as Python ints (~36 bytes each).
BATCH_BYTES = 16 * 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json (and the tokenizer_config.json "
                                                      "beside it, if any)")
    p.add_argument("--input", required=True, help="a text file, or a directory of them")
    p.add_argument("--out", required=True, help="the token file to write, e.g. data.bin")
    p.add_argument("--pattern", default="*.txt", help="which files of a directory are text (default: *.txt, as "
                                                      "data.source=text reads)")
    p.add_argument("--eos", help="the token that separates documents (default: the tokenizer's EOS, if any)")
    return p.parse_args(argv)


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
            progress: bool = True) -> tuple[int, np.dtype]:
    """Write the tokens of `files` to `out` (via a temporary file, so an interrupted run leaves no partial
    token file behind); returns (token count, dtype)."""
    from tqdm import tqdm

    vocab = tokenizer.backend.get_vocab_size()
    dtype = token_dtype(vocab)
    separator = np.array([] if eos is None else [eos], dtype)
    partial, count, done, last = out.with_name(out.name + ".partial"), 0, 0, None
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, disable=not progress)
    try:
        with open(partial, "wb") as sink:
            for group in batches(files):
                for document in tokenizer.encode_batch([read_text(f) for f in group]):
                    ids = np.asarray(document, dtype)
                    if done and last != eos:  # one EOS between documents, none more where the tokenizer ends each
                        ids = np.concatenate([separator, ids])
                    ids.tofile(sink)
                    count, done, last = count + ids.size, done + 1, ids[-1] if ids.size else last
                bar.update(sum(f.stat().st_size for f in group))
                bar.set_postfix(files=f"{done}/{len(files)}", tokens=f"{count:,}")
        if count == 0:
            raise InputError(f"--input {files[0] if len(files) == 1 else files[0].parent}: no tokens (empty text)")
        os.replace(partial, out)
        # What the file holds, so that training refuses to read it as another token type (meshpar.data).
        Path(f"{out}.json").write_text(json.dumps({"token_dtype": dtype.name, "vocab_size": vocab}) + "\n")
    finally:
        bar.close()
        partial.unlink(missing_ok=True)
    return count, dtype


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        tokenizer = load(args.tokenizer)
        eos = separator_id(tokenizer, args.tokenizer, args.eos)
        files = text_files(args.input, args.pattern)
        count, dtype = prepare(tokenizer, files, Path(args.out), eos)
    except InputError as err:
        sys.exit(f"error: {err}")
    vocab = tokenizer.backend.get_vocab_size()
    print(f"{count:,} tokens of {len(files)} file(s) → {args.out}: {dtype.name}, vocabulary {vocab:,}")
    separator = "nothing" if eos is None else repr(tokenizer.backend.id_to_token(eos))
    print(f"BOS/EOS: each document gets {' '.join(tokenizer.added_tokens()) or 'no special token'} from the "
          f"tokenizer; documents are separated by {separator}")
    print(f"train on it: --set data.source=bin --set data.path={args.out} --set data.token_dtype={dtype.name} "
          f"--set model.vocab_size={vocab}")


if __name__ == "__main__":
    main()
