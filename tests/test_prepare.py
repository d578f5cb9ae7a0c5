"""`python -m launch.prepare`: a file or a directory becomes the tokenizer's ids, documents separated by its
EOS, in the flat uint16 / uint32 file that training's `data.source=bin` memory-maps; with a model family's
tokenizer files, one BOS per document where the family has one and the EOS its tokenizer_config.json names; with
`--format`, the prepared directory of `data.source=prepared`: documents, and which tokens are trained on (the
response of prompt/response records, the assistant's turns of chats); the families' chat templates render as
transformers' apply_chat_template renders them."""

import json
import re
from pathlib import Path

import jax
import jinja2
import numpy as np
import pytest
from test_tokenizer import write_family
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from launch import chat_template, prepare, records, tokenizer
from meshpar.data import Batches, DataConfig, bin_tokens, load_corpus, split
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


# ---------------------------------------------------------------- documents, prepared directories, records

CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat?"},
        {"role": "assistant", "content": "It sat on the mat."}, {"role": "user", "content": "and the dog?"},
        {"role": "assistant", "content": "A log, 12 logs."}]


def instruct_tokenizer(directory: Path, template: str | None = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE (every byte encodable) with Qwen's special tokens, EOS <|im_end|>, and `template`."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    backend.train_from_iterator(LINES, trainer)
    directory.mkdir(parents=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", **({"chat_template": template} if template else {})}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


@pytest.fixture
def chat_tokenizer(tmp_path):
    return instruct_tokenizer(tmp_path / "model")


def runs(ids: np.ndarray, weights: np.ndarray) -> list[np.ndarray]:
    """The stretches of ids whose weight is 1."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], weights, [0]])))
    return [ids[a:b] for a, b in zip(edges[::2], edges[1::2])]


def test_the_bin_file_s_document_index(tokenizer_file, tmp_path):
    corpus = two_documents(tmp_path / "corpus")
    prepare.main(["--tokenizer", str(tokenizer_file), "--input", str(corpus), "--out", str(tmp_path / "c.bin")])
    first = len(ids(tokenizer_file, LINES[0])) + 1  # the EOS ends the first document
    total = first + len(ids(tokenizer_file, LINES[1]))
    assert np.load(tmp_path / "c.bin.documents.npy").tolist() == [0, first, total]
    loaded = load_corpus(DataConfig(source="bin", path=str(tmp_path / "c.bin")))
    assert loaded.documents.tolist() == [0, first, total]


def test_text_files_to_a_prepared_directory(tmp_path, capsys):
    path, corpus = write_family(tmp_path / "model", "llama3"), two_documents(tmp_path / "corpus")
    out = tmp_path / "prepared"
    prepare.main(["--tokenizer", str(path), "--format", "text", "--input", str(corpus), "--out", str(out),
                  "--seq-len", "8"])
    backend = Tokenizer.from_file(str(path))
    eos = backend.token_to_id("<|end_of_text|>")
    documents = [backend.encode(line).ids + [eos] for line in LINES[:2]]  # BOS ... EOS, each
    loaded = load_corpus(DataConfig(source="prepared", path=str(out)))
    assert loaded.tokens.tolist() == documents[0] + documents[1] and loaded.weights is None  # every token counts
    assert loaded.documents.tolist() == [0, len(documents[0]), len(documents[0]) + len(documents[1])]
    info = json.loads((out / "corpus.json").read_text())
    assert info["documents"] == 2 and info["weighted_tokens"] == info["tokens"] == loaded.documents[-1]
    printed = capsys.readouterr().out
    total = int(loaded.documents[-1])
    assert f"2 documents, {total} tokens ({total} trained on)" in printed
    assert re.search(r"data.packing=concat: \d+ rows of seq_len \+ 1 = 9 tokens, \d+\.\d\d% padding", printed)
    assert "data.packing=best_fit:" in printed and f"--set data.path={out}" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "model", "prepared"]  # no partial directory
    with pytest.raises(SystemExit, match=f"^error: {re.escape(str(out))} already exists"):
        prepare.main(["--tokenizer", str(path), "--format", "text", "--input", str(corpus), "--out", str(out)])


def test_prompt_response_records_train_on_the_response(chat_tokenizer):
    tokenizer_ = tokenizer.load(str(chat_tokenizer))
    fields = records.detect({"prompt": "the cat?", "response": "It sat."}, "test")
    assert fields.kind == "prompt"
    encoder = records.Encoder(tokenizer_, fields, tokenizer_.eos_id)
    [(ids_, weights)] = encoder.encode([{"prompt": "the cat?", "response": "It sat."}])
    decode = lambda x: tokenizer_.backend.decode(x.tolist(), skip_special_tokens=False)
    assert [decode(run) for run in runs(ids_, weights)] == ["It sat.<|im_end|>"]
    assert decode(ids_[weights == 0]) == "the cat?"
    [(_, all_weights)] = records.Encoder(tokenizer_, fields, tokenizer_.eos_id, "all").encode(
        [{"prompt": "the cat?", "response": "It sat."}])
    assert all_weights.all()


def test_chat_records_train_on_the_assistant_s_turns(chat_tokenizer):
    tokenizer_ = tokenizer.load(str(chat_tokenizer))
    template = chat_template.load(tokenizer_, str(chat_tokenizer))
    encoder = records.Encoder(tokenizer_, records.detect({"messages": CHAT}, "test"), tokenizer_.eos_id,
                              template=template)
    [(ids_, weights)] = encoder.encode([{"messages": CHAT}])
    decode = lambda x: tokenizer_.backend.decode(x.tolist(), skip_special_tokens=False)
    assert decode(ids_) == template.render(CHAT)  # the whole conversation, as rendered
    assert [decode(run) for run in runs(ids_, weights)] == ["It sat on the mat.<|im_end|>\n",
                                                            "A log, 12 logs.<|im_end|>\n"]


# Chat templates written here, each in the style of a family's own (its tokenizer_config.json's) and using the
# template features that family's uses: Llama 3's headers with bos_token, strftime_now and | trim; Qwen's ChatML
# with a namespace() and loop.first / loop.last; Mistral's [INST] with an alternation check; tojson on non-ASCII
# text. Each is given the tokenizer files of its family (test_tokenizer.write_family).
TEMPLATES = Path(__file__).with_name("chat_templates")
FAMILY_TEMPLATES = {"llama3_style": "llama3-instruct", "chatml_style": "qwen-instruct", "mistral_style": "mistral",
                    "json_turns": "qwen-instruct"}


@pytest.mark.parametrize("template", FAMILY_TEMPLATES)
def test_family_chat_templates_render_as_transformers_does(template, tmp_path):
    """transformers' apply_chat_template on the same files is the reference: with and without a system message,
    ending on the user (with and without the generation prompt) or on the assistant; a conversation the template
    refuses (raise_exception) is refused with the template's message."""
    transformers = pytest.importorskip("transformers")
    path = write_family(tmp_path, FAMILY_TEMPLATES[template])
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / f"{template}.jinja").read_text()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = chat_template.load(tokenizer.load(str(path)), str(path))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for messages in (CHAT, CHAT[1:], CHAT[:4], CHAT[1:4]):
        for prompt in (False, True):
            assert ours.render(messages, add_generation_prompt=prompt) == reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt), (len(messages), prompt)
    unknown_role = [CHAT[1], {"role": "narrator", "content": "The cat sat."}]
    with pytest.raises(jinja2.TemplateError) as refused:  # transformers' raise_exception
        reference.apply_chat_template(unknown_role, tokenize=False)
    with pytest.raises(InputError, match=f"refuses the conversation: {re.escape(str(refused.value))}$"):
        ours.render(unknown_role)


