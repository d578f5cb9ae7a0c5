"""Multi-token prediction (`model.mtp_depth`, `models/mtp.py`; its loss in `meshpar.loss`).

- The step's loss is the main cross-entropy + λ/D Σ_k L_k, each module applied by hand from its parameters and
  its shifted, masked targets written here with loops (a prompt-masked batch of packed documents).
- A mixture of experts with an MTP module on expert × fsdp × model equals one device (loss and gradients,
  float32, 1e-5): the step's metrics name `mtp_loss`; ring context parallelism in zigzag order with packed
  documents, accumulation over unevenly weighted microbatches, GPipe, Megatron SP with full remat and LoRA
  (adapters in the module's block) in the slow tier.
- 1F1B and zero-bubble are refused by name; greedy generation is the same with and without the modules.
- Hugging Face: a DeepSeek-V3 checkpoint with its MTP layer (layer n_layers) round-trips bit for bit, its
  copies of the embedding and head checked on import, and transformers still loads the export; the imported
  module's logits are those of transformers' `MtpModel` fed the same stack output (measured: 3.6e-6).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hf_reference import call
from layouts import MeshRun, max_relative_error, shared_run
from meshpar import generate, rules as rules_lib, train
from meshpar.batch import Batch, normalised
from meshpar.errors import InputError
from meshpar.loss import next_token_loss_and_routing
from models import hf
from models.transformer import Transformer, TransformerConfig
from test_hf import RULES, TOKENS_BT, build_mesh, hf_logits
from test_hf_deepseek import DEEPSEEK

DENSE = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, mtp_depth=2)
MOE = dataclasses.replace(DENSE, n_layers=1, n_experts=4, experts_per_token=2, d_expert=32, mtp_depth=1)
TRAIN = train.TrainConfig(steps=2, global_batch=8, seq_len=16, warmup_steps=1, remat="none",
                          router_aux_loss_coef=0.1)
TOLERANCE = 1e-5


def packed_batch(B: int = 8, T: int = 16, seed: int = 0) -> Batch:
    """Rows of two or three documents, the first tokens of each row a prompt (weight 0), and every document's
    first token no target (as packing weighs it)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, (B, T + 1)).astype(np.int32)
    segments = np.zeros((B, T + 1), np.int32)
    for b in range(B):
        for cut in sorted(rng.choice(np.arange(2, T - 1), rng.integers(1, 3), replace=False)):
            segments[b, cut:] += 1
    weights = (rng.random((B, T + 1)) < 0.8).astype(np.float32)
    weights[:, :3] = 0
    weights[:, 1:][segments[:, 1:] != segments[:, :-1]] = 0
    return Batch(tokens, segments, weights)


