"""`python -m launch.prepare`: a file or a directory becomes the tokenizer's ids, documents separated by its
EOS, in the flat uint16 / uint32 file that training's `data.source=bin` memory-maps; with a model family's
tokenizer files, one BOS per document where the family has one and the EOS its tokenizer_config.json names."""

import re
from pathlib import Path

import numpy as np
import pytest
from test_tokenizer import write_family
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from launch import prepare, tokenizer
from meshpar.data import bin_tokens
from meshpar.errors import InputError

LINES = ["the cat sat on the mat", "a dog sat on a log", "the cat and the dog", "mats and logs and cats"]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A small BPE trained here, with an EOS among its special tokens."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "</s>"]))
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def two_documents(directory: Path) -> Path:
    directory.mkdir()
    for name, line in zip(["a.txt", "b.txt"], LINES):
        (directory / name).write_text(line)
    return directory


def ids(tokenizer_file, text: str) -> list[int]:
    return Tokenizer.from_file(str(tokenizer_file)).encode(text).ids


def test_a_file(tokenizer_file, tmp_path, capsys):
    (tmp_path / "book.txt").write_text("\n".join(LINES))
    prepare.main(["--tokenizer", str(tokenizer_file), "--input", str(tmp_path / "book.txt"),
                  "--out", str(tmp_path / "out" / "book.bin")])
    tokens = bin_tokens(str(tmp_path / "out" / "book.bin"), "uint16")  # as training reads it
    assert tokens.tolist() == ids(tokenizer_file, "\n".join(LINES))
    assert "data.token_dtype=uint16" in capsys.readouterr().out
    with pytest.raises(InputError, match=r"book.bin holds uint16 tokens \(book.bin.json\), but data.token_dtype = uint32"):
        bin_tokens(str(tmp_path / "out" / "book.bin"), "uint32")


def test_a_directory_in_sorted_order_with_eos_between_documents(tokenizer_file, tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    (corpus / "b.txt").write_text(LINES[1])
    (corpus / "a" / "z.txt").write_text(LINES[0])
    (corpus / "a" / "notes.md").write_text(LINES[2])  # not a *.txt file
    prepare.main(["--tokenizer", str(tokenizer_file), "--input", str(corpus), "--out", str(tmp_path / "c.bin")])
    eos = Tokenizer.from_file(str(tokenizer_file)).token_to_id("</s>")
    expected = ids(tokenizer_file, LINES[0]) + [eos] + ids(tokenizer_file, LINES[1])  # a/z.txt before b.txt
    assert np.fromfile(tmp_path / "c.bin", np.uint16).tolist() == expected
    prepare.main(["--tokenizer", str(tokenizer_file), "--input", str(corpus), "--out", str(tmp_path / "all.bin"),
                  "--pattern", "*.md", "--eos", "[UNK]"])
    assert np.fromfile(tmp_path / "all.bin", np.uint16).tolist() == ids(tokenizer_file, LINES[2])


def test_a_vocabulary_over_65536_is_written_as_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text("w1 w69999 w65536 w7")
    prepare.main(["--tokenizer", str(tmp_path / "tokenizer.json"), "--input", str(tmp_path / "text.txt"),
                  "--out", str(tmp_path / "t.bin")])
    assert bin_tokens(str(tmp_path / "t.bin"), "uint32").tolist() == [2, 70_000, 65_537, 8]
    assert prepare.token_dtype(2**16) == np.uint16 and prepare.token_dtype(2**16 + 1) == np.uint32


@pytest.mark.parametrize(("change", "message"), [
    ({"--input": "missing"}, "--input missing: no such file or directory"),
    ({"--eos": "<nope>"}, "--eos '<nope>' is not a token"),
])
def test_bad_input_is_one_error_line(tokenizer_file, tmp_path, change, message):
    (tmp_path / "x.txt").write_text("the cat")
    options = {"--tokenizer": str(tokenizer_file), "--input": str(tmp_path / "x.txt"),
               "--out": str(tmp_path / "x.bin"), **change}
    with pytest.raises(SystemExit, match=f"^error: {message}"):
        prepare.main([item for option in options.items() for item in option])
    assert not (tmp_path / "x.bin").exists()


def test_the_eos_named_by_tokenizer_config_json(tokenizer_file, tmp_path):
    """A Hugging Face model directory names its EOS in tokenizer_config.json; that one wins."""
    (tmp_path / "tokenizer.json").write_text(tokenizer_file.read_text())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": {"content": "[UNK]"}}')
    backend = Tokenizer.from_file(str(tokenizer_file))
    assert tokenizer.load(str(tmp_path / "tokenizer.json")).eos_id == backend.token_to_id("[UNK]")
    assert tokenizer.load(str(tokenizer_file)).eos_id == backend.token_to_id("</s>")  # a well-known EOS


@pytest.mark.parametrize(("family", "bos", "eos"), [
    ("llama3", "<|begin_of_text|>", "<|end_of_text|>"),
    ("llama3-instruct", "<|begin_of_text|>", "<|eot_id|>"),
    ("qwen-instruct", None, "<|im_end|>"),
    ("mistral", "<s>", "</s>"),
])
def test_a_family_s_bos_starts_each_document_and_its_eos_separates_them(family, bos, eos, tmp_path, capsys):
    path, corpus = write_family(tmp_path / "model", family), two_documents(tmp_path / "corpus")
    prepare.main(["--tokenizer", str(path), "--input", str(corpus), "--out", str(tmp_path / "c.bin")])
    backend = Tokenizer.from_file(str(path))
    bos_ids = [backend.token_to_id(bos)] if bos else []
    document = lambda text: bos_ids + backend.encode(text, add_special_tokens=False).ids
    expected = document(LINES[0]) + [backend.token_to_id(eos)] + document(LINES[1])
    assert np.fromfile(tmp_path / "c.bin", np.uint16).tolist() == expected
    assert f"each document gets {bos or 'no special token'} from the tokenizer; documents are separated by " \
           f"{eos!r}" in capsys.readouterr().out


def test_one_eos_between_documents_where_the_tokenizer_ends_each_with_it(tmp_path):
    path = write_family(tmp_path / "model", "mistral")
    backend = Tokenizer.from_file(str(path))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[
        ("<s>", backend.token_to_id("<s>")), ("</s>", backend.token_to_id("</s>"))])
    backend.save(str(path))
    prepare.main(["--tokenizer", str(path), "--input", str(two_documents(tmp_path / "corpus")),
                  "--out", str(tmp_path / "c.bin")])
    expected = backend.encode(LINES[0]).ids + backend.encode(LINES[1]).ids  # <s> a </s> <s> b </s>
    assert np.fromfile(tmp_path / "c.bin", np.uint16).tolist() == expected


def test_a_bad_tokenizer_config_json_is_one_error_line(tmp_path):
    path = write_family(tmp_path, "llama3")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|nope|>"}')
    (tmp_path / "x.txt").write_text("the cat")
    message = f"error: {tmp_path / 'tokenizer_config.json'}: eos_token '<|nope|>' is not a token of {path}"
    with pytest.raises(SystemExit, match=f"^{re.escape(message)}$"):
        prepare.main(["--tokenizer", str(path), "--input", str(tmp_path / "x.txt"), "--out", str(tmp_path / "x.bin")])
