"""Hugging Face mixtures of experts ↔ meshpar: Mixtral (with a sliding window), Qwen3-MoE (q/k norms, its
own head dim; its top-k probabilities renormalised or not), Qwen2-MoE (q/k/v biases, a shared expert gated
per token) and gpt-oss (its layer: q/k/v/o biases, attention sinks, a biased router and experts, the clamped
SwiGLU; alternating windows, YaRN; MXFP4 experts dequantised on import), `hf_reference.MOE_FAMILIES`.
Imported weights give transformers' logits on one device and on an expert-parallel mesh (float32, relative
1e-5), greedy generation gives transformers' tokens, the checkpoint meshpar writes holds the tensors it read
(the Hub's per-expert layout, which transformers' save_pretrained also writes; gpt-oss's fused one) and loads
into transformers as the same family; what meshpar's MoE cannot compute is refused by name. One prompt, which
no batch axis splits, generates the same on an expert mesh, and evaluation there gives transformers'
cross-entropy. One step's loss and every gradient, the shared expert's and gpt-oss's sinks, biases and
clamped experts among them, are PyTorch's (Qwen2-MoE, gpt-oss; relative 1e-5). Training step for step against
PyTorch, the load-balancing loss included: test_hf_training.py.

Measured here (max |meshpar − transformers| / max |transformers|), one device / expert=2,fsdp=2,model=2:
mixtral 1.6e-6 / 1.9e-6, qwen3_moe 9.6e-7 / 8.4e-7, unnormalised 8.5e-7 / 8.9e-7, qwen2_moe 1.4e-6 / 1.1e-6,
gpt_oss 2.1e-6 / 1.9e-6 (1.8e-6 on ring CP with TP; with MXFP4 experts 1.1e-6 on the expert mesh, its
weights exactly transformers' dequantised ones); one prompt's first pass in generation on expert=2,model=2:
mixtral 1.1e-6, gpt_oss 1.7e-6; exports give transformers' logits exactly (0.0). Gradients
(expert=2,fsdp=2,model=2), tensor by tensor: Qwen2-MoE at most 6.5e-6 (an expert's), 2.7e-6 of the shared
expert and its gate; gpt-oss at most 6.3e-6 (a layer's sinks; with jax 0.12 a q projection); a bias measured
with its weight (`affine_map_error`); the losses within 2e-7."""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import require_devices
from hf_reference import MOE_FAMILIES, SMALL, call
from launch import convert
from meshpar import context, generate, sharding, train
from meshpar.errors import InputError
from models import hf
from models.transformer import Transformer
from test_hf import RULES, TOKENS_BT, build_mesh, hf_logits, meshpar_logits, relative_error

EXPERT_MESH = "expert=2,fsdp=2,model=2"
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
CASES = {"mixtral": ("mixtral", {}), "qwen3_moe": ("qwen3_moe", {}),
         "qwen3_moe-unnormalised": ("qwen3_moe", {"norm_topk_prob": False}), "qwen2_moe": ("qwen2_moe", {}),
         "gpt_oss": ("gpt_oss", {})}


@functools.cache
def family_config(model_type: str) -> dict:
    """transformers' `config.json` of the small `model_type` model."""
    return call("hf_config", model_type, MOE_FAMILIES[model_type])


@pytest.fixture(scope="module", params=list(CASES))
def moe(request, tmp_path_factory):
    """(model_type, checkpoint directory, transformers' logits) of each small random mixture of experts."""
    model_type, fields = CASES[request.param]
    directory = str(tmp_path_factory.mktemp(request.param))
    call("save_random", directory, model_type, {**MOE_FAMILIES[model_type], **fields}, 0)
    return model_type, directory, hf_logits(directory)


