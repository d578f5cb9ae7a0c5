"""The tokenizer a Hugging Face model directory ships, read as `transformers.AutoTokenizer` reads it:
`launch.prepare` and `launch.generate --tokenizer` load it here.

`tokenizer.json` (the `tokenizers` library) encodes a text with the special tokens its post-processor adds:
that is the family's BOS (Llama 3: <|begin_of_text|>; Mistral, Llama 2: <s>; Qwen: none), added once. Beside
it, `tokenizer_config.json` names `bos_token` and `eos_token` (a string, {"content": ...}, or null, as Qwen's
bos_token is), and `generation_config.json` the ids that end generation (`eos_token_id`, an id or a list:
Llama 3 instruct lists <|end_of_text|>, <|eom_id|>, <|eot_id|>). transformers (5) leaves tokenizer_config's
`add_bos_token` / `add_eos_token` aside when a tokenizer.json is present, and so does this module: where they
disagree with what the post-processor adds, it warns (transformers 4's Llama classes followed them).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import tokenizers

from meshpar.errors import InputError

# EOS spellings of common tokenizers (GPT-2/NeoX/Qwen, Llama 1-2/Mistral, Llama 3, Gemma), tried in order where
# no tokenizer_config.json names one.
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


@dataclasses.dataclass(frozen=True)
class HFTokenizer:
    """A tokenizer.json and the special ids its config files name."""

    backend: tokenizers.Tokenizer  # tokenizer.json, without truncation or padding
    bos_id: int | None  # tokenizer_config.json's bos_token
    eos_id: int | None  # its eos_token, else the first KNOWN_EOS among the special tokens
    stop_ids: tuple[int, ...]  # generation_config.json's eos_token_id, else (eos_id,), else ()

    def encode(self, text: str) -> list[int]:
        """The ids of `text` with the family's special tokens: transformers' `tokenizer(text)["input_ids"]`."""
        return self.backend.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, on the library's threads."""
        return [encoding.ids for encoding in self.backend.encode_batch_fast(texts)]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` without special tokens (ids outside the vocabulary are left out)."""
        return self.backend.decode(ids, skip_special_tokens=True)

    def added_tokens(self) -> list[str]:
        """The special tokens the post-processor puts around every text, e.g. ['<|begin_of_text|>']."""
        return self.backend.encode("").tokens


def load(path: str) -> HFTokenizer:
    """`path` (a tokenizer.json) and the tokenizer_config.json and generation_config.json beside it, if any."""
    try:
        backend = tokenizers.Tokenizer.from_file(path)
    except Exception as err:  # the library raises its own exception types for unreadable files
        raise InputError(f"--tokenizer {path}: cannot read it as a tokenizer.json ({err})") from None
    # A tokenizer.json may carry training-time truncation or padding, which would cut or pad texts.
    backend.no_truncation()
    backend.no_padding()
    config_file = Path(path).with_name("tokenizer_config.json")
    config = _read_json(config_file)
    bos_id, eos_id = (_token_id(backend, path, config_file, config, key) for key in ("bos_token", "eos_token"))
    _warn_where_add_flags_disagree(backend, path, config_file, config, bos_id, eos_id)
    if eos_id is None:
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        eos_id = next((backend.token_to_id(t) for t in KNOWN_EOS if t in special), None)
    stop_ids = _generation_eos_ids(backend, Path(path).with_name("generation_config.json"))
    return HFTokenizer(backend, bos_id, eos_id, stop_ids or tuple(i for i in [eos_id] if i is not None))


def _read_json(file: Path) -> dict:
    """The object `file` holds; {} where there is no such file."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{file}: cannot read it as JSON ({err})") from None
    if not isinstance(value, dict):
        raise InputError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_id(backend, path: str, file: Path, config: dict, key: str) -> int | None:
    """The id of the token `config[key]` names (as a string or {"content": ...}); None where it names none."""
    value = config.get(key)
    token = value["content"] if isinstance(value, dict) and "content" in value else value
    if token is None:
        return None
    if not isinstance(token, str):
        raise InputError(f'{file}: {key} must be a token (a string or {{"content": ...}}) or null, got {value!r}')
    if backend.token_to_id(token) is None:
        raise InputError(f"{file}: {key} {token!r} is not a token of {path}")
    return backend.token_to_id(token)


def _warn_where_add_flags_disagree(backend, path: str, file: Path, config: dict, bos_id: int | None,
                                   eos_id: int | None) -> None:
    added = backend.encode("").ids
    for key, token_id, adds in (("add_bos_token", bos_id, added[:1] == [bos_id]),
                                ("add_eos_token", eos_id, added[-1:] == [eos_id])):
        flag = config.get(key)
        if flag is not None and not isinstance(flag, bool):
            raise InputError(f"{file}: {key} must be true or false, got {flag!r}")
        if flag is not None and token_id is not None and flag != adds:
            print(f"warning: {file}: {key} is {json.dumps(flag)}, but {path} "
                  f"{'adds' if adds else 'does not add'} {backend.id_to_token(token_id)!r}: following {path}, "
                  f"as transformers 5 does", file=sys.stderr)


def _generation_eos_ids(backend, file: Path) -> tuple[int, ...]:
    """The ids of `file`'s eos_token_id; () where it names none."""
    value = _read_json(file).get("eos_token_id")
    ids = [value] if isinstance(value, int) else value
    if ids is None:
        return ()
    vocab = backend.get_vocab_size()
    if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < vocab for i in ids):
        raise InputError(f"{file}: eos_token_id must be a token id or a list of them, in [0, {vocab}) (the "
                         f"tokenizer's vocabulary), got {value!r}")
    return tuple(ids)
