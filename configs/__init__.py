"""Presets: one module per configuration, each with `config() -> Config`.

`load("tiny")` imports `configs/tiny.py` and returns its frozen `Config`.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from meshpar.data import DataConfig
from meshpar.mesh import MeshConfig
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    model: TransformerConfig
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    data: DataConfig = DataConfig()


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name: str) -> Config:
    if name not in names():
        raise ValueError(f"unknown config '{name}'; presets: {', '.join(names())}")
    return importlib.import_module(f"configs.{name}").config()
