"""Leading layers that differ from the repeating stack (`model.layer_prefix`: DeepSeek-V3's 3 dense layers before
58 with experts), stacked on their own `lead_layers` axis (`Transformer.lead`; `meshpar.layers.lead`).

- The model with a prefix gives the logits of its layers built one at a time and chained by hand (alike kinds:
  a stack of Blocks; kinds that differ: one unrolled group; dense kinds among experts carry none).
- fsdp × model × expert and GPipe on `stage=2` equal one device (float32, 1e-5), the prefix whole over
  `stage`; 1F1B, zero-bubble, the circular and interleaved schedules and experts under 1F1B in the slow tier.
- Greedy generation equals the uncached forward's argmax; a checkpoint round trip; the planner's counts;
  the config's checks and `--set`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import require_devices
from layouts import max_relative_error, shared_run
from meshpar import (checkpoint, config as config_lib, context, generate, lora, mesh as mesh_lib, moe, plan,
                     rules as rules_lib, train)
from meshpar.plan.layout import local_dims
from meshpar.plan.time import layer_flops_per_token, lead_seconds
from meshpar.errors import InputError
from models.transformer import Block, LayerKind, Transformer, TransformerConfig
from test_hf import build_mesh
from test_moe import MOE, TOLERANCE, TRAIN
from test_pipeline_moe import PER_MICROBATCH, reference

WINDOW = 3
# Alike kinds: a stack of 2 Blocks before 4 plain layers (stage=2 · R=2 chunks)
DENSE = TransformerConfig(vocab_size=256, d_model=32, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=64,
                          layer_prefix=(LayerKind(window=WINDOW),) * 2)
# Kinds that differ, before a pattern: one unrolled group of 2 (a windowed layer, another RoPE base)
MIXED = dataclasses.replace(DENSE, n_layers=4, layer_prefix=(LayerKind(window=WINDOW), LayerKind(rope_theta=5e5)),
                            layer_pattern=(LayerKind(window=WINDOW), LayerKind()))
# DeepSeek-V3's shape, small: 2 dense layers, then 2 with experts (and a shared one)
DEEP = dataclasses.replace(MOE, n_layers=4, n_shared_experts=1, layer_prefix=(LayerKind(dense=True),) * 2)


def build(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, rngs=nnx.Rngs(seed))


def layers_by_hand(model: Transformer) -> list[tuple[LayerKind, nnx.State]]:
    """Every layer in order, with its kind and its own weights cut from the stacks (no prefix code)."""
    cfg, state = model.cfg, nnx.state(model)
    prefix, stacked = cfg.layer_prefix, cfg.n_layers - len(cfg.layer_prefix)
    lead_alike = all(kind == prefix[0] for kind in prefix)
    cut = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    out = [(kind, cut(state["lead"], j) if lead_alike else cut(state["lead"][f"layer{j}"], 0))
           for j, kind in enumerate(prefix)]
    period = cfg.layer_pattern or (LayerKind(),)
    for i in range(stacked):
        p, j = divmod(i, len(period))
        out.append((period[j], cut(state["blocks"][f"layer{j}"], p) if cfg.layer_pattern else cut(state["blocks"], p)))
    return out


def logits_by_hand(model: Transformer, tokens_BT: jax.Array) -> jax.Array:
    cfg, x_BTD = model.cfg, model.embed(tokens_BT)
    positions, stats = jnp.arange(tokens_BT.shape[1]), moe.RouterStats.zeros(tokens_BT.shape[0], cfg.n_experts)
    for kind, weights in layers_by_hand(model):
        with nnx.use_eager_sharding(False):
            block = Block(cfg, jnp.float32, nnx.Rngs(99), kind)
        nnx.update(block, weights)
        x_BTD, stats = block((x_BTD, stats), positions) if cfg.n_experts else (block(x_BTD, positions), stats)
    return model.final_norm(x_BTD) @ model.head_DV[...]


@pytest.mark.parametrize("cfg", [DENSE, MIXED, DEEP], ids=["alike", "differing", "dense-among-experts"])
def test_the_prefix_runs_as_its_layers_written_out(cfg):
    model = build(cfg)
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)))
    expected = logits_by_hand(model, tokens_BT)
    np.testing.assert_allclose(model(tokens_BT), expected, rtol=1e-5, atol=1e-5)
    without = build(dataclasses.replace(cfg, layer_prefix=(), n_layers=cfg.n_layers - len(cfg.layer_prefix)))
    nnx.update(without, nnx.state(model, lambda path, _: path[0] != "lead"))
    assert np.abs(np.asarray(without(tokens_BT) - expected)).max() > 1e-2  # the prefix's layers count


def test_the_prefix_stacks_on_its_own_axis():
    """Alike kinds: [prefix, ...] on `lead_layers`; differing: one group; dense kinds among experts carry no
    experts; LoRA adapters on the prefix too."""
    shapes = lambda cfg, adapters=None: {k: (v.shape, v.get_metadata()["out_sharding"]) for k, v in
                                         nnx.to_flat_state(Transformer.abstract(cfg, adapters)[1])}
    deep = shapes(DEEP, lora.LoraConfig(rank=2, alpha=4.0, targets=("q", "down")))
    assert deep[("lead", "mlp", "w_gate_DF")] == ((2, 32, 64), ("lead_layers", "embed", "mlp"))
    assert not [k for k in deep if k[0] == "lead" and "router" in "".join(map(str, k))]
    assert deep[("blocks", "mlp", "w_gate_EDF")][0] == (2, 8, 32, 48)
    adapted = {k[:3] for k in deep if len(k) > 3 and str(k[2]).endswith(lora.SUFFIX)}
    assert adapted == {(stack, sub, w + lora.SUFFIX) for stack in ("lead", "blocks")
                       for sub, w in (("attn", "wq_DNH"), ("mlp", "w_down_FD"))} - {("blocks", "mlp", "w_down_FD_lora")}
    mixed = shapes(MIXED)
    assert mixed[("lead", "layer1", "attn", "wq_DNH")][0] == (1, 32, 4, 8)


def test_fsdp_model_expert_equal_one_device():
    require_devices(8)
    layout = shared_run("fsdp=2,model=2,expert=2", TRAIN, DEEP)
    ref_loss, ref_grads = shared_run("single", TRAIN, DEEP).loss_and_grads()
    loss, grads = layout.loss_and_grads()
    assert abs(loss - ref_loss) / ref_loss < TOLERANCE
    assert max_relative_error(grads, ref_grads) < TOLERANCE
    shard = layout.state["model"]["lead"]["mlp"]["w_gate_DF"][...].addressable_shards[0].data
    assert shard.shape == (2, 8, 32)  # the prefix whole, D over fsdp × expert (its replicas), F over model
    experts = layout.state["model"]["blocks"]["mlp"]["w_gate_EDF"][...].addressable_shards[0].data
    assert experts.shape[2] == DEEP.d_model // 2  # an expert's D over fsdp alone: expert splits E


def pipelined(kind: str, R: int, M: int, spec: str = "stage=2,data=2,fsdp=2"):
    return shared_run(spec, TRAIN, DENSE, rules_lib.ParallelConfig(microbatches=M, pipeline_schedule=kind,
                                                                 pipeline_repeats=R))


SCHEDULES = [pytest.param("gpipe", 1, 2, "stage=2,data=2,fsdp=2", id="gpipe"),
             *(pytest.param(*case, id=f"{case[0]}-R{case[1]}-{case[3]}", marks=pytest.mark.slow)
               for case in [("gpipe", 2, 2, "stage=2,data=2,fsdp=2"), ("1f1b", 1, 2, "stage=2,data=2,fsdp=2"),
                            ("1f1b", 2, 2, "stage=2,data=2,fsdp=2"), ("zero_bubble", 1, 2, "stage=2,data=2,fsdp=2"),
                            ("1f1b", 1, 2, "stage=2,sequence=2,data=2")])]  # the prefix's ring attention in a slot


@pytest.mark.parametrize("kind,R,M,spec", SCHEDULES)
def test_pipelines_equal_one_device(kind, R, M, spec):
    """The prefix runs before the stages (whole over `stage`), the stack in stages of its own periods."""
    require_devices(8)
    layout = pipelined(kind, R, M, spec)
    ref_loss, ref_grads = shared_run("single", TRAIN, DENSE).loss_and_grads()
    loss, grads = layout.loss_and_grads()
    assert abs(loss - ref_loss) / ref_loss < TOLERANCE
    assert max_relative_error(grads, ref_grads) < TOLERANCE
    model = layout.state["model"]
    assert model["lead"]["attn"]["wq_DNH"][...].addressable_shards[0].data.shape[0] == 2
    assert model["blocks"]["attn"]["wq_DNH"][...].addressable_shards[0].data.shape[0] == 2  # 4 layers / 2 stages


def test_gpipe_splits_the_prefix_rows_over_the_stages():
    """Outside the stages each stage computes the prefix on its share of the rows: half a device's FLOPs."""
    require_devices(8)
    graphdef, params = nnx.split(build(DENSE))
    tokens_BT = jnp.zeros((16, 8), jnp.int32)

    def flops(spec: str) -> float:
        compute = context.Compute(build_mesh(spec), rules_lib.default())

        def lead(params, tokens_BT):
            with context.use(compute):
                return nnx.merge(graphdef, params).stack_input(tokens_BT)

        return jax.jit(lead).lower(params, tokens_BT).compile().cost_analysis()["flops"]

    assert flops("stage=2,data=4") == pytest.approx(flops("data=4") / 2, rel=0.05)


