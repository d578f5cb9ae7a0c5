"""Dotted overrides of nested frozen dataclasses: `apply(cfg, ["model.n_layers=4"])`.

Values are parsed by the type of the field they replace (int, float, bool, str; a JSON list for a tuple of
records, `model.layer_pattern='[{"window": 4096}, {}]'`), so a typo fails at once with the field's name and
the list of valid keys, not later inside a jitted step.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Iterable
from typing import Any

from meshpar.errors import InputError

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every settable dotted key of a (nested) dataclass."""
    out = []
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value):
            out += keys(value, f"{prefix}{field.name}.")
        else:
            out.append(f"{prefix}{field.name}")
    return out


def _parse(text: str, kind: type, key: str) -> Any:
    if kind is bool:
        if text.lower() not in _TRUE | _FALSE:
            raise InputError(f"--set {key}={text}: expected true or false")
        return text.lower() in _TRUE
    if kind in (int, float, str):
        try:
            return kind(text)
        except ValueError:
            raise InputError(f"--set {key}={text}: expected {kind.__name__}") from None
    record = typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else None
    if dataclasses.is_dataclass(record):  # a tuple of records (model.layer_pattern's LayerKinds)
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            items = None
        if not isinstance(items, list):
            raise InputError(f"--set {key}={text}: expected a JSON list of {record.__name__} fields, e.g. "
                             f"[{{\"window\": 4096}}, {{}}]")
        return tuple(_record(record, fields, f"{key}[{j}]") for j, fields in enumerate(items))
    raise InputError(f"--set {key}: fields of type {kind} cannot be set from the command line")


def _record(record: type, fields: Any, where: str) -> Any:
    """A record built from its JSON fields, each checked against the type its dataclass declares (a nested
    record from a JSON object), so `"window": "4"` fails here by name, not later in a comparison."""
    if not isinstance(fields, dict):
        raise InputError(f"--set {where} = {json.dumps(fields)}: expected a JSON object of {record.__name__} fields")
    hints = typing.get_type_hints(record)
    values = {}
    for name, value in fields.items():
        if name not in hints:
            raise InputError(f"--set {where}.{name}: {record.__name__} has no field '{name}'; its fields: "
                             f"{', '.join(hints)}")
        args = typing.get_args(hints[name])  # (T, None) for an optional field
        optional, kind = type(None) in args, next(k for k in args or (hints[name],) if k is not type(None))
        if value is None and optional:
            values[name] = None
        elif dataclasses.is_dataclass(kind):
            values[name] = _record(kind, value, f"{where}.{name}")
        elif _is(value, kind):
            values[name] = kind(value)
        else:
            raise InputError(f"--set {where}.{name} = {json.dumps(value)}: expected {kind.__name__}"
                             + (" or null" if optional else ""))
    return record(**values)


def _is(value: Any, kind: type) -> bool:
    """JSON's `value` fits a field of type `kind`: a float field takes a whole number too; true is no number."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def _replace(cfg: Any, changes: dict[str, Any]) -> Any:
    """Rebuild `cfg` once with all of its changes, so `__post_init__` sees them together."""
    hints = typing.get_type_hints(type(cfg))
    values = {}
    for name, change in changes.items():
        if isinstance(change, dict):
            values[name] = _replace(getattr(cfg, name), change)
        else:
            key, text = change
            values[name] = _parse(text, hints[name], key)
    return dataclasses.replace(cfg, **values)


def apply(cfg: Any, overrides: Iterable[str]) -> Any:
    """A copy of `cfg` with every `key=value` applied (a later one wins); validated once, at the end."""
    valid = keys(cfg)
    changes: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise InputError(f"--set '{item}': expected KEY=VALUE, e.g. model.n_layers=4")
        if key not in valid:
            raise InputError(f"--set: unknown key '{key}'; valid keys: {', '.join(valid)}")
        *sections, name = key.split(".")
        node = changes
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = (key, text.strip())
    return _replace(cfg, changes) if changes else cfg
