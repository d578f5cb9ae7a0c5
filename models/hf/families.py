"""The Hugging Face model families meshpar's transformer computes, each as its `config.json` and its tensors.

| model_type | architecture        | its options (TransformerConfig)                | tensors beyond Llama's         |
|------------|---------------------|------------------------------------------------|--------------------------------|
| llama      | LlamaForCausalLM    | rope scaling (linear, llama3, yarn), head_dim  | –                              |
| mistral    | MistralForCausalLM  | as llama; `sliding_window` (every layer)       | –                              |
| qwen2      | Qwen2ForCausalLM    | `qkv_bias` (always on); per-layer windows      | self_attn.{q,k,v}_proj.bias    |
| qwen3      | Qwen3ForCausalLM    | `qk_norm` (always on), head_dim; per-layer windows | self_attn.{q,k}_norm.weight |
| gemma2     | Gemma2ForCausalLM   | Gemma's layer, soft-capping; per-layer windows | pre/post_feedforward norms     |
| gemma3_text | Gemma3ForCausalLM  | Gemma's layer, q/k norms; per-type RoPE        | as gemma2, q/k norms           |
| mixtral    | MixtralForCausalLM  | as mistral; `n_experts` (every layer)          | block_sparse_moe.* for mlp.*   |
| qwen3_moe  | Qwen3MoeForCausalLM | as qwen3; `n_experts`, dense layers, `norm_topk_prob` | mlp.gate, mlp.experts.* |
| qwen2_moe  | Qwen2MoeForCausalLM | as qwen2 and qwen3_moe; a gated shared expert  | mlp.shared_expert{,_gate}.*    |
| gpt_oss    | GptOssForCausalLM   | gpt-oss's layer; YaRN; per-layer windows       | biases, sinks, fused experts   |

Gemma's layer (`Family.gemma`): GeGLU (`hidden_activation` gelu_pytorch_tanh), RMSNorms scaled by 1 + w around
both sublayers (`norm_plus_one`, `sandwich_norms`: its `post_attention_layernorm` norms attention's output, and
`pre_feedforward_layernorm` is the MLP's input norm), embeddings × √D, scores / √`query_pre_attn_scalar`
(`query_scale`), and Gemma 2's `attn_logit_softcapping` and `final_logit_softcapping`. Gemma 3's sliding layers
take `rope_parameters.sliding_attention` (4.x: `rope_local_base_freq`), its full ones the `full_attention` entry.

gpt-oss's layer (`Family.gpt_oss`): biases on q, k, v and o (`qkv_bias`, `o_bias`), a sink logit per head
(`attn_sinks`, `self_attn.sinks`), a router and experts with biases (`moe_bias`), the experts' clamped SwiGLU
(`mlp_activation` clamped_swiglu, `swiglu_alpha`, `swiglu_limit`), YaRN (`truncate` false). Its experts are
fused tensors [E, in, out], the gate and up projections interleaved column by column in `gate_up_proj`
(kinds `even` and `odd`); the Hub's checkpoints store `gate_up_proj` and `down_proj` as MXFP4 (`_blocks` and
`_scales`: `models.hf.mxfp4`), which import dequantises; export writes them unquantised.

Layers that differ (`layer_pattern`): qwen2, qwen3, the Gemmas and gpt-oss read `layer_types` (or, without it,
transformers' rules: Qwen's layers from `max_window_layers` on slide where `use_sliding_window`, Gemma's and
gpt-oss's all but every 2nd (Gemma 2, gpt-oss) or `sliding_window_pattern`-th (Gemma 3, 6)), each sliding layer
with the one
`sliding_window`; qwen3_moe and qwen2_moe read which layers have experts from `decoder_sparse_step` and
`mlp_only_layers` (the others are dense, `intermediate_size` wide). The per-layer kinds become the shortest
period that repeats over the layers; with one kind, the model-wide options. A pattern's period j holds layer
j of each period: HF layer l is `blocks.layer{l % p}` at stack index l // p.

The mixtures of experts (`n_experts`, `experts_per_token`, `d_expert`) read `num_local_experts` (mixtral)
or `num_experts` (qwen3_moe), `num_experts_per_tok`, and an expert's width from `intermediate_size`
(mixtral) or `moe_intermediate_size` (qwen3_moe and qwen2_moe, whose `intermediate_size`, the width of their
optional dense layers, is kept as d_ff). Qwen2-MoE's one shared expert, `shared_expert_intermediate_size` wide,
is meshpar's `n_shared_experts` = that width / `moe_intermediate_size` (a whole number, or refused), its
output gated per token (`shared_expert_gate`). transformers' `router_aux_loss_coef` is a training setting in
meshpar (`train.router_aux_loss_coef`), not the model's: `launch.convert from-hf` prints it.

Every family shares Llama's names and layouts (`LLAMA`), has an MLP (`SWIGLU`) or experts
(`MIXTRAL_EXPERTS`, `QWEN3_MOE_EXPERTS`, `QWEN2_MOE_EXPERTS`) and adds its own rows. Hugging Face tensors are
torch `nn.Linear` weights, [out, in], one per layer; meshpar's are [in, out] with the heads split out and
the layers stacked on a leading L axis:

| Hugging Face (layer l)                  | meshpar                            | kind (how)                       |
|-----------------------------------------|------------------------------------|----------------------------------|
| model.embed_tokens.weight [V, D]        | embed_VD [V, D]                    | same                             |
| lm_head.weight [V, D] (absent if tied)  | head_DV [D, V]                     | transpose                        |
| model.norm.weight [D]                   | final_norm.scale [D]               | same                             |
| input_layernorm.weight [D]              | blocks.attn_norm.scale [L, D]      | same, stacked                    |
| post_attention_layernorm.weight [D]     | blocks.mlp_norm.scale [L, D]       | same, stacked                    |
| self_attn.q_proj.weight [N·H, D]        | blocks.attn.wq_DNH [L, D, N, H]    | heads_in: W.T.reshape(D, N, H)   |
| self_attn.k_proj, v_proj [K·H, D]       | blocks.attn.wk_DKH, wv_DKH         | heads_in: W.T.reshape(D, K, H)   |
| self_attn.o_proj.weight [D, N·H]        | blocks.attn.wo_NHD [L, N, H, D]    | heads_out: W.T.reshape(N, H, D)  |
| mlp.gate_proj, up_proj [F, D]           | blocks.mlp.w_gate_DF, w_up_DF      | transpose                        |
| mlp.down_proj [D, F]                    | blocks.mlp.w_down_FD [L, F, D]     | transpose                        |
| mlp.gate.weight [E, D] (qwen3_moe)      | blocks.mlp.w_router_DE [L, D, E]   | transpose                        |
| mlp.experts.{e}.gate_proj, up_proj      | blocks.mlp.w_gate_EDF, w_up_EDF    | transpose, stacked over L and E  |
|   [F, D], per expert e                  |   [L, E, D, F]                     |                                  |
| mlp.experts.{e}.down_proj [D, F]        | blocks.mlp.w_down_EFD [L, E, F, D] | transpose, stacked over L and E  |
| mlp.shared_expert.gate_proj, up_proj,   | blocks.mlp.shared.w_gate_DF, …     | transpose (qwen2_moe)            |
|   down_proj                             |   as the MLP's                     |                                  |
| mlp.shared_expert_gate.weight [1, D]    | blocks.mlp.w_shared_gate_D1 [L, D, 1] | transpose (qwen2_moe)         |
| self_attn.q_proj.bias [N·H] (qwen2)     | blocks.attn.q_bias_NH [L, N, H]    | heads_bias: b.reshape(N, H)      |
| self_attn.k_proj, v_proj.bias [K·H]     | blocks.attn.k_bias_KH, v_bias_KH   | heads_bias: b.reshape(K, H)      |
| self_attn.q_norm, k_norm.weight [H]     | blocks.attn.q_norm.scale, k_norm…  | same, stacked (qwen3)            |
| self_attn.o_proj.bias [D] (gpt_oss)     | blocks.attn.o_bias_D [L, D]        | same, stacked                    |
| self_attn.sinks [N] (gpt_oss)           | blocks.attn.sinks_N [L, N]         | same, stacked                    |
| mlp.router.weight, bias [E, D], [E]     | blocks.mlp.w_router_DE, router_bias_E | transpose; same               |
| mlp.experts.gate_up_proj [E, D, 2F]     | blocks.mlp.w_gate_EDF, w_up_EDF    | even, odd: columns 2f, 2f + 1    |
| mlp.experts.gate_up_proj_bias [E, 2F]   | blocks.mlp.gate_bias_EF, up_bias_EF | even, odd                       |
| mlp.experts.down_proj [E, F, D]         | blocks.mlp.w_down_EFD              | same, stacked                    |
| mlp.experts.down_proj_bias [E, D]       | blocks.mlp.down_bias_ED            | same, stacked                    |

Mixtral names its experts `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up),
`w2` (down). These per-expert tensors are what the Hub's checkpoints hold and what transformers 5
`save_pretrained` writes (it fuses the experts only in memory), so meshpar reads and writes them.

All rotate the pairs (i, i + H/2) ("rotate half"), as meshpar does, so q and k need no permutation.
Anything a config.json sets that the model does not implement is refused, naming the key.
"""

