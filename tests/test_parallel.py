"""Tensor and sequence parallelism, ZeRO stages, mixed precision, remat and gradient accumulation, each
against its plain counterpart on one device: loss and gradients (float32), memory and collectives."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from conftest import require_devices
from layouts import MODEL, MeshRun, TRAIN, max_relative_error, param_bytes, shared_run
from meshpar import train
from meshpar.rules import ParallelConfig


@pytest.fixture(scope="module")
def single():
    return shared_run("single")


@pytest.fixture(scope="module")
def reference(single):
    return single.loss_and_grads()


def assert_matches(layout: MeshRun, reference, rtol: float = 1e-5):
    loss, grads = layout.loss_and_grads()
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) / ref_loss < rtol
    assert max_relative_error(grads, ref_grads) < rtol


def test_max_relative_error_refuses_another_shape_or_another_tree():
    """A (4, 1) leaf would broadcast against its (4, 4) reference and pass: refused, naming the leaf."""
    reference = {"w": np.ones((4, 4))}
    with pytest.raises(AssertionError, match=re.escape("leaf ['w']: shape (4, 1) against the reference's (4, 4)")):
        max_relative_error({"w": np.ones((4, 1))}, reference)
    with pytest.raises(AssertionError, match=re.escape("leaf paths differ: ['v'] here, ['w'] in the reference")):
        max_relative_error({"v": np.ones((4, 4))}, reference)


# --- tensor parallelism, with and without Megatron sequence parallelism ----------------------------------


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("spec", ["model=8", "data=2,model=4", "fsdp=2,model=4", "data=2,fsdp=2,model=2"])
def test_tensor_parallel_matches_one_device(reference, spec, sequence_parallel):
    require_devices(8)
    assert_matches(shared_run(spec, parallel=ParallelConfig(sequence_parallel=sequence_parallel)), reference)


@pytest.fixture(scope="module")
def tp8():
    require_devices(8)
    return {sp: shared_run("model=8", parallel=ParallelConfig(sequence_parallel=sp)) for sp in (False, True)}


def test_tensor_parallel_splits_heads_mlp_and_vocab(tp8):
    params = tp8[False].state["model"]
    shard = lambda p: p[...].sharding.shard_shape(p[...].shape)
    D, N, H, F, V = MODEL.d_model, MODEL.n_heads, MODEL.head_size, MODEL.d_ff, MODEL.vocab_size
    assert shard(params["blocks"]["attn"]["wq_DNH"]) == (2, D, N // 8, H)  # heads split: column parallel
    assert shard(params["blocks"]["attn"]["wo_NHD"]) == (2, N // 8, H, D)  # row parallel
    assert shard(params["blocks"]["mlp"]["w_up_DF"]) == (2, D, F // 8)
    assert shard(params["blocks"]["mlp"]["w_down_FD"]) == (2, F // 8, D)
    assert shard(params["embed_VD"]) == (V // 8, D)  # vocab-parallel embedding and head
    assert shard(params["head_DV"]) == (D, V // 8)


def test_vocab_parallel_loss_never_builds_full_logits(tp8):
    hlo = tp8[False].step_hlo()
    B, T, V = TRAIN.global_batch, TRAIN.seq_len, MODEL.vocab_size
    assert f"f32[{B},{T},{V // 8}]" in hlo  # each device's slice of the logits
    assert f"[{B},{T},{V}]" not in hlo


def test_tensor_parallel_all_reduces_activations(tp8):
    collectives = tp8[False].report()["collectives"]
    assert set(collectives) == {"all-reduce"}
    # per layer: attention and MLP outputs in the forward pass, their input gradients in the backward
    activation = TRAIN.global_batch * TRAIN.seq_len * MODEL.d_model * 4
    assert collectives["all-reduce"]["bytes"] >= 4 * MODEL.n_layers * activation


def test_sequence_parallel_gathers_and_saves_activation_memory(tp8):
    plain, sp = tp8[False].report(), tp8[True].report()
    assert "all-gather" not in plain["collectives"]
    # entering each TP region the sequence is all-gathered (2 per layer in the forward pass)
    assert sp["collectives"]["all-gather"]["count"] >= 2 * MODEL.n_layers
    assert sp["memory_per_device"]["temp_bytes"] < 0.8 * plain["memory_per_device"]["temp_bytes"]


# --- ZeRO stages over fsdp ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero_stages():
    require_devices(8)
    return {stage: shared_run("fsdp=8", parallel=ParallelConfig(zero_stage=stage)) for stage in range(4)}


@pytest.mark.parametrize("stage", range(4))
def test_zero_stage_matches_one_device(single, reference, zero_stages, stage):
    """Every ZeRO stage: the loss and every gradient of one device's (1e-5), and 4 steps of its losses."""
    assert_matches(zero_stages[stage], reference)
    np.testing.assert_allclose(zero_stages[stage].losses(4), single.losses(4), rtol=1e-5)


