"""LoRA on latent attention (DeepSeek-V3's MLA) against PEFT: an adapter of the small random DeepSeek-V3 of
`test_hf_deepseek` on all of its attention's projections (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj,
o_proj; B drawn non-zero), read by `from-peft`, gives PEFT's logits on one device and on an expert × FSDP × tensor
mesh, and one step's gradients of every adapter equal PyTorch's; meshpar's own adapters (targets q, k, v, o)
written by `to-peft` load in PEFT with meshpar's logits and read back as they were; greedy decoding through the
latent cache with the adapters gives transformers' tokens of the merged weights. The rotary rows of q_b and kv_a
are reordered on import (`Tensor.rope`), and so are their lora_B's: left as PEFT holds them, the logits are far
off. Targets latent attention cannot take, or that name what the model lacks, are refused by name.

Measured here (max |meshpar − PEFT| / max |PEFT|): logits 2.0e-6 on one device, 2.1e-6 on expert=2,fsdp=2,model=2
(q_proj: 1.7e-6, 1.8e-6); one step's adapter gradients 5.9e-6 (q_proj: 5.3e-6), the worst tensor's.

The query through its latent runs in `make test`; a query of one projection (q_lora_rank 0: q_proj) in the
slow tier."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from hf_reference import FAMILIES, call
from meshpar import generate, lora, sharding, train
from meshpar.errors import InputError
from models import hf, rope
from models.hf import peft
from models.transformer import Transformer
from test_hf import RULES, TOKENS_BT, build_mesh, meshpar_logits, relative_error
from test_hf_deepseek import DEEPSEEK, DEEPSEEK_TRAIN

RANK, ALPHA = 4, 8.0
MESH = "expert=2,fsdp=2,model=2"
# transformers builds no multi-token prediction module, so PEFT adapts none
MODEL = {**DEEPSEEK, "num_nextn_predict_layers": 0}
# each variant's attention modules, as PEFT names them: the query through its latent, or one projection
VARIANTS = {"q_latent": (MODEL, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
            "q_proj": ({**MODEL, "q_lora_rank": None}, ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])}
SLOW = pytest.mark.slow
FAST_AND_SLOW = ["q_latent", pytest.param("q_proj", marks=SLOW)]


@pytest.fixture(scope="module")
def adapter(request, tmp_path_factory):
    """(base directory, PEFT adapter directory, PEFT's logits of TOKENS_BT, the modules) of a variant."""
    fields, modules = VARIANTS[request.param]
    base, out = (str(tmp_path_factory.mktemp(f"{request.param}_{part}")) for part in ("base", "adapter"))
    call("save_random", base, "deepseek_v3", fields, 0)
    call("save_peft", base, out, modules, RANK, ALPHA, False, 0)
    return base, out, call("logits", base, TOKENS_BT.tolist(), out), modules


def imported(base: str, adapter_dir: str, mesh):
    """(model config, LoRA settings, the base's and the adapters' parameters) on `mesh`."""
    cfg = hf.load_config(base)
    adapters, lora_params = peft.import_adapters(adapter_dir, cfg, "deepseek_v3", mesh, RULES)
    return cfg, adapters, nnx.merge_state(hf.import_params(base, cfg, mesh, RULES), lora_params)


@pytest.mark.parametrize("spec", ["", MESH], ids=["one-device", "expert+fsdp+tp"])
@pytest.mark.parametrize("adapter", FAST_AND_SLOW, indirect=True)
def test_peft_adapter_gives_pefts_logits(adapter, spec):
    base, adapter_dir, reference, modules = adapter
    mesh = build_mesh(spec)
    cfg, adapters, params = imported(base, adapter_dir, mesh)
    assert adapters.targets == tuple(t for t in lora.TARGETS if peft.MODULES.get(t) in modules)
    error = relative_error(meshpar_logits(params, cfg, mesh, adapters=adapters), reference)
    print(f"LoRA on latent attention ({', '.join(modules)}) on {spec or 'one device'}: max relative logits "
          f"difference {error:.2e}")
    assert error < 1e-5
    assert relative_error(call("logits", base, TOKENS_BT.tolist()), reference) > 1e-2  # B ≠ 0: the adapters act


@pytest.mark.parametrize("adapter", FAST_AND_SLOW, indirect=True)
def test_meshpars_adapters_go_to_peft_and_back(adapter, tmp_path):
    """Adapters on q, k, v, o drawn by meshpar (over the imported base, on one device): `to-peft` names every
    projection of the attention, PEFT loads them with meshpar's logits, and `from-peft` reads them back exactly."""
    base, adapter_dir, _, modules = adapter
    mesh = build_mesh("")
    cfg, _, params = imported(base, adapter_dir, mesh)
    ours = lora.LoraConfig(RANK, ALPHA, ("q", "k", "v", "o"))
    rng = np.random.default_rng(1)
    flat = dict(nnx.to_flat_state(params))
    drawn = {path: v.replace(jnp.asarray(rng.normal(0.0, 0.1, v.shape), jnp.float32))
             for path, v in nnx.to_flat_state(lora.adapters(Transformer.abstract(cfg, ours)[1]))}
    assert sorted(drawn) == sorted(path for path in flat if any(str(k).endswith(lora.SUFFIX) for k in path))
    params = nnx.from_flat_state({**flat, **drawn})
    logits = meshpar_logits(params, cfg, mesh, adapters=ours)
    peft.export(params, cfg, ours, tmp_path, base, "deepseek_v3")
    assert json.loads((tmp_path / peft.CONFIG_FILE).read_text())["target_modules"] == sorted(modules)
    assert relative_error(logits, call("logits", base, TOKENS_BT.tolist(), str(tmp_path))) < 1e-5
    back = peft.import_adapters(tmp_path, cfg, "deepseek_v3", mesh, RULES)[1]
    for path, v in nnx.to_flat_state(back):
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(drawn[path][...]), err_msg=str(path))