from __future__ import annotations

import dataclasses
import json

from meshpar.errors import InputError
from models.hf import deepseek, fp8_blocks
from models.rope import RopeScaling
from models.transformer import LayerKind, TransformerConfig


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One meshpar parameter and its Hugging Face tensor; `{l}` in the name marks a per-layer tensor,
    stacked on meshpar's leading L axis, and `{e}` a per-expert one, stacked on the E axis after it.
    `kind` says how the layouts relate (module docstring)."""

    path: tuple[str, ...]
    name: str
    kind: str  # same, transpose, heads_in, heads_out, heads_bias, even, odd
    layers: tuple[int, int] = (0, 1)  # (j, p): index i of the stacked L axis is the checkpoint's layer j + p·i
    rope: int = 0  # the last `rope` entries of the last axis are rotary dims in interleaved pairs (DeepSeek's)
    entries: int = 1  # the length of its stacked L axis (a per-layer tensor's: its stack's periods)

    def layer(self, i: int) -> int:
        """The checkpoint's layer at index `i` of the stacked axis."""
        return self.layers[0] + self.layers[1] * i

    def index_of(self, layer: int) -> int | None:
        """The index on the stacked axis of the checkpoint's `layer` (None: a layer of another kind)."""
        j, p = self.layers
        return (layer - j) // p if (layer - j) % p == 0 and 0 <= (layer - j) // p < self.entries else None

    @property
    def stacked(self) -> tuple[str, ...]:
        """The placeholders in the name, in the order of the leading axes they stack: (), ("l",), ("l", "e")."""
        return tuple(p for p in STACKED if "{" + p + "}" in self.name)


STACKED = ("l", "e")  # the placeholders a name may have: layer, expert


_LAYER = "model.layers.{l}."
LLAMA = (
    Tensor(("embed_VD",), "model.embed_tokens.weight", "same"),
    Tensor(("blocks", "attn_norm", "scale"), _LAYER + "input_layernorm.weight", "same"),
    Tensor(("blocks", "attn", "wq_DNH"), _LAYER + "self_attn.q_proj.weight", "heads_in"),
    Tensor(("blocks", "attn", "wk_DKH"), _LAYER + "self_attn.k_proj.weight", "heads_in"),
    Tensor(("blocks", "attn", "wv_DKH"), _LAYER + "self_attn.v_proj.weight", "heads_in"),
    Tensor(("blocks", "attn", "wo_NHD"), _LAYER + "self_attn.o_proj.weight", "heads_out"),
    Tensor(("blocks", "mlp_norm", "scale"), _LAYER + "post_attention_layernorm.weight", "same"),
    Tensor(("final_norm", "scale"), "model.norm.weight", "same"),
    Tensor(("head_DV",), "lm_head.weight", "transpose"),
)


def _swiglu(path: tuple[str, ...], module: str) -> tuple[Tensor, ...]:
    """A SwiGLU MLP at `path` in meshpar and `module` of each layer in Hugging Face's checkpoints."""
    return tuple(Tensor((*path, f"w_{w}"), _LAYER + f"{module}.{hf}.weight", "transpose")
                 for w, hf in (("gate_DF", "gate_proj"), ("up_DF", "up_proj"), ("down_FD", "down_proj")))