@pytest.mark.parametrize("stage", range(4))
def test_zero_stage_memory_follows_the_paper(zero_stages, stage):
    """ZeRO (arXiv:1910.02054 §5.1): stage 1 divides the optimizer states by N, stage 2 the gradients too,
    stage 3 the parameters too. In float32 with Adam: parameters 4Ψ, moments 8Ψ bytes; gradients are
    temporaries, not arguments, so argument bytes are parameters + moments."""
    layout, N = zero_stages[stage], 8
    params = param_bytes(layout)
    moments = 2 * params
    expected = (params / N if stage == 3 else params) + (moments / N if stage >= 1 else moments)
    arguments = layout.report()["memory_per_device"]["arguments_bytes"]
    print(f"ZeRO-{stage}: arguments {arguments:,} bytes, the paper's {expected:,.0f}: {arguments / expected - 1:+.3%}")
    assert abs(arguments - expected) / expected < 0.002  # the README's "within 0.2%": tokens and counters


def test_zero2_shards_the_gradients(zero_stages):
    temp = {stage: zero_stages[stage].report()["memory_per_device"]["temp_bytes"] for stage in (1, 2)}
    sharded_away = param_bytes(zero_stages[1]) * 7 / 8  # what an 8-way split of the gradients saves
    assert temp[2] < temp[1] - sharded_away / 2


# --- mixed precision -------------------------------------------------------------------------------------


def test_bfloat16_is_close_to_float32(single, reference):
    """bfloat16 matmuls and activations with float32 master weights, loss and softmax statistics: the loss
    within 1e-3 relative, the gradients within 10% of their largest element, 10 steps within 2%."""
    bf16 = shared_run("single", cfg=dataclasses.replace(TRAIN, compute_dtype="bfloat16"))
    floats = [x.dtype for x in jax.tree.leaves(bf16.state) if np.issubdtype(x.dtype, np.floating)]
    assert floats and set(floats) == {np.dtype(np.float32)}  # master weights and moments stay float32
    loss, grads = bf16.loss_and_grads()
    assert abs(loss - reference[0]) / reference[0] < 1e-3
    assert max_relative_error(grads, reference[1]) < 0.1
    # the traced program multiplies in bfloat16 (XLA on CPU then upcasts dots internally; GPUs do not)
    lowered = train.make_step(bf16.sharded, bf16.tokens_sharding, bf16.cfg).lower(bf16.state, bf16.batch(0)).as_text()
    assert re.search(r"dot_general.*tensor<[\dx]+bf16>.*tensor<[\dx]+bf16>", lowered)
    np.testing.assert_allclose(bf16.losses(10), single.losses(10), rtol=2e-2)


# --- rematerialisation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_gives_the_same_gradients_with_less_memory(reference, policy):
    require_devices(8)
    plain = shared_run("data=8")
    remat = shared_run("data=8", cfg=dataclasses.replace(TRAIN, remat=policy))
    assert_matches(remat, reference)
    assert remat.report()["memory_per_device"]["temp_bytes"] < 0.7 * plain.report()["memory_per_device"]["temp_bytes"]


# --- gradient accumulation -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["single", "data=8", "fsdp=8"])
def test_grad_accumulation_equals_the_large_batch_step(reference, spec):
    require_devices(8)
    accum = shared_run(spec, cfg=dataclasses.replace(TRAIN, grad_accum=2))
    assert_matches(accum, reference)
    if spec == "data=8":  # pure replicas: one gradient synchronisation per step, the same bytes as K = 1
        plain = shared_run(spec).report()["collectives"]["all-reduce"]["bytes"]
        assert abs(accum.report()["collectives"]["all-reduce"]["bytes"] - plain) / plain < 0.01


