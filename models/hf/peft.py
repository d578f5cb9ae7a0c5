"""LoRA adapters ↔ PEFT's adapter directories: `adapter_config.json` and `adapter_model.safetensors`.

PEFT names a layer's adapter after the module it adapts: `base_model.model.<module>.lora_A.weight` [R, in] and
`….lora_B.weight` [out, R], the module's weight being W [out, in] (torch's Linear). meshpar's adapter of a
weight [in..., out...] is A [in..., R] and B [R, out...] (`meshpar.lora`), so A = lora_Aᵀ and B = lora_Bᵀ with
the in and out axes flattened as Hugging Face flattens them (heads first: `models.hf.families`), stacked
over the layers. A tensor goes to PEFT where meshpar's weight has an adapter (`lora.attach` decides: a
mixture's routed experts have one only with the `experts` target), and `target_modules` names those modules:
q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (the MLP's, and Qwen2-MoE's shared expert's),
and latent attention's (DeepSeek-V3's) q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj (or q_proj), o_proj.
Where the import reorders a weight's rotary rows (`Tensor.rope`: q(_b) and kv_a's rotary key), lora_B's rows
are those rows too, reordered the same way in and back out.
Refused both ways: adapters on routed experts (transformers fuses the experts into tensors, which PEFT adapts
by `target_parameters`; export them merged, `launch.convert to-hf --merge-lora`), and, in a model with routed
experts, the other MLPs' (a Qwen3-MoE's layers without experts, a Qwen2-MoE's shared expert): there PEFT takes
gate_proj, up_proj and down_proj for the fused experts.

What PEFT can hold and meshpar cannot (DoRA, biases, per-layer ranks, other modules, dropout) is refused on
import, naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from meshpar import lora
from meshpar.errors import InputError
from meshpar.rules import Rules
from meshpar.sharding import state_shardings
from models import rope
from models.hf.checkpoint import hf_names, on_host, stacked_ranges
from models.hf.families import Tensor, family_of, tensors
from models.transformer import Transformer, TransformerConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "q_a": "q_a_proj", "q_b": "q_b_proj",
           "kv_a": "kv_a_proj_with_mqa", "kv_b": "kv_b_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}
MLP_MODULES = tuple(MODULES[t] for t in ("gate", "up", "down"))
# PEFT's settings meshpar has no counterpart for, and the value that means "not used" (target_parameters first:
# PEFT adapts fused experts with it, and adds the rank_pattern that follows from it)
UNUSED = {"target_parameters": None, "use_dora": False, "bias": "none", "modules_to_save": None,
          "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False,
          "lora_dropout": 0.0}


def _module(t: Tensor) -> str:
    """The module of a tensor's name, as PEFT's target_modules name it (q_proj, …)."""
    return t.name.split(".")[-2]


def _adapted(cfg: TransformerConfig, adapters: lora.LoraConfig, model_type: str | None, held: set[tuple],
             setting: str) -> list[Tensor]:
    """The family's tensors whose weight has an adapter among the flat state paths `held`; adapters PEFT cannot
    hold are refused, naming `setting` (where their targets were asked for)."""
    if "experts" in adapters.targets:
        raise InputError(f"{setting} has experts: adapters on routed experts have no PEFT module names; write them "
                         f"merged into the weights instead (launch.convert to-hf --merge-lora)")
    rows = [t for t in tensors(cfg, family_of(cfg, model_type)) if (*_adapter_path(t), "a") in held]
    if cfg.n_experts and (mlp := sorted({_module(t) for t in rows} & set(MLP_MODULES))):
        raise InputError(f"{setting} adapts {', '.join(mlp)} of the MLPs beside the routed experts (layers "
                         f"without experts, a shared expert): PEFT takes those names for the experts' fused tensors "
                         f"in such a model; leave gate, up and down out, or write them merged (to-hf --merge-lora)")
    return rows


def _names(t: Tensor, cfg: TransformerConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(lora_A's name, lora_B's name, the layer's index on the stacked axis) of each layer of a tensor."""
    module = lambda name: PREFIX + name.removesuffix(".weight")
    return [(f"{module(name)}.lora_A.weight", f"{module(name)}.lora_B.weight", index)
            for name, index in hf_names(t, stacked_ranges(cfg, t))]


def _adapter_path(t: Tensor) -> tuple[str, ...]:
    return (*t.path[:-1], t.path[-1] + lora.SUFFIX)


