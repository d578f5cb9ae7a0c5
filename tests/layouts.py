"""A model on a mesh, for tests: the same weights and batches on any layout, and what it computes.

The initial state is made once per model and training config, on one device, and placed on each mesh by
its shardings (`train.init_state` makes the same values on every mesh: test_train holds that), so a layout
costs the compile of what it computes, not another compile of the initialisation. A config with LoRA
adapters (`train.lora_rank`) builds them on the frozen model, their B drawn non-zero, so that the first
step's gradients reach every adapter's A too."""

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshpar import compiler, lora, mesh as mesh_lib, pipeline, rules as rules_lib, sharding, train
from meshpar.data import stdlib_tokens
from models.transformer import Transformer, TransformerConfig

MODEL = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=128)
TRAIN = train.TrainConfig(steps=10, global_batch=16, seq_len=32, lr=3e-3, warmup_steps=2, remat="none")
CORPUS = stdlib_tokens(max_bytes=200_000)


def tokens(step: int, cfg: train.TrainConfig = TRAIN) -> np.ndarray:
    """Rows of real text (so that the loss can fall), the same for every layout."""
    starts = np.random.default_rng(step).integers(0, len(CORPUS) - cfg.seq_len - 1, cfg.global_batch)
    return np.stack([CORPUS[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int32)


@functools.cache
def initial_state(model: TransformerConfig, cfg: train.TrainConfig) -> nnx.State:
    """The initial state (model and optimizer) as host arrays, made by `train.init_state` on one device."""
    run = MeshRun("single", cfg, model, init_here=True)
    state = jax.tree.map(np.asarray, run.state)
    rng = np.random.default_rng(1)
    for path, variable in nnx.to_flat_state(state["model"]):
        if path[-1] == "b" and str(path[-2]).endswith(lora.SUFFIX):
            variable.set_value(rng.normal(0.0, 0.05, variable.shape).astype(np.float32))
    return state


class MeshRun:
    """One mesh ("single" is one device): the sharded state's structure, the initial state (`initial_state`
    placed on the mesh; with `init_here`, made there by `train.init_state`), the token sharding and the
    compiled functions."""

    def __init__(self, spec: str, cfg: train.TrainConfig = TRAIN, model: TransformerConfig = MODEL,
                 parallel: rules_lib.ParallelConfig = rules_lib.ParallelConfig(), init_here: bool = False):
        devices = jax.devices()[:1] if spec == "single" else None
        self.mesh = mesh_lib.build(mesh_lib.parse("" if spec == "single" else spec), devices)
        self.cfg, self.rules = cfg, rules_lib.make(parallel)
        self.make_model = cfg.frozen_base(Transformer.factory(model, cfg.dtype, cfg.lora))
        self.tx = train.optimizer(cfg)
        self.sharded = train.sharded_abstract(self.make_model, self.tx, self.mesh, self.rules, cfg.seed, cfg.reference)
        if init_here:
            self.state = train.init_state(self.make_model, self.tx, self.sharded, cfg.seed, reference=cfg.reference)
        else:
            placed = jax.device_put(initial_state(model, cfg), self.sharded.shardings)
            self.state = pipeline.to_rest(placed, self.mesh, parallel.pipeline_repeats)
        self.tokens_sharding = sharding.batch_sharding(self.mesh, self.rules, (cfg.global_batch, cfg.seq_len + 1))

    def batch(self, step: int) -> jax.Array:
        return jax.device_put(tokens(step, self.cfg), self.tokens_sharding)

    def loss_and_grads(self) -> tuple[float, nnx.State]:
        """The loss and gradients of the first batch, as host arrays (computed once: the state never changes)."""
        return self._loss_and_grads

    @functools.cached_property
    def _loss_and_grads(self) -> tuple[float, nnx.State]:
        loss, grads = train.loss_and_grads(self.sharded, self.tokens_sharding, self.cfg)(self.state, self.batch(0))
        return float(loss), jax.tree.map(np.asarray, grads)

    @functools.cached_property
    def compiled_step(self) -> tuple[Any, dict]:
        """The compiled training step and what the compiler says about it."""
        step = train.make_step(self.sharded, self.tokens_sharding, self.cfg)
        return compiler.compile_report(step, self.state, self.batch(0))

    @functools.cache
    def losses(self, steps: int) -> list[float]:
        """The losses of `steps` training steps from the initial state (run once per count)."""
        step = self.compiled_step[0]
        state, out = jax.tree.map(lambda x: x.copy(), self.state), []  # the step donates its input
        for i in range(steps):
            state, metrics = step(state, self.batch(i))
            out.append(float(metrics["loss"]))
        return out

    def report(self) -> dict:
        return self.compiled_step[1]

    def step_hlo(self) -> str:
        return self.compiled_step[0].as_text()


@functools.cache
def shared_run(spec: str = "single", cfg: train.TrainConfig = TRAIN, model: TransformerConfig = MODEL,
               parallel: rules_lib.ParallelConfig = rules_lib.ParallelConfig()) -> MeshRun:
    """One `MeshRun` per layout in a test process, shared by every test (of any file) that asks for it: a
    one-device reference or a common layout is traced and run once, its results kept."""
    return MeshRun(spec, cfg, model, parallel)


def max_relative_error(tree, reference) -> float:
    """The largest |a - b| over max |b| of any leaf: gradients compared leaf by leaf. A non-finite value in
    any leaf of either tree gives inf, so no comparison with a tolerance can pass on a NaN. The trees must
    have the same leaf paths and each leaf the same shape (else an AssertionError names the leaf):
    broadcasting would compare a wrongly shaped leaf with its reference and hide it."""
    leaves, reference_leaves = (jax.tree_util.tree_leaves_with_path(t) for t in (tree, reference))
    paths, reference_paths = ([jax.tree_util.keystr(path) for path, _ in ls] for ls in (leaves, reference_leaves))
    assert paths == reference_paths, (f"leaf paths differ: {' '.join(sorted(set(paths) - set(reference_paths)))} "
                                      f"here, {' '.join(sorted(set(reference_paths) - set(paths)))} in the reference")
    errors = []
    for path, (_, a), (_, b) in zip(paths, leaves, reference_leaves):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, f"leaf {path or '(root)'}: shape {a.shape} against the reference's {b.shape}"
        finite = np.all(np.isfinite(a)) and np.all(np.isfinite(b))
        errors.append(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)) if finite else np.inf)
    return max(errors)


def param_bytes(layout: MeshRun) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(layout.state["model"], nnx.Param)))