ACCUMULATED = [  # mesh, ParallelConfig fields, whether the model is the 4-layer one (pipelines)
    ("sequence=4,fsdp=2", {}, False),  # ring, zigzag
    ("data=2,sequence=4", {"context_attention": "allgather"}, False),
    ("fsdp=2,sequence=2,model=2", {"context_attention": "ulysses"}, False),
    ("data=2,fsdp=2,model=2", {"sequence_parallel": True}, False),
    ("model=8", {}, False),
    ("stage=2,data=4", {"microbatches": 2}, True),
    ("stage=2,fsdp=2,model=2", {"microbatches": 2}, True),
    ("stage=2,sequence=2,data=2", {"microbatches": 2}, True),
]


# the pipeline with ring attention inside it: the slow tier (accumulation around either runs here)
SLOW_ACCUMULATED = ("stage=2,sequence=2,data=2",)


@pytest.mark.parametrize(("spec", "parallel", "deep"), [
    pytest.param(*case, id=case[0], marks=[pytest.mark.slow] * (case[0] in SLOW_ACCUMULATED)) for case in ACCUMULATED])
def test_grad_accumulation_composes_with_every_axis(reference, deep_reference, spec, parallel, deep):
    """Accumulation over 2 microbatches on meshes with sequence (all three attention modes), stage, model
    with and without SP, and fsdp: the same loss and gradients as one device's large batch."""
    require_devices(8)
    model = dataclasses.replace(MODEL, n_layers=4) if deep else MODEL
    layout = shared_run(spec, cfg=dataclasses.replace(TRAIN, grad_accum=2), model=model,
                        parallel=ParallelConfig(**parallel))
    assert_matches(layout, deep_reference if deep else reference)


def test_grad_accumulation_synchronises_replicas_once_per_step():
    """data=2, fsdp=4 (ZeRO-3): the accumulator is split over fsdp, so each microbatch's gradient is reduced
    into it (an all-reduce and a slice on CPU, a reduce-scatter on GPUs); over `data`, where gradients are
    whole, each replica keeps its own sum and they are all-reduced once per step. Measured as all-reduce
    bytes per step = K·(per microbatch) + (once per step): the once-per-step part is the fsdp-split
    float32 gradient, 4Ψ/4 — the data all-reduce — and it does not grow with K."""
    require_devices(8)
    total = {K: shared_run("data=2,fsdp=4", cfg=dataclasses.replace(TRAIN, grad_accum=K, global_batch=32)).report()
             ["collectives"]["all-reduce"]["bytes"] for K in (2, 4)}
    per_microbatch = (total[4] - total[2]) / 2
    once = total[2] - 2 * per_microbatch
    gradient = param_bytes(shared_run("single"))  # float32: 4Ψ
    assert abs(once - gradient / 4) / (gradient / 4) < 0.05, (once, gradient)
    assert per_microbatch > 2 * once


def test_grad_accumulation_must_divide_the_batch_shards():
    require_devices(8)
    layout = shared_run("data=8", cfg=dataclasses.replace(TRAIN, grad_accum=4))
    with pytest.raises(ValueError, match=r"global_batch = 16 is not divisible into train.grad_accum = 4 "
                                         r"microbatches on each of the 8 batch shards \(data\)"):
        layout.loss_and_grads()


# --- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "culprit"), [
    # 6 heads: the first attention weight checked (wk, kv_heads = 6 too) names it
    (dataclasses.replace(MODEL, d_model=96, n_heads=6, n_kv_heads=6), r"attn/w\w+': dimension 2 \('(kv_)?heads'\) of size 6"),
    (dataclasses.replace(MODEL, n_kv_heads=2), r"wk_DKH': dimension 2 \('kv_heads'\) of size 2"),
    (dataclasses.replace(MODEL, d_ff=130), r"w_down_FD': dimension 1 \('mlp'\) of size 130"),
])
def test_tensor_parallel_refuses_what_model_does_not_divide(model, culprit):
    require_devices(4)
    with pytest.raises(ValueError, match=culprit + r".* is not divisible by mesh axes model=4"):
        shared_run("data=2,model=4", model=model)