@pytest.mark.parametrize("spec", ["", EXPERT_MESH], ids=["one-device", "expert+fsdp+tp"])
def test_imported_logits_match_transformers(moe, spec):
    model_type, directory, reference = moe
    mesh = build_mesh(spec)
    cfg = hf.load_config(directory)
    written = json.loads((Path(directory) / "config.json").read_text())
    assert (cfg.n_experts, cfg.experts_per_token, cfg.expert_width) == (4, 2, 64)
    assert cfg.norm_topk_prob == written.get("norm_topk_prob", True)  # Mixtral's have no key: always renormalised
    assert cfg.sliding_window == (8 if model_type == "mixtral" else 0) and cfg.qk_norm == (model_type == "qwen3_moe")
    shared = model_type == "qwen2_moe"  # a shared expert 128 wide: two experts' width, gated
    assert (cfg.n_shared_experts, cfg.shared_expert_gate) == ((2, True) if shared else (0, False))
    assert cfg.qkv_bias == (model_type in ("qwen2_moe", "gpt_oss"))
    oss = model_type == "gpt_oss"  # its layer, and windows of 4 on every other layer
    assert (cfg.o_bias, cfg.attn_sinks, cfg.moe_bias, cfg.mlp_activation == "clamped_swiglu") == (oss,) * 4
    assert [k.window for k in cfg.kinds] == ([4, 0] if oss else [cfg.sliding_window])
    params = hf.import_params(directory, cfg, mesh, RULES)
    shardings = sharding.state_shardings(Transformer.abstract(cfg)[1], mesh, RULES)
    stack = lambda state: state["blocks"]["layer0"] if cfg.layer_pattern else state["blocks"]
    assert stack(params)["mlp"]["w_gate_EDF"][...].sharding == stack(shardings)["mlp"]["w_gate_EDF"].get_value()
    error = relative_error(meshpar_logits(params, cfg, mesh), reference)
    print(f"{model_type} (norm_topk_prob {cfg.norm_topk_prob}) on {spec or 'one device'}: max relative logits "
          f"difference {error:.2e}")
    assert error < 1e-5
    if not spec:  # the routing weights shape the logits: the other norm_topk_prob is far off
        flipped = dataclasses.replace(cfg, norm_topk_prob=not cfg.norm_topk_prob)
        assert relative_error(meshpar_logits(params, flipped, mesh), reference) > 1e-3
    if not spec and shared:  # and so does the shared expert's gate: at a constant 1/2 for every token, far off
        gate = params["blocks"]["mlp"]["w_shared_gate_D1"]
        params["blocks"]["mlp"]["w_shared_gate_D1"] = gate.replace(jnp.zeros_like(gate[...]))
        assert relative_error(meshpar_logits(params, cfg, mesh), reference) > 1e-3
    if not spec and oss:  # and gpt-oss's clamp (the gates reach 1), its sinks, its router's and experts' biases
        assert relative_error(meshpar_logits(params, dataclasses.replace(cfg, swiglu_limit=100.0), mesh),
                              reference) > 1e-3
        for layer in ("layer0", "layer1"):
            for path in (("attn", "sinks_N"), ("mlp", "router_bias_E"), ("mlp", "down_bias_ED")):
                variable = params["blocks"][layer][path[0]][path[1]]
                saved = variable[...]
                variable.set_value(jnp.zeros_like(saved) - (100.0 if path[1] == "sinks_N" else 0.0))
                assert relative_error(meshpar_logits(params, cfg, mesh), reference) > 1e-3, (layer, path)
                variable.set_value(saved)


@pytest.mark.slow  # the mesh logits beyond the expert mesh: `make test-slow`, as test_hf.py's
def test_gpt_oss_logits_under_ring_attention_with_tensor_parallelism(tmp_path):
    """gpt-oss's sinks in ring context parallelism (zigzag, its diagonal block), its heads and sinks split over
    `model`: transformers' logits within 1e-5."""
    call("save_random", str(tmp_path), "gpt_oss", MOE_FAMILIES["gpt_oss"], 0)
    mesh, cfg = build_mesh("sequence=2,model=2"), hf.load_config(tmp_path)
    error = relative_error(meshpar_logits(hf.import_params(tmp_path, cfg, mesh, RULES), cfg, mesh), hf_logits(tmp_path))
    print(f"gpt_oss on sequence=2,model=2 (ring): max relative logits difference {error:.2e}")
    assert error < 1e-5


