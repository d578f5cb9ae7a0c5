"""Text generation with a KV cache, on a mesh: the prompt in one pass, then one token per step.

The model provides `init_cache(batch, length)` (key and value caches [L, B, S, K, H], or any pytree of
them: one per kind of layer) and `decode(tokens [B, T], positions [T], k, v) -> (logits [B, T, V], k, v)`,
as meshpar's transformer does.
One jitted program runs the prompt (prefill), then a `lax.while_loop` of one new token per step, each step
attending over the cache and itself (`attention.cached_attention`): T·(S + T) scores per step instead of
recomputing the prefix. With a sliding window W the cache holds only the W − 1 latest positions, written as
a ring, so its memory and each step's work stay flat however long the text grows. With stop ids (a
tokenizer's EOS ids) a row is finished at its first stop id, and the loop ends early, on the device, once
every row is.

Sharding: the parameters keep the layout they have (FSDP gathers each layer's weights in compute, TP keeps
heads and the MLP split over `model`); the cache is split like attention's keys (rows over the batch
axes, kv heads over `model`). Rows are split over `data`/`fsdp`/`expert` when the batch divides over them,
else every device works on all rows (one prompt): a mixture of experts then computes on each device its own
experts' share of every row, summed over `expert` (`meshpar.moe.dispatch`). `sequence` and `stage` are
refused: a decode step has one position and no pipeline.

Sampling: greedy by default (temperature 0); else logits / temperature, restricted to the `top_k` most
likely tokens and to the smallest set whose probability reaches `top_p`, then drawn with a key from `seed`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

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
            raise InputError(f"generation runs on the data, fsdp, expert and model axes; this mesh has {axis} = "
                             f"{mesh.shape[axis]}")


def compute_context(mesh: Mesh, rules: Rules, batch: int) -> context.Compute:
    """How generation computes `batch` rows on `mesh` under `rules`: no remat, the dense kernel, the rows
    whole on every device when `batch` does not divide over the batch axes."""
    axes = rules.table("activations")["batch"]
    if batch % int(np.prod([mesh.shape[a] for a in axes])):
        activations = tuple((name, () if name == "batch" else a) for name, a in rules.activations)
        rules = dataclasses.replace(rules, activations=activations)
    return context.Compute(mesh, rules, "none", "dense")


@functools.lru_cache(maxsize=16)
def _program(graphdef: nnx.GraphDef, batch: int, prompt_len: int, new_tokens: int, sampling: Sampling,
             compute: context.Compute):
    def run(state: nnx.State, prompt_BT: jax.Array, key: jax.Array, stops: jax.Array) -> jax.Array:
        """The new tokens [B, new_tokens]; after early stopping, the columns no step reached hold 0."""
        with context.use(compute):
            model = nnx.merge(graphdef, state)
            k_LBSKH, v_LBSKH = model.init_cache(batch, prompt_len + new_tokens)
            logits_BTV, k_LBSKH, v_LBSKH = model.decode(prompt_BT, jnp.arange(prompt_len), k_LBSKH, v_LBSKH)
            key, first = jax.random.split(key)
            token_B = next_token(logits_BTV[:, -1], sampling, first)
            tokens_BT = jnp.zeros((batch, new_tokens), jnp.int32).at[:, 0].set(token_B)

            def going(carry):
                made, _, stopped_B, *_ = carry
                # Without stop ids the condition is the step count alone: a loop of known length for XLA.
                return made < new_tokens if stops.size == 0 else (made < new_tokens) & ~jnp.all(stopped_B)

            def step(carry):
                made, token_B, stopped_B, tokens_BT, k_LBSKH, v_LBSKH, key = carry
                position = prompt_len + made - 1  # of the last token made, which this step feeds in
                logits_B1V, k_LBSKH, v_LBSKH = model.decode(token_B[:, None], position[None], k_LBSKH, v_LBSKH)
                key, sub = jax.random.split(key)
                token_B = next_token(logits_B1V[:, 0], sampling, sub)
                stopped_B |= jnp.isin(token_B, stops)
                return made + 1, token_B, stopped_B, tokens_BT.at[:, made].set(token_B), k_LBSKH, v_LBSKH, key

            carry = (jnp.int32(1), token_B, jnp.isin(token_B, stops), tokens_BT, k_LBSKH, v_LBSKH, key)
            return jax.lax.while_loop(going, step, carry)[3]

    return jax.jit(run)


def generate(model: nnx.Module, prompt_BT: np.ndarray, new_tokens: int, mesh: Mesh, rules: Rules,
             sampling: Sampling = Sampling(), stop_ids: Sequence[int] = ()) -> np.ndarray | list[np.ndarray]:
    """`new_tokens` tokens [B, new_tokens] continuing each row of `prompt_BT` (int token ids, one length).

    With `stop_ids` (e.g. a tokenizer's EOS ids), a list of B rows instead: each row's tokens up to and
    including its first stop id, all `new_tokens` where it meets none; generation ends as soon as every row
    has stopped. The tokens are the same as without stop ids, cut.

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
    stops = np.asarray(stop_ids, np.int64)
    if stops.size and (stops.min() < 0 or stops.max() >= vocab):
        raise InputError(f"stop ids {list(stop_ids)} must be in [0, {vocab}) (the model's vocabulary)")
    _check_mesh(mesh)
    (B, T_prompt), S = prompt_BT.shape, prompt_BT.shape[1] + new_tokens
    if S > model.cfg.max_seq_len:
        raise InputError(f"prompt ({T_prompt}) + new tokens ({new_tokens}) = {S} exceeds the model's "
                         f"max_seq_len = {model.cfg.max_seq_len}")
    compute = compute_context(mesh, rules, B)
    graphdef, state = nnx.split(model)
    replicated = lambda ids: jax.device_put(ids.astype(np.int32), NamedSharding(mesh, P()))
    program = _program(graphdef, B, T_prompt, new_tokens, sampling, compute)
    tokens_BT = np.asarray(jax.device_get(program(state, replicated(prompt_BT), jax.random.key(sampling.seed),
                                                  replicated(stops))))
    if not stops.size:
        return tokens_BT
    hit_BT = np.isin(tokens_BT, stops)
    ends_B = np.where(hit_BT.any(axis=1), hit_BT.argmax(axis=1) + 1, new_tokens)
    return [row[:end] for row, end in zip(tokens_BT, ends_B)]
