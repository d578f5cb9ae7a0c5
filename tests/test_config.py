"""meshpar.config.apply (typed dotted overrides), the presets in configs/, and their parameter counts."""

import dataclasses
import importlib
import math

import jax
import pytest
from flax import nnx

import configs
from meshpar import config as config_lib
from meshpar.mesh import MeshConfig
from models.transformer import LayerKind, Transformer, TransformerConfig

PRESETS = ["llama_1b", "llama_70b", "llama_8b", "small", "tiny"]


@pytest.fixture
def tiny():
    return configs.load("tiny")


# --- apply ----------------------------------------------------------------------------------------------


def test_keys_list_every_leaf_field(tiny):
    keys = config_lib.keys(tiny)
    assert keys[:3] == ["name", "model.vocab_size", "model.d_model"]
    assert {"model.n_layers", "model.tie_embeddings", "train.lr", "train.compute_dtype", "mesh.fsdp",
            "data.source"} <= set(keys)
    assert "model" not in keys and "mesh" not in keys  # sections are not leaves
    assert len(keys) == len(set(keys))


def test_apply_parses_by_field_type(tiny):
    cfg = config_lib.apply(tiny, ["model.n_layers=4", "train.lr=1e-4", "model.tie_embeddings=true",
                                  "train.compute_dtype=bfloat16", "name=mine", "model.rope_theta=5"])
    assert cfg.model.n_layers == 4 and type(cfg.model.n_layers) is int
    assert cfg.train.lr == 1e-4 and type(cfg.train.lr) is float
    assert cfg.model.tie_embeddings is True
    assert cfg.train.compute_dtype == "bfloat16"
    assert cfg.name == "mine"
    assert cfg.model.rope_theta == 5.0 and type(cfg.model.rope_theta) is float
    # everything else is untouched, and the input is not modified
    assert cfg.model.d_model == tiny.model.d_model and cfg.train.steps == tiny.train.steps
    assert tiny.model.n_layers == 2 and tiny.name == "tiny"
    assert dataclasses.is_dataclass(cfg.model) and isinstance(cfg.model, TransformerConfig)


@pytest.mark.parametrize(("text", "value"), [("true", True), ("False", False), ("1", True), ("0", False),
                                             ("yes", True), ("off", False)])
def test_apply_parses_bools(tiny, text, value):
    assert config_lib.apply(tiny, [f"model.tie_embeddings={text}"]).model.tie_embeddings is value


def test_apply_nested_keys_in_every_section(tiny):
    cfg = config_lib.apply(tiny, [" mesh.fsdp = 4 ", "mesh.data=-1", "data.max_bytes=1000", "train.seed=7"])
    assert cfg.mesh == MeshConfig(data=-1, fsdp=4)
    assert cfg.data.max_bytes == 1000
    assert cfg.train.seed == 7


def test_apply_later_overrides_win(tiny):
    assert config_lib.apply(tiny, ["model.n_layers=4", "model.n_layers=3"]).model.n_layers == 3


def test_apply_no_overrides_is_the_same_config(tiny):
    assert config_lib.apply(tiny, []) == tiny


@pytest.mark.parametrize("key", ["model.n_layer", "n_layers", "model", "train.lr.x", "optimizer.lr"])
def test_apply_unknown_key_lists_the_valid_ones(tiny, key):
    with pytest.raises(ValueError, match=rf"--set: unknown key '{key}'; valid keys: name, model.vocab_size, ") as err:
        config_lib.apply(tiny, [f"{key}=4"])
    listed = str(err.value).split("valid keys: ")[1].split(", ")
    assert listed == config_lib.keys(tiny)


def test_apply_malformed_item(tiny):
    with pytest.raises(ValueError, match=r"--set 'model.n_layers': expected KEY=VALUE, e.g. model.n_layers=4"):
        config_lib.apply(tiny, ["model.n_layers"])


@pytest.mark.parametrize(("item", "message"), [
    ("model.n_layers=abc", r"--set model.n_layers=abc: expected int"),
    ("model.n_layers=2.5", r"--set model.n_layers=2.5: expected int"),
    ("train.lr=fast", r"--set train.lr=fast: expected float"),
    ("model.tie_embeddings=maybe", r"--set model.tie_embeddings=maybe: expected true or false"),
    # a layer pattern's records: each field against its type, by name
    ('model.layer_pattern=[{"windw": 64}]', r"layer_pattern\[0\].windw: LayerKind has no field 'windw'; its fields: "),
    ('model.layer_pattern=[{}, {"window": "4"}]', r"model.layer_pattern\[1\].window = \"4\": expected int$"),
    ('model.layer_pattern=[{"dense": 1}]', r"model.layer_pattern\[0\].dense = 1: expected bool$"),
    ('model.layer_pattern=[{"rope_theta": true}]', r"model.layer_pattern\[0\].rope_theta = true: expected float$"),
    ('model.layer_pattern=[{"rope_scaling": {"factor": "2"}}]', r"rope_scaling.factor = \"2\": expected float$"),
    ('model.layer_pattern=[{"rope_scaling": 2}]', r"rope_scaling = 2: expected a JSON object of RopeScaling"),
    ("model.layer_pattern=[4]", r"model.layer_pattern\[0\] = 4: expected a JSON object of LayerKind fields$"),
    ('model.layer_pattern={"window": 4}', r"expected a JSON list of LayerKind fields"),
    ('model.layer_pattern=[{"window": 4}', r"expected a JSON list of LayerKind fields"),
])
def test_apply_wrong_type(tiny, item, message):
    with pytest.raises(ValueError, match=message):
        config_lib.apply(tiny, [item])


