"""DeepSeek-V3's checkpoints (`deepseek_v3`: DeepSeek-V3/R1, Kimi K2, Moonlight) and GLM-4.5's (`glm4_moe`, its
mixture and leading layers with Llama's attention): what they hold beyond the Llama layout `models.hf.families`
reads, and their config.json keys.

Latent attention (`models.latent_attention`), per layer l:

| Hugging Face (layer l)                          | meshpar                          | kind                         |
|-------------------------------------------------|----------------------------------|------------------------------|
| self_attn.q_a_proj.weight [R, D]                | attn.wq_a_DR [D, R]              | transpose                    |
| self_attn.q_a_layernorm.weight [R]              | attn.q_norm.scale [R]            | same                         |
| self_attn.q_b_proj.weight [N·(Hn+Hr), R]        | attn.wq_b_RNH [R, N, Hn+Hr]      | heads_in, rope pairs → halves |
| self_attn.q_proj.weight (q_lora_rank null)      | attn.wq_DNH [D, N, Hn+Hr]        | heads_in, rope pairs → halves |
| self_attn.kv_a_proj_with_mqa.weight [C+Hr, D]   | attn.wkv_a_DA [D, C+Hr]          | transpose, rope pairs → halves |
| self_attn.kv_a_layernorm.weight [C]             | attn.kv_norm.scale [C]           | same                         |
| self_attn.kv_b_proj.weight [N·(Hn+Hv), C]       | attn.wkv_b_CNH [C, N, Hn+Hv]     | heads_in                     |
| self_attn.o_proj.weight [D, N·Hv]               | attn.wo_NHD [N, Hv, D]           | heads_out                    |

Its checkpoints rotate interleaved pairs of the rope dims (`rope_interleave`); meshpar rotates halves, so the
rope rows of q and of the rotary key are reordered evens-then-odds on import and back on export (`Tensor.rope`).

The mixture: a router `mlp.gate.weight` with the selection bias `mlp.gate.e_score_correction_bias` [E]
(`selection_bias_E`), per-expert `mlp.experts.{e}.{gate,up,down}_proj`, and `n_shared_experts` ungated
shared experts fused in `mlp.shared_experts.*` (meshpar's `n_shared_experts`, `n_shared_experts` experts wide).
Routing is sigmoid (`router_score`), group-limited (`n_group` → `expert_groups`, `topk_group` →
`topk_groups`), scaled (`routed_scaling_factor` → `routed_scaling`). Its first `first_k_dense_replace`
layers are dense (`layer_prefix`), `intermediate_size` wide. GLM-4.5 has the same mixture and leading layers;
its attention is Llama's with q, k, v biases (`attention_bias`), optional q/k norms (`use_qk_norm`) and
rotary positions on the leading `partial_rotary_factor` of each head (`rotary_dims`).

Multi-token prediction (`models.mtp`): `num_nextn_predict_layers` = `mtp_depth` modules, module k held as the
checkpoint's layer n_layers + k − 1 (DeepSeek-V3's `model.layers.61`), stacked on meshpar's `mtp_layers` axis:

| Hugging Face (layer n_layers + k − 1)             | meshpar                           | kind                     |
|---------------------------------------------------|-----------------------------------|--------------------------|
| enorm.weight, hnorm.weight [D]                    | mtp.enorm.scale, mtp.hnorm.scale  | same                     |
| eh_proj.weight [D, 2D]                            | mtp.proj_CD [2D, D]               | transpose                |
| shared_head.norm.weight [D]                       | mtp.final_norm.scale              | same                     |
| input_layernorm, self_attn.*, post_attention_layernorm, mlp.* | mtp.block.*           | as the stack's layers'   |
| embed_tokens.weight, shared_head.head.weight      | embed_VD, head_DV (`mtp_copies`)  | copies: equal or refused |

transformers' `MtpModel` (speculative decoding) computes the same logits from the same stack output
(`tests/test_mtp.py`).

YaRN (`rope_parameters` rope_type yarn): cosines and sines × `attention_factor` (or mscale(factor, mscale) /
mscale(factor, mscale_all_dim)), and the softmax scale × mscale(factor, mscale_all_dim)², which meshpar
writes as `query_scale` = (Hn + Hr) / mscale⁴, mscale(f, m) = 0.1·m·ln f + 1.
"""

