"""LoRA (meshpar.lora) on every parallel layout and DPO (meshpar.dpo) on one, against one device: the same weights
(adapters' B drawn non-zero: `layouts.initial_state`) and batch, the loss and every adapter's gradient
(float32); the adapters laid out by the rules; the frozen base untouched by training and without optimizer
state; the merged model equal to the adapted one; DPO's loss and gradients against its formula; the settings
refused by name. Against PEFT and TRL: test_peft.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from conftest import require_devices
from launch import configure
from layouts import MODEL, MeshRun, TRAIN, max_relative_error, shared_run
from meshpar import config as config_lib, lora, sharding, train
from meshpar.batch import Batch
from meshpar.errors import InputError
from meshpar.frozen import Frozen
from meshpar.rules import ParallelConfig
from models.transformer import Transformer

LORA = dataclasses.replace(TRAIN, lora_rank=4, lora_alpha=8.0)
DEEP = dataclasses.replace(MODEL, n_layers=4)
MOE = dataclasses.replace(MODEL, n_experts=4, experts_per_token=2, d_expert=64)
EXPERTS = dataclasses.replace(LORA, lora_targets="q,k,v,o,experts")

# mesh, ParallelConfig fields, train config, model: one row per strategy
STRATEGIES = {
    "data": ("data=8", {}, LORA, MODEL),
    "zero1": ("data=2,fsdp=4", {"zero_stage": 1}, LORA, MODEL),
    "fsdp": ("fsdp=8", {}, LORA, MODEL),
    "tp+sp": ("data=2,model=4", {"sequence_parallel": True}, LORA, MODEL),
    "fsdp+tp": ("data=2,fsdp=2,model=2", {}, LORA, MODEL),
    "ring": ("sequence=4,fsdp=2", {}, LORA, MODEL),
    "allgather": ("data=2,sequence=4", {"context_attention": "allgather", "load_balance": False}, LORA, MODEL),
    "ulysses": ("fsdp=2,sequence=2,model=2", {"context_attention": "ulysses"}, LORA, MODEL),
    "gpipe": ("stage=2,data=4", {"microbatches": 2}, LORA, DEEP),
    "circular": ("stage=2,fsdp=2,model=2", {"microbatches": 2, "pipeline_repeats": 2}, LORA, DEEP),
    "1f1b": ("stage=2,data=2,fsdp=2", {"pipeline_schedule": "1f1b", "microbatches": 4}, LORA, DEEP),
    "interleaved 1f1b": ("stage=2,data=4", {"pipeline_schedule": "1f1b", "microbatches": 2, "pipeline_repeats": 2},
                         LORA, DEEP),
    "zero_bubble": ("stage=2,data=4", {"pipeline_schedule": "zero_bubble", "microbatches": 4}, LORA, DEEP),
    "offload": ("fsdp=8", {"offload": "optimizer+params"}, dataclasses.replace(LORA, remat="dots"), MODEL),
    "accumulation": ("data=2,fsdp=2,model=2", {}, dataclasses.replace(LORA, grad_accum=2), MODEL),
    "experts": ("expert=4,data=2", {}, EXPERTS, MOE),
}




@functools.cache
def single(model, cfg) -> tuple[float, nnx.State]:
    """One device's loss and gradients (without accumulation or remat: the same numbers)."""
    return shared_run("single", cfg=dataclasses.replace(cfg, grad_accum=1, remat="none"), model=model).loss_and_grads()


# The slow tier's: their code runs in make test's other rows (adapters split as on fsdp and tp+sp; a pipeline's
# stages hold them as 1f1b's do; an attention mode never sees them)
SLOW = ("ring", "allgather", "ulysses", "gpipe", "circular", "interleaved 1f1b", "zero_bubble")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] * (n in SLOW)) for n in STRATEGIES])
def test_lora_matches_one_device(name):
    """Loss and every adapter's gradient on each strategy's mesh equal one device's (float32, 1e-5); the
    gradients are the adapters' alone."""
    require_devices(8)
    spec, parallel, cfg, model = STRATEGIES[name]
    loss, grads = shared_run(spec, cfg=cfg, model=model, parallel=ParallelConfig(**parallel)).loss_and_grads()
    ref_loss, ref_grads = single(model, cfg)
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    assert max_relative_error(grads, ref_grads) < 1e-5
    paths = [sharding.path_name(path) for path, _ in nnx.to_flat_state(grads)]
    assert paths and all(lora.SUFFIX + "/" in path for path in paths), paths