@pytest.mark.parametrize(("item", "message"), [
    ("train.compute_dtype=float8", r"train.compute_dtype = 'float8' is not one of float32, bfloat16"),
    ("model.n_heads=7", r"model.d_model = 128 is not divisible by model.n_heads = 7"),
    ("model.n_kv_heads=3", r"model.n_heads = 8 is not divisible by model.n_kv_heads = 3"),
    ("model.n_layers=0", r"model.n_layers = 0 must be >= 1"),
    ("train.steps=0", r"train.steps = 0 must be >= 1"),
    ("train.clip_norm=0", r"train.clip_norm = 0.0 must be > 0"),
    ("mesh.fsdp=0", r"mesh axis 'fsdp' has size 0"),
    ("data.source=web", r"unknown data source 'web'; valid sources: stdlib, text, bin"),
])
def test_apply_surfaces_validation_errors(tiny, item, message):
    with pytest.raises(ValueError, match=message):
        config_lib.apply(tiny, [item])


def test_a_layer_pattern_is_set_as_a_json_list(tiny):
    """`--set model.layer_pattern=` takes a JSON list of LayerKind fields (a nested record as a JSON object), and
    the pattern is checked against the layers."""
    cfg = config_lib.apply(tiny, ['model.layer_pattern=[{"window": 64}, {"rope_theta": 5e5}]'])
    assert cfg.model.layer_pattern == (LayerKind(window=64), LayerKind(rope_theta=5e5))
    assert config_lib.apply(cfg, ["model.layer_pattern=[]"]).model.layer_pattern == ()
    assert config_lib.apply(tiny, ['model.layer_pattern=[{"rope_scaling": {"kind": "linear", "factor": 2}}]']
                            ).model.layer_pattern[0].rope_scaling.factor == 2.0
    with pytest.raises(ValueError, match=r"model.n_layers = 2 is not a whole number of model.layer_pattern's periods "
                                         r"of 3 layers"):
        config_lib.apply(tiny, ["model.layer_pattern=[{}, {}, {}]"])


def test_apply_validates_the_overrides_together(tiny):
    cfg = config_lib.apply(tiny, ["model.n_heads=12", "model.n_kv_heads=12", "model.d_model=768"])
    assert (cfg.model.n_heads, cfg.model.d_model) == (12, 768)


# --- presets ---------------------------------------------------------------------------------------------


def test_preset_names():
    names = configs.names()
    assert set(PRESETS) <= set(names) and names == sorted(names)
    assert "__init__" not in names


@pytest.mark.parametrize("name", configs.names())
def test_load_every_preset(name):
    cfg = configs.load(name)
    assert isinstance(cfg, configs.Config)
    assert cfg.name == name
    assert isinstance(cfg.model, TransformerConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "other"
    # each preset file starts with the command that runs it
    assert f"python -m launch.train --config {name}" in importlib.import_module(f"configs.{name}").__doc__


def test_load_unknown_preset():
    with pytest.raises(ValueError, match=r"^unknown config 'nope'; presets: (\w+, )*llama_70b, (\w+, )*tiny(, \w+)*$"):
        configs.load("nope")
    with pytest.raises(ValueError, match=r"unknown config 'Tiny'"):
        configs.load("Tiny")


# --- parameter counts, computed abstractly --------------------------------------------------------------


def abstract_param_count(cfg: TransformerConfig) -> int:
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)  # nothing was allocated
    return sum(math.prod(leaf.shape) for leaf in leaves)


