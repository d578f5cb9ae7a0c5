"""Hugging Face ↔ meshpar, for every family meshpar converts (`hf_reference.FAMILIES`: llama with Llama 3.1's
RoPE scaling, mistral with a head dim of its own and a sliding window, qwen2 with q/k/v biases, tied embeddings and YaRN, qwen3
with q/k norms, a head dim of its own and linear scaling, gemma2 and gemma3_text with Gemma's layer, alternating
windows, soft-capping (Gemma 2) and per-type rotary bases (Gemma 3); GQA in all): imported weights give
transformers' logits on one device and on TP, FSDP and ring context-parallel meshes (float32, relative 1e-5;
the meshes in the slow tier), greedy
generation gives transformers' tokens, and an export loads back into transformers as the same family with
the same logits. Llama checkpoints in several shards, from bfloat16 and tied; each device reads only its
block; unsupported configs and mismatched weights are refused by name; `launch.convert` end to end.
Training step for step against PyTorch: test_hf_training.py.

Measured here (max |meshpar − transformers| / max |transformers|): 2.4e-7 to 3.4e-6 over the families and
meshes; exports give transformers' logits exactly (0.0)."""

import dataclasses
import functools
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from conftest import require_devices
from hf_reference import FAMILIES, SMALL, call
from launch import convert
from meshpar import context, mesh as mesh_lib, rules as rules_lib, sharding
from meshpar.errors import InputError
from models import hf
from models.hf import checkpoint
from models.rope import RopeScaling
from models.transformer import Transformer

RULES = rules_lib.default()
TOKENS_BT = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (4, 16))
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def hf_model(directory, model_type: str = "llama", seed: int = 0, fields: dict | None = None, **saving) -> str:
    """A random `model_type` model (`hf_reference.save_random`) of its FAMILIES shape saved in `directory`."""
    call("save_random", str(directory), model_type, {**FAMILIES[model_type], **(fields or {})}, seed,
         *saving.values())
    return str(directory)


@functools.cache
def family_config(model_type: str) -> dict:
    """transformers' `config.json` of the small `model_type` model."""
    return call("hf_config", model_type, FAMILIES[model_type])


def hf_logits(directory) -> np.ndarray:
    """transformers' logits of the checkpoint in `directory` for TOKENS_BT."""
    return call("logits", str(directory), TOKENS_BT.tolist())


def build_mesh(spec: str):
    config = mesh_lib.parse(spec)
    n = math.prod(config.sizes().values())
    require_devices(n)
    return mesh_lib.build(config, jax.devices()[:n])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef, compute, params, tokens_BT):
    with context.use(compute):
        return nnx.merge(graphdef, params)(tokens_BT)


def meshpar_logits(params: nnx.State, cfg, mesh, kernel: str = "auto", adapters=None) -> np.ndarray:
    """The logits of meshpar's Transformer with `params` (and LoRA `adapters`), run on `mesh` as a training step
    runs it (with the attention kernel `kernel`: `auto` is the dense one at these lengths on CPU)."""
    graphdef, _ = Transformer.abstract(cfg, adapters)
    tokens_BT = jax.device_put(TOKENS_BT, sharding.batch_sharding(mesh, RULES, TOKENS_BT.shape))
    compute = context.Compute(mesh, RULES, attention_kernel=kernel)
    return np.asarray(_forward(graphdef, compute, params, tokens_BT))


