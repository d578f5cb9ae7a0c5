"""Text generation with a KV cache, on a mesh: the prompt in one pass, then one token per step.

The model provides `init_cache(batch, length)` (key and value caches [L, B, S, K, H]) and
`decode(tokens [B, T], positions [T], k, v) -> (logits [B, T, V], k, v)`, as meshpar's transformer does.
One jitted program runs the prompt (prefill), then a `lax.scan` over the new tokens, each step attending
over the cache (`attention.cached_attention`): T·S scores per step instead of recomputing the prefix.

Sharding: the parameters keep the layout they have (FSDP gathers each layer's weights in compute, TP keeps
heads and the MLP split over `model`); the cache is split like attention's keys (rows over the batch
axes, kv heads over `model`). Rows are split over `data`/`fsdp` when the batch divides over them, else
every device works on all rows (one prompt). `sequence` and `stage` are refused: a decode step has one
position and no pipeline.

Sampling: greedy by default (temperature 0); else logits / temperature, restricted to the `top_k` most
likely tokens and to the smallest set whose probability reaches `top_p`, then drawn with a key from `seed`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar import context
from meshpar.errors import InputError
from meshpar.rules import Rules


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (the most likely token)
    top_k: int = 0  # keep the k most likely tokens; 0: all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p; 1: all
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise InputError(f"temperature {self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise InputError(f"top-k {self.top_k} must be >= 0 (0: no limit)")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top-p {self.top_p} must be in (0, 1]")


def next_token(logits_BV: jax.Array, sampling: Sampling, key: jax.Array) -> jax.Array:
    """The next token of each row [B] from its logits."""
    if sampling.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV.astype(jnp.float32) / sampling.temperature
    if sampling.top_k:
        kth_B1 = jax.lax.top_k(logits_BV, min(sampling.top_k, logits_BV.shape[-1]))[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if sampling.top_p < 1:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        before_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1) - jax.nn.softmax(sorted_BV, axis=-1)
        # The smallest logit still kept: the last whose preceding mass is below p (the most likely always).
        cutoff_B1 = jnp.min(jnp.where(before_BV < sampling.top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def _check_mesh(mesh: Mesh) -> None:
    for axis in ("sequence", "stage"):
        if mesh.shape.get(axis, 1) > 1:
            raise InputError(f"generation runs on the data, fsdp and model axes; this mesh has {axis} = "
                             f"{mesh.shape[axis]}")


def _rules_for_batch(rules: Rules, mesh: Mesh, batch: int) -> Rules:
    """`rules`, with the rows whole on every device when `batch` does not divide over the batch axes."""
    axes = rules.table("activations")["batch"]
    if batch % int(np.prod([mesh.shape[a] for a in axes])) == 0:
        return rules
    activations = tuple((name, () if name == "batch" else a) for name, a in rules.activations)
    return dataclasses.replace(rules, activations=activations)


@functools.lru_cache(maxsize=16)
def _program(graphdef: nnx.GraphDef, batch: int, prompt_len: int, new_tokens: int, sampling: Sampling,
             compute: context.Compute):
    def run(state: nnx.State, prompt_BT: jax.Array, key: jax.Array) -> jax.Array:
        with context.use(compute):
            model = nnx.merge(graphdef, state)
            k_LBSKH, v_LBSKH = model.init_cache(batch, prompt_len + new_tokens)
            logits_BTV, k_LBSKH, v_LBSKH = model.decode(prompt_BT, jnp.arange(prompt_len), k_LBSKH, v_LBSKH)
            key, first = jax.random.split(key)
            token_B = next_token(logits_BTV[:, -1], sampling, first)

            def step(carry, position):
                token_B, k_LBSKH, v_LBSKH, key = carry
                logits_B1V, k_LBSKH, v_LBSKH = model.decode(token_B[:, None], position[None], k_LBSKH, v_LBSKH)
                key, sub = jax.random.split(key)
                return (next_token(logits_B1V[:, 0], sampling, sub), k_LBSKH, v_LBSKH, key), token_B

            positions = jnp.arange(prompt_len, prompt_len + new_tokens - 1)
            (last_B, *_), tokens_TB = jax.lax.scan(step, (token_B, k_LBSKH, v_LBSKH, key), positions)
            return jnp.concatenate([tokens_TB.T, last_B[:, None]], axis=1)

    return jax.jit(run)


def generate(model: nnx.Module, prompt_BT: np.ndarray, new_tokens: int, mesh: Mesh, rules: Rules,
             sampling: Sampling = Sampling()) -> np.ndarray:
    """`new_tokens` tokens [B, new_tokens] continuing each row of `prompt_BT` (int token ids, one length).

    `model`'s parameters may live on `mesh` in any layout (a training state's, or `launch.weights.load`'s).
    """
    prompt_BT = np.asarray(prompt_BT)
    if prompt_BT.ndim != 2 or prompt_BT.shape[1] == 0:
        raise InputError(f"the prompt must be token ids [batch, length >= 1]; got shape {prompt_BT.shape}")
    if new_tokens < 1:
        raise InputError(f"the number of new tokens ({new_tokens}) must be >= 1")
    vocab = model.cfg.vocab_size
    if prompt_BT.min() < 0 or prompt_BT.max() >= vocab:
        raise InputError(f"prompt token ids must be in [0, {vocab}) (the model's vocabulary); got "
                         f"{prompt_BT.min()}..{prompt_BT.max()}")
    _check_mesh(mesh)
    (B, T_prompt), S = prompt_BT.shape, prompt_BT.shape[1] + new_tokens
    if S > model.cfg.max_seq_len:
        raise InputError(f"prompt ({T_prompt}) + new tokens ({new_tokens}) = {S} exceeds the model's "
                         f"max_seq_len = {model.cfg.max_seq_len}")
    compute = context.Compute(mesh, _rules_for_batch(rules, mesh, B), "none", "dense")
    graphdef, state = nnx.split(model)
    prompt = jax.device_put(prompt_BT.astype(np.int32), NamedSharding(mesh, P()))
    tokens = _program(graphdef, B, T_prompt, new_tokens, sampling, compute)(state, prompt, jax.random.key(sampling.seed))
    return np.asarray(jax.device_get(tokens))