def export(params: nnx.State, cfg: TransformerConfig, adapters: lora.LoraConfig, out_dir: str | Path,
           base: str, model_type: str | None = None) -> list[Path]:
    """Write the adapters of `params` as a PEFT directory over the base model `base` (its path or Hub name);
    every process must call it, process 0 writes. Returns the files written."""
    out_dir = Path(out_dir)
    flat = {path: v.get_value() for path, v in nnx.to_flat_state(params)}
    rows = _adapted(cfg, adapters, model_type, set(flat), "train.lora_targets")
    host = {}
    for t in rows:
        a, b = flat[(*_adapter_path(t), "a")], flat[(*_adapter_path(t), "b")]
        for name_a, name_b, index in _names(t, cfg):
            a_IR, b_RO = on_host(a, index), rope.pairs_from_halves(on_host(b, index), t.rope)
            host[name_a] = np.ascontiguousarray(a_IR.reshape(-1, adapters.rank).T)
            host[name_b] = np.ascontiguousarray(b_RO.reshape(adapters.rank, -1).T)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": adapters.rank,
              "lora_alpha": adapters.alpha, "use_rslora": adapters.rslora,
              "target_modules": sorted({_module(t) for t in rows}), "inference_mode": True, **UNUSED}
    if jax.process_index() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(host, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    return [out_dir / CONFIG_FILE, out_dir / WEIGHTS_FILE]


def read_config(peft_dir: str | Path) -> lora.LoraConfig:
    """The LoRA settings of a PEFT directory's adapter_config.json; what meshpar cannot run is refused."""
    path = Path(peft_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise InputError(f"cannot read {path}: {err}") from None
    if config.get("peft_type") != "LORA":
        raise InputError(f"{path}: peft_type = {config.get('peft_type')!r}: meshpar reads LORA adapters")
    for key, unused in UNUSED.items():
        value = config.get(key)
        if value not in (None, unused) and value not in ([], {}):
            raise InputError(f"{path}: {key} = {json.dumps(config[key])} is not implemented (meshpar's adapters: "
                             f"{key} = {json.dumps(unused)})")
    modules = config.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else modules
    ours = {module: target for target, module in MODULES.items()}
    if unknown := [m for m in modules if m not in ours]:
        raise InputError(f"{path}: target_modules has {unknown[0]!r}; meshpar adapts {', '.join(ours)}")
    targets = tuple(t for t in lora.TARGETS if t in {ours[m] for m in modules})
    return lora.LoraConfig(int(config["r"]), float(config["lora_alpha"]), targets, bool(config.get("use_rslora", False)))


def import_adapters(peft_dir: str | Path, cfg: TransformerConfig, model_type: str, mesh: Mesh,
                    rules: Rules) -> tuple[lora.LoraConfig, nnx.State]:
    """(the settings, the adapters) of a PEFT directory over a `model_type` base of the model `cfg`, laid out on
    `mesh` by `rules`. Missing, unexpected or misshapen tensors are refused, naming the tensor."""
    adapters = read_config(peft_dir)
    abstract = lora.adapters(Transformer.abstract(cfg, adapters)[1])
    flat = dict(nnx.to_flat_state(abstract))
    rows = _adapted(cfg, adapters, model_type, set(flat), f"{Path(peft_dir) / CONFIG_FILE}: target_modules")
    path = Path(peft_dir) / WEIGHTS_FILE
    try:
        f = safe_open(path, framework="np")
    except OSError as err:
        raise InputError(f"cannot read {path}: {err}") from None
    with f:
        present = set(f.keys())
        expected = {name for t in rows for name_a, name_b, _ in _names(t, cfg) for name in (name_a, name_b)}
        if missing := sorted(expected - present):
            raise InputError(f"{path}: tensor {missing[0]} is missing ({len(missing)} in all); is the base the one "
                             f"these adapters were trained on?")
        if unexpected := sorted(present - expected):
            raise InputError(f"{path}: unexpected tensor {unexpected[0]} ({len(unexpected)} in all), which no "
                             f"adapter of {CONFIG_FILE}'s target_modules holds")
        values = {}
        for t in rows:
            a, b = flat[(*_adapter_path(t), "a")], flat[(*_adapter_path(t), "b")]
            a_L, b_L = np.zeros(a.shape, np.float32), np.zeros(b.shape, np.float32)
            for name_a, name_b, index in _names(t, cfg):
                R, width = adapters.rank, int(np.prod(a.shape[1:-1]))
                for name, out, want, rotary in ((name_a, a_L, (R, width), 0),
                                                (name_b, b_L, (int(np.prod(b.shape[2:])), R), t.rope)):
                    tensor = f.get_tensor(name).astype(np.float32)
                    if tensor.shape != want:
                        raise InputError(f"{path}: tensor {name} has shape {tensor.shape}; the base and r = {R} "
                                         f"need {want}")
                    out[index] = rope.halves_from_pairs(tensor.T.reshape(out.shape[1:]), rotary)
            values[(*_adapter_path(t), "a")], values[(*_adapter_path(t), "b")] = a_L, b_L
    shardings = dict(nnx.to_flat_state(state_shardings(abstract, mesh, rules)))
    return adapters, nnx.from_flat_state({p: v.replace(jax.device_put(values[p], shardings[p].get_value()))
                                          for p, v in flat.items()})