SWIGLU = _swiglu(("blocks", "mlp"), "mlp")


def _experts(module: str, gate: str, up: str, down: str) -> tuple[Tensor, ...]:
    """A mixture of experts under `module` of each layer: its router `gate` and each expert's three matrices."""
    prefix = _LAYER + module
    return (Tensor(("blocks", "mlp", "w_router_DE"), prefix + ".gate.weight", "transpose"),
            *(Tensor(("blocks", "mlp", f"w_{w}"), prefix + ".experts.{e}." + hf + ".weight", "transpose")
              for w, hf in (("gate_EDF", gate), ("up_EDF", up), ("down_EFD", down))))


MIXTRAL_EXPERTS = _experts("block_sparse_moe", "w1", "w3", "w2")
QWEN3_MOE_EXPERTS = _experts("mlp", "gate_proj", "up_proj", "down_proj")
# Qwen3-MoE's, and a shared expert with its gate, one logit per token
QWEN2_MOE_EXPERTS = (*QWEN3_MOE_EXPERTS, *_swiglu(("blocks", "mlp", "shared"), "mlp.shared_expert"),
                     Tensor(("blocks", "mlp", "w_shared_gate_D1"), _LAYER + "mlp.shared_expert_gate.weight",
                            "transpose"))
# DeepSeek-V3's: Qwen3-MoE's experts, the router's selection bias and ungated shared experts
DEEPSEEK_EXPERTS = (*QWEN3_MOE_EXPERTS, *_swiglu(("blocks", "mlp", "shared"), "mlp.shared_experts"),
                    Tensor(("blocks", "mlp", "selection_bias_E"), _LAYER + "mlp.gate.e_score_correction_bias", "same"))
# Gemma's norms: of attention's input and output, and of the MLP's (`sandwich_norms`)
SANDWICH = (Tensor(("blocks", "post_attn_norm", "scale"), _LAYER + "post_attention_layernorm.weight", "same"),
            Tensor(("blocks", "mlp_norm", "scale"), _LAYER + "pre_feedforward_layernorm.weight", "same"),
            Tensor(("blocks", "post_mlp_norm", "scale"), _LAYER + "post_feedforward_layernorm.weight", "same"))
QKV_BIASES = tuple(Tensor(("blocks", "attn", f"{x}_bias_{X}H"), _LAYER + f"self_attn.{x}_proj.bias", "heads_bias")
                   for x, X in (("q", "N"), ("k", "K"), ("v", "K")))
QK_NORMS = tuple(Tensor(("blocks", "attn", f"{x}_norm", "scale"), _LAYER + f"self_attn.{x}_norm.weight", "same")
                 for x in ("q", "k"))
O_BIAS = (Tensor(("blocks", "attn", "o_bias_D"), _LAYER + "self_attn.o_proj.bias", "same"),)
SINKS = (Tensor(("blocks", "attn", "sinks_N"), _LAYER + "self_attn.sinks", "same"),)
# gpt-oss's: a router with a bias; fused experts [E, in, out], gate and up interleaved column by column
GPT_OSS_EXPERTS = (
    Tensor(("blocks", "mlp", "w_router_DE"), _LAYER + "mlp.router.weight", "transpose"),
    Tensor(("blocks", "mlp", "router_bias_E"), _LAYER + "mlp.router.bias", "same"),
    Tensor(("blocks", "mlp", "w_gate_EDF"), _LAYER + "mlp.experts.gate_up_proj", "even"),
    Tensor(("blocks", "mlp", "w_up_EDF"), _LAYER + "mlp.experts.gate_up_proj", "odd"),
    Tensor(("blocks", "mlp", "gate_bias_EF"), _LAYER + "mlp.experts.gate_up_proj_bias", "even"),
    Tensor(("blocks", "mlp", "up_bias_EF"), _LAYER + "mlp.experts.gate_up_proj_bias", "odd"),
    Tensor(("blocks", "mlp", "w_down_EFD"), _LAYER + "mlp.experts.down_proj", "same"),
    Tensor(("blocks", "mlp", "down_bias_ED"), _LAYER + "mlp.experts.down_proj_bias", "same"),
)


@dataclasses.dataclass(frozen=True)
class Experts:
    """How a family's config.json and tensors hold the mixture of experts it has in every layer."""

    count_keys: tuple[str, ...]  # config.json's number of experts: the first is written, any is read
    width_key: str  # config.json's width of one expert
    tensors: tuple[Tensor, ...]
    renormalised: bool | None = None  # the top-k probabilities always are (True); None: norm_topk_prob says
    # config.json's width of the one shared expert every token passes, gated (Qwen2-MoE); None: it has none
    shared_width_key: str | None = None
    # config.json's number of ungated shared experts, each an expert wide (DeepSeek); None: it has none
    shared_count_key: str | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    qkv_bias: bool | None = False  # its attention always has q, k and v biases (None: as `attention_bias` says)
    qk_norm: bool | None = False  # its attention always norms each query and key head (None: as `use_qk_norm` says)
    windowed: bool = False  # its config.json's `sliding_window` is one window for every layer (model.sliding_window)
    layer_types: bool = False  # its config.json's `layer_types` slide some layers' attention (one window)
    # config.json keys whose value must be what the model computes (e.g. no sliding window), and the
    # values a checkpoint of this family written by meshpar carries for them
    fixed: tuple[tuple[str, object], ...] = ()
    experts: Experts | None = None  # a mixture of experts in place of the MLP
    dense_layers: bool = False  # `decoder_sparse_step` and `mlp_only_layers` leave some layers dense
    # Gemma's layer: GeGLU, (1 + w) RMSNorms around both sublayers, √D embeddings, `query_pre_attn_scalar`,
    # soft-capping; its sliding layers always slide (`sliding_window`)
    gemma: bool = False
    local_rope: bool = False  # its sliding layers have a rotary base (and scaling) of their own (Gemma 3)
    # gpt-oss's layer: o biases, attention sinks, router and expert biases, the clamped SwiGLU; its sliding
    # layers always slide
    gpt_oss: bool = False
    full_every: int = 0  # without `layer_types`, every n-th layer is full, the others slide (Gemma's default)
    # DeepSeek-V3's layer (`models.hf.deepseek`): latent attention (`latent`); its mixture (`deepseek_moe`):
    # sigmoid group-limited routing with a selection bias, ungated shared experts, dense leading layers
    latent: bool = False
    deepseek_moe: bool = False
    partial_rotary: bool = False  # its heads rotate their leading `partial_rotary_factor` only (GLM-4.5)