def test_greedy_generation_matches_transformers(moe):
    """meshpar's KV-cache generation with the experts split over `expert` continues prompts token for token as
    transformers' greedy generate."""
    _, directory, _ = moe
    mesh = build_mesh("expert=2,model=2")
    cfg = hf.load_config(directory)
    model = nnx.merge(Transformer.abstract(cfg)[0], hf.import_params(directory, cfg, mesh, RULES))
    prompt_BT = TOKENS_BT[:2, :6]
    expected = call("greedy", directory, prompt_BT.tolist(), 12)
    np.testing.assert_array_equal(generate.generate(model, prompt_BT, 12, mesh, RULES), expected)


def prefill_logits(model: nnx.Module, tokens_BT: np.ndarray, mesh) -> np.ndarray:
    """The logits of `tokens_BT` as generation's first pass computes them on `mesh`, into an empty cache."""
    graphdef, state = nnx.split(model)
    B, T = tokens_BT.shape

    @jax.jit
    def prefill(state, tokens_BT):
        with context.use(generate.compute_context(mesh, RULES, B)):
            model = nnx.merge(graphdef, state)
            return model.decode(tokens_BT, jnp.arange(T), *model.init_cache(B, T))[0]

    return np.asarray(prefill(state, tokens_BT))


@pytest.mark.parametrize("moe", ["mixtral", "gpt_oss"], indirect=True)
def test_one_prompt_on_an_expert_mesh_is_transformers(moe):
    """One prompt, which the batch axes cannot split (as `launch.generate` gives it): every device of `expert`
    holds it and computes its own experts' share, summed over `expert` and `model`. Its first pass's logits are
    transformers' (float32, relative 1e-5) and greedy generation continues it token for token as transformers'
    generate does (Mixtral's sliding window; gpt-oss's biased experts, whose down bias one share adds)."""
    model_type, directory, reference = moe
    mesh = build_mesh("expert=2,model=2")
    cfg = hf.load_config(directory)
    model = nnx.merge(Transformer.abstract(cfg)[0], hf.import_params(directory, cfg, mesh, RULES))
    error = relative_error(prefill_logits(model, TOKENS_BT[:1], mesh), reference[:1])
    print(f"{model_type}, one prompt on expert=2,model=2: max relative logits difference {error:.2e}")
    assert error < 1e-5
    prompt_BT = TOKENS_BT[:1, :6]
    expected = call("greedy", directory, prompt_BT.tolist(), 12)
    np.testing.assert_array_equal(generate.generate(model, prompt_BT, 12, mesh, RULES), expected)


@pytest.mark.parametrize("moe", ["mixtral"], indirect=True)
def test_evaluation_on_an_expert_mesh_is_transformers_cross_entropy(moe):
    """The eval step (`train.make_eval_step`: the training step's loss and layout, without the router's losses)
    on an expert-parallel mesh gives the mean cross-entropy of transformers' logits (float32, relative 1e-5)."""
    _, directory, reference_BTV = moe
    B, T = TOKENS_BT.shape
    settings = train.TrainConfig(global_batch=B, seq_len=T - 1, remat="none")
    sharded, state, tokens = imported_state(directory, build_mesh(EXPERT_MESH), settings)
    loss, count = train.make_eval_step(sharded, tokens, settings)(state, jax.device_put(TOKENS_BT, tokens))
    logits_BTV = reference_BTV[:, :-1].astype(np.float64)
    log_probs_BTV = logits_BTV - np.log(np.exp(logits_BTV).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs_BTV, TOKENS_BT[:, 1:, None], -1).mean()
    assert int(count) == B * (T - 1)
    assert abs(float(loss) - expected) < 1e-5 * expected


def test_export_writes_the_tensors_it_read(moe, tmp_path):
    """Imported on an expert mesh and written back, a checkpoint is the one transformers saved: the same
    tensor names (one per expert), shapes and float32 values, and a config.json that reads as the same model
    and loads in transformers as the same family with the same logits; in shards with an index as well."""
    model_type, directory, reference = moe
    require_devices(8)
    mesh = build_mesh(EXPERT_MESH)
    cfg = hf.load_config(directory)
    params = hf.import_params(directory, cfg, mesh, RULES)
    hf.export(params, cfg, tmp_path / "one", model_type=model_type)
    original, written = (load_file(f"{d}/{hf.SINGLE_FILE}") for d in (directory, tmp_path / "one"))
    assert sorted(written) == sorted(original)
    assert all(np.array_equal(written[name], original[name]) for name in original)
    assert hf.config_from_hf(json.loads((tmp_path / "one" / "config.json").read_text())) == cfg
    files = hf.export(params, cfg, tmp_path / "shards", max_shard_bytes=100_000)  # the family its options name
    assert (tmp_path / "shards" / hf.INDEX_FILE) in files and len(files) > 3
    assert call("describe", str(tmp_path / "shards")) == {"class": ARCHITECTURES[model_type], "tied": False}
    error = relative_error(hf_logits(tmp_path / "shards"), reference)
    print(f"{model_type} round trip: max relative logits difference {error:.2e}")
    assert error == 0.0


