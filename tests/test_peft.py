"""LoRA against PEFT and DPO against TRL's loss: meshpar imports a PEFT adapter of the small random model of a
family (`hf_reference.save_peft`: B drawn non-zero, so the first step already tests them; the mixtures of experts'
on attention, the names PEFT keeps as modules there), computes its logits, trains it step for step as PEFT + the
PyTorch AdamW loop does, and writes it back for PEFT (`to-peft`) and, merged, for transformers (`--merge-lora`).
What meshpar cannot read or write is refused by name, and so is a LoRA checkpoint over a base that changed.
DPO's losses and reward metrics are held to a PyTorch loop on transformers' log-probabilities with TRL's loss
(`hf_reference.dpo_steps`), for a LoRA run (its reference the base, the adapters off) and a full fine-tuning run
(its reference a frozen copy).

The logits and exports run in `make test`; the 20-step and 10-step training comparisons in the slow tier.
"""

import dataclasses
import json
import math
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from safetensors.numpy import load_file, save_file

from conftest import require_devices
from hf_reference import FAMILIES, MOE_FAMILIES, call
from launch import convert, generate, weights
from layouts import CORPUS, MODEL
from meshpar import checkpoint, lora, mesh as mesh_lib, rules as rules_lib, sharding, train
from meshpar.batch import Batch
from meshpar.errors import InputError
from meshpar.run import Checkpoints, Outputs, run
from models import hf
from models.hf import peft
from models.transformer import Transformer

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# In a model with routed experts PEFT takes the MLP's names for the experts' fused tensors: attention alone
ATTENTION = TARGETS[:4]
DENSE = ["llama", "qwen3"]
LAYER0 = f"{peft.PREFIX}model.layers.0.self_attn"
STEPS = 20
# test_hf_training's run (the loss halves in 20 steps at lr 3e-3; clipping acts), on adapters alone: lr 1e-2
TRAIN = train.TrainConfig(steps=STEPS, global_batch=8, seq_len=32, lr=1e-2, warmup_steps=3, weight_decay=0.1,
                          clip_norm=1.0, remat="none", lora_rank=RANK, lora_alpha=ALPHA)
SETTINGS = {k: getattr(TRAIN, k) for k in ("lr", "warmup_steps", "steps", "decay_steps", "weight_decay", "clip_norm")}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def adapter(request, tmp_path_factory):
    """(model_type, base directory, PEFT adapter directory) of one family (indirect parameter)."""
    model_type = request.param
    base, out = (str(tmp_path_factory.mktemp(f"{model_type}_{part}")) for part in ("base", "adapter"))
    call("save_random", base, model_type, {**FAMILIES, **MOE_FAMILIES}[model_type], 0)
    call("save_peft", base, out, TARGETS if model_type in FAMILIES else ATTENTION, RANK, ALPHA, False, 0)
    return model_type, base, out


def on_mesh(spec: str, parallel: rules_lib.ParallelConfig = rules_lib.ParallelConfig()):
    config = mesh_lib.parse(spec)
    n = math.prod(config.sizes().values())
    require_devices(n)
    return mesh_lib.build(config, jax.devices()[:n]), rules_lib.make(parallel)


def imported(model_type: str, base: str, adapter_dir: str | None, mesh, rules):
    """(model config, LoRA settings or None, the base's and the adapters' parameters) on `mesh`."""
    cfg = hf.load_config(base)
    params = hf.import_params(base, cfg, mesh, rules)
    if adapter_dir is None:
        return cfg, None, params
    adapters, lora_params = peft.import_adapters(adapter_dir, cfg, model_type, mesh, rules)
    return cfg, adapters, nnx.merge_state(params, lora_params)