# Why meshpar needs a `fixed` key's value, where the key's name does not say it
_WHY_FIXED = {"router_jitter_noise": "meshpar's router adds no noise",
              "qkv_bias": "as Qwen2-MoE's checkpoints: meshpar's qwen2_moe has q, k and v biases"}

FAMILIES = {family.model_type: family for family in (
    Family("llama", "LlamaForCausalLM", fixed=(("attention_bias", False), ("mlp_bias", False))),
    Family("mistral", "MistralForCausalLM", windowed=True),
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, layer_types=True),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, layer_types=True, fixed=(("attention_bias", False),)),
    Family("gemma2", "Gemma2ForCausalLM", layer_types=True, gemma=True, full_every=2,
           fixed=(("attention_bias", False), ("use_bidirectional_attention", False))),
    Family("gemma3_text", "Gemma3ForCausalLM", qk_norm=True, layer_types=True, gemma=True, local_rope=True,
           full_every=6,
           fixed=(("attention_bias", False), ("use_bidirectional_attention", False))),
    Family("mixtral", "MixtralForCausalLM", windowed=True, fixed=(("router_jitter_noise", 0.0),),
           experts=Experts(("num_local_experts",), "intermediate_size", MIXTRAL_EXPERTS, renormalised=True)),
    # the Hub's checkpoints (and transformers 4) name the count num_experts, transformers 5 num_local_experts
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True,
           fixed=(("attention_bias", False), ("use_sliding_window", False)), dense_layers=True,
           experts=Experts(("num_experts", "num_local_experts"), "moe_intermediate_size", QWEN3_MOE_EXPERTS)),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True,
           fixed=(("qkv_bias", True), ("use_sliding_window", False)), dense_layers=True,
           experts=Experts(("num_experts",), "moe_intermediate_size", QWEN2_MOE_EXPERTS,
                           shared_width_key="shared_expert_intermediate_size")),
    Family("gpt_oss", "GptOssForCausalLM", qkv_bias=True, layer_types=True, gpt_oss=True, full_every=2,
           fixed=(("attention_bias", True),),
           experts=Experts(("num_local_experts",), "intermediate_size", GPT_OSS_EXPERTS, renormalised=True)),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", latent=True, deepseek_moe=True, fixed=deepseek.FIXED,
           experts=Experts(("n_routed_experts",), "moe_intermediate_size", DEEPSEEK_EXPERTS,
                           shared_count_key="n_shared_experts")),
    Family("glm4_moe", "Glm4MoeForCausalLM", qkv_bias=None, qk_norm=None, deepseek_moe=True, partial_rotary=True,
           fixed=deepseek.MOE_FIXED, experts=Experts(("n_routed_experts",), "moe_intermediate_size", DEEPSEEK_EXPERTS,
                                                     shared_count_key="n_shared_experts")),
)}


def tensors(cfg: TransformerConfig, family: Family) -> list[Tensor]:
    """The tensors of a `family` checkpoint of the model `cfg`: Llama's, its MLP's or its experts', and the
    rows of the options it has on; with a `layer_pattern`, each layer row once per kind of its period, and with a
    `layer_prefix` once per kind of its stack (`lead`), the stack's layers numbered after the prefix's."""
    if cfg.n_experts and family.experts is None:
        raise InputError(f"model.n_experts = {cfg.n_experts}: a {family.model_type} checkpoint holds no experts")
    options = [*(QKV_BIASES if cfg.qkv_bias else ()), *(QK_NORMS if cfg.qk_norm else ()),
               *(O_BIAS if cfg.o_bias else ()), *(SINKS if cfg.attn_sinks else ())]
    norms = LLAMA if not cfg.sandwich_norms else (*(t for t in LLAMA if t.path != ("blocks", "mlp_norm", "scale")),
                                                  *SANDWICH)
    if cfg.kv_lora_rank:  # latent attention's tensors for q, k, v and o
        norms = (*(t for t in norms if t.path[:2] != ("blocks", "attn")), *deepseek.attention_rows(cfg, Tensor))
    whole = [t for t in (*norms, *SWIGLU)
             if t.path[0] != "blocks" and not (cfg.tie_embeddings and t.path == ("head_DV",))]
    mlp = lambda kind: family.experts.tensors if cfg.n_experts and not kind.dense else SWIGLU
    layer = lambda kind: [t for t in (*norms, *mlp(kind), *options) if t.path[0] == "blocks"]
    P, lead = len(cfg.layer_prefix), cfg.lead_kinds
    stacks = [("lead", lead, P // max(len(lead), 1), 0, len(lead) > 1), ("blocks", cfg.kinds, cfg.periods, P,
                                                                          bool(cfg.layer_pattern))]
    if cfg.mtp_depth and not family.deepseek_moe:
        raise InputError(f"model.mtp_depth = {cfg.mtp_depth}: a {family.model_type} checkpoint holds no multi-token "
                         f"prediction modules (deepseek_v3 and glm4_moe do)")
    mtp = deepseek.mtp_rows(cfg, Tensor, layer(cfg.kinds[-1])) if cfg.mtp_depth else []
    return whole + [dataclasses.replace(t, path=(stack, *((f"layer{j}",) if period else ()), *t.path[1:]),
                                        layers=(first + j, len(kinds)), entries=entries)
                    for stack, kinds, entries, first, period in stacks if entries
                    for j, kind in enumerate(kinds) for t in layer(kind)] + mtp


# ---------------------------------------------------------------------------------------------- reading

