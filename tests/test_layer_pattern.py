"""Layers that differ (`model.layer_pattern`): a repeating period of kinds (each its own attention window,
rotary base, dense MLP or experts), stacked as periods, each kind compiled once.

- Qwen 2 with `layer_types` alternating sliding and full attention, and Qwen3-MoE with dense layers from
  `decoder_sparse_step`: imported weights give transformers' logits on one device and on ring CP and expert
  meshes (and, in the slow tier, TP, FSDP and the blockwise kernel); greedy generation past the window (the ring
  caches wrap) gives transformers' tokens; the export loads back with the same logits. How `layer_types`,
  transformers' `max_window_layers` rule and `mlp_only_layers` read.
- A mixed dense/MoE stack with a windowed kind trains under GPipe, 1F1B and zero-bubble on
  `stage=2,expert=2,data=2`, and on a ring CP mesh, as on one device (float32, 1e-5; the slow tier).
- The caches are per kind; the planner counts each kind's layers; what cannot run is refused in one line.
"""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from conftest import require_devices
from hf_reference import SMALL, call
from layouts import max_relative_error, shared_run
from meshpar import generate, plan, rules as rules_lib
from meshpar.errors import InputError
from models import hf
from models.transformer import LayerKind, Transformer, TransformerConfig
from test_hf import RULES, TOKENS_BT, build_mesh, hf_logits, meshpar_logits, relative_error
from test_moe import MOE, TOLERANCE, TRAIN
from test_pipeline_moe import PER_MICROBATCH, reference