@pytest.mark.parametrize("adapter", [*DENSE, "qwen3_moe", "mixtral"], indirect=True)
def test_peft_adapter_in_and_out(adapter, tmp_path):
    """meshpar's logits of a PEFT adapter over its base equal PEFT's; PEFT loads meshpar's export (`to-peft`) of a
    run with the default targets, which on a mixture of experts adapt attention alone, with those logits; that
    export reads back (`from-peft`) as the same adapters, also where its target_modules name all seven targets;
    transformers loads the merged weights (`--merge-lora`) with those logits too."""
    model_type, base, adapter_dir = adapter
    targets = TARGETS if model_type in DENSE else ATTENTION
    mesh, rules = on_mesh("fsdp=2,model=2")
    cfg, adapters, params = imported(model_type, base, adapter_dir, mesh, rules)
    assert adapters == lora.LoraConfig(RANK, ALPHA, tuple(t.removesuffix("_proj") for t in targets))
    tokens = (CORPUS[:2 * 24].reshape(2, 24) % cfg.vocab_size).astype(np.int32)
    graphdef, _ = Transformer.abstract(cfg, adapters)
    ours = np.asarray(nnx.merge(graphdef, params)(tokens))
    reference = call("logits", base, tokens.tolist(), adapter_dir)
    scale = np.max(np.abs(reference))
    assert np.max(np.abs(ours - reference)) < TOLERANCE * scale
    assert np.max(np.abs(np.asarray(call("logits", base, tokens.tolist())) - reference)) > 1e-2 * scale  # B ≠ 0
    default = train.TrainConfig(lora_rank=RANK, lora_alpha=ALPHA).lora  # its targets: q, k, v, o, gate, up, down
    peft.export(params, cfg, default, tmp_path / "peft", base, model_type)
    assert np.max(np.abs(np.asarray(call("logits", base, tokens.tolist(), str(tmp_path / "peft"))) - ours)) \
        < TOLERANCE * scale
    config = json.loads((tmp_path / "peft" / peft.CONFIG_FILE).read_text())
    assert config["target_modules"] == sorted(targets)
    for modules in (targets, TARGETS):
        (tmp_path / "peft" / peft.CONFIG_FILE).write_text(json.dumps({**config, "target_modules": modules}))
        back = peft.import_adapters(tmp_path / "peft", cfg, model_type, mesh, rules)[1]
        assert all(np.array_equal(v[...], dict(nnx.to_flat_state(params))[path][...])
                   for path, v in nnx.to_flat_state(back))
    hf.export(lora.merged(params, adapters), cfg, tmp_path / "merged", model_type=model_type)
    assert np.max(np.abs(np.asarray(call("logits", str(tmp_path / "merged"), tokens.tolist())) - ours)) \
        < TOLERANCE * scale


@pytest.mark.parametrize(("change", "culprit"), [
    pytest.param({"peft_type": "IA3"}, "peft_type = 'IA3': meshpar reads LORA adapters", id="ia3"),
    pytest.param({"peft_type": "LOHA"}, "peft_type = 'LOHA'", id="loha"),
    pytest.param({"use_dora": True}, "use_dora = true is not implemented", id="dora"),
    pytest.param({"lora_dropout": 0.05},
                 r"lora_dropout = 0.05 is not implemented \(meshpar's adapters: lora_dropout = 0.0\)", id="dropout"),
    pytest.param({"target_parameters": ["gate_up_proj"], "rank_pattern": {".*gate_up_proj": 8}},
                 r'target_parameters = \["gate_up_proj"\] is not implemented', id="fused-experts"),
    pytest.param({"target_modules": ["q_proj", "lm_head"]}, "target_modules has 'lm_head'", id="lm_head"),
])
def test_what_meshpar_cannot_run_is_refused(tmp_path, change, culprit):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj"]}
    (tmp_path / peft.CONFIG_FILE).write_text(json.dumps({**config, **change}))
    with pytest.raises(InputError, match=f"^{tmp_path / peft.CONFIG_FILE}: {culprit}"):
        peft.read_config(tmp_path)