def config_from_hf(d: dict) -> TransformerConfig:
    """The TransformerConfig of a `config.json` of one of FAMILIES; anything meshpar's model does not
    implement is refused with the key that asks for it."""
    family = FAMILIES.get(d.get("model_type"))
    if family is None:
        raise InputError(f"config.json: model_type = {d.get('model_type')!r} is not one meshpar can convert: "
                         f"{', '.join(FAMILIES)}")
    if family.architecture not in (d.get("architectures") or [family.architecture]):
        raise InputError(f"config.json: architectures = {d['architectures']}: only {family.architecture} (a language "
                         f"model head) can be converted")
    _refuse_what_is_not_implemented(d, family)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    if missing:
        raise InputError(f"config.json lacks {', '.join(missing)}")
    d, rotary = deepseek.partial_rotary(d) if family.partial_rotary else (d, {})
    theta, scaling = _rope(_global_rope(d) if family.gemma else deepseek.yarn_keys(d) if family.latent else d)
    heads, hidden = d["num_attention_heads"], d["hidden_size"]
    # Defaults are transformers' config classes', for keys an older config.json leaves out.
    fields = dict(
        vocab_size=d["vocab_size"], d_model=hidden, n_layers=d["num_hidden_layers"], n_heads=heads,
        n_kv_heads=d.get("num_key_value_heads") or heads, d_ff=d["intermediate_size"],
        max_seq_len=d.get("max_position_embeddings", 2048), tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        rope_theta=float(theta), rope_scaling=scaling, norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        head_dim=0 if d.get("head_dim") in (None, hidden // heads) else d["head_dim"],
        qkv_bias=_attention_option(d, family, "qkv_bias"), qk_norm=_attention_option(d, family, "qk_norm"),
        mlp_activation=_activation(d, family),
        **(_gemma_from_hf(d) if family.gemma else {}), **(_gpt_oss_from_hf(d) if family.gpt_oss else {}),
        **_layers_from_hf(d, family), **_experts_from_hf(d, family))
    return TransformerConfig(**{**fields, **rotary, **(deepseek.latent_fields(d) if family.latent else {}),
                                **(deepseek.moe_fields(d) if family.deepseek_moe else {})})


# The config.json keys of attention options a family may have or not (`Family.qkv_bias`, `qk_norm` None)
_ATTENTION_KEYS = {"qkv_bias": "attention_bias", "qk_norm": "use_qk_norm"}


def _attention_option(d: dict, family: Family, option: str) -> bool:
    """Whether a checkpoint's attention has `option` (qkv_bias, qk_norm): always or never as its family has it,
    else as its config.json says."""
    fixed = getattr(family, option)
    return bool(d.get(_ATTENTION_KEYS[option], False)) if fixed is None else fixed


# Hugging Face's names of the gated MLP's activations (`TransformerConfig.mlp_activation`)
HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def _gated_unit(family: Family) -> str:
    """The gated unit (`TransformerConfig.mlp_activation`) a family's checkpoints compute."""
    return "gelu_tanh" if family.gemma else "clamped_swiglu" if family.gpt_oss else "silu"


def _activation(d: dict, family: Family) -> str:
    """The gated unit of a config.json: gpt-oss's own (its `hidden_act` is not read), else `hidden_act`'s."""
    if family.gpt_oss:
        return _gated_unit(family)
    name = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    ours = {hf_name: name for name, hf_name in HF_ACTIVATIONS.items()}
    if name not in ours:
        raise InputError(f"config.json: hidden_act = {name!r} is not implemented: meshpar's gated MLP takes "
                         f"{', '.join(ours)}")
    return ours[name]


def _gemma_from_hf(d: dict) -> dict:
    """Gemma's layer (`Family.gemma`) as TransformerConfig fields."""
    head_size = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    scalar = d.get("query_pre_attn_scalar") or head_size
    return {"norm_plus_one": True, "sandwich_norms": True, "embed_scale": True,
            "query_scale": 0.0 if scalar == head_size else float(scalar),
            "attn_softcap": float(d.get("attn_logit_softcapping") or 0.0),
            "logit_softcap": float(d.get("final_logit_softcapping") or 0.0)}


def _gpt_oss_from_hf(d: dict) -> dict:
    """gpt-oss's layer (`Family.gpt_oss`) as TransformerConfig fields; the SwiGLU's defaults are transformers'."""
    return {"o_bias": True, "attn_sinks": True, "moe_bias": True,
            "swiglu_alpha": float(d.get("swiglu_alpha", 1.702)), "swiglu_limit": float(d.get("swiglu_limit", 7.0))}


def _global_rope(d: dict) -> dict:
    """The config.json of Gemma's full-attention layers' rotary positions, in the keys `_rope` reads:
    transformers ≥ 5's `rope_parameters` per layer type, or 4.x's `rope_theta` and `rope_scaling`."""
    per_type = d.get("rope_parameters") or {}
    return {**d, "rope_parameters": per_type.get("full_attention")} if "full_attention" in per_type else d


def _local_rope(d: dict) -> tuple[float, RopeScaling]:
    """Gemma's sliding layers' rotary base and scaling: `rope_parameters.sliding_attention`, or 4.x's
    `rope_local_base_freq` (unscaled)."""
    per_type = d.get("rope_parameters") or {}
    if "sliding_attention" in per_type:
        return _rope({**d, "rope_parameters": per_type["sliding_attention"], "rope_scaling": None})
    return float(d.get("rope_local_base_freq", 10_000.0)), RopeScaling()


def _layers_from_hf(d: dict, family: Family) -> dict:
    """The TransformerConfig fields of the layers' kinds: a window in every layer (`sliding_window`), or the
    shortest period of per-layer kinds that repeats (`layer_pattern`)."""
    n = d["num_hidden_layers"]
    if family.windowed:
        return {"sliding_window": d.get("sliding_window") or 0}
    window = (d.get("sliding_window") or 0) if family.gemma or family.gpt_oss or d.get("use_sliding_window") else 0
    types = d.get("layer_types") or _default_layer_types(d, family, window)
    if len(types) != n or not set(types) <= {"full_attention", "sliding_attention"}:
        raise InputError(f"config.json: layer_types = {json.dumps(types)} is not implemented: meshpar reads one of "
                         f"full_attention or sliding_attention per layer, {n} in all")
    only = set(d.get("mlp_only_layers") or ())
    step = d.get("decoder_sparse_step") or 1
    local = dict(zip(("rope_theta", "rope_scaling"), _local_rope(d))) if family.local_rope else {}
    kinds = [LayerKind(**({"window": window, **local} if kind == "sliding_attention" else {}),
                       dense=family.dense_layers and (i in only or (i + 1) % step != 0)) for i, kind in enumerate(types)]
    period = next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))
    if period == 1 and kinds[0] == LayerKind(window=kinds[0].window):
        return {"sliding_window": kinds[0].window}
    return {"layer_pattern": tuple(kinds[:period])}