from __future__ import annotations

import dataclasses
import math

from meshpar.errors import InputError
from models.rope import yarn_mscale
from models.transformer import LayerKind, TransformerConfig

_LAYER = "model.layers.{l}."
# config.json keys that must say what meshpar computes, and the values meshpar writes
MOE_FIXED = (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1))
FIXED = (("attention_bias", False), ("rope_interleave", True), *MOE_FIXED)


def attention_rows(cfg: TransformerConfig, tensor) -> tuple:
    """The latent attention's tensors of a layer (module docstring), as `families.Tensor`s built by `tensor`."""
    attn, Hr = _LAYER + "self_attn.", cfg.qk_rope_head_dim
    query = ((tensor(("blocks", "attn", "wq_a_DR"), attn + "q_a_proj.weight", "transpose"),
              tensor(("blocks", "attn", "q_norm", "scale"), attn + "q_a_layernorm.weight", "same"),
              tensor(("blocks", "attn", "wq_b_RNH"), attn + "q_b_proj.weight", "heads_in", rope=Hr))
             if cfg.q_lora_rank
             else (tensor(("blocks", "attn", "wq_DNH"), attn + "q_proj.weight", "heads_in", rope=Hr),))
    return (*query,
            tensor(("blocks", "attn", "wkv_a_DA"), attn + "kv_a_proj_with_mqa.weight", "transpose", rope=Hr),
            tensor(("blocks", "attn", "kv_norm", "scale"), attn + "kv_a_layernorm.weight", "same"),
            tensor(("blocks", "attn", "wkv_b_CNH"), attn + "kv_b_proj.weight", "heads_in"),
            tensor(("blocks", "attn", "wo_NHD"), attn + "o_proj.weight", "heads_out"))


def mtp_rows(cfg: TransformerConfig, tensor, block: list) -> list:
    """The multi-token prediction modules' tensors (module docstring) as `families.Tensor`s built by `tensor`:
    their own, and `block`, the stack's rows of a layer of their block's kind, moved under `mtp.block`."""
    at = {"layers": (cfg.n_layers, 1), "entries": cfg.mtp_depth}
    own = [tensor(("mtp", *path), _LAYER + name, kind, **at) for path, name, kind in (
        (("enorm", "scale"), "enorm.weight", "same"), (("hnorm", "scale"), "hnorm.weight", "same"),
        (("proj_CD",), "eh_proj.weight", "transpose"), (("final_norm", "scale"), "shared_head.norm.weight", "same"))]
    return own + [dataclasses.replace(t, path=("mtp", "block", *t.path[1:]), **at) for t in block]


def mtp_copies(cfg: TransformerConfig) -> list[tuple[str, str]]:
    """(a copy, the tensor it copies) of the embedding and the output head in each multi-token prediction module:
    shared with the main model in meshpar, so import refuses copies that differ and export writes them."""
    head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    return [pair for l in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth)
            for pair in ((_LAYER.format(l=l) + "embed_tokens.weight", "model.embed_tokens.weight"),
                         (_LAYER.format(l=l) + "shared_head.head.weight", head))]


def latent_fields(d: dict) -> dict:
    """The TransformerConfig fields of a deepseek_v3 config.json's latent attention."""
    missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if d.get(k) is None]
    if missing:
        raise InputError(f"config.json lacks {', '.join(missing)}")
    head_size = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    m_all = rope.get("mscale_all_dim") or 0.0
    yarn = rope.get("rope_type", rope.get("type")) == "yarn"
    scale = yarn_mscale(_yarn_factor(d, rope), m_all) if m_all and yarn else 1.0
    return {"kv_lora_rank": d["kv_lora_rank"], "q_lora_rank": d.get("q_lora_rank") or 0,
            "qk_nope_head_dim": d["qk_nope_head_dim"], "qk_rope_head_dim": d["qk_rope_head_dim"],
            "v_head_dim": d["v_head_dim"], "head_dim": 0, "query_scale": 0.0 if scale == 1 else head_size / scale**4}