def formula_param_count(cfg: TransformerConfig) -> int:
    D, N, K, H, F, V, L = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_size, cfg.d_ff, cfg.vocab_size,
                           cfg.n_layers)
    dense = 3 * D * F
    mlp = dense
    if cfg.n_experts:  # the router (and its selection bias), the experts, the shared experts
        mlp = (D + cfg.selection_bias) * cfg.n_experts + (cfg.n_experts + cfg.n_shared_experts) * 3 * D * cfg.expert_width
        mlp += D * cfg.shared_expert_gate  # Qwen2-MoE's gate of the shared experts: one logit per token
    attention = D * N * H + 2 * D * K * H + N * H * D
    if cfg.kv_lora_rank:  # latent attention: the query direct or through its latent, the kv latent and rotary key, o
        C, R, Hr, Hv = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
        attention = ((D * R + R + R * N * H) if R else D * N * H) + D * (C + Hr) + C + C * N * (
            cfg.qk_nope_head_dim + Hv) + N * Hv * D
    per_layer = attention + 2 * D
    per_layer += (N + 2 * K) * H * cfg.qkv_bias + 2 * H * cfg.qk_norm  # Qwen 2's biases, Qwen 3's q/k norm scales
    per_layer += 2 * D * cfg.sandwich_norms  # Gemma's norms of the sublayers' outputs
    per_layer += D * cfg.o_bias + N * cfg.attn_sinks  # gpt-oss's o bias and sinks …
    per_layer += cfg.n_experts * (1 + 2 * cfg.expert_width + D) * cfg.moe_bias  # … and its router's and experts' biases
    kinds = [*cfg.layer_prefix, *cfg.kinds * cfg.periods]  # each layer's MLP: dense where its kind says
    mlp_of = lambda kind: dense if kind.dense or not cfg.n_experts else mlp
    mlps = sum(mlp_of(kind) for kind in kinds)
    # multi-token prediction: per module its two input norms, its [2D, D] projection, a block of the last
    # layer's kind and its final norm (the embedding and the head shared)
    mtp = cfg.mtp_depth * (3 * D + 2 * D * D + per_layer + mlp_of(cfg.kinds[-1]))
    return V * D * (1 if cfg.tie_embeddings else 2) + L * per_layer + mlps + D + mtp


@pytest.mark.parametrize("name", [*configs.names(), "tiny_moe with a gated shared expert"])
def test_param_count_matches_the_formula(name):
    cfg = (dataclasses.replace(configs.load("tiny_moe").model, n_shared_experts=2, shared_expert_gate=True)
           if name.endswith("gated shared expert") else configs.load(name).model)
    assert abstract_param_count(cfg) == formula_param_count(cfg)


@pytest.mark.parametrize(("name", "expected", "rel"), [
    ("small", 124e6, 0.02),
    ("llama_8b", 8.03e9, 0.01),
    ("llama_70b", 70.55e9, 0.01),
    # the open families' published sizes, their biases and q/k norms included
    ("llama3_8b", 8.03e9, 0.001), ("qwen2_5_7b", 7.62e9, 0.001), ("qwen3_8b", 8.19e9, 0.001), ("mistral_7b", 7.25e9, 0.001),
    ("mixtral_8x7b", 46.70e9, 0.001), ("qwen3_30b_a3b", 30.53e9, 0.001),  # mixtures of experts: every expert counted
    ("gpt_oss_20b", 20.91e9, 0.001),  # gpt-oss's model card: 20.91B, its biases and sinks included
    ("gemma3_12b", 11.77e9, 4e-4),  # the README's figure, to its two decimals (Gemma 3 12B's text decoder alone)
    # DeepSeek-V3's architecture, the model cards' sizes: 671B (the main model), 1T (1.026T), 16B (15.96B)
    ("deepseek_v3", 671e9, 1e-3), ("kimi_k2", 1.03e12, 5e-3), ("moonlight_16b_a3b", 16e9, 5e-3),
])
def test_param_count_of_the_named_shapes(name, expected, rel):
    cfg = dataclasses.replace(configs.load(name).model, mtp_depth=0)
    assert abstract_param_count(cfg) == pytest.approx(expected, rel=rel)


def test_deepseek_v3_with_its_prediction_module_is_the_checkpoints_685b():
    """The model card's 685B: the main model's 671B and the 14B of its MTP module, which the checkpoint holds
    with its own copies of the embedding and the head (shared here)."""
    cfg = configs.load("deepseek_v3").model
    assert cfg.mtp_depth == 1
    assert abstract_param_count(cfg) + 2 * cfg.vocab_size * cfg.d_model == pytest.approx(685e9, rel=1e-3)


@pytest.mark.parametrize(("name", "active"), [("deepseek_v3", 37e9), ("kimi_k2", 32e9), ("moonlight_16b_a3b", 3e9)])
def test_active_params_of_deepseeks_architecture(name, active):
    """The parameters a token computes with (every weight but the routed experts it is not sent to) are the
    model cards' activated parameters, which they give to the billion: 37.6B, 32.9B and 2.9B (the main model's)."""
    cfg = dataclasses.replace(configs.load(name).model, mtp_depth=0)
    routed = cfg.n_experts * 3 * cfg.d_model * cfg.expert_width * (cfg.n_layers - len(cfg.layer_prefix))
    assert abstract_param_count(cfg) - routed * (1 - cfg.experts_per_token / cfg.n_experts) == pytest.approx(
        active, rel=0.03)


def test_tied_embeddings_drop_the_head():
    untied = configs.load("tiny").model
    tied = dataclasses.replace(untied, tie_embeddings=True)
    assert abstract_param_count(untied) - abstract_param_count(tied) == untied.vocab_size * untied.d_model