@pytest.fixture(scope="module")
def fsdp_tp():
    require_devices(8)
    return shared_run("data=2,fsdp=2,model=2", cfg=dataclasses.replace(LORA, frozen_dtype="bfloat16"))


def test_adapters_are_laid_out_as_the_weights_they_adapt(fsdp_tp):
    """A's input axes and B's output axes split as the weight's: q's A [L, D, R] over fsdp on D, its B
    [L, R, N, H] over model on the heads; o's A [L, N, H, R] over model, its B [L, R, D] over fsdp."""
    attn = fsdp_tp.state["model"]["blocks"]["attn"]
    shard = lambda v: v[...].sharding.shard_shape(v[...].shape)
    L, D, N, H, R = MODEL.n_layers, MODEL.d_model, MODEL.n_heads, MODEL.head_size, LORA.lora_rank
    assert shard(attn["wq_DNH"]) == (L, D // 2, N // 2, H)
    assert shard(attn["wq_DNH_lora"]["a"]) == (L, D // 2, R)
    assert shard(attn["wq_DNH_lora"]["b"]) == (L, R, N // 2, H)
    assert shard(attn["wo_NHD_lora"]["a"]) == (L, N // 2, H, R)
    assert shard(attn["wo_NHD_lora"]["b"]) == (L, R, D // 2)


def test_the_base_is_frozen_in_its_dtype_and_has_no_optimizer_state(fsdp_tp):
    """Frozen weights in bfloat16 (train.frozen_dtype), adapters and their moments in float32; every moment
    belongs to an adapter; after three steps the base is bit for bit what it was and the adapters moved."""
    state = fsdp_tp.state
    weights = dict(nnx.to_flat_state(state["model"]))
    frozen = {p: v for p, v in weights.items() if isinstance(v, Frozen)}
    adapters = {p: v for p, v in weights.items() if not isinstance(v, Frozen)}
    assert frozen and all(v.dtype == jnp.bfloat16 for v in frozen.values())
    assert adapters and all(str(p[-2]).endswith(lora.SUFFIX) and v.dtype == jnp.float32 for p, v in adapters.items())
    moments = [(p, v) for p, v in nnx.to_flat_state(state["opt"]) if v.ndim]
    assert moments and all(any(str(k).endswith(lora.SUFFIX) for k in p) for p, _ in moments)
    assert sum(v.size for _, v in moments) == 2 * sum(v.size for v in adapters.values())  # Adam: μ and ν
    before = jax.tree.map(np.asarray, state["model"])
    step = fsdp_tp.compiled_step[0]
    after = jax.tree.map(lambda x: x.copy(), state)
    for i in range(3):
        after, _ = step(after, fsdp_tp.batch(i))
    for path, v in nnx.to_flat_state(after["model"]):
        old = dict(nnx.to_flat_state(before))[path][...]
        if isinstance(v, Frozen):
            assert np.array_equal(np.asarray(v[...]), old), path
        else:
            assert not np.array_equal(np.asarray(v[...]), old), path


def test_the_merged_model_computes_what_the_adapted_one_does():
    """`lora.merged` folds s·A·B into each weight: a plain model with those weights gives the adapted model's
    logits; with the adapters switched off (`lora.disabled`) the adapted model gives the base's."""
    run = shared_run("single", cfg=LORA)
    model = nnx.merge(run.sharded.graphdef, run.state).model
    tokens_BT = jnp.asarray(run.batch(0)[:2, :-1])
    with nnx.use_eager_sharding(False):
        plain = Transformer(MODEL, rngs=nnx.Rngs(0))
    nnx.update(plain, lora.merged(nnx.state(model, (nnx.Param, Frozen)), LORA.lora))
    adapted = model(tokens_BT)
    assert np.max(np.abs(plain(tokens_BT) - adapted)) <= 1e-5 * np.max(np.abs(adapted))
    with lora.disabled():
        off = model(tokens_BT)
    nnx.update(plain, nnx.from_flat_state({p: nnx.Param(v[...].astype(jnp.float32))
                                           for p, v in nnx.to_flat_state(nnx.state(model, Frozen))}))
    np.testing.assert_array_equal(off, plain(tokens_BT))
    assert np.max(np.abs(off - adapted)) > 1e-3  # the adapters' B are not 0


@pytest.mark.parametrize(("settings", "culprit"), [
    ({"lora_rank": 4, "lora_targets": "q,attention"}, "train.lora_targets = 'q,attention': 'attention' is not one of"),
    ({"lora_rank": -1}, "train.lora_rank = -1 must be >= 0"),
    ({"lora_rank": 4, "lora_alpha": 0.0}, "train.lora_alpha = 0.0 must be > 0"),
    ({"lora_rank": 4, "lora_targets": " , "}, "train.lora_targets = '': name at least one of q, k, v, o"),
    ({"frozen_dtype": "float16"}, "train.frozen_dtype = 'float16' is not one of"),
    ({"objective": "dpo", "global_batch": 6, "grad_accum": 2}, "must be an even number of rows per microbatch"),
    ({"objective": "sft"}, "train.objective = 'sft' is not one of lm, dpo"),
    ({"objective": "dpo", "dpo_beta": 0.0}, "train.dpo_beta = 0.0 must be > 0"),
])
def test_bad_settings_are_refused(settings, culprit):
    with pytest.raises(InputError, match=culprit):
        train.TrainConfig(**settings)


SAVED = lora.LoraConfig(4, 8.0, ("q", "v", "down"), rslora=True)  # adapters an --init-from directory holds


@pytest.mark.parametrize(("overrides", "culprit"), [
    (["train.lora_alpha=32"], "train.lora_alpha=32.0 cannot make them others"),
    (["train.lora_rank=8"], "train.lora_rank=8 cannot"),
    (["train.lora_targets=q,v"], "train.lora_targets=q,v cannot"),
    (["train.lora_rslora=false", "train.lora_alpha=8"], "train.lora_rslora=False cannot"),
    (["train.lora_rank=0", "train.lora_alpha=32"], "train.lora_alpha=32 cannot"),  # merged: alpha means nothing
])
def test_other_lora_settings_over_saved_adapters_are_refused_by_name(overrides, culprit):
    """`--init-from ADAPTERS --set train.lora_*`: another adapter setting would train other adapters (or, under
    launch.train, merge them and train every weight), so it is refused, naming the setting."""
    cfg = config_lib.apply(configs.load("tiny"), overrides)
    with pytest.raises(InputError, match=rf"--init-from adapters holds LoRA adapters of rank 4, alpha 8.0 on q,v,down "
                                         rf"\(rslora True\): {culprit}"):
        configure.with_saved_adapters(cfg, SAVED, "adapters", overrides)


@pytest.mark.parametrize("overrides", [[], ["train.lora_targets=down, q,v", "train.lora_rank=4"]])
def test_saved_adapters_train_with_their_own_settings(overrides):
    """The adapters' own settings, whatever the preset's, and those written again (in any order) are accepted;
    train.lora_rank=0 alone merges them (every weight trains)."""
    cfg = config_lib.apply(configs.load("tiny"), ["train.lora_rank=16", "train.lora_alpha=1", *overrides])
    assert configure.with_saved_adapters(cfg, SAVED, "adapters", overrides).train.lora == SAVED
    merged = config_lib.apply(cfg, ["train.lora_rank=0"])
    assert configure.with_saved_adapters(merged, SAVED, "adapters", ["train.lora_rank=0"]).train.lora is None


def test_the_planner_counts_a_frozen_weights_matmuls_at_4_flops_per_token():
    """Model FLOPs of a LoRA run (the planner's, and what MFU counts: `configure.flops_per_token`): each base weight's
    matmuls, counted here from the model's shape, at 4 per parameter and token (forward, input gradient: no weight
    gradient), the adapters' at 6 as trained weights', attention's as a full run's."""
    full, adapted = (config_lib.apply(configs.load("tiny"), o) for o in ([], ["train.lora_rank=4"]))
    m, T = full.model, full.train.seq_len
    D, N, K, H, F = m.d_model, m.n_heads, m.n_kv_heads, m.head_size, m.d_ff
    base = m.n_layers * (D * (N + 2 * K) * H + N * H * D + 3 * D * F) + D * m.vocab_size  # untied: the head
    full_shape, adapted_shape = configure.shape(full), configure.shape(adapted)
    assert full_shape.matmul_params == base
    adapters = adapted_shape.params - full_shape.params  # every element of every A and B takes part in x·A·B
    assert adapted_shape.matmul_params - base == adapters > 0
    assert configure.flops_per_token(adapted) == adapted_shape.model_flops_per_token(T) == pytest.approx(
        full_shape.model_flops_per_token(T) - 2 * base + 6 * adapters, rel=1e-12)


def test_experts_target_on_a_dense_model_is_refused():
    with pytest.raises(InputError, match="train.lora_targets names experts, and this model has none"):
        shared_run("single", cfg=EXPERTS)


# --- DPO -------------------------------------------------------------------------------------------------


def pairs(run: MeshRun, step: int) -> Batch:
    """Pairs (rows 2i, 2i + 1) sharing a prompt of 12 tokens, their responses weighed 1."""
    tokens = np.array(run.batch(step))
    tokens[1::2, :12] = tokens[0::2, :12]
    weights = np.zeros(tokens.shape, np.float32)
    weights[:, 12:] = 1.0
    return Batch(*(jax.device_put(x, run.tokens_sharding) for x in (tokens, None, weights)))


DPO = {"lora": dataclasses.replace(LORA, objective="dpo", dpo_beta=0.5, lr=1e-3),
       "full": dataclasses.replace(TRAIN, objective="dpo", dpo_beta=0.5, lr=1e-4)}


@pytest.mark.slow  # 30 s of compiles: `make test-slow` (which also holds both against TRL's loss: test_peft)
@pytest.mark.parametrize("kind", DPO)
def test_dpo_on_a_mesh_with_accumulation_matches_one_device(kind):
    """Three DPO steps on data=2,fsdp=2,model=2 with 2 accumulation microbatches, on the same pairs: the losses
    and reward metrics equal one device's, and the margin grows; a full fine-tuning run's reference copy stays
    as it was and has no optimizer state."""
    require_devices(8)
    cfg = DPO[kind]
    runs = [shared_run("single", cfg=cfg),
            shared_run("data=2,fsdp=2,model=2", cfg=dataclasses.replace(cfg, grad_accum=2))]
    records = []
    for run in runs:
        step, state, out = train.make_step(run.sharded, run.tokens_sharding, run.cfg), run.state, []
        state = jax.tree.map(lambda x: x.copy(), state)
        for i in range(3):
            state, metrics = step(state, pairs(run, 0))  # the same pairs: the margin must grow
            out.append({k: float(v) for k, v in metrics.items()})
        records.append(out)
        if kind == "full":  # the reference: the starting weights, frozen, without moments of its own
            reference = dict(nnx.to_flat_state(state["reference"]))
            start = dict(nnx.to_flat_state(run.state["model"]))
            assert reference.keys() == start.keys()
            assert all(np.array_equal(np.asarray(v[...]), np.asarray(start[p][...])) for p, v in reference.items())
            moments = sum(v.size for _, v in nnx.to_flat_state(state["opt"]) if v.ndim)
            assert moments == 2 * sum(v.size for v in start.values())
    if kind == "full":  # the policy starts as the reference (a LoRA run's adapters start with B ≠ 0 here): each
        # margin is 0 but for float32's rounding of two sums of log-probabilities, and the loss log 2 but for it
        first = records[0][0]
        assert abs(first["rewards/margins"]) <= 1e-5 * cfg.dpo_beta * abs(first["logps/chosen"])
        assert first["loss"] == pytest.approx(np.logaddexp(0, -first["rewards/margins"]), rel=1e-6)
    for i, (one, mesh) in enumerate(zip(*records)):
        # a reward is β times a difference of two sums of log-probabilities: float32 rounds it to their size
        rounding = 1e-5 * cfg.dpo_beta * abs(one["logps/chosen"])
        for key in ("loss", "logps/chosen", "logps/rejected"):
            assert mesh[key] == pytest.approx(one[key], rel=1e-5), key
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert abs(mesh[key] - one[key]) <= rounding, key
        if kind == "lora" or i:  # a full run's first margins are 0 but for rounding: their signs are noise
            assert mesh["rewards/accuracies"] == one["rewards/accuracies"]
    assert records[0][-1]["rewards/margins"] > records[0][0]["rewards/margins"] + 0.01  # it learns to prefer them


@pytest.mark.slow  # two compiles of DPO's step: `make test-slow`
def test_dpo_under_gpipe_matches_one_device():
    """GPipe computes the loss after the pipeline, so DPO runs on it: the loss and every adapter's gradient equal one
    device's (float32, 1e-5)."""
    require_devices(8)
    results = []
    for spec, parallel in (("single", ParallelConfig()), ("stage=2,data=4", ParallelConfig(microbatches=2))):
        run = shared_run(spec, cfg=DPO["lora"], model=DEEP, parallel=parallel)
        loss, grads = train.loss_and_grads(run.sharded, run.tokens_sharding, run.cfg)(run.state, pairs(run, 0))
        results.append((float(loss), jax.tree.map(np.asarray, grads)))
    (ref_loss, ref_grads), (loss, grads) = results
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    assert max_relative_error(grads, ref_grads) < 1e-5


def test_dpo_refuses_the_pipeline_schedules_that_run_the_loss_inside():
    require_devices(8)
    run = shared_run("stage=2,data=4", cfg=DPO["lora"], model=DEEP,
                     parallel=ParallelConfig(pipeline_schedule="1f1b", microbatches=4))
    with pytest.raises(InputError, match="train.objective = dpo takes each sequence's log-probability whole"):
        train.loss_and_grads(run.sharded, run.tokens_sharding, run.cfg)(run.state, pairs(run, 0))


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_dpo_under_a_schedule_that_runs_the_loss_inside_is_refused_up_front(schedule):
    """Refused where the launch commands read the config, before a state is made; GPipe is accepted."""
    require_devices(8)
    settings = ["train.objective=dpo", "train.lora_rank=4", "parallel.microbatches=4"]
    with pytest.raises(InputError, match=rf"parallel.pipeline_schedule = {schedule} cannot give .*: use "
                                         r"pipeline_schedule=gpipe"):
        configure.configure("tiny", "stage=2,data=4", [*settings, f"parallel.pipeline_schedule={schedule}"])
    assert configure.configure("tiny", "stage=2,data=4", settings)[0].parallel.pipeline_schedule == "gpipe"


def test_dpo_loss_and_gradients_are_the_formulas():
    """DPO's loss and the adapters' gradients (`train.loss_and_grads`: chunked log-probabilities, the reference
    with the adapters off, the mean over pairs) against the formula written here on the model's logits:
    −log σ(β·((π_c − ref_c) − (π_r − ref_r))), each π the sum of log-softmax over its response's targets."""
    run, cfg = shared_run("single", cfg=LORA), DPO["lora"]  # the adapters' B ≠ 0: the policy is not the reference
    batch = pairs(run, 0)
    loss, grads = train.loss_and_grads(run.sharded, run.tokens_sharding, cfg)(run.state, batch)
    graphdef, params, rest = nnx.split(nnx.merge(run.sharded.graphdef, run.state).model, nnx.Param, ...)
    tokens_BT1, weights_BT = np.asarray(batch.tokens), np.asarray(batch.weights)[:, 1:]

    def log_probs_P2(model) -> jax.Array:
        logp_BTV = jax.nn.log_softmax(model(tokens_BT1[:, :-1]).astype(jnp.float32))
        logp_BT = jnp.take_along_axis(logp_BTV, tokens_BT1[:, 1:, None], axis=-1)[..., 0]
        return (logp_BT * weights_BT).sum(axis=1).reshape(-1, 2)  # (chosen, rejected) per pair

    @jax.jit
    def formula(params):
        model = nnx.merge(graphdef, params, rest)
        with lora.disabled():
            reference_P2 = jax.lax.stop_gradient(log_probs_P2(model))
        reward_P2 = cfg.dpo_beta * (log_probs_P2(model) - reference_P2)
        return -jax.nn.log_sigmoid(reward_P2[:, 0] - reward_P2[:, 1]).mean()

    expected, expected_grads = jax.value_and_grad(formula)(params)
    assert abs(float(loss) - np.log(2)) > 1e-3  # not the policy-is-the-reference value
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert max_relative_error(grads, jax.tree.map(np.asarray, expected_grads)) < 1e-5