@pytest.mark.slow
def test_experts_after_dense_layers_pipeline_as_one_device():
    """DeepSeek's shape under 1F1B on `stage=2,expert=2,data=2`: the prefix in the first part, on stage 0."""
    require_devices(8)
    layout = shared_run("stage=2,expert=2,data=2", PER_MICROBATCH, DEEP,
                        rules_lib.ParallelConfig(microbatches=2, pipeline_schedule="1f1b"))
    ref_loss, ref_grads = reference(np.asarray(layout.batch(0)), 2, model=DEEP)
    loss, grads = layout.loss_and_grads()
    assert abs(loss - ref_loss) / ref_loss < TOLERANCE
    assert max_relative_error(grads, ref_grads) < TOLERANCE


@pytest.mark.slow
def test_packed_documents_reach_the_prefix_in_1f1b():
    """The documents' positions and ids ride into the prefix in 1F1B's first part, as into the stages."""
    require_devices(8)
    from test_documents import CFG as DOCS_CFG, packed_batch

    batch = packed_batch(DOCS_CFG)[0]
    runs = [shared_run(spec, DOCS_CFG, DENSE, rules_lib.ParallelConfig(microbatches=2, pipeline_schedule="1f1b"))
            for spec in ("single", "stage=2,data=2,model=2")]
    (ref_loss, ref_grads), (loss, grads) = (
        train.loss_and_grads(run.sharded, run.tokens_sharding, run.cfg)(
            run.state, jax.tree.map(lambda x: jax.device_put(x, run.tokens_sharding), batch)) for run in runs)
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < TOLERANCE
    assert max_relative_error(jax.device_get(grads), jax.device_get(ref_grads)) < TOLERANCE


