"""Presets: one module per configuration, each with `config() -> Config`.

`load("tiny")` imports `configs/tiny.py` and returns its frozen `Config`.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable

from flax import nnx

from meshpar.checkpoint import CheckpointConfig
from meshpar.data import DataConfig
from meshpar.errors import InputError
from meshpar.mesh import MeshConfig
from meshpar.rules import ParallelConfig
from meshpar.train import TrainConfig
from models.transformer import Transformer, TransformerConfig


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    model: TransformerConfig
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig(fsdp=-1)  # FSDP over every device unless --mesh says otherwise
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()

    def model_factory(self) -> Callable[[nnx.Rngs], Transformer]:
        """`rngs → the model`, computing in `train.compute_dtype` (with LoRA adapters on a frozen base where
        `train.lora_rank` asks for them): what meshpar's training takes."""
        return self.train.frozen_base(Transformer.factory(self.model, self.train.dtype, self.train.lora))

    def __post_init__(self):
        if self.data.source in ("stdlib", "text") and self.model.vocab_size < 256:
            raise InputError(f"data.source = '{self.data.source}' gives byte tokens (0..255), but "
                             f"model.vocab_size = {self.model.vocab_size}")
        if self.train.seq_len > self.model.max_seq_len:
            raise InputError(f"train.seq_len = {self.train.seq_len} exceeds model.max_seq_len = "
                             f"{self.model.max_seq_len}")


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name: str) -> Config:
    if name not in names():
        raise InputError(f"unknown config '{name}'; presets: {', '.join(names())}")
    return importlib.import_module(f"configs.{name}").config()