def relative_error(a: np.ndarray, reference: np.ndarray) -> float:
    return float(np.max(np.abs(a - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model_type, checkpoint directory, transformers' logits) of each family's small random model."""
    directory = hf_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, directory, hf_logits(directory)


SLOW = pytest.mark.slow  # `make test-slow`: kept out of `make test`'s time (generation and export run on a mesh there)


@pytest.mark.parametrize(("spec", "kernel"), [
    pytest.param("", "auto", id="one-device"), pytest.param("", "blockwise", id="blockwise-kernel", marks=SLOW),
    pytest.param("model=2", "auto", id="tp", marks=SLOW), pytest.param("fsdp=4", "auto", id="fsdp", marks=SLOW),
    pytest.param("sequence=2", "auto", id="ring-cp", marks=SLOW)])
def test_imported_logits_match_transformers(family, spec, kernel):
    model_type, directory, reference = family
    mesh = build_mesh(spec)
    cfg = hf.load_config(directory)
    params = hf.import_params(directory, cfg, mesh, RULES)
    shardings = sharding.state_shardings(Transformer.abstract(cfg)[1], mesh, RULES)
    wq = lambda state: next(v for path, v in nnx.to_flat_state(state) if path[-1] == "wq_DNH")
    assert wq(params)[...].sharding == wq(shardings).get_value()
    error = relative_error(meshpar_logits(params, cfg, mesh, kernel), reference)
    print(f"{model_type} on {spec or 'one device'} ({kernel} kernel): max relative logits difference {error:.2e}")
    assert error < 1e-5


def test_the_options_shape_the_logits(family):
    """Each family's small model has its options on (not a Llama by another name): its config has them, and
    without its RoPE scaling, window, query scalar or soft-capping meshpar's logits would be far from
    transformers'."""
    model_type, directory, reference = family
    cfg = hf.load_config(directory)
    options = {"llama": ("llama3", 0, False, False, 0), "mistral": ("none", 32, False, False, 5),
               "qwen2": ("yarn", 0, True, False, 0), "qwen3": ("linear", 32, False, True, 0),
               "gemma2": ("none", 32, False, False, 0), "gemma3_text": ("linear", 32, False, True, 0)}[model_type]
    assert (cfg.rope_scaling.kind, cfg.head_dim, cfg.qkv_bias, cfg.qk_norm, cfg.sliding_window) == options
    assert cfg.tie_embeddings == (model_type in ("qwen2", "gemma2", "gemma3_text")) and cfg.n_kv_heads < cfg.n_heads
    mesh = build_mesh("")
    for option, off in (("rope_scaling", RopeScaling()), ("sliding_window", 0), ("query_scale", 0.0),
                        ("attn_softcap", 0.0), ("logit_softcap", 0.0)):
        if getattr(cfg, option) != off:
            without = dataclasses.replace(cfg, **{option: off})
            assert relative_error(meshpar_logits(hf.import_params(directory, cfg, mesh, RULES), without, mesh),
                                  reference) > 1e-3, option


def test_greedy_generation_matches_transformers(family):
    """meshpar's KV-cache generation on fsdp=2 × model=2 continues prompts token for token as transformers'
    greedy generate."""
    from meshpar import generate

    model_type, directory, _ = family
    mesh = build_mesh("fsdp=2,model=2")
    cfg = hf.load_config(directory)
    graphdef, _ = Transformer.abstract(cfg)
    model = nnx.merge(graphdef, hf.import_params(directory, cfg, mesh, RULES))
    prompt_BT = TOKENS_BT[:2, :6]
    expected = call("greedy", directory, prompt_BT.tolist(), 12)
    np.testing.assert_array_equal(generate.generate(model, prompt_BT, 12, mesh, RULES), expected)


def test_export_loads_in_transformers_as_the_same_family(family, tmp_path):
    model_type, directory, reference = family
    mesh = build_mesh("fsdp=2,model=2")
    cfg = hf.load_config(directory)
    params = hf.import_params(directory, cfg, mesh, RULES)
    # small shards, so the export writes an index as transformers does for large models
    written = hf.export(params, cfg, tmp_path / "out", max_shard_bytes=60_000, model_type=model_type)
    assert (tmp_path / "out" / hf.INDEX_FILE) in written and len(written) > 3
    assert call("describe", str(tmp_path / "out")) == {"class": ARCHITECTURES[model_type],
                                                       "tied": cfg.tie_embeddings}
    error = relative_error(hf_logits(tmp_path / "out"), reference)
    print(f"{model_type} round trip: max relative logits difference {error:.2e}")
    assert error == 0.0  # the same float32 weights
    assert hf.config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == cfg


def test_the_family_written_is_the_models_unless_asked():
    """Without a family named, the model's options choose it (qwen3: q/k norms, qwen2: biases, mistral: a
    sliding window, else llama);
    a family that cannot hold the model is refused, naming the option."""
    configs = {t: hf.config_from_hf(family_config(t)) for t in FAMILIES}
    assert {t: hf.family_of(cfg).model_type for t, cfg in configs.items()} == {t: t for t in FAMILIES}
    assert hf.family_of(configs["llama"], "mistral").model_type == "mistral"
    with pytest.raises(InputError, match=r"model.sliding_window = 5: a llama checkpoint cannot hold it"):
        hf.config_to_hf(configs["mistral"], "llama")
    with pytest.raises(InputError, match=r"model.qkv_bias = true: a llama checkpoint cannot hold it"):
        hf.config_to_hf(configs["qwen2"], "llama")
    with pytest.raises(InputError, match=r"model.qk_norm = false: a qwen3 checkpoint cannot hold it"):
        hf.config_to_hf(configs["llama"], "qwen3")
    with pytest.raises(InputError, match="--family gemma: not one of llama, mistral, qwen2, qwen3, gemma2, "
                                         "gemma3_text, mixtral"):
        hf.family_of(configs["llama"], "gemma")


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory):
    """An untied Llama saved in several safetensors shards with an index."""
    directory = tmp_path_factory.mktemp("sharded")
    hf_model(directory, dtype="float32", max_shard_size="100KB")
    assert (directory / hf.INDEX_FILE).is_file() and not (directory / hf.SINGLE_FILE).exists()
    return directory


def test_each_device_reads_only_its_block(sharded_llama, monkeypatch):
    """On fsdp=2 × model=2 every matrix splits four ways, and each read from the files is one quarter of a
    layer's tensor: no whole tensor is assembled on the host on its way to the devices."""
    reads = []
    read = checkpoint._from_hf
    monkeypatch.setattr(checkpoint, "_from_hf", lambda kind, part, box, shape: reads.append((box, shape))
                        or read(kind, part, box, shape))
    cfg = hf.load_config(sharded_llama)
    params = hf.import_params(sharded_llama, cfg, build_mesh("fsdp=2,model=2"), RULES)
    matrices = [(box, shape) for box, shape in reads if len(shape) > 1]
    assert len(matrices) == 4 * (2 + 7 * SMALL["num_hidden_layers"])  # per device: embed, head, 7 per layer
    assert all(4 * math.prod(b - a for a, b in box) == math.prod(shape) for box, shape in matrices)
    assert relative_error(meshpar_logits(params, cfg, build_mesh("fsdp=2,model=2")), hf_logits(sharded_llama)) < 1e-5


def test_tied_bfloat16_checkpoint(tmp_path):
    """A bfloat16 file of a tied model: meshpar reads it into float32 as transformers does."""
    hf_model(tmp_path, seed=1, fields={"tie_word_embeddings": True}, dtype="bfloat16")
    with safe_open(tmp_path / hf.SINGLE_FILE, framework="np") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
        assert "lm_head.weight" not in f.keys()
    reference = hf_logits(tmp_path)  # transformers reads the bfloat16 file into float32
    cfg = hf.load_config(tmp_path)
    assert cfg.tie_embeddings
    mesh = build_mesh("fsdp=2,model=2")
    error = relative_error(meshpar_logits(hf.import_params(tmp_path, cfg, mesh, RULES), cfg, mesh), reference)
    print(f"tied, bfloat16 file, fsdp=2,model=2: max relative logits difference {error:.2e}")
    assert error < 1e-5


@pytest.mark.parametrize(("model_type", "change", "culprit"), [
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not implemented"),
    ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope'"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                "mscale": 0.7}}, "rope_scaling.mscale is not implemented"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"attention_bias": True}, "attention_bias = true is not implemented"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"model_type": "gemma"}, "model_type = 'gemma' is not one meshpar can convert"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "only LlamaForCausalLM"),
    ("llama", {"layer_types": ["full_attention", "sliding_attention"]},
     r"layer_types has 'sliding_attention' layers, which meshpar does not read for llama \(per-layer windows: qwen2"),
    ("qwen2", {"layer_types": ["full_attention", "chunked_attention"]}, r"layer_types = \[.*is not implemented"),
    ("qwen3", {"layer_types": ["full_attention"]}, r"layer_types = \[.*one of full_attention or sliding_attention"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"attention_dropout": 0.1}, "attention_dropout"),
])
def test_unsupported_configs_are_refused(model_type, change, culprit):
    config = family_config(model_type)
    if "rope_scaling" in change:  # as transformers 4.x writes it: no rope_parameters
        config = {k: v for k, v in config.items() if k != "rope_parameters"}
    with pytest.raises(InputError, match=culprit):
        hf.config_from_hf({**config, **change})


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_config_round_trip(model_type):
    cfg = hf.config_from_hf(family_config(model_type))
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta, cfg.norm_eps) == (4, 2, 5000.0, SMALL["rms_norm_eps"])
    assert hf.config_from_hf(hf.config_to_hf(cfg, model_type)) == cfg


