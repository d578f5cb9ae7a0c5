"""A decoder-only Llama-style transformer in Flax NNX.

Token embedding, pre-norm blocks (RMSNorm → grouped-query causal attention with rotary positions →
RMSNorm → SwiGLU MLP), a final RMSNorm and an output head, tied to the embedding or not. The options of
the open families are config fields, not other models: biases on q, k and v (Qwen 2), an RMSNorm of each
query and key head before the rotation (Qwen 3), a head dim of its own (Qwen 3), scaled rotary positions
(Llama 3.1: `models/rope.py`), tied embeddings, each family's RoPE base and norm epsilon, Gemma's layer (GeGLU,
RMSNorms scaled by 1 + w around both sublayers, embeddings × √D, its query scalar, Gemma 2's soft-capped
attention scores and logits), gpt-oss's (biases on q, k, v and o, a sink logit per head in every softmax,
a router and experts with biases, the clamped SwiGLU), and a mixture of
experts in place of every MLP (Mixtral, Qwen3-MoE: `MoE`, routed by `meshpar.moe`), with shared experts every
token passes, their output gated per token or not (Qwen2-MoE, DeepSeek). The blocks are
stacked along a leading `layers` axis and run with `lax.scan`, so compile time does not grow with depth
and the pipeline can split that axis into stages. Layers that differ (per-layer windows, rotary bases,
dense layers among experts: `layer_pattern`) stack as periods of the pattern (`Period`), so each kind
compiles once and a stage holds whole periods; leading layers that differ (DeepSeek's dense ones:
`layer_prefix`) stack apart (`lead`) and run before the stack. Its forward pass also comes in the parts the 1F1B
schedule takes (`embed`, `blocks`, `final_norm`, `output_head`: `meshpar.pipeline.one_f_one_b`).

The model names LOGICAL axes only (`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`, `layers`,
`experts`, `expert_mlp` for parameters; `batch`, `seq` for activations); meshpar's rules decide where they
live. Parameters are
float32; `dtype` is the compute dtype, to which parameters are cast where they are used.

Shape letters: B batch, T sequence, D d_model, N query heads, K kv heads, H head dim, F d_ff (or an expert's
width), V vocab, X query or kv heads, E experts, k experts per token.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar import fp8, layers, lora, moe
from meshpar.attention import attend, cached_attention, sequence_order
from meshpar.errors import InputError
from meshpar.loss import logits
from meshpar.sharding import constrain, gathered, project, relayout
from models import latent_attention, mtp, rope


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One layer of a repeating pattern (`TransformerConfig.layer_pattern`): its attention's reach, its rotary
    positions and its MLP."""

    window: int = 0  # each query sees its W latest keys, its own included; 0: all (full causal attention)
    rope_theta: float = 0.0  # its own RoPE base (Gemma 3's local layers); 0: the model's
    rope_scaling: rope.RopeScaling | None = None  # its own scaling; None: the model's
    dense: bool = False  # a dense MLP of width d_ff where the model has experts (Qwen3-MoE's mlp_only_layers)

    @classmethod
    def from_dict(cls, fields: dict) -> LayerKind:
        scaling = fields.get("rope_scaling")
        return cls(**{**fields, "rope_scaling": scaling if scaling is None else rope.RopeScaling(**scaling)})


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
    rope_scaling: rope.RopeScaling = rope.RopeScaling()
    norm_eps: float = 1e-5
    norm_plus_one: bool = False  # RMSNorms scale by 1 + w, their weights starting at 0 (Gemma)
    sandwich_norms: bool = False  # RMSNorms of attention's and the MLP's outputs too, before the adds (Gemma 2, 3)
    embed_scale: bool = False  # the embeddings multiplied by √d_model (Gemma)
    mlp_activation: str = "silu"  # the gated MLP's: silu (SwiGLU), gelu_tanh (GeGLU: Gemma) or clamped_swiglu
    swiglu_alpha: float = 1.702  # clamped_swiglu (gpt-oss): the gate's sigmoid gain …
    swiglu_limit: float = 7.0  # … and the clamp of gate (above) and up (both sides)
    query_scale: float = 0.0  # scores are q·k / √query_scale (Gemma's query_pre_attn_scalar); 0: / √head size
    attn_softcap: float = 0.0  # attention scores soft-capped to c·tanh(s / c) (Gemma 2: 50); 0: none
    logit_softcap: float = 0.0  # the output logits soft-capped the same way (Gemma 2: 30); 0: none
    head_dim: int = 0  # 0: d_model / n_heads (the size used is `head_size`)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen 2)
    o_bias: bool = False  # a bias on attention's output projection (gpt-oss)
    attn_sinks: bool = False  # a learned logit per query head in every attention softmax's denominator (gpt-oss)
    qk_norm: bool = False  # an RMSNorm of each query and key head before the rotation (Qwen 3)
    sliding_window: int = 0  # each query sees its W latest keys, its own included, in every layer (Mistral); 0: all
    # A mixture of experts in every layer in place of the MLP (Mixtral, Qwen3-MoE); 0: dense
    n_experts: int = 0
    experts_per_token: int = 2  # k: the experts each token is routed to
    d_expert: int = 0  # an expert's SwiGLU width; 0: d_ff
    n_shared_experts: int = 0  # experts every token passes (DeepSeek): one SwiGLU of n_shared_experts · d_expert
    shared_expert_gate: bool = False  # weigh the shared experts' output per token by sigmoid(x · w) (Qwen2-MoE)
    norm_topk_prob: bool = True  # weigh the k chosen experts by their probabilities renormalised over the k
    moe_bias: bool = False  # biases on the router's logits and on every expert's gate, up and down (gpt-oss)
    # DeepSeek-V3's routing (meshpar.moe.routing): a sigmoid score per expert instead of the softmax, …
    router_score: str = "softmax"  # softmax or sigmoid
    expert_groups: int = 1  # … the experts in groups (n_group), a token's k chosen among the topk_groups groups …
    topk_groups: int = 1  # … with the largest sums of their two best scores (topk_group)
    routed_scaling: float = 1.0  # × the chosen experts' weights, after norm_topk_prob (routed_scaling_factor)
    selection_bias: bool = False  # a per-expert bias on the scores for choosing only (e_score_correction_bias)
    # Layers that differ: layer i is of kind layer_pattern[i % len]. The stack scans over periods of the
    # pattern (`Period`), so each kind compiles once. (): every layer alike (`sliding_window`, experts or not).
    layer_pattern: tuple[LayerKind, ...] = ()
    # The first len(layer_prefix) layers, of these kinds, before the periods (DeepSeek-V3's 3 dense layers); n_layers
    # counts them. They stack apart (`Transformer.lead`), each kind compiled once where they are alike.
    layer_prefix: tuple[LayerKind, ...] = ()
    rotary_dims: int = 0  # the leading dims of each query and key head that rotate (GLM-4.5: half); 0: all
    # Multi-head latent attention (DeepSeek: `models/latent_attention.py`) where kv_lora_rank > 0: K and V from
    # a latent of kv_lora_rank per token; the query direct (q_lora_rank 0) or through a latent of q_lora_rank
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0  # a head's key and query width without positions …
    qk_rope_head_dim: int = 0  # … and with them (one rotary key shared by the heads)
    v_head_dim: int = 0  # a head's value width
    mtp_depth: int = 0  # D multi-token prediction modules after the stack (DeepSeek-V3: 1; `models/mtp.py`)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise InputError(f"model.{name} = {getattr(self, name)} must be >= 1")
        if self.sliding_window < 0:
            raise InputError(f"model.sliding_window = {self.sliding_window} must be >= 0 (0: no window)")
        if self.head_dim < 0:
            raise InputError(f"model.head_dim = {self.head_dim} must be >= 0 (0: d_model / n_heads)")
        if not self.head_dim and self.d_model % self.n_heads:
            raise InputError(f"model.d_model = {self.d_model} is not divisible by model.n_heads = {self.n_heads} "
                             f"(or set model.head_dim)")
        if self.n_heads % self.n_kv_heads:
            raise InputError(f"model.n_heads = {self.n_heads} is not divisible by "
                             f"model.n_kv_heads = {self.n_kv_heads} (grouped-query attention)")
        if self.mtp_depth < 0:
            raise InputError(f"model.mtp_depth = {self.mtp_depth} must be >= 0 (0: no multi-token prediction)")
        if self.kv_lora_rank < 0:
            raise InputError(f"model.kv_lora_rank = {self.kv_lora_rank} must be >= 0 (0: no latent attention)")
        if not 0 <= self.rotary_dims <= self.head_size or self.rotary_dims % 2:
            raise InputError(f"model.rotary_dims = {self.rotary_dims} must be even, between 0 (every dim) and the "
                             f"head size {self.head_size}")
        if self.kv_lora_rank:
            latent_attention.check(self)
        elif self.head_size % 2:
            raise InputError(f"head dim {self.head_size} must be even for rotary positions")
        if self.mlp_activation not in ACTIVATIONS:
            raise InputError(f"model.mlp_activation = '{self.mlp_activation}' is not one of {', '.join(ACTIVATIONS)}")
        if self.mlp_activation == "clamped_swiglu" and not self.swiglu_limit > 0:
            raise InputError(f"model.swiglu_limit = {self.swiglu_limit} must be > 0 (mlp_activation clamped_swiglu)")
        if self.moe_bias and not self.n_experts:
            raise InputError("model.moe_bias = true biases the router and the experts: it needs model.n_experts > 0")
        if self.query_scale < 0:
            raise InputError(f"model.query_scale = {self.query_scale} must be >= 0 (0: the head size)")
        for name in ("attn_softcap", "logit_softcap"):
            if getattr(self, name) < 0:
                raise InputError(f"model.{name} = {getattr(self, name)} must be >= 0 (0: no soft-capping)")
        for name in ("n_experts", "d_expert", "n_shared_experts"):
            if getattr(self, name) < 0:
                raise InputError(f"model.{name} = {getattr(self, name)} must be >= 0")
        if self.shared_expert_gate and not (self.n_experts and self.n_shared_experts):
            raise InputError(f"model.shared_expert_gate = true gates the shared experts: it needs model.n_experts and "
                             f"model.n_shared_experts > 0 (they are {self.n_experts} and {self.n_shared_experts})")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise InputError(f"model.experts_per_token = {self.experts_per_token} must be between 1 and "
                             f"model.n_experts = {self.n_experts}")
        if self.n_experts:
            self._check_routing()
        self._check_pattern()

    def _check_routing(self):
        E, G, k = self.n_experts, self.expert_groups, self.experts_per_token
        if self.router_score not in moe.SCORES:
            raise InputError(f"model.router_score = '{self.router_score}' is not one of {', '.join(moe.SCORES)}")
        if G < 1 or E % G:
            raise InputError(f"model.expert_groups = {G} must be >= 1 and divide model.n_experts = {E}")
        if G > 1 and E // G < 2:
            raise InputError(f"model.expert_groups = {G} leaves groups of {E // G} expert: a group scores its two "
                             f"best, so it needs at least 2 (model.n_experts = {E})")
        if not 1 <= self.topk_groups <= G:
            raise InputError(f"model.topk_groups = {self.topk_groups} must be between 1 and model.expert_groups = {G}")
        if k > self.topk_groups * (E // G):
            raise InputError(f"model.experts_per_token = {k} is more than the {self.topk_groups * (E // G)} experts "
                             f"of model.topk_groups = {self.topk_groups} groups of {E // G}")
        if not self.routed_scaling > 0:
            raise InputError(f"model.routed_scaling = {self.routed_scaling} must be > 0")

    def _check_pattern(self):
        for name in ("layer_pattern", "layer_prefix"):
            if self.sliding_window and getattr(self, name):
                raise InputError(f"model.sliding_window = {self.sliding_window} is every layer's window: with "
                                 f"model.{name} each kind gives its own (LayerKind.window)")
            for j, kind in enumerate(getattr(self, name)):
                if kind.window < 0:
                    raise InputError(f"model.{name}[{j}].window = {kind.window} must be >= 0 (0: full attention)")
                if kind.dense and not self.n_experts:
                    raise InputError(f"model.{name}[{j}].dense = true: every layer is dense already "
                                     f"(model.n_experts = 0)")
        stacked = self.n_layers - len(self.layer_prefix)
        if stacked < 1:
            raise InputError(f"model.n_layers = {self.n_layers} leaves no layer after model.layer_prefix's "
                             f"{len(self.layer_prefix)}: the stack needs at least one")
        if stacked % len(self.kinds):
            prefix = f" less model.layer_prefix's {len(self.layer_prefix)}" if self.layer_prefix else ""
            raise InputError(f"model.n_layers = {self.n_layers}{prefix} is not a whole number of "
                             f"model.layer_pattern's periods of {len(self.kinds)} layers")

    @property
    def head_size(self) -> int:
        """H: a query's and a key's width: `head_dim`, or d_model / n_heads where it is 0; with latent
        attention qk_nope_head_dim + qk_rope_head_dim."""
        if self.kv_lora_rank:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.d_model // self.n_heads

    @property
    def expert_width(self) -> int:
        """An expert's SwiGLU width: `d_expert`, or d_ff where it is 0."""
        return self.d_expert or self.d_ff

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """One period of the layers' kinds: `layer_pattern`, or the one kind every layer is."""
        return self.layer_pattern or (LayerKind(window=self.sliding_window),)

    @property
    def lead_kinds(self) -> tuple[LayerKind, ...]:
        """One entry of the `layer_prefix`'s stack: its one kind where its layers are alike (the stack holds
        len(layer_prefix) of them), else all its kinds in turn (the stack holds one)."""
        alike = all(kind == self.layer_prefix[0] for kind in self.layer_prefix)
        return self.layer_prefix[:1] if alike else self.layer_prefix

    @property
    def periods(self) -> int:
        """How many periods of the pattern the stack holds: the length of its `layers` axis."""
        return (self.n_layers - len(self.layer_prefix)) // len(self.kinds)

    @classmethod
    def from_dict(cls, fields: dict) -> TransformerConfig:
        """The config `dataclasses.asdict` wrote (a saved run's); fields it lacks keep their defaults."""
        return cls(**{**fields, "rope_scaling": rope.RopeScaling(**fields.get("rope_scaling", {})),
                      **{name: tuple(LayerKind.from_dict(k) for k in fields.get(name, ()))
                         for name in ("layer_pattern", "layer_prefix")}})


def _clamped_swiglu(gate, up, alpha: float, limit: float):
    """gpt-oss's: the gate clamped to ≤ limit times σ(α · it), times the up projection clamped to ±limit, + 1."""
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + 1)