def test_mxfp4_experts_are_dequantised_on_import(tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 blocks and scales, as the Hub's are: imported on an expert
    mesh, meshpar's weights are those transformers' own dequantiser gives (exactly) and its logits are
    transformers' on them; export writes them unquantised, as one float32 tensor each."""
    require_devices(8)
    fields = MOE_FAMILIES["gpt_oss"]
    call("save_random", str(tmp_path / "float"), "gpt_oss", fields, 0)
    packed, dequantized = tmp_path / "mxfp4", tmp_path / "dequantized"
    call("save_mxfp4", str(tmp_path / "float"), str(packed), str(dequantized), 1)
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in load_file(packed / hf.SINGLE_FILE)
    mesh, cfg = build_mesh(EXPERT_MESH), hf.load_config(packed)
    params = hf.import_params(packed, cfg, mesh, RULES)
    hf.export(params, cfg, tmp_path / "out")
    ours, theirs = (load_file(d / hf.SINGLE_FILE) for d in (tmp_path / "out", dequantized))
    assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[name], theirs[name]) for name in theirs)
    assert not np.array_equal(theirs["model.layers.0.mlp.experts.down_proj"],
                              load_file(tmp_path / "float" / hf.SINGLE_FILE)["model.layers.0.mlp.experts.down_proj"])
    error = relative_error(meshpar_logits(params, cfg, mesh), hf_logits(dequantized))
    print(f"gpt_oss with MXFP4 experts on {EXPERT_MESH}: max relative logits difference {error:.2e}")
    assert error < 1e-5


def imported_state(directory: str, mesh, settings: train.TrainConfig):
    """(the sharded abstract state, a training state holding the checkpoint in `directory`, the tokens'
    sharding) on `mesh`."""
    cfg = hf.load_config(directory)
    make_model, tx = Transformer.factory(cfg), train.optimizer(settings)
    sharded = train.sharded_abstract(make_model, tx, mesh, RULES, settings.seed)
    state = train.init_state(make_model, tx, sharded, settings.seed, hf.import_params(directory, cfg, mesh, RULES))
    return sharded, state, sharding.batch_sharding(mesh, RULES, (settings.global_batch, settings.seq_len + 1))


# Per family, the tensors whose gradients the test names: Qwen2-MoE's shared expert and its gate; gpt-oss's sinks,
# biases and experts (its clamped SwiGLU, at a bound of 1 the gates reach)
OWN_TENSORS = {"qwen2_moe": ("shared_expert",), "gpt_oss": ("sinks", "bias", "experts")}


def affine_map_error(name: str, ours: dict, theirs: dict) -> float:
    """`relative_error` of one gradient, a bias's relative to the larger of its own and its weight's: the two
    are one affine map's, and a bias's entries, each a sign-mixed cotangent summed over the tokens, can be far
    smaller than its weight's (a router's sum to the load-balancing loss's share), so that float32 rounding of
    order 1e-7 of the map's gradient would read as 1e-5 of the bias's alone."""
    # q_proj.bias → q_proj.weight; gpt-oss's experts' gate_up_proj_bias → gate_up_proj
    weight = name[:-len(".bias")] + ".weight" if name.endswith(".bias") else name[:-len("_bias")]
    if not name.endswith(("_bias", ".bias")) or weight not in theirs:
        return relative_error(ours[name], theirs[name])
    scale = max(np.abs(theirs[name]).max(), np.abs(theirs[weight]).max())
    return float(np.abs(ours[name].astype(np.float64) - theirs[name]).max() / scale)