@pytest.mark.parametrize("adapter", ["llama"], indirect=True)
@pytest.mark.parametrize(("spoil", "culprit"), [
    pytest.param(lambda t: t.pop(f"{LAYER0}.q_proj.lora_A.weight"),
                 rf"tensor {LAYER0}.q_proj.lora_A.weight is missing", id="missing"),
    pytest.param(lambda t: t.update({f"{LAYER0}.q_proj.lora_C.weight": t[f"{LAYER0}.q_proj.lora_A.weight"]}),
                 rf"unexpected tensor {LAYER0}.q_proj.lora_C.weight", id="unexpected"),
    pytest.param(lambda t: t.update({f"{LAYER0}.k_proj.lora_B.weight": np.zeros((32, 8), np.float32)}),  # r 8
                 rf"tensor {LAYER0}.k_proj.lora_B.weight has shape \(32, 8\); the base and r = 4 need \(32, 4\)",
                 id="misshaped"),
])
def test_adapter_tensors_that_do_not_fit_are_refused(adapter, tmp_path, spoil, culprit):
    model_type, base, adapter_dir = adapter
    shutil.copy(f"{adapter_dir}/{peft.CONFIG_FILE}", tmp_path)
    tensors = load_file(f"{adapter_dir}/{peft.WEIGHTS_FILE}")
    spoil(tensors)
    save_file(tensors, tmp_path / peft.WEIGHTS_FILE)
    with pytest.raises(InputError, match=f"^{tmp_path / peft.WEIGHTS_FILE}: {culprit}"):
        peft.import_adapters(tmp_path, hf.load_config(base), model_type, *on_mesh("fsdp=2"))


def test_adapters_peft_cannot_name_in_a_mixture_are_refused_both_ways(tmp_path):
    """A Qwen3-MoE with a layer without experts: adapters on the routed experts, and on that layer's MLP, which
    PEFT cannot name there (it takes gate_proj, up_proj, down_proj for the experts' fused tensors)."""
    cfg = hf.config_from_hf(call("hf_config", "qwen3_moe", {**MOE_FAMILIES["qwen3_moe"], "mlp_only_layers": [0]}))
    for targets, culprit in ((("q", "experts"), "has experts: adapters on routed experts have no PEFT module names"),
                             (("q", "gate", "up"), "adapts gate_proj, up_proj of the MLPs beside the routed experts")):
        adapters = lora.LoraConfig(RANK, ALPHA, targets)
        with pytest.raises(InputError, match=f"^train.lora_targets {culprit}"):
            peft.export(lora.adapters(Transformer.abstract(cfg, adapters)[1]), cfg, adapters, tmp_path, "", "qwen3_moe")
    (tmp_path / peft.CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA,
                                                         "target_modules": ["q_proj", "down_proj"]}))
    with pytest.raises(InputError, match=f"^{tmp_path / peft.CONFIG_FILE}: target_modules adapts down_proj"):
        peft.import_adapters(tmp_path, cfg, "qwen3_moe", *on_mesh("fsdp=2"))


def batches(vocab_size: int, steps: int, rows: int, seq_len: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(CORPUS) - seq_len - 1, (steps, rows))
    return (CORPUS[starts[..., None] + np.arange(seq_len + 1)] % vocab_size).astype(np.int32)


def run_steps(model_type: str, base: str, adapter_dir: str | None, cfg: train.TrainConfig, spec: str,
              parallel: rules_lib.ParallelConfig, batches_: list[Batch]) -> list[dict]:
    """meshpar's metrics of each step, trained on `spec` from the imported weights (and adapters)."""
    mesh, rules = on_mesh(spec, parallel)
    model_cfg, adapters, params = imported(model_type, base, adapter_dir, mesh, rules)
    make_model = cfg.frozen_base(Transformer.factory(model_cfg, cfg.dtype, adapters))
    tx = train.optimizer(cfg)
    sharded = train.sharded_abstract(make_model, tx, mesh, rules, cfg.seed, cfg.reference)
    state = train.init_state(make_model, tx, sharded, cfg.seed, params, cfg.reference)
    tokens_sharding = sharding.batch_sharding(mesh, rules, batches_[0].tokens.shape)
    step, out = train.make_step(sharded, tokens_sharding, cfg), []
    for batch in batches_:
        state, metrics = step(state, jax.device_put(batch, tokens_sharding))
        out.append(metrics)
    return [{k: float(v) for k, v in m.items()} for m in out]