# The gated MLP's units, (gate, up) → hidden: SwiGLU's, GeGLU's (GELU's tanh approximation, PyTorch's
# gelu_pytorch_tanh), gpt-oss's clamped SwiGLU (`gated_unit` gives it its config)
ACTIVATIONS = {"silu": moe.swiglu,
               "gelu_tanh": lambda gate, up: jax.nn.gelu(gate, approximate=True) * up,
               "clamped_swiglu": _clamped_swiglu}


def gated_unit(cfg: TransformerConfig) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The MLP's and the experts' (gate, up) → hidden, as `mlp_activation` names it."""
    if cfg.mlp_activation == "clamped_swiglu":
        return functools.partial(_clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return ACTIVATIONS[cfg.mlp_activation]


# The residual stream: its sequence dimension is `resid_seq`, which Megatron SP splits over `model` too.
RESIDUAL = ("batch", "resid_seq", "embed")
# The input of attention and MLP: whole sequences (with Megatron SP this is where T is all-gathered).
REGION_INPUT = ("batch", "seq", "embed")
# A generation's key or value cache [B, S, K, H]: rows like the batch, kv heads like attention's.
CACHE = ("batch", None, "kv_heads", None)


def param(rngs: nnx.Rngs, shape: tuple[int, ...], logical: tuple[str, ...], std: float) -> nnx.Param:
    """A float32 weight drawn from N(0, std²), its logical axes declared (models name logical axes only)."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), out_sharding=logical)