WINDOW = 5  # shorter than the tests' sequences (16) and generations (6 + 12)
PATTERNS = {
    "qwen2-alternating": ("qwen2", {**SMALL, "num_hidden_layers": 4, "use_sliding_window": True,
                                    "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "qwen3_moe-sparse-step": ("qwen3_moe", {**SMALL, "num_hidden_layers": 4, "head_dim": 32, "num_experts": 4,
                                            "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                            "decoder_sparse_step": 2, "norm_topk_prob": True}),
}
# What each reads as: its period
EXPECTED = {"qwen2-alternating": (LayerKind(window=WINDOW), LayerKind()),
            "qwen3_moe-sparse-step": (LayerKind(dense=True), LayerKind())}


@pytest.fixture(scope="module", params=list(PATTERNS))
def pattern(request, tmp_path_factory):
    """(name, model_type, checkpoint directory, transformers' logits) of each small random model."""
    model_type, fields = PATTERNS[request.param]
    directory = str(tmp_path_factory.mktemp(request.param))
    call("save_random", directory, model_type, fields, 0)
    return request.param, model_type, directory, hf_logits(directory)


def test_the_config_reads_as_its_period(pattern):
    name, _, directory, _ = pattern
    cfg = hf.load_config(directory)
    assert cfg.layer_pattern == EXPECTED[name] and cfg.sliding_window == 0


SLOW = pytest.mark.slow  # `make test-slow`: kept out of `make test`'s time


@pytest.mark.parametrize(("spec", "kernel"), [
    pytest.param("", "auto", id="one-device"), pytest.param("", "blockwise", id="blockwise-kernel", marks=SLOW),
    pytest.param("model=2", "auto", id="tp", marks=SLOW), pytest.param("fsdp=4", "auto", id="fsdp", marks=SLOW),
    pytest.param("sequence=2", "auto", id="ring-cp"), pytest.param("expert=2,data=2", "auto", id="expert")])
def test_imported_logits_match_transformers(pattern, spec, kernel):
    name, _, directory, reference_logits = pattern
    mesh = build_mesh(spec)
    cfg = hf.load_config(directory)
    error = relative_error(meshpar_logits(hf.import_params(directory, cfg, mesh, RULES), cfg, mesh, kernel),
                           reference_logits)
    print(f"{name} on {spec or 'one device'} ({kernel} kernel): max relative logits difference {error:.2e}")
    assert error < 1e-5


def test_the_windows_shape_the_logits(pattern):
    """Without its windows (or its dense layers' difference) the logits would be far from transformers'."""
    name, _, directory, reference_logits = pattern
    cfg = hf.load_config(directory)
    mesh = build_mesh("")
    params = hf.import_params(directory, cfg, mesh, RULES)
    if name.startswith("qwen3_moe"):  # the dense layers' MLPs zeroed: another model
        params["blocks"]["layer0"]["mlp"]["w_down_FD"][...] = 0 * params["blocks"]["layer0"]["mlp"]["w_down_FD"][...]
    else:
        cfg = dataclasses.replace(cfg, layer_pattern=tuple(LayerKind() for _ in cfg.layer_pattern))
    assert relative_error(meshpar_logits(params, cfg, mesh), reference_logits) > 1e-3


def test_greedy_generation_matches_transformers_past_the_window(pattern):
    """12 new tokens after 6: the windowed kinds' ring caches (W − 1 = 4 slots) wrap, the full ones do not."""
    _, _, directory, _ = pattern
    mesh = build_mesh("fsdp=2,model=2")
    cfg = hf.load_config(directory)
    model = nnx.merge(Transformer.abstract(cfg)[0], hf.import_params(directory, cfg, mesh, RULES))
    k_caches, _ = model.init_cache(2, 18)
    assert [k.shape[2] for k in k_caches] == [WINDOW - 1 if kind.window else 18 for kind in cfg.layer_pattern]
    prompt_BT = TOKENS_BT[:2, :6]
    expected = call("greedy", directory, prompt_BT.tolist(), 12)
    np.testing.assert_array_equal(generate.generate(model, prompt_BT, 12, mesh, RULES), expected)


def test_export_loads_in_transformers_with_the_same_logits(pattern, tmp_path):
    _, model_type, directory, reference_logits = pattern
    mesh = build_mesh("fsdp=2,model=2")
    cfg = hf.load_config(directory)
    hf.export(hf.import_params(directory, cfg, mesh, RULES), cfg, tmp_path / "out", model_type=model_type)
    assert relative_error(hf_logits(tmp_path / "out"), reference_logits) == 0.0
    assert hf.config_from_hf(call("hf_config", model_type, PATTERNS[pattern[0]][1])) == cfg


@pytest.mark.parametrize(("fields", "expected"), [
    ({"layer_types": ["sliding_attention"] * 4, "use_sliding_window": True, "sliding_window": 7},
     {"sliding_window": 7, "layer_pattern": ()}),  # one kind: the model-wide window
    ({"layer_types": ["sliding_attention", "full_attention"] * 2, "use_sliding_window": False},
     {"sliding_window": 0, "layer_pattern": ()}),  # transformers: no window unless use_sliding_window
    ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
      "use_sliding_window": True, "sliding_window": 3},
     {"layer_pattern": (LayerKind(), LayerKind(window=3), LayerKind(window=3), LayerKind(window=3))}),
    ({"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2},  # transformers' rule, no list
     {"layer_pattern": (LayerKind(), LayerKind(), LayerKind(window=3), LayerKind(window=3))}),
])
def test_qwen_layer_types_read_as_the_shortest_period(fields, expected):
    cfg = hf.config_from_hf(call("hf_config", "qwen2", {**SMALL, "num_hidden_layers": 4, **fields}))
    assert {key: getattr(cfg, key) for key in expected} == expected


def test_mlp_only_layers_read_as_dense_kinds():
    fields = {**PATTERNS["qwen3_moe-sparse-step"][1], "decoder_sparse_step": 1, "mlp_only_layers": [0, 2]}
    assert hf.config_from_hf(call("hf_config", "qwen3_moe", fields)).layer_pattern == (LayerKind(dense=True),
                                                                                       LayerKind())


# A mixture whose period is a dense layer with a window and a full MoE layer: P = 2 stages of one period each
MIXED = dataclasses.replace(MOE, n_layers=4, layer_pattern=(LayerKind(window=WINDOW, dense=True), LayerKind()))
STAGES = [("gpipe", 1, 2), ("1f1b", 1, 2), ("zero_bubble", 1, 2)]


@SLOW
@pytest.mark.parametrize("kind,R,M", STAGES, ids=[kind for kind, *_ in STAGES])
def test_a_mixed_stack_pipelines_as_one_device(kind, R, M):
    """Loss and every gradient within 1e-5 of one device pooling each microbatch's router losses
    (test_pipeline_moe's reference), under each schedule on `stage=2,expert=2,data=2`."""
    require_devices(8)
    layout = shared_run("stage=2,expert=2,data=2", PER_MICROBATCH, MIXED, rules_lib.ParallelConfig(
        microbatches=M, pipeline_schedule=kind, pipeline_repeats=R))
    ref_loss, ref_grads = reference(np.asarray(layout.batch(0)), M, model=MIXED)
    loss, grads = layout.loss_and_grads()
    assert abs(loss - ref_loss) / ref_loss < TOLERANCE
    assert max_relative_error(grads, ref_grads) < TOLERANCE
    stage_shard = layout.state["model"]["blocks"]["layer1"]["mlp"]["w_gate_EDF"][...].addressable_shards[0].data
    assert stage_shard.shape[:2] == (1, MIXED.n_experts // 2)  # one period per stage, half the experts


@pytest.fixture(scope="module")
def mixed_reference():
    return shared_run("single", TRAIN, MIXED).loss_and_grads()


@SLOW
def test_a_mixed_stack_trains_under_ring_attention_as_on_one_device(mixed_reference):
    """The windowed kind's ring skips the steps beyond its window, the full kind's runs them all (all-gather and
    Ulysses take the windows as the kernels do: tests/test_window.py)."""
    require_devices(8)
    loss, grads = shared_run("sequence=2,expert=2,data=2", TRAIN, MIXED,
                             rules_lib.ParallelConfig(context_attention="ring")).loss_and_grads()
    assert abs(loss - mixed_reference[0]) / mixed_reference[0] < TOLERANCE
    assert max_relative_error(grads, mixed_reference[1]) < TOLERANCE


def test_the_planner_counts_each_kind():
    """An entry of the stack is a period: two attentions, one dense MLP, one set of experts; the FLOPs'
    attention term sees W keys in the windowed layer and T in the full one."""
    shape = plan.Shape.of_model(Transformer.factory(MIXED), MIXED.experts_per_token, (WINDOW, 0))
    assert (shape.layers, shape.period, shape.mlp_layers, shape.moe_layers) == (2, 2, 1, 1)
    T, attention = 64, 12 * MIXED.n_heads * MIXED.head_size
    full = plan.Shape.of_model(Transformer.factory(MIXED), MIXED.experts_per_token)
    assert full.model_flops_per_token(T) - shape.model_flops_per_token(T) == pytest.approx(
        shape.layers * attention * (T - WINDOW))


@pytest.mark.parametrize(("change", "culprit"), [
    ({"n_layers": 3}, r"model.n_layers = 3 is not a whole number of model.layer_pattern's periods of 2 layers"),
    ({"sliding_window": 4}, r"model.sliding_window = 4 is every layer's window"),
    ({"layer_pattern": (LayerKind(window=-1), LayerKind())}, r"model.layer_pattern\[0\].window = -1"),
])
def test_bad_patterns_are_refused(change, culprit):
    with pytest.raises(InputError, match=culprit):
        dataclasses.replace(MIXED, **change)
    with pytest.raises(InputError, match=r"layer_pattern\[0\].dense = true: every layer is dense already"):
        TransformerConfig(n_layers=2, layer_pattern=(LayerKind(dense=True), LayerKind()))


def test_a_stage_split_that_cuts_a_period_is_refused():
    require_devices(8)
    with pytest.raises(InputError, match=r"L = 2 stacked layers are not divisible by P = 2 stages × R = 2 repeats "
                                         r"\(with model.layer_pattern, L counts its periods: a chunk holds whole ones"):
        shared_run("stage=2,data=4", TRAIN, MIXED, rules_lib.ParallelConfig(microbatches=2, pipeline_repeats=2))


def test_a_family_that_cannot_hold_the_pattern_is_refused():
    dense = dataclasses.replace(MIXED, n_experts=0, layer_pattern=(LayerKind(window=3), LayerKind(window=4)))
    with pytest.raises(InputError, match=r"windows \[3, 4\]: a qwen2 checkpoint holds one"):
        hf.config_to_hf(dataclasses.replace(dense, qkv_bias=True))
    with pytest.raises(InputError, match=r"windowed layers: a llama checkpoint cannot hold them"):
        hf.config_to_hf(dense)
    with pytest.raises(InputError, match=r"layer_pattern\[0\]\.dense = true: a mixtral checkpoint cannot hold it"):
        hf.config_to_hf(dataclasses.replace(MIXED, layer_pattern=(LayerKind(dense=True), LayerKind())), "mixtral")
    with pytest.raises(InputError, match=r"layer_pattern\[0\].rope_theta: a qwen3 checkpoint cannot hold it"):
        hf.config_to_hf(dataclasses.replace(dense, qk_norm=True, layer_pattern=(LayerKind(rope_theta=1e4),
                                                                                LayerKind())))