def moe_fields(d: dict) -> dict:
    """The TransformerConfig fields of DeepSeek's mixture (deepseek_v3, glm4_moe): routing, shared experts and
    the dense leading layers (transformers' defaults where a key is left out)."""
    if d.get("n_shared_experts") is None:
        raise InputError("config.json lacks n_shared_experts")
    return {"n_shared_experts": d["n_shared_experts"], "router_score": "sigmoid", "selection_bias": True,
            "expert_groups": d.get("n_group") or 1, "topk_groups": d.get("topk_group") or 1,
            "routed_scaling": float(d.get("routed_scaling_factor", 1.0)),
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
            "layer_prefix": (LayerKind(dense=True),) * (d.get("first_k_dense_replace") or 0),
            "mtp_depth": d.get("num_nextn_predict_layers") or 0}


def partial_rotary(d: dict) -> tuple[dict, dict]:
    """(a glm4_moe config.json without its `partial_rotary_factor`, which `families` would refuse; the
    TransformerConfig fields of it): the leading dims of each head that rotate (transformers' default: half)."""
    rope = dict(d.get("rope_parameters") or {})
    factor = rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 0.5
    head_size = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    rest = {k: v for k, v in d.items() if k != "partial_rotary_factor"}
    return {**rest, **({"rope_parameters": rope} if rope else {})}, {"rotary_dims": int(head_size * factor)}


def _yarn_factor(d: dict, rope: dict) -> float:
    """YaRN's factor, or, where a config.json leaves it out, the context's growth (transformers' rule)."""
    original = rope.get("original_max_position_embeddings") or 1
    return rope.get("factor") or d.get("max_position_embeddings", 0) / original


def yarn_keys(d: dict) -> dict:
    """A deepseek_v3 config.json with its YaRN `mscale`/`mscale_all_dim` turned into the `attention_factor`
    transformers derives from them (the softmax's share goes to `config_fields`' query_scale)."""
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rope = dict(d.get(key) or {})
    m, m_all = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
    if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("attention_factor") is None:
        factor = _yarn_factor(d, rope)
        rope["attention_factor"] = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
                                    else yarn_mscale(factor))
    return {**d, key: rope or d.get(key)}


def latent_json(cfg: TransformerConfig) -> dict:
    """The deepseek_v3 config.json keys of `cfg`'s latent attention."""
    return {"kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "head_dim": cfg.qk_rope_head_dim, "num_nextn_predict_layers": cfg.mtp_depth}


def moe_json(cfg: TransformerConfig) -> dict:
    """The config.json keys of `cfg`'s DeepSeek mixture (deepseek_v3, glm4_moe)."""
    if any(not kind.dense for kind in cfg.layer_prefix) or any(kind.dense for kind in cfg.layer_pattern):
        raise InputError("model.layer_prefix / model.layer_pattern: a DeepSeek-style checkpoint holds dense leading "
                         "layers, then experts in every layer (first_k_dense_replace)")
    return {"n_group": cfg.expert_groups, "topk_group": cfg.topk_groups, "routed_scaling_factor": cfg.routed_scaling,
            "first_k_dense_replace": len(cfg.layer_prefix), "num_nextn_predict_layers": cfg.mtp_depth}


def rope_json(cfg: TransformerConfig) -> dict:
    """The `rope_parameters` entry that scales a deepseek_v3 model's softmax: YaRN's `mscale_all_dim`, from
    `query_scale` (none where it is unset)."""
    if not cfg.query_scale:
        return {}
    if cfg.rope_scaling.kind != "yarn" or cfg.rope_scaling.factor <= 1:
        raise InputError(f"model.query_scale = {cfg.query_scale}: a deepseek_v3 checkpoint scales its scores "
                         f"only through YaRN's mscale_all_dim (model.rope_scaling is {cfg.rope_scaling.kind}, "
                         f"factor {cfg.rope_scaling.factor})")
    mscale = (cfg.head_size / cfg.query_scale) ** 0.25
    return {"mscale_all_dim": (mscale - 1) / (0.1 * math.log(cfg.rope_scaling.factor))}