@pytest.mark.parametrize(("field", "value"), [("remat", "some"), ("compute_dtype", "float16")])
def test_unknown_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"train.{field} = '{value}' is not one of"):
        train.TrainConfig(**{field: value})


# --- context parallelism and pipeline parallelism, whole model -----------------------------------------


@pytest.mark.parametrize(("spec", "mode", "balanced"), [
    ("sequence=8", "ring", True),
    ("data=2,sequence=4", "ring", False),
    ("data=2,sequence=4", "allgather", True),
    ("fsdp=2,sequence=2,model=2", "ulysses", True),
])
def test_context_parallel_matches_one_device(reference, spec, mode, balanced):
    require_devices(8)
    parallel = ParallelConfig(context_attention=mode, load_balance=balanced)
    assert_matches(shared_run(spec, parallel=parallel), reference)


@pytest.fixture(scope="module")
def deep_reference():
    return shared_run("single", model=dataclasses.replace(MODEL, n_layers=4)).loss_and_grads()


@pytest.mark.parametrize(("spec", "microbatches", "repeats", "attention"), [
    ("stage=4,data=2", 4, 1, "ring"), ("stage=2,fsdp=2,model=2", 2, 2, "ring"), ("stage=2,data=2,fsdp=2", 1, 1, "ring"),
    # ring with R = 2, all-gather with R = 1 here; the other two in the slow tier
    *[pytest.param("stage=2,sequence=2,data=2", 2, repeats, mode,
                   marks=[pytest.mark.slow] * ((repeats == 2) == (mode == "allgather")))
      for repeats in (1, 2) for mode in ("ring", "allgather")],
    ("stage=2,sequence=2,model=2", 2, 1, "ulysses"), ("stage=2,sequence=2,data=2", 2, 2, "ulysses")])
def test_pipeline_matches_one_device(deep_reference, spec, microbatches, repeats, attention):
    """Also with the sequence split (context parallelism inside the stages): every attention mode with
    R = 1 and R = 2."""
    require_devices(8)
    layout = shared_run(spec, model=dataclasses.replace(MODEL, n_layers=4),
                        parallel=ParallelConfig(microbatches=microbatches, pipeline_repeats=repeats,
                                                context_attention=attention))
    assert_matches(layout, deep_reference)


# --- one matmul for the projections of one input under tensor parallelism (meshpar.sharding.project) ------


@pytest.mark.parametrize(("spec", "kv_heads", "sequence_parallel"),
                         [("model=8", 8, True), ("data=2,fsdp=2,model=2", 8, False), ("data=2,model=4", 4, False)])
def test_fused_projections_match_one_device(spec, kv_heads, sequence_parallel):
    """With `dots` q, k, v (and gate, up) are one matmul over the concatenated weight shards: the same loss
    and gradients as one device running them one by one (grouped-query heads too)."""
    require_devices(8)
    model = dataclasses.replace(MODEL, n_kv_heads=kv_heads)
    dots = dataclasses.replace(TRAIN, remat="dots")
    reference = shared_run("single", cfg=dots, model=model).loss_and_grads()
    assert_matches(shared_run(spec, cfg=dots, model=model,
                              parallel=ParallelConfig(sequence_parallel=sequence_parallel)),
                   reference)


def test_fused_projections_all_reduce_one_input_gradient(tp8):
    """model=8: unfused (remat none) the backward pass all-reduces x's gradient once per projection, five
    per layer (q, k, v, gate, up); fused (dots), once per group: three activations a layer fewer."""
    fused = shared_run("model=8", cfg=dataclasses.replace(TRAIN, remat="dots")).report()["collectives"]
    unfused = tp8[False].report()["collectives"]
    activation = TRAIN.global_batch * TRAIN.seq_len * MODEL.d_model * 4
    saved = unfused["all-reduce"]["bytes"] - fused["all-reduce"]["bytes"]
    assert saved >= 3 * MODEL.n_layers * activation, (saved, activation)
