"""A decoder-only Llama-style transformer in Flax NNX.

Token embedding, pre-norm blocks (RMSNorm → grouped-query causal attention with rotary positions →
RMSNorm → SwiGLU MLP), a final RMSNorm and an output head, tied to the embedding or not. The blocks are
stacked along a leading `layers` axis and run with `lax.scan`, so compile time does not grow with depth
and the pipeline can split that axis into stages. Its forward pass also comes in the parts the 1F1B
schedule takes (`embed`, `blocks`, `final_norm`, `output_head`: `meshpar.pipeline.one_f_one_b`).

The model names LOGICAL axes only (`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`, `layers`
for parameters; `batch`, `seq` for activations); meshpar's rules decide where they live. Parameters are
float32; `dtype` is the compute dtype, to which parameters are cast where they are used.

Shape letters: B batch, T sequence, D d_model, N query heads, K kv heads, H head dim, F d_ff, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar import layers
from meshpar.attention import attend, cached_attention
from meshpar.errors import InputError
from meshpar.loss import logits
from meshpar.sharding import constrain, gathered, project, relayout


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 8
    d_ff: int = 512
    max_seq_len: int = 1024
    tie_embeddings: bool = False
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise InputError(f"model.{name} = {getattr(self, name)} must be >= 1")
        if self.d_model % self.n_heads:
            raise InputError(f"model.d_model = {self.d_model} is not divisible by model.n_heads = {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise InputError(f"model.n_heads = {self.n_heads} is not divisible by "
                             f"model.n_kv_heads = {self.n_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise InputError(f"head dim d_model / n_heads = {self.head_dim} must be even for rotary positions")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# The residual stream: its sequence dimension is `resid_seq`, which Megatron SP splits over `model` too.
RESIDUAL = ("batch", "resid_seq", "embed")
# The input of attention and MLP: whole sequences (with Megatron SP this is where T is all-gathered).
REGION_INPUT = ("batch", "seq", "embed")
# A generation's key or value cache [B, S, K, H]: rows like the batch, kv heads like attention's.
CACHE = ("batch", None, "kv_heads", None)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], logical: tuple[str, ...], std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), out_sharding=logical)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: TransformerConfig, dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((cfg.d_model,), jnp.float32), out_sharding=("embed",))
        self.eps, self.dtype = cfg.norm_eps, dtype

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x_BTD = x_BTD.astype(jnp.float32)  # the statistics in float32 whatever the compute dtype
        # x·x, not x**2: the power's derivative 2x would be one more [B, T, D] kept for the backward pass
        normed_BTD = x_BTD * jax.lax.rsqrt(jnp.mean(x_BTD * x_BTD, axis=-1, keepdims=True) + self.eps)
        return (normed_BTD * gathered(self.scale, jnp.float32)).astype(self.dtype)


def rotary(x_BTNH: jax.Array, positions_T: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs (i, i + H/2) of each head by angles set by each token's global position."""
    H = x_BTNH.shape[3]
    inv_freq_h = theta ** (-jnp.arange(0, H // 2, dtype=jnp.float32) / (H // 2))
    angles_Th = positions_T.astype(jnp.float32)[:, None] * inv_freq_h[None, :]
    cos_T1h, sin_T1h = jnp.cos(angles_Th)[:, None, :], jnp.sin(angles_Th)[:, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos_T1h - x2 * sin_T1h, x2 * cos_T1h + x1 * sin_T1h], axis=-1)
    return rotated.astype(x_BTNH.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        std, out_std = D**-0.5, (N * H) ** -0.5 / math.sqrt(2 * cfg.n_layers)
        self.wq_DNH = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), std)
        self.wk_DKH = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.wv_DKH = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.wo_NHD = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), out_std)
        self.theta, self.dtype = cfg.rope_theta, dtype

    def __call__(self, x_BTD: jax.Array, positions_T: jax.Array) -> jax.Array:
        q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, positions_T)
        return self._output(attend(q_BTNH, k_BTKH, v_BTKH))

    def cached(self, x_BTD: jax.Array, positions_T: jax.Array, k_BSKH: jax.Array,
               v_BSKH: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention of T new positions (contiguous from positions_T[0]) over a KV cache of S positions:
        writes their keys and values into the cache and returns (output, k cache, v cache)."""
        q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, positions_T)
        k_BSKH = constrain(jax.lax.dynamic_update_slice_in_dim(k_BSKH, k_BTKH.astype(k_BSKH.dtype), positions_T[0], 1),
                           CACHE)
        v_BSKH = constrain(jax.lax.dynamic_update_slice_in_dim(v_BSKH, v_BTKH.astype(v_BSKH.dtype), positions_T[0], 1),
                           CACHE)
        return self._output(cached_attention(q_BTNH, k_BSKH, v_BSKH, positions_T)), k_BSKH, v_BSKH

    def _project(self, x_BTD: jax.Array, positions_T: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries and keys rotated to their positions, and values."""
        cast = lambda w: gathered(w, self.dtype)
        x_BTD = relayout(x_BTD, RESIDUAL, REGION_INPUT)
        q_BTNH, k_BTKH, v_BTKH = project(x_BTD, [cast(self.wq_DNH), cast(self.wk_DKH), cast(self.wv_DKH)],
                                         [("batch", "seq", "heads", None)] + [("batch", "seq", "kv_heads", None)] * 2)
        return rotary(q_BTNH, positions_T, self.theta), rotary(k_BTKH, positions_T, self.theta), v_BTKH

    def _output(self, out_BTNH: jax.Array) -> jax.Array:
        return jnp.einsum("btnh,nhd->btd", out_BTNH, gathered(self.wo_NHD, self.dtype))


class MLP(nnx.Module):
    """SwiGLU: down(silu(x · gate) ⊙ (x · up))."""

    def __init__(self, cfg: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_ff
        self.w_gate_DF = _param(rngs, (D, F), ("embed", "mlp"), D**-0.5)
        self.w_up_DF = _param(rngs, (D, F), ("embed", "mlp"), D**-0.5)
        self.w_down_FD = _param(rngs, (F, D), ("mlp", "embed"), F**-0.5 / math.sqrt(2 * cfg.n_layers))
        self.dtype = dtype

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        cast = lambda w: gathered(w, self.dtype)
        x_BTD = relayout(x_BTD, RESIDUAL, REGION_INPUT)
        gate_BTF, up_BTF = project(x_BTD, [cast(self.w_gate_DF), cast(self.w_up_DF)], [("batch", "seq", "mlp")] * 2)
        return (jax.nn.silu(gate_BTF) * up_BTF) @ cast(self.w_down_FD)


class Block(nnx.Module):
    def __init__(self, cfg: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x_BTD: jax.Array, positions_T: jax.Array) -> jax.Array:
        x_BTD = constrain(x_BTD + self.attn(self.attn_norm(x_BTD), positions_T), RESIDUAL)
        return constrain(x_BTD + self.mlp(self.mlp_norm(x_BTD)), RESIDUAL)

    def cached(self, x_BTD: jax.Array, positions_T: jax.Array, k_BSKH: jax.Array,
               v_BSKH: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        attn_BTD, k_BSKH, v_BSKH = self.attn.cached(self.attn_norm(x_BTD), positions_T, k_BSKH, v_BSKH)
        x_BTD = constrain(x_BTD + attn_BTD, RESIDUAL)
        return constrain(x_BTD + self.mlp(self.mlp_norm(x_BTD)), RESIDUAL), k_BSKH, v_BSKH


class Transformer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, dtype
        self.embed_VD = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1.0)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, dtype, rngs)

        self.blocks = stacked_blocks(rngs)
        self.final_norm = RMSNorm(cfg, dtype)
        if not cfg.tie_embeddings:
            self.head_DV = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.d_model**-0.5)

    @classmethod
    def factory(cls, cfg: TransformerConfig, dtype: jnp.dtype = jnp.float32) -> Callable[[nnx.Rngs], Transformer]:
        """`rngs → Transformer(cfg)` computing in `dtype`: the model factory meshpar's training takes."""
        return lambda rngs: cls(cfg, dtype=dtype, rngs=rngs)

    @classmethod
    def abstract(cls, cfg: TransformerConfig) -> tuple[nnx.GraphDef, nnx.State]:
        """The model's structure and its parameters as shapes with logical axes; nothing is allocated."""
        with nnx.use_eager_sharding(False):  # meshpar, not Flax, resolves logical names
            return nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))), nnx.Param)

    def __call__(self, tokens_BT: jax.Array, positions_T: jax.Array | None = None) -> jax.Array:
        """Logits `[B, T, V]` in float32 for int tokens `[B, T]` at global `positions_T` (default 0..T-1;
        a load-balanced context-parallel step passes the tokens and their positions reordered)."""
        return logits(self.hidden_states(tokens_BT, positions_T), self.output_head())

    def hidden_states(self, tokens_BT: jax.Array, positions_T: jax.Array | None = None) -> jax.Array:
        """The final norm's output `[B, T, D]`, which the output head turns into logits."""
        if positions_T is None:
            positions_T = jnp.arange(tokens_BT.shape[1])
        return self.final_norm(layers.scan(self.blocks, self.embed(tokens_BT), positions_T))

    def embed(self, tokens_BT: jax.Array) -> jax.Array:
        """The token embeddings `[B, T, D]`: the residual stream entering the first block."""
        return constrain(gathered(self.embed_VD, self.dtype, lookup=True)[tokens_BT], RESIDUAL)

    def init_cache(self, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
        """Empty key and value caches [L, B, S, K, H] of `length` positions, in the compute dtype."""
        cfg = self.cfg
        zeros = jnp.zeros((cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim), self.dtype)
        return constrain(zeros, ("layers", *CACHE)), constrain(zeros, ("layers", *CACHE))

    def decode(self, tokens_BT: jax.Array, positions_T: jax.Array, k_LBSKH: jax.Array,
               v_LBSKH: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Logits [B, T, V] of T new tokens at positions (contiguous), attending over the KV caches and
        everything before them; returns the caches with the new positions written in."""
        x_BTD = self.embed(tokens_BT)
        graphdef, stacked = nnx.split(self.blocks)

        def one_layer(x_BTD, layer):
            block, k_BSKH, v_BSKH = layer
            x_BTD, k_BSKH, v_BSKH = nnx.merge(graphdef, block).cached(x_BTD, positions_T, k_BSKH, v_BSKH)
            return x_BTD, (k_BSKH, v_BSKH)

        x_BTD, (k_LBSKH, v_LBSKH) = jax.lax.scan(one_layer, x_BTD, (stacked, k_LBSKH, v_LBSKH))
        return logits(self.final_norm(x_BTD), self.output_head()), k_LBSKH, v_LBSKH

    def output_head(self) -> jax.Array:
        """The output projection `[D, V]` as compute uses it (cast; gathered over `fsdp`, vocab split).
        meshpar's loss multiplies chunks of the hidden states by it, so the whole logits never exist."""
        if self.cfg.tie_embeddings:
            return gathered(self.embed_VD, self.dtype).T
        return gathered(self.head_DV, self.dtype)
