"""The planner on a mixture of experts: its parameters, their split over `expert`, the dispatch's all-to-alls
against the compiled step, the search's `expert` axis, and what it refuses."""

import dataclasses
import math

import jax
import pytest
from conftest import require_devices
from layouts import MODEL, TRAIN, shared_run
from test_config import abstract_param_count

import configs
from launch.configure import flops_per_token
from meshpar import mesh as mesh_lib, plan
from meshpar.divisors import divisors
from meshpar.errors import InputError
from meshpar.mfu import palm_flops_per_token
from meshpar.plan import Layout, Run, check, memory
from meshpar.plan.comm import collectives, totals
from meshpar.plan.layout import expert_rows
from meshpar.plan.search import CAPACITY, _meshes
from meshpar.rules import ParallelConfig
from models.transformer import Transformer, TransformerConfig

MOE = dataclasses.replace(MODEL, n_experts=8, experts_per_token=2, d_expert=32)
RUN = Run(TRAIN.global_batch, TRAIN.seq_len, compute_dtype="float32", flash_attention=False)


def shape_of(model: TransformerConfig) -> plan.Shape:
    return plan.Shape.of_model(Transformer.factory(model), model.experts_per_token if model.n_experts else 0)


def layout(spec: str, remat: str = "none", **parallel) -> Layout:
    return Layout(mesh_lib.parse(spec), ParallelConfig(**parallel), remat)


@pytest.mark.parametrize("model", [MOE, dataclasses.replace(MOE, n_shared_experts=2)], ids=["routed", "shared"])
def test_the_parameter_count_is_the_models(model):
    shape = shape_of(model)
    assert shape.params == abstract_param_count(model)
    D, E, F, k, L = model.d_model, model.n_experts, model.expert_width, model.experts_per_token, model.n_layers
    routed = L * E * 3 * D * F
    assert shape.params - shape.matmul_params == routed * (E - k) // E + L * 2 * D + D * model.vocab_size + D


def test_the_presets_active_parameters_are_the_flops_per_token():
    """MFU counts what a token computes with: Mixtral's 12.9B of 46.7B, Qwen3-30B-A3B's 3.3B of 30.5B."""
    for name, active in (("mixtral_8x7b", 12.88e9), ("qwen3_30b_a3b", 3.35e9)):
        cfg = configs.load(name)
        shape = shape_of(cfg.model)
        assert shape.matmul_params + cfg.model.vocab_size * cfg.model.d_model == pytest.approx(active, rel=0.01)
        attention = palm_flops_per_token(0, cfg.model.n_layers, cfg.model.n_heads, cfg.model.head_size,
                                         cfg.train.seq_len)
        assert flops_per_token(cfg) == 6 * shape.matmul_params + attention


def test_a_mixture_needs_its_k():
    with pytest.raises(InputError, match=r"the model has 8 experts .* give experts_per_token"):
        plan.Shape.of_model(Transformer.factory(MOE))


@pytest.mark.parametrize("spec", ["expert=4,data=2", "expert=2,fsdp=2,model=2"])
def test_model_states_are_the_shards_of_the_state(spec):
    """Per-device parameter and Adam bytes: the experts split over expert (× fsdp at rest, × model for F)."""
    require_devices(8)
    run = shared_run(spec, model=MOE)
    states = jax.tree.leaves(run.sharded.abstract)
    shards = jax.tree.leaves(run.sharded.shardings)
    measured = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(states, shards)
                   if x.ndim and x.dtype == "float32")
    mem = memory(shape_of(MOE), layout(spec), RUN)
    assert mem.params + mem.optimizer == measured


CASES = [("expert=4,data=2", 0.0, "full"), ("expert=4,data=2", 1.5, "none"),
         ("expert=2,fsdp=2,model=2", 0.0, "none"), ("expert=2,fsdp=2,model=2", 1.25, "none")]