def _default_layer_types(d: dict, family: Family, window: int) -> list[str]:
    """transformers' layer types where config.json lists none: Gemma's every n-th layer full, the others
    sliding (Gemma 3's n: `sliding_window_pattern`); Qwen's layers from `max_window_layers` on sliding."""
    n = d["num_hidden_layers"]
    if family.full_every:
        every = d.get("sliding_window_pattern") or family.full_every
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    return ["sliding_attention" if window and i >= d.get("max_window_layers", n) else "full_attention"
            for i in range(n)]


def _experts_from_hf(d: dict, family: Family) -> dict:
    """The TransformerConfig fields of a family's mixture of experts (none for a dense family)."""
    experts = family.experts
    if experts is None:
        return {}
    count_key = next((k for k in experts.count_keys if d.get(k) is not None), experts.count_keys[0])
    keys = (count_key, "num_experts_per_tok", experts.width_key, experts.shared_width_key)
    missing = [k for k in keys if k and d.get(k) is None]
    if missing:
        raise InputError(f"config.json lacks {', '.join(missing)}")
    count = d[count_key]
    if count < 1:
        raise InputError(f"config.json: {count_key} = {count} is not implemented: meshpar converts "
                         f"{family.model_type} checkpoints with experts in every layer")
    # transformers' default where a config.json leaves norm_topk_prob out (Qwen3-MoE's, Qwen2-MoE's: False)
    renormalised = experts.renormalised if experts.renormalised is not None else d.get("norm_topk_prob", False)
    return {"n_experts": count, "experts_per_token": d["num_experts_per_tok"], "d_expert": d[experts.width_key],
            "norm_topk_prob": bool(renormalised), **_shared_from_hf(d, experts)}