@pytest.mark.parametrize("model_type", list(OWN_TENSORS))
def test_one_step_gradients_match_pytorch(tmp_path, model_type):
    """One forward and backward pass on an expert-parallel mesh gives PyTorch's loss (the cross-entropy plus
    0.02 × the load-balancing loss) and its gradient: every tensor of the checkpoint, the router's and each
    expert's among them and the family's own (`OWN_TENSORS`), as each side writes it (a bias with its weight:
    `affine_map_error`)."""
    require_devices(8)
    directory, coef = str(tmp_path / "hf"), 0.02
    call("save_random", directory, model_type, MOE_FAMILIES[model_type], 0)
    tokens_BT = np.random.default_rng(1).integers(0, SMALL["vocab_size"], (8, 17)).astype(np.int32)
    reference = call("save_gradients", directory, tokens_BT.tolist(), coef, str(tmp_path / "torch"))
    cfg = hf.load_config(directory)
    settings = train.TrainConfig(global_batch=8, seq_len=16, router_aux_loss_coef=coef, remat="none")
    sharded, state, tokens = imported_state(directory, build_mesh(EXPERT_MESH), settings)
    loss, grads = train.loss_and_grads(sharded, tokens, settings)(state, jax.device_put(tokens_BT, tokens))
    hf.export(grads, cfg, tmp_path / "meshpar")  # the gradients as a checkpoint: PyTorch's names and layouts
    ours, theirs = (load_file(tmp_path / side / hf.SINGLE_FILE) for side in ("meshpar", "torch"))
    assert sorted(ours) == sorted(theirs)
    errors = {name: affine_map_error(name, ours, theirs) for name in theirs}
    worst = max(errors, key=errors.get)
    own = max(e for name, e in errors.items() if any(word in name for word in OWN_TENSORS[model_type]))
    print(f"{model_type} one step: loss {float(loss):.6f} / {reference:.6f}; max relative gradient difference "
          f"{errors[worst]:.2e} ({worst}), of its own tensors ({', '.join(OWN_TENSORS[model_type])}) {own:.2e}")
    assert abs(float(loss) - reference) < 1e-5 * reference
    assert errors[worst] < 1e-5


def test_convert_cli_round_trip_and_router_hint(tmp_path, capsys):
    """`launch.convert` takes a Mixtral in and out on an expert mesh, and says where transformers' router
    loss coefficient goes in meshpar."""
    require_devices(8)
    call("save_random", str(tmp_path / "hf"), "mixtral", {**MOE_FAMILIES["mixtral"], "router_aux_loss_coef": 0.02}, 1)
    convert.main(["from-hf", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "params"),
                  "--mesh", "expert=4,model=2"])
    assert "--set train.router_aux_loss_coef=0.02" in capsys.readouterr().out
    convert.main(["to-hf", "--checkpoint", str(tmp_path / "params"), "--out", str(tmp_path / "back"),
                  "--mesh", EXPERT_MESH])
    assert call("describe", str(tmp_path / "back"))["class"] == "MixtralForCausalLM"
    assert relative_error(hf_logits(tmp_path / "back"), hf_logits(tmp_path / "hf")) == 0.0


@pytest.mark.parametrize(("model_type", "change", "culprit"), [
    ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise = 0.1 is not implemented.*adds no noise"),
    ("qwen3_moe", {"num_local_experts": 0}, r"num_local_experts = 0 is not implemented"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window = true is not implemented"),
    ("mixtral", {"num_experts_per_tok": None}, "lacks num_experts_per_tok"),
    ("qwen3_moe", {"moe_intermediate_size": None}, "lacks moe_intermediate_size"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 96},
     r"shared_expert_intermediate_size = 96 is not implemented.*multiple of moe_intermediate_size = 64"),
    ("qwen2_moe", {"shared_expert_intermediate_size": None}, "lacks shared_expert_intermediate_size"),
    ("qwen2_moe", {"qkv_bias": False}, "qkv_bias = false is not implemented"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window = true is not implemented"),
    ("gpt_oss", {"attention_bias": False}, "attention_bias = false is not implemented"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                     "mscale": 2.0}}, r"rope_parameters.mscale is not implemented"),
])
def test_unsupported_configs_are_refused(model_type, change, culprit):
    with pytest.raises(InputError, match=culprit):
        hf.config_from_hf({**family_config(model_type), **change})


