"""`launch.tokenizer`: a model directory's tokenizer.json with its tokenizer_config.json and
generation_config.json, read as transformers reads them, on small byte-level BPEs built like each family's
files (Llama 3 base and instruct, Qwen 2.5 / 3, Mistral / Llama 2)."""

import json
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from launch import tokenizer
from meshpar.errors import InputError

TEXTS = ["the cat sat on the mat", "A dog, 12 logs.\nHéllo <|eot_id|> </s>", ""]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# How the families' tokenizer.json split text before the bytes are merged (Qwen: digits one by one, after an
# NFC normalizer; transformers' Qwen2Tokenizer builds the same whatever the file says).
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}DIGITS| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT, QWEN_SPLIT = SPLIT.replace("DIGITS", "{1,3}"), SPLIT.replace("DIGITS", "")
MISTRAL_BOS = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
               "single_word": False}
# family: (special tokens, the split, the BOS its tokenizer.json's template adds, tokenizer_config.json, the
# tokens of generation_config.json's eos_token_id), as the families' own files have them.
FAMILIES = {
    "llama3": (LLAMA3_SPECIALS, LLAMA3_SPLIT, "<|begin_of_text|>",
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                "tokenizer_class": "PreTrainedTokenizerFast"}, "<|end_of_text|>"),
    "llama3-instruct": (LLAMA3_SPECIALS, LLAMA3_SPLIT, "<|begin_of_text|>",
                        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                         "tokenizer_class": "PreTrainedTokenizerFast"},
                        ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "qwen-instruct": (QWEN_SPECIALS, QWEN_SPLIT, None,
                      {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>",
                       "pad_token": "<|endoftext|>", "unk_token": None, "tokenizer_class": "Qwen2Tokenizer"},
                      ["<|im_end|>", "<|endoftext|>"]),
    "qwen-base": (QWEN_SPECIALS, QWEN_SPLIT, None,
                  {"bos_token": None, "eos_token": "<|endoftext|>", "tokenizer_class": "Qwen2Tokenizer"}, None),
    "mistral": (["<unk>", "<s>", "</s>"], None, "<s>",
                {"add_bos_token": True, "add_eos_token": False, "bos_token": MISTRAL_BOS, "eos_token": "</s>",
                 "unk_token": "<unk>"}, "</s>"),
    # Gemma 2 and 3 instruct: <bos> added by the template, turns ended by <end_of_turn>
    "gemma-instruct": (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], None, "<bos>",
                       {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
                        "pad_token": "<pad>", "unk_token": "<unk>"}, ["<eos>", "<end_of_turn>"]),
}