def test_records_of_unknown_shape_name_their_keys(chat_tokenizer, tmp_path):
    with pytest.raises(InputError, match=r"data.jsonl: cannot tell what the records hold from the first one's keys "
                                         r"\['body', 'id'\].*--text-field"):
        records.detect({"id": 1, "body": "x"}, "data.jsonl")
    assert records.detect({"id": 1, "body": "x"}, "data.jsonl", text="body").text == "body"
    fields = records.detect({"prompt": "a", "response": "b"}, "data.jsonl")
    with pytest.raises(InputError, match=r"data.jsonl: record 3 has no field 'response' \(prompt records\); its "
                                         r"fields: \['prompt'\]"):
        records.check({"prompt": "a", "response": None}, fields, "data.jsonl", 3)
    with pytest.raises(InputError, match=r"record 0: 'messages' must be a list of"):
        records.detect({"messages": "hi"}, "data.jsonl")
    # A tokenizer without a chat template cannot render chats.
    path = instruct_tokenizer(tmp_path / "base", template=None)
    with pytest.raises(InputError, match=r"base/tokenizer_config.json: no chat_template \(and no chat_template.jinja"):
        chat_template.load(tokenizer.load(str(path)), str(path))


def test_a_bad_format_is_refused(tokenizer_file, tmp_path, capsys):
    with pytest.raises(SystemExit):
        prepare.main(["--tokenizer", str(tokenizer_file), "--format", "csv", "--input", ".", "--out", "x"])
    assert "argument --format: invalid choice: 'csv'" in capsys.readouterr().err


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_jsonl_records_to_a_prepared_directory(chat_tokenizer, tmp_path, capsys):
    pytest.importorskip("datasets")
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}, {"messages": CHAT[:3]}])
    out = tmp_path / "chats"
    prepare.main(["--tokenizer", str(chat_tokenizer), "--format", "jsonl", "--input", str(data), "--out", str(out)])
    corpus = load_corpus(DataConfig(source="prepared", path=str(out)))
    assert corpus.num_documents == 2 and corpus.weights is not None
    backend = Tokenizer.from_file(str(chat_tokenizer))
    second = corpus.tokens[corpus.documents[1]:]
    trained = runs(np.asarray(second), np.asarray(corpus.weights[corpus.documents[1]:]))
    assert [backend.decode(run.tolist(), skip_special_tokens=False) for run in trained] == \
        ["It sat on the mat.<|im_end|>\n"]
    assert f"({int(corpus.weights.sum())} trained on)" in capsys.readouterr().out

    prompts = write_jsonl(tmp_path / "qa.jsonl", [{"q": "the cat?", "a": "It sat."}])
    prepare.main(["--tokenizer", str(chat_tokenizer), "--format", "jsonl", "--input", str(prompts),
                  "--out", str(tmp_path / "qa"), "--prompt-field", "q", "--response-field", "a"])
    qa = load_corpus(DataConfig(source="prepared", path=str(tmp_path / "qa")))
    assert backend.decode(np.asarray(qa.tokens)[qa.weights == 1].tolist(), skip_special_tokens=False) == \
        "It sat.<|im_end|>"