MESHES = [
    pytest.param("fsdp=2,model=2", rules_lib.ParallelConfig(), id="fsdp+tp"),
    pytest.param("sequence=2", rules_lib.ParallelConfig(context_attention="ring"), id="ring-cp"),
    pytest.param("stage=2", rules_lib.ParallelConfig(pipeline_schedule="1f1b", microbatches=2), id="1f1b"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "parallel"), MESHES)
@pytest.mark.parametrize("adapter", DENSE, indirect=True)
def test_lora_trains_as_peft_step_for_step(adapter, spec, parallel):
    """20 steps of the adapters alone, meshpar against PEFT + the PyTorch AdamW loop on the same batches: the
    loss at every step within 1e-5 relative."""
    model_type, base, adapter_dir = adapter
    tokens = batches(FAMILIES[model_type]["vocab_size"], STEPS, TRAIN.global_batch, TRAIN.seq_len)
    reference = np.asarray(call("train_losses", base, tokens.tolist(), SETTINGS, None, adapter_dir))
    losses = np.asarray([m["loss"] for m in run_steps(model_type, base, adapter_dir, TRAIN, spec, parallel,
                                                      [Batch(t) for t in tokens])])
    relative = np.abs(losses - reference) / np.abs(reference)
    print(f"LoRA {model_type} on {spec}: loss {reference[0]:.4f} → {reference[-1]:.4f}; worst relative "
          f"difference {relative.max():.2e} (step {int(np.argmax(relative))})")
    assert reference[-1] < reference[0] - 0.3  # the adapters learn
    assert relative.max() < TOLERANCE, (losses, reference)


DPO_STEPS, BETA, PROMPT = 10, 0.1, 12


def preference_pairs(vocab_size: int, rows: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """([steps, B, T + 1] tokens, [steps, B, T + 1] weights): pairs of rows with one prompt of PROMPT tokens
    and two responses of different lengths, padded with 0 (weight 0)."""
    tokens = batches(vocab_size, DPO_STEPS, rows, seq_len)
    tokens[:, 1::2, :PROMPT] = tokens[:, 0::2, :PROMPT]
    lengths = np.random.default_rng(1).integers(PROMPT + 4, seq_len + 1, (DPO_STEPS, rows))
    positions = np.arange(seq_len + 1)
    weights = ((positions >= PROMPT) & (positions < lengths[..., None])).astype(np.float32)
    return np.where(positions < lengths[..., None], tokens, 0), weights


# 8 pairs a step: on data=2,fsdp=2 with 2 microbatches each shard's microbatch holds one whole pair
DPO = {"lora": dataclasses.replace(TRAIN, objective="dpo", dpo_beta=BETA, steps=DPO_STEPS, global_batch=16, lr=3e-3),
       "full": dataclasses.replace(TRAIN, objective="dpo", dpo_beta=BETA, steps=DPO_STEPS, global_batch=16, lr=3e-4,
                                   lora_rank=0)}
DPO_MESHES = [pytest.param("", 1, id="one-device"), pytest.param("data=2,fsdp=2", 2, id="data+fsdp-accumulation")]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "accumulation"), DPO_MESHES)
@pytest.mark.parametrize("kind", DPO)
def test_dpo_matches_trl_step_for_step(tmp_path, kind, spec, accumulation):
    """10 DPO steps (β 0.1, TRL's default) of llama's LoRA adapter or of all its weights: meshpar's loss, log-
    probabilities and TRL's reward metrics at every step equal the PyTorch loop's within 1e-5 relative (a reward,
    β·(difference of two log-probability sums), within 1e-5 of β·|log π|: float32's rounding of those sums), the
    accuracies exactly (but a full run's first step: there every margin is 0 in exact arithmetic, and the signs
    float32 gives them are noise)."""
    base, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    call("save_random", base, "llama", FAMILIES["llama"], 0)
    call("save_peft", base, adapter_dir, TARGETS, RANK, ALPHA, False, 0)
    cfg = dataclasses.replace(DPO[kind], grad_accum=accumulation)
    tokens, weights = preference_pairs(FAMILIES["llama"]["vocab_size"], cfg.global_batch, cfg.seq_len)
    settings = {**{k: getattr(cfg, k) for k in SETTINGS}, "beta": BETA}
    adapted = adapter_dir if kind == "lora" else None
    reference = call("dpo_steps", base, tokens.tolist(), weights[:, :, 1:].tolist(), settings, adapted)
    ours = run_steps("llama", base, adapted, cfg, spec or "", rules_lib.ParallelConfig(),
                     [Batch(t, None, w) for t, w in zip(tokens, weights)])
    worst = 0.0
    for i, (theirs, mine) in enumerate(zip(reference, ours)):
        rounding = TOLERANCE * BETA * abs(theirs["logps/chosen"])
        for key in ("loss", "logps/chosen", "logps/rejected"):
            worst = max(worst, abs(mine[key] - theirs[key]) / abs(theirs[key]))
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert abs(mine[key] - theirs[key]) <= rounding, (key, mine, theirs)
        if kind == "lora" or i:
            assert mine["rewards/accuracies"] == theirs["rewards/accuracies"], i
    print(f"DPO {kind} on {spec or 'one device'}: loss {reference[0]['loss']:.4f} → {reference[-1]['loss']:.4f}; "
          f"worst relative difference of loss and log-probabilities {worst:.2e}")
    assert worst < TOLERANCE
    assert reference[-1]["rewards/margins"] > reference[0]["rewards/margins"]