@pytest.mark.parametrize(("change", "culprit"), [
    ({"n_layers": 3}, "tensor model.layers.2.input_layernorm.weight is missing"),
    ({"n_layers": 1}, "unexpected tensor model.layers.1."),
    ({"d_ff": 96}, r"tensor model.layers.0.mlp.gate_proj.weight has shape \(128, 64\)"),
    ({"qkv_bias": True}, r"tensor model.layers.0.self_attn.k_proj.bias is missing \(6 missing in all"),
])
def test_weights_that_do_not_fit_the_config_are_refused(sharded_llama, change, culprit):
    cfg = dataclasses.replace(hf.load_config(sharded_llama), **change)
    with pytest.raises(InputError, match=culprit):
        hf.import_params(sharded_llama, cfg, build_mesh(""), RULES)


def test_convert_cli_from_hf_then_to_hf_keeps_the_family(tmp_path, capsys):
    """A Mistral checkpoint (which meshpar's options alone would write as Llama) goes in and comes back out as
    Mistral, with transformers' logits."""
    require_devices(8)
    hf_model(tmp_path / "hf", "mistral")
    convert.main(["from-hf", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "params")])
    assert "peak host RSS" in capsys.readouterr().out
    convert.main(["to-hf", "--checkpoint", str(tmp_path / "params"), "--out", str(tmp_path / "back"),
                  "--mesh", "fsdp=4,model=2"])
    assert call("describe", str(tmp_path / "back"))["class"] == "MistralForCausalLM"
    error = relative_error(hf_logits(tmp_path / "back"), hf_logits(tmp_path / "hf"))
    print(f"CLI from-hf → to-hf: max relative logits difference {error:.2e}")
    assert error == 0.0
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(SystemExit, match=r"^error: .*neither model.safetensors nor"):
        convert.main(["from-hf", "--hf-dir", str(tmp_path / "bare"), "--out", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match=r"^error: model.qkv_bias = false: a qwen2 checkpoint cannot hold it"):
        convert.main(["to-hf", "--checkpoint", str(tmp_path / "params"), "--out", str(tmp_path / "qwen"),
                      "--family", "qwen2"])
    with pytest.raises(SystemExit, match=rf"^error: {tmp_path / 'params'} holds no LoRA adapters \(train.lora_rank = "
                                         rf"0\): to-hf writes its weights$"):
        convert.main(["to-peft", "--checkpoint", str(tmp_path / "params"), "--out", str(tmp_path / "adapter")])
