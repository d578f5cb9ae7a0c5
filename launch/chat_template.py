"""A model's chat template, rendered as transformers renders it, and where the assistant's turns are in it.

The template is tokenizer_config.json's `chat_template` (a string, or a list of {"name", "template"} of which
"default" is taken), else a `chat_template.jinja` beside it. It is rendered with jinja2 in a sandbox with
`trim_blocks` and `lstrip_blocks`, given `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
`raise_exception`, `strftime_now` (today's date: Llama 3.2's and 3.3's system header) and a `tojson` filter that
keeps non-ASCII text, as `tokenizer.apply_chat_template` does.

An assistant turn is found by rendering prefixes of the conversation: it starts where the conversation before
it, rendered with the generation prompt, ends, and it ends where the conversation up to and including it,
rendered, ends. Both must be prefixes of the whole rendering; a template that renders earlier turns
differently once later ones follow is refused.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from launch.tokenizer import HFTokenizer
from meshpar.errors import InputError


class ChatTemplate:
    """A compiled chat template and the special tokens it is given."""

    def __init__(self, source: str, origin: str, bos_token: str | None, eos_token: str | None):
        self.origin, self.bos_token, self.eos_token = origin, bos_token, eos_token
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False,
                                                                              indent=indent)
        environment.globals["raise_exception"] = self._raise
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        try:
            self.template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise InputError(f"{origin}: the chat template does not parse (line {err.lineno}: {err.message})") from None

    def _raise(self, message: str):
        raise InputError(f"{self.origin}: the chat template refuses the conversation: {message}")

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as err:
            raise InputError(f"{self.origin}: the chat template fails on a conversation ({err})") from None

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the character span [start, end) of each assistant turn in it)."""
        text, spans = self.render(messages), []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[:i + 1])
            if not (text.startswith(before) and text.startswith(through)):
                raise InputError(f"{self.origin}: the chat template renders the conversation up to message {i} "
                                 f"differently from its start when later messages follow, so the assistant's "
                                 f"turns cannot be found; use --train-on all")
            spans.append((len(before), len(through)))
        return text, spans


def load(tokenizer: HFTokenizer, tokenizer_path: str) -> ChatTemplate:
    """The chat template beside `tokenizer_path` (tokenizer_config.json's, else chat_template.jinja's)."""
    config_file = Path(tokenizer_path).with_name("tokenizer_config.json")
    jinja_file = Path(tokenizer_path).with_name("chat_template.jinja")
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    origin = str(config_file)
    if source is None and jinja_file.is_file():
        source, origin = jinja_file.read_text(), str(jinja_file)
    if not isinstance(source, str):
        raise InputError(f"{config_file}: no chat_template (and no {jinja_file.name} beside it), so chat records "
                         f"cannot be rendered; use a model's instruct tokenizer")
    token = lambda token_id: None if token_id is None else tokenizer.backend.id_to_token(token_id)
    return ChatTemplate(source, origin, token(tokenizer.bos_id), token(tokenizer.eos_id))
