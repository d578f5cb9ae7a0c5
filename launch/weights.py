"""A model's config and parameters from a directory, laid out on a mesh: for generation, export and new runs.

Three kinds of directory hold them, and `load` reads any:
- a training checkpoint (`launch.train --checkpoint-dir`): the latest step's training state, of which the
  model's parameters are kept (the optimizer state is read too, since orbax restores the saved tree);
- a parameters directory (`meshpar.checkpoint.export_params`, `launch.convert from-hf`);
- a LoRA adapters directory (`launch.convert from-peft`).
All keep the run's config in their metadata; its `model` section rebuilds the model. A LoRA run's checkpoint
and an adapters directory hold the adapters alone (`meshpar.lora`); their base comes from the directory
their config names (`init_from`: the run's `--init-from`, the adapters' base), else, for a run that started
from random weights, from its seed; a training checkpoint's is checked against the fingerprint the run took of
it (`meshpar.frozen`), so that a base changed since is refused, not silently used.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from meshpar import checkpoint, frozen, lora, sharding, train
from meshpar.errors import InputError
from meshpar.rules import Rules
from models.transformer import Transformer, TransformerConfig


class Weights(NamedTuple):
    model: TransformerConfig
    params: nnx.State  # nnx.Params in layer order on the mesh; with `lora`, the base's and the adapters'
    lora: lora.LoraConfig | None  # the adapters' settings (None: a plain model, or adapters merged in)


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


def source(directory: str | Path) -> dict:
    """Where a directory's weights came from (`launch.convert from-hf`'s `source`: hf_dir, model_type), through
    the bases its adapters or its run began from; {} where none says."""
    config = saved_config(directory)[0]
    if "source" in config or not config.get("init_from"):
        return config.get("source", {})
    return source(config["init_from"])


def train_config(config: dict) -> train.TrainConfig:
    """The `train` section of a saved config (settings it lacks take their defaults)."""
    known = {f.name for f in dataclasses.fields(train.TrainConfig)}
    return train.TrainConfig(**{k: v for k, v in config.get("train", {}).items() if k in known})


def load(directory: str | Path, mesh: Mesh, rules: Rules, merge_lora: bool = False) -> Weights:
    """The model config and its parameters (float32) from `directory`, sharded on `mesh` by `rules`; with
    `merge_lora`, a LoRA model's adapters folded into its weights (`lora.merged`)."""
    config, whole_state = saved_config(directory)
    cfg, settings = TransformerConfig.from_dict(config["model"]), train_config(config)
    adapters, trained_over = settings.lora, {}
    if whole_state:
        params, trained_over = _restored_model(directory, cfg, settings, mesh, rules)
    else:
        abstract = Transformer.abstract(cfg, adapters)[1]
        abstract = abstract if adapters is None else lora.adapters(abstract)  # an adapters directory's
        params = checkpoint.load_params(directory, abstract, sharding.state_shardings(abstract, mesh, rules))
    if adapters is not None:  # the adapters alone were saved: the base is that of where the run began
        began = config.get("init_from")
        base = lora.base(load(began, mesh, rules).params) if began else _seeded_base(cfg, settings, mesh, rules)
        if trained_over:  # a training checkpoint's fingerprint of its base (an adapters directory has none)
            _check_base(base, trained_over, settings.frozen, directory,
                        f"{began} (init_from)" if began else f"made from train.seed = {settings.seed}")
        params = nnx.merge_state(base, params)
        if merge_lora:
            params, adapters = lora.merged(params, adapters), None
    return Weights(cfg, params, adapters)


def _check_base(base: nnx.State, trained_over: dict, dtype: jnp.dtype, directory: str | Path, whose: str) -> None:
    """Refuse a base other than the one a LoRA checkpoint was trained over: the fingerprint the run took of its
    frozen weights (`meshpar.frozen`; "model/…" paths, in `train.frozen_dtype`) against the base made again."""
    held = nnx.from_flat_state({path: v.replace(v[...].astype(dtype)) for path, v in nnx.to_flat_state(base)})
    frozen.check({path.removeprefix("model/"): sums for path, sums in trained_over.items()},
                 frozen.fingerprint(held), str(directory),
                 fix=f"its base, {whose}, is not the one it was trained over: put back those weights")


def _restored_model(directory: str | Path, cfg: TransformerConfig, settings: train.TrainConfig, mesh: Mesh,
                    rules: Rules) -> tuple[nnx.State, dict]:
    """(the model's saved parameters (a LoRA run's: its adapters), the fingerprint of the frozen weights it was
    trained over) of a training checkpoint."""
    make_model = settings.frozen_base(Transformer.factory(cfg, adapters=settings.lora))
    sharded = train.sharded_abstract(make_model, train.optimizer(settings), mesh, rules, reference=settings.reference)
    saved, _ = frozen.split(sharded.abstract)
    ckpt = checkpoint.Checkpointer(directory)
    try:
        state, meta = ckpt.restore(saved, frozen.split(sharded.shardings)[0])
    finally:
        ckpt.close()
    return nnx.state(state["model"], nnx.Param), meta.get("frozen", {})


def _seeded_base(cfg: TransformerConfig, settings: train.TrainConfig, mesh: Mesh, rules: Rules) -> nnx.State:
    """The frozen base a LoRA run that began from random weights had: its model made again from its seed."""
    make = settings.frozen_base(Transformer.factory(cfg, adapters=settings.lora))
    with nnx.use_eager_sharding(False):
        abstract = nnx.state(nnx.eval_shape(lambda: make(nnx.Rngs(settings.seed))), frozen.Frozen)
    shardings = sharding.state_shardings(abstract, mesh, rules)

    def create():
        with nnx.use_eager_sharding(False):
            return nnx.state(make(nnx.Rngs(settings.seed)), frozen.Frozen)

    return frozen.as_params(jax.jit(create, out_shardings=shardings)())