def random_params(cfg, mesh, rules, seed: int) -> nnx.State:
    """Weights of the model `cfg` drawn on the host (no program to compile), laid out on `mesh` by `rules`."""
    abstract = Transformer.abstract(cfg)[1]
    shardings = dict(nnx.to_flat_state(sharding.state_shardings(abstract, mesh, rules)))
    rng = np.random.default_rng(seed)
    return nnx.from_flat_state({path: v.replace(jax.device_put(rng.normal(0.0, 0.2, v.shape).astype(np.float32),
                                                               shardings[path].get_value()))
                                for path, v in nnx.to_flat_state(abstract)})


def test_a_lora_checkpoint_over_a_changed_base_is_refused(tmp_path):
    """A LoRA run's checkpoint names its base (init_from) and holds its fingerprint: to-hf --merge-lora, to-peft
    and generate read it over that base, and refuse it, naming the base, once the base's weights have changed."""
    base, ckpt, mesh, rules = tmp_path / "base", tmp_path / "ckpt", *on_mesh("fsdp=2")
    params = random_params(MODEL, mesh, rules, 0)
    checkpoint.export_params(base, params, config={"model": dataclasses.asdict(MODEL)})
    cfg = dataclasses.replace(TRAIN, steps=1, global_batch=2, seq_len=16, warmup_steps=0, lora_rank=RANK)
    config = {"model": dataclasses.asdict(MODEL), "train": dataclasses.asdict(cfg), "init_from": str(base)}
    run(cfg.frozen_base(Transformer.factory(MODEL, adapters=cfg.lora)), cfg, CORPUS, mesh, rules,
        init_params=params, outputs=Outputs(progress=False), checkpoints=Checkpoints(str(ckpt), config=config),
        log=lambda _: None)
    assert weights.load(ckpt, mesh, rules).lora == cfg.lora  # over its own base
    shutil.rmtree(base)
    checkpoint.export_params(base, random_params(MODEL, mesh, rules, 1), config={"model": dataclasses.asdict(MODEL)})
    refused = rf"^error: {ckpt} was trained over other frozen weights: \S+ differs \(.*\); its base, {base} " \
              rf"\(init_from\), is not the one it was trained over: put back those weights$"
    out = str(tmp_path / "out")
    for main, args in ((convert.main, ["to-hf", "--merge-lora", "--out", out]),
                       (convert.main, ["to-peft", "--out", out]), (generate.main, ["--prompt-ids", "1,2"])):
        with pytest.raises(SystemExit, match=refused):
            main([*args, "--checkpoint", str(ckpt)])
