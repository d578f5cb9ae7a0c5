"""A model's config and parameters from a directory, laid out on a mesh: for generation and export.

Two kinds of directory hold them, and `load` reads either:
- a training checkpoint (`launch.train --checkpoint-dir`): the latest step's whole training state, of
  which the parameters are kept (the optimizer state is read too, since orbax restores the saved tree);
- a parameters directory (`meshpar.checkpoint.export_params`, `launch.convert from-hf`).
Both keep the run's config in their metadata; its `model` section rebuilds the model.
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from meshpar import checkpoint, sharding, train
from meshpar.errors import InputError
from meshpar.rules import Rules
from models.transformer import Transformer, TransformerConfig


def saved_config(directory: str | Path) -> tuple[dict, bool]:
    """(the saved config, whether the directory holds a whole training state) of its latest step."""
    path = Path(directory).absolute()
    if not path.is_dir():
        raise InputError(f"checkpoint {path} is not a directory")
    with ocp.CheckpointManager(path) as manager:
        step = manager.latest_step()
        if step is None:
            raise InputError(f"{path} holds no checkpoint and no exported parameters")
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if "model" not in meta.get("config", {}):
        raise InputError(f"{path} step {step} does not say which model it holds (no config.model in its metadata)")
    return meta["config"], (path / str(step) / "state").is_dir()


def load(directory: str | Path, mesh: Mesh, rules: Rules) -> tuple[TransformerConfig, nnx.State]:
    """The model config and its parameters (float32) from `directory`, sharded on `mesh` by `rules`."""
    config, whole_state = saved_config(directory)
    cfg = TransformerConfig.from_dict(config["model"])
    if whole_state:
        sharded = train.sharded_abstract(Transformer.factory(cfg), train.optimizer(train.TrainConfig()), mesh, rules)
        ckpt = checkpoint.Checkpointer(directory)
        try:
            state, _ = ckpt.restore(sharded.abstract, sharded.shardings)
        finally:
            ckpt.close()
        return cfg, state["model"]
    _, abstract = Transformer.abstract(cfg)  # shapes and logical names only; the rules place them
    return cfg, checkpoint.load_params(directory, abstract, sharding.state_shardings(abstract, mesh, rules))