@pytest.mark.parametrize("adapter", ["q_latent"], indirect=True)
def test_lora_b_rotary_rows_follow_the_weights(adapter):
    """lora_B's rotary rows of q_b_proj and kv_a_proj_with_mqa, read as PEFT holds them (pairs interleaved, not
    reordered as their weights are), put the logits far off."""
    base, adapter_dir, reference, _ = adapter
    mesh = build_mesh("")
    cfg, adapters, params = imported(base, adapter_dir, mesh)
    for weight in ("wq_b_RNH", "wkv_a_DA"):
        b = params["blocks"]["attn"][weight + lora.SUFFIX]["b"]
        b.set_value(rope.pairs_from_halves(np.asarray(b[...]), cfg.qk_rope_head_dim))
    assert relative_error(meshpar_logits(params, cfg, mesh, adapters=adapters), reference) > 1e-3


@pytest.mark.parametrize("adapter", ["q_latent"], indirect=True)
def test_greedy_generation_with_the_adapters(adapter, tmp_path):
    """Decoding through the latent cache with the adapters beside the weights (W_kv_b's merged into the absorbed
    up-projections) continues prompts as transformers' greedy generate does with them merged (`--merge-lora`),
    not as the base does."""
    base, adapter_dir, _, _ = adapter
    mesh = build_mesh("expert=2,model=2")
    cfg, adapters, params = imported(base, adapter_dir, mesh)
    hf.export(lora.merged(params, adapters), cfg, tmp_path)
    prompt_BT = TOKENS_BT[:2, :6]
    expected = call("greedy", str(tmp_path), prompt_BT.tolist(), 12)
    model = nnx.merge(Transformer.abstract(cfg, adapters)[0], params)
    np.testing.assert_array_equal(generate.generate(model, prompt_BT, 12, mesh, RULES), expected)
    assert not np.array_equal(call("greedy", base, prompt_BT.tolist(), 12), expected)


@pytest.mark.parametrize(("model_type", "fields", "targets", "culprit"), [
    pytest.param("deepseek_v3", MODEL, "q,k,o", "latent attention's two kv projections each feed both keys and "
                 "values: name k and v together", id="k-without-v"),
    pytest.param("deepseek_v3", {**MODEL, "q_lora_rank": None}, "q_b,o",
                 r"q_b needs a query latent \(model.q_lora_rank = 0\)", id="q_b-without-a-query-latent"),
    pytest.param("llama", FAMILIES["llama"], "q,kv_a", r"kv_a is a projection of latent attention, which this model "
                 r"does not have \(model.kv_lora_rank = 0\)", id="kv_a-without-latent-attention"),
])
def test_targets_the_attention_cannot_take_are_refused(model_type, fields, targets, culprit):
    cfg = hf.config_from_hf(call("hf_config", model_type, fields))
    adapters = train.TrainConfig(lora_rank=RANK, lora_targets=targets).lora
    with pytest.raises(InputError, match=f"^train.lora_targets = '{','.join(adapters.targets)}': {culprit}"):
        Transformer.abstract(cfg, adapters)


@pytest.mark.parametrize("adapter", FAST_AND_SLOW, indirect=True)
def test_one_steps_adapter_gradients_match_pytorch(adapter, tmp_path):
    """One forward and backward pass on the expert × FSDP × tensor mesh: PyTorch's loss, and the gradient of every
    adapter as PEFT's (written by `to-peft`, PEFT's names and layouts, against PyTorch's saved by PEFT)."""
    base, adapter_dir, _, _ = adapter
    tokens_BT = np.random.default_rng(1).integers(0, DEEPSEEK["vocab_size"], (8, 17)).astype(np.int32)
    reference = call("save_gradients", base, tokens_BT.tolist(), None, str(tmp_path / "torch"), adapter_dir)
    mesh = build_mesh(MESH)
    cfg, adapters, params = imported(base, adapter_dir, mesh)
    settings = dataclasses.replace(DEEPSEEK_TRAIN, global_batch=8, seq_len=16, remat="none", lora_rank=RANK,
                                   lora_alpha=ALPHA)
    make_model = settings.frozen_base(Transformer.factory(cfg, adapters=adapters))
    tx = train.optimizer(settings)
    sharded = train.sharded_abstract(make_model, tx, mesh, RULES, settings.seed)
    state = train.init_state(make_model, tx, sharded, settings.seed, params)
    tokens = sharding.batch_sharding(mesh, RULES, tokens_BT.shape)
    loss, grads = train.loss_and_grads(sharded, tokens, settings)(state, jax.device_put(tokens_BT, tokens))
    peft.export(grads, cfg, adapters, tmp_path / "meshpar", base, "deepseek_v3")
    ours, theirs = (load_file(tmp_path / side / peft.WEIGHTS_FILE) for side in ("meshpar", "torch"))
    assert sorted(ours) == sorted(theirs)
    errors = {name: relative_error(ours[name], theirs[name]) for name in theirs}
    worst = max(errors, key=errors.get)
    print(f"LoRA on latent attention, one step on {MESH}: loss {float(loss):.6f} / {reference:.6f}; max relative "
          f"adapter gradient difference {errors[worst]:.2e} ({worst})")
    assert abs(float(loss) - reference) < 1e-5 * reference
    assert errors[worst] < 1e-5