@pytest.mark.parametrize("model_type", list(MOE_FAMILIES))
def test_config_round_trip(model_type):
    """A config.json as transformers 5 writes it (num_local_experts) and as the Hub's Qwen3-MoE holds it
    (num_experts) read as one model, which meshpar writes back as the same."""
    config = family_config(model_type)
    cfg = hf.config_from_hf(config)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.d_expert, cfg.n_heads, cfg.rope_theta) == (4, 2, 64, 4, 5000.0)
    assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg
    if model_type == "qwen3_moe":
        hub = {**{k: v for k, v in config.items() if k != "num_local_experts"}, "num_experts": 4}
        assert hf.config_from_hf(hub) == cfg and "num_experts" in hf.config_to_hf(cfg)
    if model_type == "qwen2_moe":
        assert (cfg.n_shared_experts, cfg.shared_expert_gate) == (2, True)
        assert hf.config_to_hf(cfg)["shared_expert_intermediate_size"] == 128


def test_a_family_that_cannot_hold_the_experts_is_refused():
    mixtral, qwen3_moe, qwen2_moe, gpt_oss = (hf.config_from_hf(family_config(t)) for t in MOE_FAMILIES)
    dense = hf.config_from_hf(call("hf_config", "llama", SMALL))
    assert [hf.family_of(cfg).model_type for cfg in (mixtral, qwen3_moe, qwen2_moe, gpt_oss)] == list(MOE_FAMILIES)
    with pytest.raises(InputError, match=r"model.n_experts = 4: a llama checkpoint cannot hold it \(LlamaForCausalLM "
                                         r"has no experts\)"):
        hf.config_to_hf(mixtral, "llama")
    with pytest.raises(InputError, match="model.n_experts = 0: a mixtral checkpoint cannot hold it"):
        hf.config_to_hf(dense, "mixtral")
    with pytest.raises(InputError, match="model.norm_topk_prob = false: a mixtral checkpoint cannot hold it"):
        hf.config_to_hf(dataclasses.replace(mixtral, norm_topk_prob=False))
    with pytest.raises(InputError, match="model.n_shared_experts = 1: a qwen3_moe checkpoint cannot hold it"):
        hf.config_to_hf(dataclasses.replace(qwen3_moe, n_shared_experts=1))
    with pytest.raises(InputError, match="model.qk_norm = true: a mixtral checkpoint cannot hold it"):
        hf.config_to_hf(qwen3_moe, "mixtral")
    with pytest.raises(InputError, match=r"model.n_shared_experts = 2: a mixtral checkpoint cannot hold it "
                                         r"\(MixtralForCausalLM has no shared experts\)"):
        hf.config_to_hf(qwen2_moe, "mixtral")
    with pytest.raises(InputError, match=r"model.n_shared_experts = 0: a qwen2_moe checkpoint cannot hold it "
                                         r"\(Qwen2MoeForCausalLM has a shared expert\)"):
        hf.config_to_hf(mixtral, "qwen2_moe")
    with pytest.raises(InputError, match="model.shared_expert_gate = false: a qwen2_moe checkpoint cannot hold it"):
        hf.config_to_hf(dataclasses.replace(qwen2_moe, shared_expert_gate=False))
    with pytest.raises(InputError, match="model.qkv_bias = false: a qwen2_moe checkpoint cannot hold it"):
        hf.config_to_hf(dataclasses.replace(qwen2_moe, qkv_bias=False))
    for field in ("o_bias", "attn_sinks", "moe_bias"):  # gpt-oss's layer, all of it, and only in gpt_oss
        with pytest.raises(InputError, match=f"model.{field} = false: a gpt_oss checkpoint cannot hold it"):
            hf.config_to_hf(dataclasses.replace(gpt_oss, **{field: False}), "gpt_oss")
        with pytest.raises(InputError, match=f"model.{field} = true: a mixtral checkpoint cannot hold it"):
            hf.config_to_hf(dataclasses.replace(mixtral, **{field: True}), "mixtral")
    with pytest.raises(InputError, match='model.mlp_activation = "silu": a gpt_oss checkpoint cannot hold it'):
        hf.config_to_hf(dataclasses.replace(gpt_oss, mlp_activation="silu"))