def write_family(directory: Path, family: str, template_bos: str | None = "family") -> Path:
    """A model directory's tokenizer files in the style of `family` (a byte-level BPE trained on TEXTS); its
    tokenizer.json's template adds `template_bos` (default: the family's BOS); returns tokenizer.json."""
    specials, split, bos, config, eos_tokens = FAMILIES[family]
    template_bos = bos if template_bos == "family" else template_bos
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                         pre_tokenizers.ByteLevel(False, use_regex=False)])
    if split == QWEN_SPLIT:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(vocab_size=100, special_tokens=specials))
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    if template_bos:
        backend.post_processor = processors.Sequence([backend.post_processor, processors.TemplateProcessing(
            single=f"{template_bos} $A", pair=f"{template_bos} $A {template_bos} $B",
            special_tokens=[(template_bos, backend.token_to_id(template_bos))])])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if eos_tokens is not None:  # one id, or a list of them
        ids = [backend.token_to_id(t) for t in eos_tokens] if isinstance(eos_tokens, list) else None
        eos_token_id = ids or backend.token_to_id(eos_tokens)
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return directory / "tokenizer.json"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_ids_of_transformers_tokenizer(family, tmp_path):
    """transformers' AutoTokenizer is the reference: the same ids for every text, one BOS at most, and the
    same BOS and EOS."""
    transformers = pytest.importorskip("transformers")
    path = write_family(tmp_path, family)
    ours, reference = tokenizer.load(str(path)), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert [ours.encode(text) for text in TEXTS] == [reference(text)["input_ids"] for text in TEXTS]
    assert ours.encode_batch(TEXTS) == [ours.encode(text) for text in TEXTS]
    assert (ours.bos_id, ours.eos_id) == (reference.bos_token_id, reference.eos_token_id)
    new = ours.encode(TEXTS[1])
    assert ours.decode(new) == reference.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize(("family", "bos", "eos", "stop"), [
    ("llama3", "<|begin_of_text|>", "<|end_of_text|>", ["<|end_of_text|>"]),
    ("llama3-instruct", "<|begin_of_text|>", "<|eot_id|>", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    ("qwen-instruct", None, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    ("qwen-base", None, "<|endoftext|>", ["<|endoftext|>"]),  # no generation_config.json: the EOS
    ("mistral", "<s>", "</s>", ["</s>"]),
])
def test_each_family_s_bos_eos_and_stop_ids(family, bos, eos, stop, tmp_path):
    loaded = tokenizer.load(str(write_family(tmp_path, family)))
    token_id = loaded.backend.token_to_id
    plain = loaded.backend.encode(TEXTS[0], add_special_tokens=False).ids
    assert loaded.encode(TEXTS[0]) == ([token_id(bos)] if bos else []) + plain  # one BOS, or none
    assert (loaded.bos_id, loaded.eos_id) == (bos and token_id(bos), token_id(eos))
    assert loaded.stop_ids == tuple(token_id(t) for t in stop)
    assert loaded.added_tokens() == ([bos] if bos else [])
    assert loaded.decode(loaded.encode(TEXTS[0]) + [token_id(eos)]) == TEXTS[0]  # special tokens left out


def test_add_bos_token_disagreeing_with_tokenizer_json_is_a_warning(tmp_path, capsys):
    """transformers 5 follows tokenizer.json's template and leaves add_bos_token aside; a mismatch is told."""
    path = write_family(tmp_path, "mistral", template_bos=None)  # add_bos_token true, but no template
    loaded = tokenizer.load(str(path))
    assert loaded.encode(TEXTS[0]) == loaded.backend.encode(TEXTS[0], add_special_tokens=False).ids
    assert "tokenizer_config.json: add_bos_token is true, but" in capsys.readouterr().err
    tokenizer.load(str(write_family(tmp_path / "agreeing", "mistral")))
    assert capsys.readouterr().err == ""


def test_no_config_files_and_no_truncation(tmp_path):
    """A bare tokenizer.json: the EOS is a well-known one among its special tokens; the truncation and padding
    it was saved with are dropped."""
    path = write_family(tmp_path, "qwen-base")
    (tmp_path / "tokenizer_config.json").unlink()
    backend = Tokenizer.from_file(str(path))
    whole = backend.encode(TEXTS[0]).ids
    backend.enable_truncation(max_length=3)
    backend.enable_padding(length=50)
    backend.save(str(path))
    loaded = tokenizer.load(str(path))
    assert loaded.bos_id is None and loaded.stop_ids == (loaded.eos_id,) == (backend.token_to_id("<|endoftext|>"),)
    assert loaded.encode(TEXTS[0]) == whole and len(whole) > 3


@pytest.mark.parametrize(("file", "content", "message"), [
    ("tokenizer.json", "{", "--tokenizer .*tokenizer.json: cannot read it as a tokenizer.json"),
    ("tokenizer_config.json", "{", "tokenizer_config.json: cannot read it as JSON"),
    ("tokenizer_config.json", "[]", "tokenizer_config.json: expected a JSON object, got list"),
    ("tokenizer_config.json", '{"eos_token": 7}', "tokenizer_config.json: eos_token must be a token"),
    ("tokenizer_config.json", '{"bos_token": {"id": 1}}', "tokenizer_config.json: bos_token must be a token"),
    ("tokenizer_config.json", '{"eos_token": "<nope>"}', "tokenizer_config.json: eos_token '<nope>' is not a token"),
    ("tokenizer_config.json", '{"eos_token": "</s>", "add_eos_token": "no"}',
     "tokenizer_config.json: add_eos_token must be true or false, got 'no'"),
    ("generation_config.json", '{"eos_token_id": "</s>"}', r"generation_config.json: eos_token_id must be a token id "
                                                           r"or a list of them, in \[0, \d+\) .*got '</s>'"),
    ("generation_config.json", '{"eos_token_id": [2, 100000]}', r"eos_token_id .*got \[2, 100000\]"),
    ("generation_config.json", '{"eos_token_id": true}', "eos_token_id .*got True"),
])
def test_a_bad_file_is_one_error_naming_it_and_the_key(file, content, message, tmp_path):
    path = write_family(tmp_path, "mistral")
    (tmp_path / file).write_text(content)
    with pytest.raises(InputError, match=message) as error:
        tokenizer.load(str(path))
    assert str(tmp_path / file) in str(error.value) and "\n" not in str(error.value)