def test_parquet_text_records(tokenizer_file, tmp_path):
    pytest.importorskip("datasets")
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow
    (tmp_path / "data").mkdir()
    parquet.write_table(pyarrow.table({"text": LINES[:2]}), tmp_path / "data" / "part-0.parquet")
    prepare.main(["--tokenizer", str(tokenizer_file), "--format", "parquet", "--input", str(tmp_path / "data"),
                  "--out", str(tmp_path / "out")])
    corpus = load_corpus(DataConfig(source="prepared", path=str(tmp_path / "out")))
    eos = Tokenizer.from_file(str(tokenizer_file)).token_to_id("</s>")
    assert corpus.tokens.tolist() == ids(tokenizer_file, LINES[0]) + [eos] + ids(tokenizer_file, LINES[1]) + [eos]


@pytest.mark.parametrize(("rows", "extra", "message"), [
    ([{"id": 1, "body": "x"}], [], r"cannot tell what the records hold from the first one's keys \['body', 'id'\]"),
    ([{"text": "a"}, {"txt": "b"}], [], r"record 1 has no field 'text' \(text records\); its fields: \['txt'\]"),
    ([{"messages": CHAT}], ["--tokenizer-of-base"], r"tokenizer_config.json: no chat_template"),
])
def test_bad_records_are_one_error_line_and_leave_nothing(chat_tokenizer, tmp_path, rows, extra, message):
    pytest.importorskip("datasets")
    path = instruct_tokenizer(tmp_path / "base", template=None) if extra else chat_tokenizer
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(SystemExit, match=f"^error: .*{message}"):
        prepare.main(["--tokenizer", str(path), "--format", "jsonl", "--input", str(data), "--out",
                      str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


PAIRS = [{"prompt": "the cat?", "chosen": "It sat.", "rejected": "A dog."},
         {"prompt": [{"role": "user", "content": "the cat?"}], "chosen": [{"role": "assistant", "content": "It sat."}],
          "rejected": [{"role": "assistant", "content": "No."}]}]


@pytest.mark.parametrize("record", PAIRS, ids=["text", "chat"])
def test_preference_records_to_pairs_of_rows(chat_tokenizer, tmp_path, capsys, record):
    """A preference record (TRL's text or conversational form) is two documents, prompt + chosen and prompt +
    rejected, only the responses trained on; `data.packing=pairs` gives each a row, a pair in rows 2i, 2i + 1,
    and the held-out split keeps pairs whole."""
    pytest.importorskip("datasets")
    rows = [record] * 2 + [{**record, "chosen": record["rejected"], "rejected": record["chosen"]}] * 3
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "pairs"
    prepare.main(["--tokenizer", str(chat_tokenizer), "--format", "jsonl", "--input", str(data), "--out", str(out)])
    assert "--set data.packing=pairs --set train.objective=dpo" in capsys.readouterr().out
    assert json.loads((out / "corpus.json").read_text())["pairs"] is True
    corpus = load_corpus(DataConfig(source="prepared", path=str(out)))
    backend = Tokenizer.from_file(str(chat_tokenizer))
    decode = lambda x: backend.decode(np.asarray(x).tolist(), skip_special_tokens=False)
    documents = [(corpus.tokens[a:b], corpus.weights[a:b]) for a, b in zip(corpus.documents, corpus.documents[1:])]
    assert len(documents) == 10
    first, second = (runs(np.asarray(ids_), np.asarray(weights)) for ids_, weights in documents[:2])
    chat = not isinstance(record["prompt"], str)
    assert [decode(run) for run in first] == ["It sat.<|im_end|>" + "\n" * chat]
    assert [decode(run) for run in second] == [("No." if chat else "A dog.") + "<|im_end|>" + "\n" * chat]
    train_part, held_out = split(corpus, 0.1, 8, group=2)
    assert (train_part.num_documents, held_out.num_documents) == (8, 2)
    rows_ = Batches(train_part, global_batch=8, seq_len=31, seed=0, sharding=jax.sharding.SingleDeviceSharding(
        jax.devices()[0]), packing="pairs").rows(0, range(8))
    for pair in range(4):  # the two rows of a pair: one prompt, two responses
        a, b = (rows_.tokens[2 * pair + i][rows_.segments[2 * pair + i] > 0] for i in range(2))
        w = rows_.weights[2 * pair][rows_.segments[2 * pair] > 0]
        prompt = int(np.argmax(w > 0))
        assert prompt > 0 and np.array_equal(a[:prompt], b[:prompt]) and not np.array_equal(a, b)
