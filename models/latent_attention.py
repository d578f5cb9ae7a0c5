"""Multi-head latent attention (MLA: DeepSeek-V2, V3, Kimi K2), the attention of a `TransformerConfig` with
`kv_lora_rank` > 0.

Keys and values come from one shared low-rank latent per token: c = RMSNorm(x · W_kv_a[:, :C]) [C], from
which every head's key part and value [k_nope Hn, v Hv] = c · W_kv_b are expanded. Positions enter through a
rotary key k_rope = rope(x · W_kv_a[:, C:]) [Hr] that all heads share (W_kv_a [D, C + Hr] and W_kv_b
[C, N, Hn + Hv] are Hugging Face's `kv_a_proj_with_mqa` and `kv_b_proj`, one matmul each). A head's query is
[q_nope Hn, rope(q_rope) Hr], from x directly (`q_lora_rank` = 0) or through a low-rank query latent
(x · W_q_a [R], normed, then · W_q_b). Scores are q·k / √(Hn + Hr) (× YaRN's mscale² through
`query_scale`, as the config asks).

Rotary pairs. DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), … of the rope dims;
meshpar rotates halves (i, i + Hr/2). The rope dims only meet in q·k, so the Hugging Face import permutes
the rope columns of W_q(_b) and W_kv_a (evens, then odds) and the two layouts give the same scores
(`models.hf.families`).

Training runs the expanded form: k [N, Hn + Hr] and v [N, Hv] per token, through `meshpar.attention.attend`
(every kernel and context-parallel schedule; v is padded with zeros to the key width there and cut back
after, as the kernels take one head width). Under tensor parallelism the heads split over `model` (W_q(_b),
W_kv_b, W_o) and the latents, small, are computed whole on every device; at rest the latent dims split
over `fsdp` like `embed` (the logical axis `latent`).

LoRA (`meshpar.lora`): q adapts the query's projection(s), k and v together both kv projections (each feeds
the keys and the values), o the output's; q_a, q_b, kv_a, kv_b one projection each. An adapter's update is
added to its projection's output (before the latents' norms), and the absorbed decoding takes W_kv_b with
its update merged in.

Generation caches the latent and the rotary key per token, C + Hr values, not N heads × (Hn + Hr + Hv), and
decodes with the up-projections absorbed: the query's nope part is taken into the latent space
(q_nope · W_kᵀ [N, C], W_k the key part of W_kv_b), attends over the cached [c, k_rope] as a single key
head (scores unchanged: q_nope · (c · W_k) = (q_nope · W_kᵀ) · c), and the latent mix of values is expanded by
the value part W_v once per query. The caches are [L, B, S, 1, C] (the latents, in the model's "k" cache) and
[L, B, S, 1, Hr] ("v").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar import fp8, lora
from meshpar.attention import attend, cached_attention
from meshpar.errors import InputError
from meshpar.sharding import constrain, gathered, project, relayout
from models import rope
from models import transformer as base

# A latent per token [B, T, C]: rows like the batch, the latent whole.
LATENT = ("batch", "seq", None)
# The latent caches [L, B, S, 1, C or Hr]: rows like the batch.
LATENT_CACHE = ("layers", "batch", None, None, None)
# The LoRA targets that name each weight (`meshpar.lora`): k stands for k and v, which go together here
TARGETS = {"wq_DNH": "q", "wq_a_DR": ("q", "q_a"), "wq_b_RNH": ("q", "q_b"), "wkv_a_DA": ("k", "kv_a"),
           "wkv_b_CNH": ("k", "kv_b"), "wo_NHD": "o"}


class LatentAttention(nnx.Module):
    """MLA (module docstring). Parameters: the query's `wq_DNH` or `wq_a_DR`, `q_norm`, `wq_b_RNH`; the
    latent's and the rotary key's `wkv_a_DA` (A = C + Hr), `kv_norm`; the keys' and values' `wkv_b_CNH`
    (H = Hn + Hv); `wo_NHD`."""

    def __init__(self, cfg: base.TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs,
                 kind: base.LayerKind | None = None, adapters: lora.LoraConfig | None = None):
        kind = kind or cfg.kinds[0]
        D, N, C, R = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.q_lora_rank
        Hq, Hr, Hv = cfg.head_size, cfg.qk_rope_head_dim, cfg.v_head_dim
        param = base.param
        if R:
            self.wq_a_DR = param(rngs, (D, R), ("embed", None), D**-0.5)
            self.q_norm = base.RMSNorm(cfg, dtype, axis=None, size=R)
            self.wq_b_RNH = param(rngs, (R, N, Hq), ("latent", "heads", "head_dim"), R**-0.5)
        else:
            self.wq_DNH = param(rngs, (D, N, Hq), ("embed", "heads", "head_dim"), D**-0.5)
        self.wkv_a_DA = param(rngs, (D, C + Hr), ("embed", None), D**-0.5)
        self.kv_norm = base.RMSNorm(cfg, dtype, axis=None, size=C)
        # its last axis holds two widths, a key's part and a value, so it names no `head_dim`: the planner reads a
        # head's widths from the query and output weights
        self.wkv_b_CNH = param(rngs, (C, N, cfg.qk_nope_head_dim + Hv), ("latent", "heads", None), C**-0.5)
        out_std = (N * Hv) ** -0.5 / math.sqrt(2 * cfg.n_layers)
        self.wo_NHD = param(rngs, (N, Hv, D), ("heads", "head_dim", "embed"), out_std)
        for weight, target in TARGETS.items():
            if hasattr(self, weight):
                lora.attach(self, weight, target, adapters, rngs, inputs=2 if weight == "wo_NHD" else 1)
        self.cfg, self.dtype = cfg, dtype
        self.window = kind.window or None
        self.rope = (kind.rope_theta or cfg.rope_theta, kind.rope_scaling or cfg.rope_scaling)

    def __call__(self, x_BTD: jax.Array, positions: jax.Array, segments_BT: jax.Array | None = None) -> jax.Array:
        x_BTD = relayout(x_BTD, base.RESIDUAL, base.REGION_INPUT)
        q_nope_BTNH, q_rope_BTNH = self._queries(x_BTD, positions)
        c_BTC, k_rope_BTH = self._latents(x_BTD, positions)
        kv_BTNH = lora.add(self, "wkv_b_CNH", c_BTC, project_latent(c_BTC, self._weight(self.wkv_b_CNH)))
        k_nope_BTNH, v_BTNH = jnp.split(kv_BTNH, [self.cfg.qk_nope_head_dim], axis=-1)
        N, Hv, Hq = self.cfg.n_heads, self.cfg.v_head_dim, self.cfg.head_size
        k_rope_BTNH = jnp.broadcast_to(k_rope_BTH[:, :, None], (*k_rope_BTH.shape[:2], N, k_rope_BTH.shape[-1]))
        heads = ("batch", "seq", "heads", None)
        q_BTNH = constrain(jnp.concatenate([q_nope_BTNH, q_rope_BTNH], -1), heads)
        k_BTNH = constrain(jnp.concatenate([k_nope_BTNH, k_rope_BTNH], -1), heads)
        v_BTNH = constrain(jnp.pad(v_BTNH, ((0, 0),) * 3 + ((0, Hq - Hv),)), heads)  # the kernels take one width
        out_BTNH = attend(q_BTNH, k_BTNH, v_BTNH, window=self.window, segments_BT=segments_BT)
        return self._output(out_BTNH[..., :Hv])

    def cached(self, x_BTD: jax.Array, positions_T: jax.Array, c_BS1C: jax.Array,
               k_rope_BS1H: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention of T new positions over themselves and the latent caches of S slots (slot p holds
        position p; no window), absorbed (module docstring); returns (output, latent cache, rotary key cache)
        with the new positions written in."""
        if self.window:
            raise InputError("generation with latent attention and a sliding window is not supported "
                             "(model.kv_lora_rank with a LayerKind.window)")
        x_BTD = relayout(x_BTD, base.RESIDUAL, base.REGION_INPUT)
        q_nope_BTNH, q_rope_BTNH = self._queries(x_BTD, positions_T)
        c_BTC, k_rope_BTH = self._latents(x_BTD, positions_T)
        C, S = c_BS1C.shape[-1], c_BS1C.shape[1]
        wk_CNH, wv_CNH = jnp.split(lora.weight(self, "wkv_b_CNH", self.dtype), [self.cfg.qk_nope_head_dim], axis=-1)
        q_lat_BTNC = jnp.einsum("btnh,cnh->btnc", q_nope_BTNH, wk_CNH,
                                preferred_element_type=jnp.float32).astype(self.dtype)
        # The kernel divides by √(C + Hr); the scores must be over √(Hn + Hr), the training form's.
        q_BTNL = jnp.concatenate([q_lat_BTNC, q_rope_BTNH], -1) * jnp.asarray(
            math.sqrt((C + q_rope_BTNH.shape[-1]) / self.cfg.head_size), self.dtype)
        c_BS1C = c_BS1C.at[:, positions_T].set(c_BTC[:, :, None].astype(c_BS1C.dtype))
        k_rope_BS1H = k_rope_BS1H.at[:, positions_T].set(k_rope_BTH[:, :, None].astype(k_rope_BS1H.dtype))
        keys_BS1L = jnp.concatenate([c_BS1C, k_rope_BS1H], -1)
        slot_pos_S = jnp.where(jnp.arange(S) <= positions_T[-1], jnp.arange(S), jnp.iinfo(jnp.int32).max)
        # the values are the latents: the keys' first C dims, the rest of the output dropped
        out_BTNL = cached_attention(q_BTNL, keys_BS1L, keys_BS1L, positions_T, slot_pos_S)
        out_BTNH = jnp.einsum("btnc,cnh->btnh", out_BTNL[..., :C], wv_CNH,
                              preferred_element_type=jnp.float32).astype(self.dtype)
        cache = lambda x: constrain(x, LATENT_CACHE[1:])
        return self._output(out_BTNH), cache(c_BS1C), cache(k_rope_BS1H)

    def _weight(self, w: nnx.Param) -> jax.Array:
        return gathered(w, self.dtype, matmul=True)

    def _queries(self, x_BTD: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each head's query, split: (the nope part [B, T, N, Hn], the rotated part [B, T, N, Hr]), scaled
        as `query_scale` asks."""
        cfg, heads = self.cfg, [("batch", "seq", "heads", None)]
        if cfg.q_lora_rank:
            q_BTR = lora.add(self, "wq_a_DR", x_BTD, fp8.matmul(x_BTD, self._weight(self.wq_a_DR)))
            q_BTR = self.q_norm(constrain(q_BTR, LATENT))
            q_BTNH = lora.add(self, "wq_b_RNH", q_BTR, project_latent(q_BTR, self._weight(self.wq_b_RNH)))
        else:
            q_BTNH, = project(x_BTD, [self._weight(self.wq_DNH)], heads)
            q_BTNH = lora.add(self, "wq_DNH", x_BTD, q_BTNH)
        if cfg.query_scale and cfg.query_scale != cfg.head_size:  # the kernels divide by √H
            q_BTNH = q_BTNH * jnp.asarray(math.sqrt(cfg.head_size / cfg.query_scale), q_BTNH.dtype)
        q_nope_BTNH, q_rope_BTNH = jnp.split(q_BTNH, [cfg.qk_nope_head_dim], axis=-1)
        return q_nope_BTNH, rope.rotate(q_rope_BTNH, positions, *self.rope)

    def _latents(self, x_BTD: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The normed kv latent [B, T, C] and the rotated shared key [B, T, Hr]."""
        a_BTA = lora.add(self, "wkv_a_DA", x_BTD, fp8.matmul(x_BTD, self._weight(self.wkv_a_DA)))
        a_BTA = constrain(a_BTA, LATENT)
        c_BTC, k_rope_BTH = jnp.split(a_BTA, [self.cfg.kv_lora_rank], axis=-1)
        return self.kv_norm(c_BTC), rope.rotate(k_rope_BTH[:, :, None], positions, *self.rope)[:, :, 0]

    def _output(self, out_BTNH: jax.Array) -> jax.Array:
        return lora.add(self, "wo_NHD", out_BTNH, fp8.matmul(out_BTNH, self._weight(self.wo_NHD), contract=2))


def project_latent(c_BTC: jax.Array, w_CNH: jax.Array) -> jax.Array:
    """A latent expanded to heads: [B, T, C] · [C, N, H] → [B, T, N, H], split over heads as attention is."""
    return constrain(fp8.matmul(c_BTC, w_CNH), ("batch", "seq", "heads", None))


def check_adapters(cfg: base.TransformerConfig, adapters: lora.LoraConfig | None) -> None:
    """LoRA's targets name projections `cfg`'s attention has: q_a, q_b, kv_a, kv_b only latent attention's (q_a,
    q_b with a query latent), and there k and v together (module docstring)."""
    if adapters is None:
        return
    named, culprit = set(adapters.targets), f"train.lora_targets = '{','.join(adapters.targets)}'"
    if not cfg.kv_lora_rank and (latent := [t for t in lora.LATENT if t in named]):
        raise InputError(f"{culprit}: {latent[0]} is a projection of latent attention, which this model does not "
                         f"have (model.kv_lora_rank = 0); its attention's targets are q, k, v, o")
    if cfg.kv_lora_rank and not cfg.q_lora_rank and (query := [t for t in ("q_a", "q_b") if t in named]):
        raise InputError(f"{culprit}: {query[0]} needs a query latent (model.q_lora_rank = 0); this latent "
                         f"attention's query is one projection: target q")
    if cfg.kv_lora_rank and len(named & {"k", "v"}) == 1:
        raise InputError(f"{culprit}: latent attention's two kv projections each feed both keys and values: name "
                         f"k and v together (or kv_a, kv_b, one projection each)")


def check(cfg: base.TransformerConfig) -> None:
    """The latent attention fields of `cfg` (with `kv_lora_rank` > 0) make sense together."""
    for name in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(cfg, name) < (0 if name == "q_lora_rank" else 1):
            raise InputError(f"model.{name} = {getattr(cfg, name)} must be >= {0 if name == 'q_lora_rank' else 1} "
                             f"with latent attention (model.kv_lora_rank = {cfg.kv_lora_rank})")
    if cfg.qk_rope_head_dim % 2:
        raise InputError(f"model.qk_rope_head_dim = {cfg.qk_rope_head_dim} must be even for rotary positions")
    if cfg.n_kv_heads != cfg.n_heads:
        raise InputError(f"latent attention gives every head its own key and value: model.n_kv_heads = "
                         f"{cfg.n_kv_heads} must equal model.n_heads = {cfg.n_heads}")
    if cfg.v_head_dim > cfg.head_size:
        raise InputError(f"model.v_head_dim = {cfg.v_head_dim} must be <= the key width qk_nope_head_dim + "
                         f"qk_rope_head_dim = {cfg.head_size}")
    for name in ("head_dim", "qkv_bias", "o_bias", "attn_sinks", "qk_norm", "attn_softcap", "rotary_dims"):
        if getattr(cfg, name):
            raise InputError(f"model.{name} = {getattr(cfg, name)} does not apply to latent attention "
                             f"(model.kv_lora_rank = {cfg.kv_lora_rank}): leave it unset")
