"""Records (rows of a JSON Lines or Parquet file) as documents: token ids and each token's weight as a target.

A record is one of three kinds, told apart by its fields (named by flags, else found in the first record):
- text (`{"text": ...}`): the text with the tokenizer's special tokens, then EOS; every token weight 1;
- prompt/response (`{"prompt": ..., "response": ...}`): the prompt with the special tokens, the response
  without, then EOS; the prompt's tokens weight 0, the response's and the EOS 1;
- chat (`{"messages": [{"role": ..., "content": ...}, ...]}`): the conversation rendered by the chat
  template (`launch.chat_template`), whose special tokens are its own; the assistant's turns weight 1, the
  rest 0;
- preference (`{"prompt": ..., "chosen": ..., "rejected": ...}`, for DPO): two documents, the prompt with
  the chosen response, then with the rejected one, each weighed as a prompt/response record (only the
  response and its EOS count); in TRL's conversational form the prompt is a list of messages and each
  response a list of the assistant's, rendered by the chat template, only the responses' assistant turns
  weighing 1. `data.packing=pairs` keeps the two documents together.
With `train_on="all"`, every token weighs 1 (not for preferences: DPO compares the responses).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from launch.tokenizer import HFTokenizer
from meshpar.errors import InputError

if TYPE_CHECKING:  # jinja2 is needed only where there are chats
    from launch.chat_template import ChatTemplate

KINDS = ("text", "prompt", "chat", "preference")


@dataclass(frozen=True)
class Fields:
    """What kind the records are, and the names of their fields."""

    kind: str
    text: str = "text"
    prompt: str = "prompt"
    response: str = "response"
    messages: str = "messages"
    chosen: str = "chosen"
    rejected: str = "rejected"

    def names(self) -> tuple[str, ...]:
        return {"text": (self.text,), "prompt": (self.prompt, self.response), "chat": (self.messages,),
                "preference": (self.prompt, self.chosen, self.rejected)}[self.kind]


def detect(record: dict, source: str, text: str | None = None, prompt: str | None = None,
           response: str | None = None, messages: str | None = None, chosen: str | None = None,
           rejected: str | None = None) -> Fields:
    """The kind of records like `record`: from the field names given, else from the usual names among its fields."""
    present = _fields(record)
    if chosen or rejected or {"chosen", "rejected"} <= present and not (text or response or messages):
        fields = Fields("preference", prompt=prompt or "prompt", chosen=chosen or "chosen",
                        rejected=rejected or "rejected")
    elif messages or "messages" in present and not (text or prompt or response):
        fields = Fields("chat", messages=messages or "messages")
    elif prompt or response or not text and {"prompt", "response"} <= present:
        fields = Fields("prompt", prompt=prompt or "prompt", response=response or "response")
    elif text or "text" in present:
        fields = Fields("text", text=text or "text")
    else:
        raise InputError(f"{source}: cannot tell what the records hold from the first one's keys "
                         f"{sorted(present)}: expected text, prompt and response, messages, or prompt, chosen and "
                         f"rejected; name the fields with --text-field, --prompt-field and --response-field, "
                         f"--messages-field, or --chosen-field and --rejected-field")
    check(record, fields, source, 0)
    return fields


def check(record: dict, fields: Fields, source: str, index: int) -> None:
    """Refuse a record without the fields of its kind, or with fields of the wrong type."""
    for name in fields.names():
        if record.get(name) is None:
            raise InputError(f"{source}: record {index} has no field {name!r} ({fields.kind} records); its fields: "
                             f"{sorted(_fields(record))}")
    conversational = fields.kind == "chat" or fields.kind == "preference" and not isinstance(record[fields.prompt], str)
    if conversational:
        for name in fields.names():
            messages = record[name]
            if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                                         for m in messages):
                raise InputError(f"{source}: record {index}: {name!r} must be a list of "
                                 f'{{"role": ..., "content": ...}}, got {str(messages)[:200]}')
    elif not all(isinstance(record[name], str) for name in fields.names()):
        raise InputError(f"{source}: record {index}: {', '.join(map(repr, fields.names()))} must be text, got "
                         f"{', '.join(type(record[name]).__name__ for name in fields.names())}")


def _fields(record: dict) -> set[str]:
    """The fields a record has: `datasets` gives every record the columns of all, null where it has none."""
    return {name for name, value in record.items() if value is not None}


@dataclass(frozen=True)
class Encoder:
    """Turns records of one kind into (ids, weights) documents."""

    tokenizer: HFTokenizer
    fields: Fields
    eos: int | None  # ends text and prompt/response documents
    train_on: str = "assistant"  # "assistant" (the response, or the assistant's turns) or "all"
    template: ChatTemplate | None = None  # for chat records

    def encode(self, records: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The (ids int64, weights uint8) of each record."""
        if self.fields.kind == "text":
            texts = [self._with_eos(ids) for ids in self.tokenizer.encode_batch([r[self.fields.text] for r in records])]
            return [(ids, np.ones(len(ids), np.uint8)) for ids in texts]
        if self.fields.kind == "prompt":
            return self._prompt_response(records)
        if self.fields.kind == "preference":
            return self._pairs(records)
        return self._chat(records)

    def _pairs(self, records: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each record's (prompt + chosen, prompt + rejected) documents in turn, the responses alone weighing 1."""
        f, sides = self.fields, (self.fields.chosen, self.fields.rejected)
        texts = [isinstance(r[f.prompt], str) for r in records]
        if any(texts) and not all(texts):
            raise InputError("preference records: some prompts are text and some chats; prepare them apart")
        responses_only = dataclasses.replace(self, train_on="assistant")
        if all(texts):
            pairs = [{"prompt": r[f.prompt], "response": r[side]} for r in records for side in sides]
            return dataclasses.replace(responses_only, fields=Fields("prompt"))._prompt_response(pairs)
        pairs = [{"messages": [*r[f.prompt], *r[side]], "prompt_turns": len(r[f.prompt])}
                 for r in records for side in sides]
        return dataclasses.replace(responses_only, fields=Fields("chat"))._chat(pairs)

    def _with_eos(self, ids: list[int]) -> np.ndarray:
        ends = self.eos is None or (ids and ids[-1] == self.eos)  # a tokenizer that ends every text with it
        return np.asarray(ids if ends else [*ids, self.eos], np.int64)

    def _prompt_response(self, records: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
        backend = self.tokenizer.backend
        prompts = self.tokenizer.encode_batch([r[self.fields.prompt] for r in records])
        responses = backend.encode_batch_fast([r[self.fields.response] for r in records], add_special_tokens=False)
        documents = []
        for prompt, response in zip(prompts, responses):
            answer = self._with_eos(response.ids)
            weights = np.concatenate([np.full(len(prompt), self.train_on == "all", np.uint8),
                                      np.ones(len(answer), np.uint8)])
            documents.append((np.concatenate([np.asarray(prompt, np.int64), answer]), weights))
        return documents

    def _chat(self, records: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Chats; a record's `prompt_turns` first messages are a preference pair's prompt, whose assistant
        turns weigh 0."""
        rendered = [self.template.assistant_spans(r[self.fields.messages]) for r in records]
        rendered = [(text, spans[_assistant_turns(r):]) for (text, spans), r in zip(rendered, records)]
        # The template writes the special tokens itself, as transformers' apply_chat_template(tokenize=True).
        encodings = self.tokenizer.backend.encode_batch([text for text, _ in rendered], add_special_tokens=False)
        documents = []
        for (_, spans), encoding in zip(rendered, encodings):
            starts = np.array([start for start, _ in encoding.offsets], np.int64)
            weights = np.full(len(starts), self.train_on == "all", np.uint8)
            for lo, hi in spans:
                weights[(starts >= lo) & (starts < hi)] = 1
            documents.append((np.asarray(encoding.ids, np.int64), weights))
        return documents


def _assistant_turns(record: dict) -> int:
    """How many assistant turns open a record without weighing: a preference pair's prompt's."""
    return sum(m["role"] == "assistant" for m in record.get("messages", [])[:record.get("prompt_turns", 0)])