def _shared_from_hf(d: dict, experts: Experts) -> dict:
    """The TransformerConfig fields of a family's gated shared expert (none where it has none)."""
    if experts.shared_width_key is None:
        return {}
    shared, width = d[experts.shared_width_key], d[experts.width_key]
    if shared < 1 or shared % width:  # meshpar's shared experts are a whole number of experts wide
        raise InputError(f"config.json: {experts.shared_width_key} = {shared} is not implemented: meshpar's shared "
                         f"expert is a whole number of experts wide, a multiple of {experts.width_key} = {width}")
    return {"n_shared_experts": shared // width, "shared_expert_gate": True}


def _refuse_what_is_not_implemented(d: dict, family: Family) -> None:
    wanted = _gated_unit(family)
    if (activation := _activation(d, family)) != wanted:
        raise InputError(f"config.json: hidden_act = {HF_ACTIVATIONS[activation]!r} is not implemented for "
                         f"{family.model_type}: meshpar converts it with {HF_ACTIVATIONS[wanted]!r}")
    for key, value in family.fixed:
        if d.get(key) is not None and d[key] != value:  # null: transformers' default, which is `value`
            why = f" ({_WHY_FIXED[key]})" if key in _WHY_FIXED else ""
            raise InputError(f"config.json: {key} = {json.dumps(d[key])} is not implemented: meshpar converts "
                             f"{family.model_type} checkpoints with {key} = {json.dumps(value)}{why}")
    windowed = [kind for kind in d.get("layer_types") or () if kind != "full_attention"]
    if windowed and not family.layer_types:
        readers = ", ".join(f.model_type for f in FAMILIES.values() if f.layer_types)
        raise InputError(f"config.json: layer_types has {windowed[0]!r} layers, which meshpar does not read for "
                         f"{family.model_type} (per-layer windows: {readers})")
    fp8_blocks.block_size(d)  # a quantisation meshpar cannot read is refused here
    if d.get("attention_dropout", 0.0):
        raise InputError(f"config.json: attention_dropout = {d['attention_dropout']} is not implemented: meshpar's "
                         f"attention has no dropout")


_ROPE_KEYS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
              "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                       "truncate")}


def _rope(d: dict) -> tuple[float, RopeScaling]:
    """(RoPE base, scaling) of a config.json: transformers ≥ 5 writes `rope_parameters` {rope_type, rope_theta,
    …}; 4.x `rope_theta` and `rope_scaling` {type or rope_type, …}."""
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rope = dict(d.get(key) or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    theta = rope.pop("rope_theta", d.get("rope_theta", 10_000.0))
    if kind not in _ROPE_KEYS:
        raise InputError(f"config.json: {key} = {json.dumps(d[key])}: rope_type '{kind}' is not implemented (meshpar "
                         f"scales rotary positions by {', '.join(_ROPE_KEYS)})")
    unknown = sorted(k for k, v in rope.items() if k not in _ROPE_KEYS[kind] and v is not None)
    if unknown or d.get("partial_rotary_factor", 1.0) != 1.0:
        culprit = f"{key}.{unknown[0]}" if unknown else "partial_rotary_factor"
        raise InputError(f"config.json: {culprit} is not implemented for rope_type '{kind}'")
    original = rope.get("original_max_position_embeddings") or 0
    if kind == "default":
        return theta, RopeScaling()
    factor = rope.get("factor") or d.get("max_position_embeddings", 0) / max(original, 1)  # yarn may leave it out
    return theta, RopeScaling(kind, float(factor), int(original), float(rope.get("low_freq_factor", 1.0)),
                              float(rope.get("high_freq_factor", 4.0)), float(rope.get("beta_fast") or 32.0),
                              float(rope.get("beta_slow") or 1.0), float(rope.get("attention_factor") or 0.0),
                              rope.get("truncate", True) is not False)


# ---------------------------------------------------------------------------------------------- writing

def family_of(cfg: TransformerConfig, model_type: str | None = None) -> Family:
    """The family a checkpoint of `cfg` is written as: `model_type` if given, else the one its options
    name (latent attention deepseek_v3; a selection bias glm4_moe; with experts: sinks gpt_oss, qk_norm qwen3_moe, shared experts qwen2_moe, else mixtral; without:
    qkv_bias qwen2,
    qk_norm qwen3, sliding_window mistral, none llama); refused where the family cannot hold them."""
    if model_type is None and (cfg.kv_lora_rank or cfg.selection_bias):
        model_type = "deepseek_v3" if cfg.kv_lora_rank else "glm4_moe"
    elif model_type is None and cfg.n_experts:
        model_type = ("gpt_oss" if cfg.attn_sinks else "qwen3_moe" if cfg.qk_norm else
                      "qwen2_moe" if cfg.n_shared_experts else "mixtral")
    elif model_type is None:
        gemma = "gemma3_text" if cfg.qk_norm else "gemma2"
        model_type = (gemma if cfg.sandwich_norms else "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias
                      else "mistral" if cfg.sliding_window else "llama")
    family = FAMILIES.get(model_type)
    if family is None:
        raise InputError(f"--family {model_type}: not one of {', '.join(FAMILIES)}")
    _refuse_experts_it_cannot_hold(cfg, family)
    for option in ("qkv_bias", "qk_norm"):
        if getattr(family, option) is not None and getattr(cfg, option) != getattr(family, option):
            raise InputError(f"model.{option} = {str(getattr(cfg, option)).lower()}: a {model_type} checkpoint "
                             f"cannot hold it ({family.architecture} has {'' if getattr(family, option) else 'no '}"
                             f"{option.replace('_', ' ')})")
    if cfg.sliding_window and not (family.windowed or family.layer_types):
        windowed = ", ".join(f.model_type for f in FAMILIES.values() if f.windowed or f.layer_types)
        raise InputError(f"model.sliding_window = {cfg.sliding_window}: a {model_type} checkpoint cannot hold it "
                         f"(of the families meshpar writes, those with windows: {windowed})")
    _refuse_a_pattern_it_cannot_hold(cfg, family)
    _refuse_a_layer_it_cannot_hold(cfg, family)
    return family


def _refuse_a_layer_it_cannot_hold(cfg: TransformerConfig, family: Family) -> None:
    """Gemma's layer (`Family.gemma`) in a Gemma family, gpt-oss's in gpt_oss, Llama's elsewhere."""
    wanted = {"norm_plus_one": family.gemma, "sandwich_norms": family.gemma, "embed_scale": family.gemma,
              "mlp_activation": _gated_unit(family), "o_bias": family.gpt_oss, "attn_sinks": family.gpt_oss,
              "moe_bias": family.gpt_oss, "router_score": "sigmoid" if family.deepseek_moe else "softmax",
              "selection_bias": family.deepseek_moe}
    if bool(cfg.kv_lora_rank) != family.latent:
        raise InputError(f"model.kv_lora_rank = {cfg.kv_lora_rank}: a {family.model_type} checkpoint cannot hold it "
                         f"({family.architecture} has {'latent' if family.latent else 'no latent'} attention)")
    if cfg.rotary_dims and not family.partial_rotary:
        raise InputError(f"model.rotary_dims = {cfg.rotary_dims}: a {family.model_type} checkpoint cannot hold it "
                         f"(its heads rotate whole; partial rotary: "
                         f"{', '.join(f.model_type for f in FAMILIES.values() if f.partial_rotary)})")
    for field, value in wanted.items():
        if getattr(cfg, field) != value:
            raise InputError(f"model.{field} = {json.dumps(getattr(cfg, field))}: a {family.model_type} checkpoint "
                             f"cannot hold it ({family.architecture} has {field} = {json.dumps(value)})")
    for field in ("query_scale", "attn_softcap", "logit_softcap"):
        if getattr(cfg, field) and not (family.gemma or family.latent and field == "query_scale"):
            raise InputError(f"model.{field} = {getattr(cfg, field)}: a {family.model_type} checkpoint cannot hold it "
                             f"(of the families meshpar writes, Gemma's have it)")


def _refuse_a_pattern_it_cannot_hold(cfg: TransformerConfig, family: Family) -> None:
    named = [(f"model.{field}[{j}]", k) for field in ("layer_prefix", "layer_pattern")
             for j, k in enumerate(getattr(cfg, field))]
    kinds, name = [k for _, k in named], family.model_type
    windows = sorted({k.window for k in kinds if k.window})
    # Gemma's sliding layers have a rotary base (and scaling) of their own, one for all of them
    local = {(k.rope_theta, k.rope_scaling) for k in kinds if k.window} if family.local_rope else set()
    culprit = next((f"{where}.{field}" for where, k in named for field in ("rope_theta", "rope_scaling")
                    if getattr(k, field) and not (k.window and len(local) == 1)), None)
    if culprit:
        held = "one for every sliding layer, the others the model's" if family.local_rope else "the same in every layer"
        raise InputError(f"{culprit}: a {name} checkpoint cannot hold it (its rotary positions are {held})")
    if windows and not family.layer_types:
        raise InputError(f"model.layer_pattern has windowed layers: a {name} checkpoint cannot hold them (per-layer "
                         f"windows: {', '.join(f.model_type for f in FAMILIES.values() if f.layer_types)})")
    if len(windows) > 1:
        raise InputError(f"model.layer_pattern has windows {windows}: a {name} checkpoint holds one (sliding_window)")
    # dense layers anywhere where the family lists them; DeepSeek's families hold a dense prefix (moe_json checks it)
    dense = next((where for where, k in named if k.dense and not family.dense_layers
                  and not (family.deepseek_moe and where.startswith("model.layer_prefix"))), None)
    if dense:
        raise InputError(f"{dense}.dense = true: a {name} checkpoint cannot hold it (dense layers beside experts: "
                         f"{', '.join(f.model_type for f in FAMILIES.values() if f.dense_layers or f.deepseek_moe)})")


def _refuse_experts_it_cannot_hold(cfg: TransformerConfig, family: Family) -> None:
    name, experts = family.model_type, family.experts
    if bool(cfg.n_experts) != (experts is not None):
        raise InputError(f"model.n_experts = {cfg.n_experts}: a {name} checkpoint cannot hold it "
                         f"({family.architecture} has {'experts in every layer' if experts else 'no experts'})")
    shared = experts is not None and (experts.shared_width_key or experts.shared_count_key) is not None
    if experts and bool(cfg.n_shared_experts) != shared:
        held = "no shared experts" if not shared else "a shared expert" if experts.shared_width_key else "shared experts"
        raise InputError(f"model.n_shared_experts = {cfg.n_shared_experts}: a {name} checkpoint cannot hold it "
                         f"({family.architecture} has {held})")
    gated = shared and experts.shared_width_key is not None
    if shared and cfg.shared_expert_gate != gated:
        raise InputError(f"model.shared_expert_gate = {str(cfg.shared_expert_gate).lower()}: a {name} checkpoint "
                         f"cannot hold it ({family.architecture} {'always' if gated else 'never'} gates its shared "
                         f"experts)")
    if experts and experts.renormalised not in (None, cfg.norm_topk_prob):
        raise InputError(f"model.norm_topk_prob = {str(cfg.norm_topk_prob).lower()}: a {name} checkpoint cannot "
                         f"hold it ({family.architecture} {'always' if experts.renormalised else 'never'} "
                         f"renormalises the top-k probabilities)")


def config_to_hf(cfg: TransformerConfig, model_type: str | None = None) -> dict:
    """A `config.json` that transformers loads as `family_of(cfg, model_type)`, computing what meshpar's model
    computes."""
    family = family_of(cfg, model_type)
    rope = {**_rope_to_hf(cfg.rope_theta, cfg.rope_scaling), **(deepseek.rope_json(cfg) if family.latent else {}),
            **({"partial_rotary_factor": (cfg.rotary_dims or cfg.head_size) / cfg.head_size}
               if family.partial_rotary else {})}
    scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    return {
        "architectures": [family.architecture], "model_type": family.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_size,
        "max_position_embeddings": cfg.max_seq_len,
        # gpt-oss's config carries transformers' default, which its clamped SwiGLU does not read
        "hidden_act": "silu" if family.gpt_oss else HF_ACTIVATIONS[cfg.mlp_activation],
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, **dict(family.fixed),
        **({"sliding_window": cfg.sliding_window or None} if family.windowed else {}),
        **(_layer_types_to_hf(cfg) if family.layer_types else {}), **_experts_to_hf(cfg, family),
        # transformers ≥ 5 reads rope_parameters and dtype; 4.x reads rope_theta, rope_scaling and torch_dtype
        "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "rope_scaling": {"rope_type": rope["rope_type"], **scaling} if scaling else None,
        "dtype": "float32", "torch_dtype": "float32", **(_gemma_to_hf(cfg, family) if family.gemma else {}),
        **({"swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit} if family.gpt_oss else {}),
        **(deepseek.latent_json(cfg) if family.latent else {}), **(deepseek.moe_json(cfg) if family.deepseek_moe else {}),
        **({key: getattr(cfg, option) for option, key in _ATTENTION_KEYS.items() if getattr(family, option) is None}),
    }


def _rope_to_hf(theta: float, s: RopeScaling) -> dict:
    """`rope_parameters` of a rotary base and scaling, as transformers ≥ 5 reads them."""
    fields = {"linear": {"factor": s.factor},
              "llama3": {"factor": s.factor, "original_max_position_embeddings": s.original_max_seq_len,
                         "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor},
              "yarn": {"factor": s.factor, "original_max_position_embeddings": s.original_max_seq_len,
                       "beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
                       **({"attention_factor": s.attention_factor} if s.attention_factor else {}),
                       **({} if s.truncate else {"truncate": False})}}.get(s.kind, {})
    return {"rope_type": "default" if s.kind == "none" else s.kind, "rope_theta": theta, **fields}


def _gemma_to_hf(cfg: TransformerConfig, family: Family) -> dict:
    """The config.json keys of Gemma's layer: its scores' scalar, soft-capping and (Gemma 3) a rotary base per
    layer type."""
    scalar = cfg.query_scale or cfg.head_size
    out = {"hidden_activation": HF_ACTIVATIONS[cfg.mlp_activation],
           "query_pre_attn_scalar": int(scalar) if scalar == int(scalar) else scalar,  # transformers wants an int
           "attn_logit_softcapping": cfg.attn_softcap or None, "final_logit_softcapping": cfg.logit_softcap or None}
    if family.local_rope:
        local = next((k for k in cfg.kinds if k.window), LayerKind())
        local_theta, local_scaling = local.rope_theta or cfg.rope_theta, local.rope_scaling or cfg.rope_scaling
        out |= {"rope_parameters": {"full_attention": _rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
                                    "sliding_attention": _rope_to_hf(local_theta, local_scaling)},
                "rope_local_base_freq": local_theta}
    return out


def _layer_kinds(cfg: TransformerConfig) -> list[LayerKind]:
    """Each layer's kind, in the checkpoint's order: the prefix's, then the pattern's over the periods."""
    return [*cfg.layer_prefix, *(cfg.kinds[i % len(cfg.kinds)] for i in range(cfg.n_layers - len(cfg.layer_prefix)))]


def _layer_types_to_hf(cfg: TransformerConfig) -> dict:
    """The config.json keys of per-layer windows: each layer's type, and the one window of the sliding ones."""
    windows = [kind.window for kind in _layer_kinds(cfg)]
    window = max(windows)
    return {"use_sliding_window": bool(window), "sliding_window": window or None, "max_window_layers": cfg.n_layers,
            "layer_types": ["sliding_attention" if w else "full_attention" for w in windows]}


def _experts_to_hf(cfg: TransformerConfig, family: Family) -> dict:
    """The config.json keys of a family's mixture of experts (none for a dense family)."""
    experts = family.experts
    if experts is None:
        return {}
    dense = [i for i, kind in enumerate(_layer_kinds(cfg)) if kind.dense]
    return {experts.count_keys[0]: cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            **({"decoder_sparse_step": 1, "mlp_only_layers": dense} if family.dense_layers else {}),
            experts.width_key: cfg.expert_width,
            **({"norm_topk_prob": cfg.norm_topk_prob} if experts.renormalised is None else {}),
            **({experts.shared_width_key: cfg.n_shared_experts * cfg.expert_width} if experts.shared_width_key
               else {}),
            **({experts.shared_count_key: cfg.n_shared_experts} if experts.shared_count_key else {})}