class RMSNorm(nnx.Module):
    """x / rms(x) · scale over the last axis: the residual stream's `embed` (D), a head's `head_dim` (H), or
    another of `size` (latent attention's latents);
    with `norm_plus_one`, · (1 + scale), the scale starting at 0."""

    def __init__(self, cfg: TransformerConfig, dtype: jnp.dtype, axis: str | None = "embed", size: int = 0):
        size = size or (cfg.d_model if axis == "embed" else cfg.head_size)
        self.plus_one = float(cfg.norm_plus_one)
        self.scale = nnx.Param(jnp.full((size,), 1.0 - self.plus_one, jnp.float32), out_sharding=(axis,))
        self.eps, self.dtype = cfg.norm_eps, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)  # the statistics in float32 whatever the compute dtype
        # x·x, not x**2: the power's derivative 2x would be one more copy of x kept for the backward pass
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        scale = gathered(self.scale, jnp.float32)
        return (normed * (scale + self.plus_one if self.plus_one else scale)).astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs, kind: LayerKind | None = None,
                 adapters: lora.LoraConfig | None = None):
        kind = kind or cfg.kinds[0]
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_size
        std, out_std = D**-0.5, (N * H) ** -0.5 / math.sqrt(2 * cfg.n_layers)
        self.wq_DNH = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), std)
        self.wk_DKH = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.wv_DKH = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.wo_NHD = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), out_std)
        for weight, target in (("wq_DNH", "q"), ("wk_DKH", "k"), ("wv_DKH", "v")):
            lora.attach(self, weight, target, adapters, rngs)
        lora.attach(self, "wo_NHD", "o", adapters, rngs, inputs=2)
        if cfg.qkv_bias:
            zeros = lambda X, heads: nnx.Param(jnp.zeros((X, H), jnp.float32), out_sharding=(heads, "head_dim"))
            self.q_bias_NH, self.k_bias_KH, self.v_bias_KH = zeros(N, "heads"), zeros(K, "kv_heads"), zeros(K, "kv_heads")
        if cfg.o_bias:
            self.o_bias_D = nnx.Param(jnp.zeros((D,), jnp.float32), out_sharding=("embed",))
        if cfg.attn_sinks:  # a sink logit of 0 takes as much of a row as a key scoring 0
            self.sinks_N = nnx.Param(jnp.zeros((N,), jnp.float32), out_sharding=("heads",))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(cfg, dtype, "head_dim"), RMSNorm(cfg, dtype, "head_dim")
        self.cfg, self.dtype = cfg, dtype
        self.window, self.softcap = kind.window or None, cfg.attn_softcap or None
        self.rope = (kind.rope_theta or cfg.rope_theta, kind.rope_scaling or cfg.rope_scaling)

    def __call__(self, x_BTD: jax.Array, positions: jax.Array, segments_BT: jax.Array | None = None) -> jax.Array:
        q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, positions)
        return self._output(attend(q_BTNH, k_BTKH, v_BTKH, window=self.window, segments_BT=segments_BT,
                                   softcap=self.softcap, sinks_N=self._sinks()))

    def cached(self, x_BTD: jax.Array, positions_T: jax.Array, k_BSKH: jax.Array,
               v_BSKH: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention of T new positions (contiguous from positions_T[0]) over themselves and a KV cache of S
        slots, slot j holding the latest earlier position p with p % S = j (S ≥ every position, or, with a
        sliding window, its W latest: a ring); returns (output, k cache, v cache) with the new keys and
        values written in (the last S of them where T > S)."""
        q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, positions_T)
        k_BTKH, v_BTKH = k_BTKH.astype(k_BSKH.dtype), v_BTKH.astype(v_BSKH.dtype)
        S, T = k_BSKH.shape[1], positions_T.shape[0]
        before = positions_T[0] - 1
        slot_pos_S = before - jnp.mod(before - jnp.arange(S), S)
        slot_pos_S = jnp.where(slot_pos_S >= 0, slot_pos_S, jnp.iinfo(jnp.int32).max)  # not written yet: after all
        keys_BSKH, values_BSKH = jnp.concatenate([k_BSKH, k_BTKH], 1), jnp.concatenate([v_BSKH, v_BTKH], 1)
        out_BTNH = cached_attention(q_BTNH, keys_BSKH, values_BSKH, positions_T,
                                    jnp.concatenate([slot_pos_S, positions_T]), window=self.window,
                                    softcap=self.softcap, sinks_N=self._sinks())
        kept = min(T, S)
        slots = positions_T[T - kept:] % S
        k_BSKH = constrain(k_BSKH.at[:, slots].set(k_BTKH[:, T - kept:]), CACHE)
        v_BSKH = constrain(v_BSKH.at[:, slots].set(v_BTKH[:, T - kept:]), CACHE)
        return self._output(out_BTNH), k_BSKH, v_BSKH

    def _project(self, x_BTD: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries and keys rotated to their positions ([T] or [B, T]; normed per head first, with `qk_norm`),
        and values."""
        cfg, cast = self.cfg, lambda w: gathered(w, self.dtype)
        weight = lambda w: gathered(w, self.dtype, matmul=True)
        x_BTD = relayout(x_BTD, RESIDUAL, REGION_INPUT)
        q_BTNH, k_BTKH, v_BTKH = project(x_BTD, [weight(self.wq_DNH), weight(self.wk_DKH), weight(self.wv_DKH)],
                                         [("batch", "seq", "heads", None)] + [("batch", "seq", "kv_heads", None)] * 2)
        q_BTNH, k_BTKH, v_BTKH = (lora.add(self, weight, x_BTD, y_BTXH) for weight, y_BTXH in
                                  zip(("wq_DNH", "wk_DKH", "wv_DKH"), (q_BTNH, k_BTKH, v_BTKH)))
        if cfg.qkv_bias:
            q_BTNH, k_BTKH, v_BTKH = (x_BTXH + cast(b_XH) for x_BTXH, b_XH in
                                      ((q_BTNH, self.q_bias_NH), (k_BTKH, self.k_bias_KH), (v_BTKH, self.v_bias_KH)))
        if cfg.qk_norm:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        rotate = lambda x_BTXH: rope.rotate(x_BTXH, positions, *self.rope, cfg.rotary_dims)
        q_BTNH = rotate(q_BTNH)
        if cfg.query_scale and cfg.query_scale != cfg.head_size:  # the kernels divide by √H
            q_BTNH = q_BTNH * jnp.asarray(math.sqrt(cfg.head_size / cfg.query_scale), q_BTNH.dtype)
        return q_BTNH, rotate(k_BTKH), v_BTKH

    def _sinks(self) -> jax.Array | None:
        """Each query head's sink logit, float32 as the softmax statistics (None: no sinks)."""
        return gathered(self.sinks_N, jnp.float32) if self.cfg.attn_sinks else None

    def _output(self, out_BTNH: jax.Array) -> jax.Array:
        out_BTD = lora.add(self, "wo_NHD", out_BTNH,
                           fp8.matmul(out_BTNH, gathered(self.wo_NHD, self.dtype, matmul=True), contract=2))
        return out_BTD + gathered(self.o_bias_D, self.dtype) if self.cfg.o_bias else out_BTD


class MLP(nnx.Module):
    """SwiGLU: down(silu(x · gate) ⊙ (x · up)), of width `d_ff` (or `width`); another gated unit with
    `mlp_activation`."""

    def __init__(self, cfg: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs, width: int = 0,
                 adapters: lora.LoraConfig | None = None):
        D, F = cfg.d_model, width or cfg.d_ff
        self.w_gate_DF = param(rngs, (D, F), ("embed", "mlp"), D**-0.5)
        self.w_up_DF = param(rngs, (D, F), ("embed", "mlp"), D**-0.5)
        self.w_down_FD = param(rngs, (F, D), ("mlp", "embed"), F**-0.5 / math.sqrt(2 * cfg.n_layers))
        for weight, target in (("w_gate_DF", "gate"), ("w_up_DF", "up"), ("w_down_FD", "down")):
            lora.attach(self, weight, target, adapters, rngs)
        self.dtype, self.gated = dtype, gated_unit(cfg)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        weight = lambda w: gathered(w, self.dtype, matmul=True)
        x_BTD = relayout(x_BTD, RESIDUAL, REGION_INPUT)
        gate_BTF, up_BTF = project(x_BTD, [weight(self.w_gate_DF), weight(self.w_up_DF)], [("batch", "seq", "mlp")] * 2)
        gate_BTF, up_BTF = (lora.add(self, weight, x_BTD, y_BTF) for weight, y_BTF in
                            zip(("w_gate_DF", "w_up_DF"), (gate_BTF, up_BTF)))
        hidden_BTF = self.gated(gate_BTF, up_BTF)
        return lora.add(self, "w_down_FD", hidden_BTF, fp8.matmul(hidden_BTF, weight(self.w_down_FD)))


class MoE(nnx.Module):
    """A mixture of SwiGLU experts: a router sends each token to its top-k experts (`meshpar.moe.routing`),
    which run where the mesh keeps them (`meshpar.moe.dispatch`); shared experts, if any, see every token, their
    output weighed per token by sigmoid(x · w_shared_gate) with `shared_expert_gate`; with `moe_bias`, biases on
    the router's logits and in the experts; with `selection_bias`, loss-free balancing's per-expert bias on the
    choice (`moe.SelectionBias`, its "gradient" this layer's loads). Returns the output and this layer's router
    statistics."""

    def __init__(self, cfg: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs,
                 adapters: lora.LoraConfig | None = None):
        D, E, F = cfg.d_model, cfg.n_experts, cfg.expert_width
        self.w_router_DE = param(rngs, (D, E), ("embed", None), D**-0.5)
        self.w_gate_EDF = param(rngs, (E, D, F), moe.GATE_UP, D**-0.5)
        self.w_up_EDF = param(rngs, (E, D, F), moe.GATE_UP, D**-0.5)
        self.w_down_EFD = param(rngs, (E, F, D), moe.DOWN, F**-0.5 / math.sqrt(2 * cfg.n_layers))
        for weight in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
            lora.attach(self, weight, "experts", adapters, rngs, lead=1)
        if cfg.moe_bias:
            zeros = lambda shape, logical: nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=logical)
            self.router_bias_E = zeros((E,), (None,))
            self.gate_bias_EF, self.up_bias_EF = zeros((E, F), moe.GATE_UP_BIAS), zeros((E, F), moe.GATE_UP_BIAS)
            self.down_bias_ED = zeros((E, D), moe.DOWN_BIAS)
        if cfg.selection_bias:  # float32, replicated: E numbers a layer
            self.selection_bias_E = moe.SelectionBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,))
        if cfg.n_shared_experts:
            self.shared = MLP(cfg, dtype, rngs, width=cfg.n_shared_experts * F, adapters=adapters)
        if cfg.shared_expert_gate:  # [D, 1]: one logit per token
            self.w_shared_gate_D1 = param(rngs, (D, 1), ("embed", None), D**-0.5)
        self.cfg, self.dtype = cfg, dtype

    def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, moe.RouterStats]:
        cast = lambda w: gathered(w, self.dtype)
        x_BTD = relayout(x_BTD, RESIDUAL, REGION_INPUT)
        logits_BTE = jnp.einsum("btd,de->bte", x_BTD, cast(self.w_router_DE), preferred_element_type=jnp.float32)
        biases = None
        if self.cfg.moe_bias:
            logits_BTE = logits_BTE + gathered(self.router_bias_E, jnp.float32)
            biases = (cast(self.gate_bias_EF), cast(self.up_bias_EF), cast(self.down_bias_ED))
        cfg = self.cfg
        bias_E = gathered(self.selection_bias_E, jnp.float32) if cfg.selection_bias else None
        routes = moe.route(logits_BTE, cfg.experts_per_token, cfg.norm_topk_prob, cfg.router_score, cfg.expert_groups,
                           cfg.topk_groups, cfg.routed_scaling, bias_E)
        experts = (lora.weight(self, w, self.dtype) for w in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"))
        y_BTD, dropped_B = moe.experts_ffn(x_BTD, routes.experts_BTk, routes.weights_BTk, *experts, moe.capacity(),
                                           biases=biases, gated=gated_unit(self.cfg))
        if self.cfg.n_shared_experts:
            shared_BTD = self.shared(x_BTD)
            if self.cfg.shared_expert_gate:
                shared_BTD = jax.nn.sigmoid(x_BTD @ cast(self.w_shared_gate_D1)) * shared_BTD
            y_BTD = y_BTD + shared_BTD
        if cfg.selection_bias:
            y_BTD = moe.with_loads(y_BTD, bias_E, routes.stats.counts_BE)
        return y_BTD, routes.stats._replace(dropped_B=dropped_B)


# A MoE block's router statistics: per row, as the batch.
ROUTER_STATS = moe.RouterStats(("batch", None), ("batch", None), ("batch",), ("batch",), ("batch",))


class Block(nnx.Module):
    """Attention and an MLP (or a mixture of experts), each on a pre-normed residual, as `kind` says. In a
    dense model a block maps x [B, T, D] to x; in one with experts (x, router statistics) to (x, the
    statistics with its own added: none from a dense kind). `kind`: the model's one kind where not given."""

    def __init__(self, cfg: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs, kind: LayerKind | None = None,
                 adapters: lora.LoraConfig | None = None):
        kind = kind or cfg.kinds[0]
        self.attn_norm = RMSNorm(cfg, dtype)
        attention = latent_attention.LatentAttention if cfg.kv_lora_rank else Attention
        self.attn = attention(cfg, dtype, rngs, kind, adapters)
        self.mlp_norm = RMSNorm(cfg, dtype)
        self.mlp = (MoE(cfg, dtype, rngs, adapters) if cfg.n_experts and not kind.dense else
                    MLP(cfg, dtype, rngs, adapters=adapters))
        if cfg.sandwich_norms:
            self.post_attn_norm, self.post_mlp_norm = RMSNorm(cfg, dtype), RMSNorm(cfg, dtype)
        self.routed, self.sandwich = bool(cfg.n_experts), cfg.sandwich_norms  # the carry holds router statistics

    def __call__(self, carry, positions: jax.Array, segments_BT: jax.Array | None = None):
        x_BTD, stats = carry if self.routed else (carry, None)
        x_BTD = self._add(x_BTD, self.attn(self.attn_norm(x_BTD), positions, segments_BT), "post_attn_norm")
        if isinstance(self.mlp, MoE):
            y_BTD, layer_stats = self.mlp(self.mlp_norm(x_BTD))
            stats = jax.tree.map(constrain, stats + layer_stats, ROUTER_STATS)
        else:
            y_BTD = self.mlp(self.mlp_norm(x_BTD))
        x_BTD = self._add(x_BTD, y_BTD, "post_mlp_norm")
        return (x_BTD, stats) if self.routed else x_BTD

    def cached(self, x_BTD: jax.Array, positions_T: jax.Array, k_BSKH: jax.Array,
               v_BSKH: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        attn_BTD, k_BSKH, v_BSKH = self.attn.cached(self.attn_norm(x_BTD), positions_T, k_BSKH, v_BSKH)
        x_BTD = self._add(x_BTD, attn_BTD, "post_attn_norm")
        y_BTD = self.mlp(self.mlp_norm(x_BTD))
        y_BTD = y_BTD[0] if isinstance(self.mlp, MoE) else y_BTD
        return self._add(x_BTD, y_BTD, "post_mlp_norm"), k_BSKH, v_BSKH

    def _add(self, x_BTD: jax.Array, y_BTD: jax.Array, post_norm: str) -> jax.Array:
        """The residual add of a sublayer's output, normed first with `sandwich_norms`."""
        return constrain(x_BTD + (getattr(self, post_norm)(y_BTD) if self.sandwich else y_BTD), RESIDUAL)


class Period(nnx.Module):
    """One period of `layer_pattern` (or the `kinds` given: a `layer_prefix` whose kinds differ): a block of
    each kind in turn (`layer0`, `layer1`, …), the unit the stack scans and a pipeline's stages hold whole.
    Its KV caches are a tuple, one per kind."""

    def __init__(self, cfg: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs,
                 adapters: lora.LoraConfig | None = None, kinds: tuple[LayerKind, ...] = ()):
        kinds = kinds or cfg.layer_pattern
        self.size = len(kinds)
        for j, kind in enumerate(kinds):
            setattr(self, f"layer{j}", Block(cfg, dtype, rngs, kind, adapters))

    def blocks(self) -> list[Block]:
        return [getattr(self, f"layer{j}") for j in range(self.size)]

    def __call__(self, carry, positions: jax.Array, segments_BT: jax.Array | None = None):
        for block in self.blocks():
            carry = block(carry, positions, segments_BT)
        return carry

    def cached(self, x_BTD: jax.Array, positions_T: jax.Array, k_caches: tuple[jax.Array, ...],
               v_caches: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        ks, vs = [], []
        for block, k_BSKH, v_BSKH in zip(self.blocks(), k_caches, v_caches):
            x_BTD, k_BSKH, v_BSKH = block.cached(x_BTD, positions_T, k_BSKH, v_BSKH)
            ks.append(k_BSKH)
            vs.append(v_BSKH)
        return x_BTD, tuple(ks), tuple(vs)


def _cached_scan(stack: nnx.Module, x_BTD: jax.Array, positions_T: jax.Array, k_LBSKH, v_LBSKH):
    """`x_BTD` through each entry of a stack by its `cached` (decoding), its caches [L, ...] beside it."""
    graphdef, stacked = nnx.split(stack)

    def one_layer(x_BTD, layer):
        block, k_BSKH, v_BSKH = layer
        x_BTD, k_BSKH, v_BSKH = nnx.merge(graphdef, block).cached(x_BTD, positions_T, k_BSKH, v_BSKH)
        return x_BTD, (k_BSKH, v_BSKH)

    x_BTD, (k_LBSKH, v_LBSKH) = jax.lax.scan(one_layer, x_BTD, (stacked, k_LBSKH, v_LBSKH))
    return x_BTD, k_LBSKH, v_LBSKH


def stack_of(make: Callable[[nnx.Rngs], nnx.Module], count: int, axis: str) -> Callable[[nnx.Rngs], nnx.Module]:
    """`rngs →` `count` modules of `make` stacked along a leading axis of logical name `axis`."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def stacked(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return stacked


class Transformer(nnx.Module):
    """The model; with `adapters`, LoRA adapters on the weights they target (`meshpar.lora`). With a
    `layer_prefix`, its layers (`lead`, stacked on `lead_layers`) run before the stack (`blocks`); with
    `mtp_depth`, the multi-token prediction modules (`mtp`, on `mtp_layers`) after it, for training only."""

    def __init__(self, cfg: TransformerConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs,
                 adapters: lora.LoraConfig | None = None):
        if adapters is not None and "experts" in adapters.targets and not cfg.n_experts:
            raise InputError("train.lora_targets names experts, and this model has none (model.n_experts = 0)")
        latent_attention.check_adapters(cfg, adapters)
        self.cfg, self.dtype = cfg, dtype
        self.embed_VD = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1.0)
        if cfg.layer_prefix:  # its own stack, on an axis no pipeline stage splits (`meshpar.layers.lead`)
            lead = cfg.lead_kinds
            self.lead = stack_of(lambda r: Block(cfg, dtype, r, lead[0], adapters) if len(lead) == 1 else
                                 Period(cfg, dtype, r, adapters, lead), len(cfg.layer_prefix) // len(lead),
                                 "lead_layers")(rngs)
        self.blocks = stack_of(lambda r: Period(cfg, dtype, r, adapters) if cfg.layer_pattern else
                               Block(cfg, dtype, r, adapters=adapters), cfg.periods, "layers")(rngs)
        self.final_norm = RMSNorm(cfg, dtype)
        if cfg.mtp_depth:  # after the stack, on `mtp_layers`; never in `decode`
            self.mtp = mtp.stack(cfg, dtype, rngs, adapters)
        if not cfg.tie_embeddings:
            self.head_DV = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.d_model**-0.5)

    @classmethod
    def factory(cls, cfg: TransformerConfig, dtype: jnp.dtype = jnp.float32,
                adapters: lora.LoraConfig | None = None) -> Callable[[nnx.Rngs], Transformer]:
        """`rngs → Transformer(cfg)` computing in `dtype` (with LoRA `adapters`): the model factory meshpar's
        training takes."""
        return lambda rngs: cls(cfg, dtype=dtype, rngs=rngs, adapters=adapters)

    @classmethod
    def abstract(cls, cfg: TransformerConfig, adapters: lora.LoraConfig | None = None
                 ) -> tuple[nnx.GraphDef, nnx.State]:
        """The model's structure and its parameters (with LoRA `adapters`, theirs too) as shapes with logical
        axes; nothing is allocated."""
        with nnx.use_eager_sharding(False):  # meshpar, not Flax, resolves logical names
            return nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), adapters=adapters)), nnx.Param)

    def __call__(self, tokens_BT: jax.Array, positions: jax.Array | None = None,
                 segments_BT: jax.Array | None = None) -> jax.Array:
        """Logits `[B, T, V]` in float32 for int tokens `[B, T]`: of a sequence in its order (reordered for
        the step and back, `meshpar.attention.sequence_order`), or of tokens already in the step's order at
        their `positions` (a load-balanced context-parallel step's: global positions [T], or [B, T] within
        each document with `segments_BT`, the document ids of packed rows: `meshpar.batch`)."""
        if positions is not None:
            return logits(self.hidden_states(tokens_BT, positions, segments_BT), self.output_head(), self.logit_softcap)
        if segments_BT is not None:
            raise InputError("packed documents (segments_BT) need their positions: meshpar.loss.next_token_inputs")
        reorder, positions_T, restore = sequence_order(tokens_BT.shape[1])
        return restore(logits(self.hidden_states(reorder(tokens_BT), positions_T), self.output_head(),
                              self.logit_softcap))

    def hidden_states(self, tokens_BT: jax.Array, positions: jax.Array | None = None,
                      segments_BT: jax.Array | None = None) -> jax.Array:
        """The final norm's output `[B, T, D]`, which the output head turns into logits."""
        return self.routed_hidden_states(tokens_BT, positions, segments_BT)[0]

    def routed_hidden_states(self, tokens_BT: jax.Array, positions: jax.Array | None = None,
                             segments_BT: jax.Array | None = None) -> tuple[jax.Array, moe.RouterStats | None]:
        """`hidden_states`, and the router statistics of the MoE layers summed over them (None: dense),
        from which the training loss takes its load-balancing and z losses (`meshpar.moe.routing`)."""
        x_BTD, stats = self._trunk(tokens_BT, positions, segments_BT)
        return self.final_norm(x_BTD), stats

    def mtp_hidden_states(self, tokens_BT: jax.Array, positions: jax.Array, mtp_tokens_KBT: jax.Array,
                          segments_BT: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array, moe.RouterStats | None]:
        """`routed_hidden_states`' final-norm output and statistics, with the multi-token prediction modules'
        outputs [K, B, T, D] between (`models.mtp`; their router statistics added): module k takes, at each
        position, the token k ahead of it, `mtp_tokens_KBT[k - 1]`."""
        x_BTD, stats = self._trunk(tokens_BT, positions, segments_BT)
        positions, segments_BT = self._per_row(tokens_BT, positions, segments_BT)
        e_KBTD = jnp.stack([self.embed(tokens_BT) for tokens_BT in mtp_tokens_KBT])
        out_KBTD, stats = mtp.hidden_states(self.mtp, x_BTD, e_KBTD, positions, segments_BT, stats)
        return self.final_norm(x_BTD), out_KBTD, stats

    @property
    def mtp_depth(self) -> int:
        """D: the multi-token prediction modules the training loss runs (`models.mtp`)."""
        return self.cfg.mtp_depth

    def _per_row(self, tokens_BT: jax.Array, positions: jax.Array | None, segments_BT: jax.Array | None):
        """(positions, segments) as the blocks take them: [T] from 0 where not given; with documents laid out
        like the tokens."""
        if positions is None:
            positions = jnp.arange(tokens_BT.shape[1])
        if segments_BT is not None:  # per row: laid out like the tokens
            positions, segments_BT = (constrain(x_BT, ("batch", "seq")) for x_BT in (positions, segments_BT))
        return positions, segments_BT

    def _trunk(self, tokens_BT: jax.Array, positions: jax.Array | None, segments_BT: jax.Array | None
               ) -> tuple[jax.Array, moe.RouterStats | None]:
        """The stack's output [B, T, D] before the final norm, and the router statistics (None: dense)."""
        positions, segments_BT = self._per_row(tokens_BT, positions, segments_BT)
        carry = layers.scan(self.blocks, self.stack_input(tokens_BT, positions, segments_BT), positions, segments_BT)
        return carry if self.cfg.n_experts else (carry, None)

    def embed(self, tokens_BT: jax.Array) -> jax.Array:
        """The token embeddings `[B, T, D]`: the residual stream entering the first block."""
        x_BTD = gathered(self.embed_VD, self.dtype, lookup=True)[tokens_BT]
        if self.cfg.embed_scale:  # √D in the compute dtype, as Gemma's embedding multiplies
            x_BTD = x_BTD * jnp.asarray(math.sqrt(self.cfg.d_model), self.dtype)
        return constrain(x_BTD, RESIDUAL)

    def stack_input(self, tokens_BT: jax.Array, positions: jax.Array | None = None,
                    segments_BT: jax.Array | None = None) -> jax.Array | tuple[jax.Array, moe.RouterStats]:
        """What the first block of the stack takes: the embeddings, for a mixture of experts with zero router
        statistics, through the `layer_prefix`'s layers where there are some (at `positions`, with
        `segments_BT` as `routed_hidden_states` takes them)."""
        carry = self.embed(tokens_BT)
        if self.cfg.n_experts:
            carry = carry, jax.tree.map(constrain, moe.RouterStats.zeros(tokens_BT.shape[0], self.cfg.n_experts),
                                        ROUTER_STATS)
        if not self.cfg.layer_prefix:
            return carry
        positions = jnp.arange(tokens_BT.shape[1]) if positions is None else positions
        return layers.lead(self.lead, carry, positions, segments_BT)

    def init_cache(self, batch: int, length: int):
        """Empty key and value caches [L, B, S, K, H] for `length` positions, in the compute dtype: S = length,
        or with a sliding window W the W − 1 latest positions (a query's own key comes with it: `cached`).
        With `layer_pattern`, a tuple of them, one per kind, each [L / period, B, S of its kind, K, H].
        With latent attention the "key" cache holds the latents [L, B, S, 1, C] and the "value" cache the
        rotary keys [L, B, S, 1, Hr] (`models.latent_attention`). With `layer_prefix`, a pair of them: the
        prefix's (`lead`: [its entries, ...], a tuple per kind where its kinds differ) and the stack's."""
        cfg = self.cfg

        def cache(kind: LayerKind, width: int, count: int, axis: str) -> jax.Array:
            S = min(length, kind.window - 1) if kind.window > 1 else length
            if cfg.kv_lora_rank:
                return constrain(jnp.zeros((count, batch, S, 1, width), self.dtype),
                                 (axis, *latent_attention.LATENT_CACHE[1:]))
            zeros = jnp.zeros((count, batch, S, cfg.n_kv_heads, width), self.dtype)
            return constrain(zeros, (axis, *CACHE))

        def caches(width: int):  # per stack: one cache of its Blocks, or a tuple per kind of its Periods
            each = [tuple(cache(kind, width, count, axis) for kind in kinds) if period else
                    cache(kinds[0], width, count, axis) for kinds, count, axis, period in self._stacks()]
            return tuple(each) if cfg.layer_prefix else each[0]

        k_width, v_width = (cfg.kv_lora_rank, cfg.qk_rope_head_dim) if cfg.kv_lora_rank else (cfg.head_size,) * 2
        return caches(k_width), caches(v_width)

    def _stacks(self) -> list[tuple[tuple[LayerKind, ...], int, str, bool]]:
        """(an entry's kinds, entries, the stacked axis, whether an entry is a Period) of `lead` (with a
        `layer_prefix`) and `blocks`, in the order they run."""
        cfg, lead = self.cfg, self.cfg.lead_kinds
        prefix = [(lead, len(cfg.layer_prefix) // len(lead), "lead_layers", len(lead) > 1)] if cfg.layer_prefix else []
        return [*prefix, (cfg.kinds, cfg.periods, "layers", bool(cfg.layer_pattern))]

    def decode(self, tokens_BT: jax.Array, positions_T: jax.Array, k_LBSKH, v_LBSKH):
        """Logits [B, T, V] of T new tokens at positions (contiguous), attending over the KV caches
        (`init_cache`'s) and everything before them; returns the caches with the new positions written in."""
        x_BTD, prefix = self.embed(tokens_BT), bool(self.cfg.layer_prefix)
        stacks = (self.lead, self.blocks) if prefix else (self.blocks,)
        ks, vs = [], []
        for stack, k_LBSKH, v_LBSKH in zip(stacks, *((k_LBSKH, v_LBSKH) if prefix else ((k_LBSKH,), (v_LBSKH,)))):
            x_BTD, k_LBSKH, v_LBSKH = _cached_scan(stack, x_BTD, positions_T, k_LBSKH, v_LBSKH)
            ks.append(k_LBSKH)
            vs.append(v_LBSKH)
        k_LBSKH, v_LBSKH = (tuple(ks), tuple(vs)) if prefix else (ks[0], vs[0])
        return logits(self.final_norm(x_BTD), self.output_head(), self.logit_softcap), k_LBSKH, v_LBSKH

    @property
    def logit_softcap(self) -> float | None:
        """c of the logits' soft-capping c·tanh(logits / c) (None: none), which meshpar's loss applies."""
        return self.cfg.logit_softcap or None

    def output_head(self) -> jax.Array:
        """The output projection `[D, V]` as compute uses it (cast; gathered over `fsdp`, vocab split).
        meshpar's loss multiplies chunks of the hidden states by it, so the whole logits never exist."""
        if self.cfg.tie_embeddings:
            return gathered(self.embed_VD, self.dtype).T
        return gathered(self.head_DV, self.dtype)