def test_greedy_generation_is_the_uncached_argmax():
    """8 tokens after 4 through the prefix's caches (a ring of W − 1 slots in the windowed kind) and the stack's."""
    mesh = build_mesh("fsdp=2,model=2")
    model = build(MIXED, seed=3)
    prompt_BT = np.random.default_rng(1).integers(0, MIXED.vocab_size, (2, 4))
    new_BN = generate.generate(model, prompt_BT, 8, mesh, rules_lib.default())
    whole_BT = np.concatenate([prompt_BT, new_BN], axis=1)
    np.testing.assert_array_equal(np.argmax(np.asarray(model(jnp.asarray(whole_BT[:, :-1]))), -1)[:, 3:], new_BN)


def test_a_checkpoint_round_trip_onto_another_mesh(tmp_path):
    require_devices(8)
    source, target = shared_run("single", TRAIN, DEEP), shared_run("fsdp=2,model=2,expert=2", TRAIN, DEEP)
    ckpt = checkpoint.Checkpointer(tmp_path)
    ckpt.save(1, source.state, {"data": {}})
    ckpt.wait()
    restored, _ = ckpt.restore(target.sharded.abstract, target.sharded.shardings)
    ckpt.close()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(source.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lead = restored["model"]["lead"]["mlp"]["w_down_FD"][...]
    assert lead.sharding == target.state["model"]["lead"]["mlp"]["w_down_FD"][...].sharding


def test_the_planner_counts_the_prefix():
    """Its parameters are the model's; a prefix of the stack's own kind costs what as many stacked layers do."""
    for cfg in (DENSE, MIXED, DEEP):
        real = sum(v.size for v in jax.tree.leaves(Transformer.abstract(cfg)[1]))
        assert plan.Shape.of_model(Transformer.factory(cfg), 2 if cfg.n_experts else 0).params == real
    alike = dataclasses.replace(DENSE, layer_prefix=(LayerKind(),) * 2)
    flat = plan.Shape.of_model(Transformer.factory(dataclasses.replace(alike, layer_prefix=())))
    shape = plan.Shape.of_model(Transformer.factory(alike))
    assert (shape.lead, shape.layers, flat.layers) == (2, 4, 6)
    assert shape.model_flops_per_token(64) == flat.model_flops_per_token(64)
    windowed = plan.Shape.of_model(Transformer.factory(DENSE), lead_windows=(WINDOW,) * 2)
    attention = 12 * DENSE.n_heads * DENSE.head_size
    assert flat.model_flops_per_token(64) - windowed.model_flops_per_token(64) == pytest.approx(
        2 * attention * (64 - WINDOW))


@pytest.mark.parametrize(("change", "culprit"), [
    ({"n_layers": 5}, r"model.n_layers = 5 less model.layer_prefix's 2 is not a whole number of "
                      r"model.layer_pattern's periods of 2 layers"),
    ({"n_layers": 2}, r"model.n_layers = 2 leaves no layer after model.layer_prefix's 2"),
    ({"layer_prefix": (LayerKind(window=-1),)}, r"model.layer_prefix\[0\].window = -1 must be >= 0"),
    ({"layer_prefix": (LayerKind(dense=True),)}, r"model.layer_prefix\[0\].dense = true: every layer is dense"),
    ({"sliding_window": 4}, r"model.sliding_window = 4 is every layer's window: with model.layer_pattern"),
])
def test_bad_prefixes_are_refused(change, culprit):
    with pytest.raises(InputError, match=culprit):
        dataclasses.replace(MIXED, **change)


def test_the_prefix_is_set_as_a_json_list():
    cfg = config_lib.apply(DEEP, ['layer_prefix=[{"dense": true}, {"dense": true}, {"dense": true}]', "n_layers=5"])
    assert cfg.layer_prefix == (LayerKind(dense=True),) * 3 and cfg.periods == 2
    assert TransformerConfig.from_dict(dataclasses.asdict(cfg)) == cfg  # a saved run's config reads back
    with pytest.raises(InputError, match=r"--set layer_prefix\[0\].dense = \"yes\": expected bool"):
        config_lib.apply(DEEP, ['layer_prefix=[{"dense": "yes"}]'])


def test_the_planner_times_the_prefix_where_it_runs():
    """Without stages it costs what as many stacked layers of its kind do; GPipe runs it once on the batch split
    over the stages too (half of it on stage=2), 1F1B on a microbatch in each of its n = M + P − 1 slots."""
    alike = plan.Shape.of_model(Transformer.factory(dataclasses.replace(DENSE, layer_prefix=(LayerKind(),) * 2)))
    run = plan.Run(global_batch=16, seq_len=64, flash_attention=False)
    on = lambda spec, **parallel: plan.Layout(mesh_lib.parse(spec), rules_lib.ParallelConfig(**parallel), "none", 1)
    single = on("")
    b, t, *_ = local_dims(alike, single, run)
    flops = lambda lay: lead_seconds(alike, lay, run, (1.0, 1.0))  # at one second per FLOP: FLOPs
    assert flops(single) == pytest.approx(2 * sum(layer_flops_per_token(alike, single, run)) * b * t)
    assert flops(on("stage=2", microbatches=2)) == pytest.approx(flops(single) / 2)
    assert flops(on("stage=2", microbatches=2, pipeline_schedule="1f1b")) == pytest.approx(flops(single) * 3 / 2)