def rms(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def by_hand(model: Transformer, batch: Batch, lam: float) -> tuple[float, float]:
    """(main cross-entropy + λ · L_MTP, L_MTP) of `batch`, the modules applied one by one, the targets shifted
    and masked with loops: t_{i+k+1} counts at position i where it exists and lies in t_i's document."""
    cfg, (tokens, segments, weights) = model.cfg, (np.asarray(x) for x in batch[:3])
    B, T = tokens.shape[0], tokens.shape[1] - 1
    positions = np.zeros((B, T), np.int32)
    for b in range(B):
        for i in range(1, T):
            positions[b, i] = 0 if segments[b, i] != segments[b, i - 1] else positions[b, i - 1] + 1
    h_BTD, _ = model._trunk(jnp.asarray(tokens[:, :-1]), jnp.asarray(positions), jnp.asarray(segments[:, :-1]))
    head, embed = model.head_DV[...], model.embed_VD[...]
    log_probs = lambda x_BTD: jax.nn.log_softmax(x_BTD @ head, -1)

    def mean_ce(x_BTD, targets, w):
        nll = -np.take_along_axis(np.asarray(log_probs(x_BTD)), targets[..., None], -1)[..., 0]
        return float((w * nll).sum() / w.sum())

    main = mean_ce(rms(h_BTD, model.final_norm.scale[...], cfg.norm_eps), tokens[:, 1:], weights[:, 1:])
    graphdef, stacked = nnx.split(model.mtp)
    losses = []
    for k in range(1, cfg.mtp_depth + 1):
        depth = nnx.merge(graphdef, jax.tree.map(lambda x: x[k - 1], stacked))
        ahead, targets, w = (np.zeros((B, T), dtype) for dtype in (np.int32, np.int32, np.float32))
        for b in range(B):
            for i in range(T):
                if i + k + 1 <= T:
                    ahead[b, i], targets[b, i] = tokens[b, i + k], tokens[b, i + k + 1]
                    w[b, i] = weights[b, i + k + 1] * (segments[b, i] == segments[b, i + k + 1])
        x_BTC = jnp.concatenate([rms(embed[ahead], depth.enorm.scale[...], cfg.norm_eps),
                                 rms(h_BTD, depth.hnorm.scale[...], cfg.norm_eps)], -1)
        h_BTD = depth.block(x_BTC @ depth.proj_CD[...], jnp.asarray(positions), jnp.asarray(segments[:, :-1]))
        losses.append(mean_ce(rms(h_BTD, depth.final_norm.scale[...], cfg.norm_eps), targets, w))
    mtp = sum(losses) / len(losses)
    return main + lam * mtp, mtp


def test_the_loss_is_the_main_one_plus_the_modules_by_hand():
    with nnx.use_eager_sharding(False):
        model = Transformer(DENSE, rngs=nnx.Rngs(0))
    batch = packed_batch()
    value, stats = jax.jit(lambda b: next_token_loss_and_routing(model, normalised(b)[0], mtp_coef=0.3))(batch)
    expected, mtp = by_hand(model, batch, 0.3)
    assert float(stats.mtp) == pytest.approx(mtp, rel=1e-5)
    assert float(value) == pytest.approx(expected, rel=1e-5)


def placed(run: MeshRun, batch: Batch) -> Batch:
    return Batch(*(jax.device_put(x, run.tokens_sharding) for x in batch[:3]))


def loss_and_grads(spec: str, model: TransformerConfig = MOE, cfg: train.TrainConfig = TRAIN,
                   parallel: rules_lib.ParallelConfig = rules_lib.ParallelConfig()):
    run = shared_run(spec, cfg, model, parallel)
    loss, grads = train.loss_and_grads(run.sharded, run.tokens_sharding, cfg)(run.state, placed(run, packed_batch()))
    return float(loss), jax.tree.map(np.asarray, grads)


def assert_like_one_device(spec: str, model: TransformerConfig = MOE, cfg: train.TrainConfig = TRAIN, **parallel):
    loss, grads = loss_and_grads(spec, model, cfg, rules_lib.ParallelConfig(**parallel))
    reference_loss, reference_grads = loss_and_grads("single", model, dataclasses.replace(cfg, grad_accum=1))
    assert loss == pytest.approx(reference_loss, rel=TOLERANCE)
    assert max_relative_error(grads, reference_grads) < TOLERANCE
    assert np.abs(jax.tree.leaves(grads["mtp"])[0]).max() > 0  # the modules train


def test_experts_fsdp_and_tensor_parallelism_equal_one_device():
    assert_like_one_device("expert=2,fsdp=2,model=2")
    run = shared_run("expert=2,fsdp=2,model=2", TRAIN, MOE)
    step = train.make_step(run.sharded, run.tokens_sharding, TRAIN)
    _, metrics = step(jax.tree.map(lambda x: x.copy(), run.state), placed(run, packed_batch()))
    assert 0 < float(metrics["mtp_loss"]) < float(metrics["loss"])  # L_MTP before λ, inside the loss


@pytest.mark.slow
@pytest.mark.parametrize("spec, settings, parallel", [
    pytest.param("data=2,sequence=2,model=2", {}, {"context_attention": "ring"}, id="ring-zigzag"),
    # each microbatch adds its share of the global L_k (the router's losses pool per microbatch: off)
    pytest.param("data=2,fsdp=2,model=2", {"grad_accum": 2, "router_aux_loss_coef": 0.0}, {}, id="accumulation"),
    pytest.param("stage=2,data=2,fsdp=2", {}, {"microbatches": 2}, id="gpipe"),
    pytest.param("data=2,fsdp=2,model=2", {"remat": "full"}, {"sequence_parallel": True}, id="sp-remat"),
    pytest.param("expert=2,fsdp=2,model=2", {"lora_rank": 4, "lora_targets": "q,v,gate,up,down"}, {}, id="lora"),
])
def test_more_layouts_equal_one_device(spec, settings, parallel):
    model = dataclasses.replace(MOE, n_layers=2) if "stage" in spec else MOE  # a stack of 2 over 2 stages
    assert_like_one_device(spec, model, dataclasses.replace(TRAIN, **settings), **parallel)


def test_slot_schedules_are_refused():
    for schedule in ("1f1b", "zero_bubble"):
        with pytest.raises(InputError, match=f"model.mtp_depth = 1: .*pipeline_schedule = {schedule}"):
            train.check_mtp_schedule(1, schedule, 2)
    train.check_mtp_schedule(1, "gpipe", 2)
    with pytest.raises(InputError, match="model.mtp_depth = -1 must be >= 0"):
        dataclasses.replace(DENSE, mtp_depth=-1)
    with pytest.raises(InputError, match="train.mtp_loss_weight = -0.1 must be >= 0"):
        dataclasses.replace(TRAIN, mtp_loss_weight=-0.1)


def test_generation_never_runs_the_modules():
    run = shared_run("single", TRAIN, MOE)
    without = dataclasses.replace(MOE, mtp_depth=0)
    params = nnx.state(run.state["model"], nnx.Param)
    plain = nnx.merge(Transformer.abstract(without)[0], nnx.State({k: v for k, v in params.items() if k != "mtp"}))
    model = nnx.merge(Transformer.abstract(MOE)[0], params)
    prompt_BT = np.asarray(packed_batch().tokens[:2, :5])
    rules = rules_lib.default()
    np.testing.assert_array_equal(generate.generate(model, prompt_BT, 4, run.mesh, rules),
                                  generate.generate(plain, prompt_BT, 4, run.mesh, rules))


def with_mtp_layer(directory, seed: int = 0) -> dict:
    """Add DeepSeek-V3's MTP module (layer n_layers, a block with experts) to the checkpoint in `directory`,
    random, with its copies of the embedding and head; returns the tensors added."""
    tensors, n = load_file(directory / "model.safetensors"), DEEPSEEK["num_hidden_layers"]
    rng, D = np.random.default_rng(seed), DEEPSEEK["hidden_size"]
    last = {name.split(f"layers.{n - 1}.", 1)[1]: w for name, w in tensors.items() if f"layers.{n - 1}." in name}
    added = {f"model.layers.{n}.{name}": (w + rng.normal(0, 0.1, w.shape)).astype(np.float32)
             for name, w in {**last, "enorm.weight": np.ones(D), "hnorm.weight": np.ones(D),
                             "shared_head.norm.weight": np.ones(D), "eh_proj.weight": np.zeros((D, 2 * D))}.items()}
    added |= {f"model.layers.{n}.embed_tokens.weight": tensors["model.embed_tokens.weight"],
              f"model.layers.{n}.shared_head.head.weight": tensors["lm_head.weight"]}
    save_file({**tensors, **added}, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return added


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(a small random DeepSeek-V3 checkpoint with its MTP layer, the tensors of that layer, the imported model)."""
    directory = tmp_path_factory.mktemp("mtp")
    call("save_random", str(directory), "deepseek_v3", DEEPSEEK, 0)
    assert hf.load_config(directory).mtp_depth == 0  # transformers writes num_nextn_predict_layers = 1, no layer
    added = with_mtp_layer(directory)
    cfg = hf.load_config(directory)
    params = hf.import_params(directory, cfg, build_mesh("expert=2,fsdp=2,model=2"), RULES)
    return directory, added, nnx.merge(Transformer.abstract(cfg)[0], params)


def test_deepseeks_mtp_layer_round_trips(checkpoint, tmp_path):
    """Import reads layer n_layers as the MTP module, export writes it back bit for bit (its copies of the
    embedding and head too), and transformers, which leaves that layer out, loads the export."""
    (directory, added, model), out = checkpoint, tmp_path / "out"
    assert model.cfg.mtp_depth == 1
    hf.export(nnx.state(model, nnx.Param), model.cfg, out)
    exported = load_file(out / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    for name, w in {**load_file(directory / "model.safetensors"), **added}.items():
        np.testing.assert_array_equal(exported[name], w, err_msg=name)
    np.testing.assert_allclose(hf_logits(out), hf_logits(directory), rtol=0, atol=0)


def test_the_module_gives_transformers_logits(checkpoint):
    """transformers' `MtpModel` (speculative decoding's) fed the same stack output gives the module's logits."""
    directory, _, model = checkpoint
    T = TOKENS_BT.shape[1] - 1
    _, out_KBTD, _ = model.mtp_hidden_states(TOKENS_BT[:, :-1], jnp.arange(T), TOKENS_BT[None, :, 1:])
    logits_BTV = np.asarray(out_KBTD[0] @ model.output_head())
    expected = call("mtp_logits", str(directory), TOKENS_BT.tolist())
    error = np.abs(logits_BTV - expected).max() / np.abs(expected).max()
    print(f"MTP logits against transformers: {error:.1e}")
    assert error < 1e-5


def test_a_copy_that_differs_is_refused(tmp_path):
    directory = tmp_path / "in"
    call("save_random", str(directory), "deepseek_v3", DEEPSEEK, 0)
    with_mtp_layer(directory)
    tensors, n = load_file(directory / "model.safetensors"), DEEPSEEK["num_hidden_layers"]
    tensors[f"model.layers.{n}.shared_head.head.weight"][3, 5] += 1
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=f"model.layers.{n}.shared_head.head.weight differs from lm_head.weight"):
        hf.import_params(directory, hf.load_config(directory), build_mesh("expert=2,fsdp=2,model=2"), RULES)