@pytest.mark.parametrize(("spec", "capacity", "remat"), CASES)
def test_all_to_alls_match_the_compiled_step(spec, capacity, remat):
    """The dispatch's all-to-alls per device per step (count and bytes) and the all-reduces, as planned; the
    arguments (model states and tokens) to the byte."""
    require_devices(8)
    par = ParallelConfig(expert_capacity=capacity)
    run = shared_run(spec, cfg=dataclasses.replace(TRAIN, remat=remat), model=MOE, parallel=par)
    report = run.report()
    lay = layout(spec, remat, expert_capacity=capacity)
    shape = shape_of(MOE)
    assert not check(shape, lay, RUN)
    planned = collectives(shape, lay, RUN, cpu=True)
    a2a = [x for x in planned if x.op == "all-to-all"]
    measured = report["collectives"]
    assert measured["all-to-all"]["count"] == sum(x.count for x in a2a)
    assert measured["all-to-all"]["bytes"] == pytest.approx(totals(a2a)["all-to-all"], rel=0.10)
    assert measured["all-reduce"]["bytes"] == pytest.approx(totals(planned)["all-reduce"], rel=0.10)
    mem = memory(shape, lay, RUN)
    tokens = TRAIN.global_batch // lay.batch_ways * (TRAIN.seq_len + 1) * 4
    counters = sum(x.dtype.itemsize for x in jax.tree.leaves(run.sharded.abstract) if x.ndim == 0)  # step, Adam's
    assert report["memory_per_device"]["arguments_bytes"] == mem.params + mem.optimizer + tokens + counters


def test_the_search_enumerates_expert_for_a_mixture_only():
    meshes = lambda model: list(_meshes(shape_of(model), 8, 8, RUN))
    assert {m.expert for m in meshes(MOE)} == set(divisors(8))
    assert {m.expert for m in meshes(dataclasses.replace(MOE, n_experts=6))} == {1, 2}  # what divides 6
    assert {m.expert for m in meshes(MODEL)} == {1}
    result = plan.search(shape_of(MOE), devices=8, devices_per_host=8, hardware="h100",
                         global_batch=TRAIN.global_batch, seq_len=TRAIN.seq_len, top=50)
    assert any(e.layout.mesh.expert > 1 for e in result.ranked)
    assert all(MOE.n_experts % e.layout.mesh.expert == 0 for e in result.ranked)


def test_what_cannot_run_is_refused():
    shape = shape_of(dataclasses.replace(MOE, n_experts=6))
    problems = check(shape, layout("expert=4,data=2"), RUN)
    assert problems and all("('experts') of size 6" in p and "expert=4" in p for p in problems), problems
    one_f_one_b = layout("stage=2,data=4", pipeline_schedule="1f1b", microbatches=2)
    assert not check(shape_of(MOE), one_f_one_b, RUN)  # its router losses pooled per microbatch
    assert not check(shape_of(MOE), layout("stage=2,data=4", microbatches=2), RUN)  # GPipe trains it
    assert not check(shape_of(MODEL), one_f_one_b, RUN)



def test_the_search_prices_dropless_as_compiled_and_tries_a_capacity():
    """Dropless, each local expert multiplies every row of the received buffer (XLA's masked grouped matmul):
    `qwen3_30b_a3b` (128 experts) on 64 H100s computes El·ep·r rows per device, so the search's pick is at the
    capacity it tries beside dropless; fixing the capacity at 0 keeps every row dropless, slower."""
    shape = shape_of(configs.load("qwen3_30b_a3b").model)
    search = lambda **kw: plan.search(shape, devices=64, devices_per_host=8, hardware="h100", global_batch=64,
                                      seq_len=4096, top=3, **kw)
    both, dropless = search(), search(capacities=(0.0,))
    assert both.ranked[0].layout.parallel.expert_capacity == CAPACITY == 1.25
    assert all(e.layout.parallel.expert_capacity == 0 for e in dropless.ranked)
    assert dropless.ranked[0].step_s > both.ranked[0].step_s
    lay, run = dropless.ranked[0].layout, Run(64, 4096)
    _, computed, buffered = expert_rows(shape, lay, run)
    assert computed == buffered * shape.experts // lay.mesh.expert
    with pytest.raises(InputError, match="expert capacities"):
        search(capacities=(-1.0,))
