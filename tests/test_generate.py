"""Generation with a KV cache: the same tokens as recomputing the whole prefix each step, on one device and
on data, fsdp and model meshes; a mixture of experts' rows whole on every device of `expert`; sampling settings;
stopping at stop ids; the CLI, with a model family's tokenizer files; samples during training; --init-from.
Imported mixtures of experts against transformers' generate: test_hf_moe.py."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import require_devices
from meshpar import checkpoint, context, generate, mesh as mesh_lib, rules as rules_lib, sharding
from meshpar.errors import InputError
from meshpar.moe import dispatch
from models.transformer import Transformer, TransformerConfig
from test_moe import assert_group_equals_the_loop, assert_reported_drops, random_routes

CFG = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128, max_seq_len=64)
PROMPT = np.array([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]])
NEW = 8


@pytest.fixture(scope="module")
def model():
    with nnx.use_eager_sharding(False):
        return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def recomputed(model):
    """Greedy tokens by running the whole sequence again for every new token (no cache)."""
    forward = nnx.jit(lambda m, ids: m(ids))
    ids = PROMPT
    for _ in range(NEW):
        ids = np.concatenate([ids, np.asarray(forward(model, jnp.asarray(ids)))[:, -1].argmax(-1)[:, None]], axis=1)
    return ids[:, PROMPT.shape[1]:]


def placed(model, mesh, rules):
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh, rules)))


def one_device():
    return mesh_lib.build(mesh_lib.parse(""), jax.devices()[:1])


def test_cached_greedy_equals_recomputing_the_prefix(model, recomputed):
    out = generate.generate(model, PROMPT, NEW, one_device(), rules_lib.make())
    np.testing.assert_array_equal(out, recomputed)


@pytest.mark.parametrize("mesh_text", ["fsdp=8", "data=2,model=4", "fsdp=2,model=4"])
def test_the_same_tokens_on_a_mesh(model, recomputed, mesh_text):
    require_devices(8)
    mesh, rules = mesh_lib.build(mesh_lib.parse(mesh_text)), rules_lib.make()
    np.testing.assert_array_equal(generate.generate(placed(model, mesh, rules), PROMPT, NEW, mesh, rules), recomputed)


@pytest.mark.parametrize("capacity", [0.0, 0.5])
def test_experts_of_rows_the_mesh_cannot_split_are_summed_over_expert(capacity):
    """Three rows on expert=4,model=2 (which the batch axes do not divide: generation's case): every device holds
    them all, computes its own experts' share and the shares are summed over `expert` and `model` with no
    all-to-all. The outputs and drops are the loop's over all the rows, capacity counted over them all."""
    require_devices(8)
    x, experts, weights, w = random_routes(3, 6, 8, 8, 16, 2, seed=1)
    mesh = mesh_lib.build(mesh_lib.parse("expert=4,model=2"))
    compute = generate.compute_context(mesh, rules_lib.make(rules_lib.ParallelConfig(expert_capacity=capacity)), 3)

    def run(*args):
        with context.use(compute):
            return dispatch.experts_ffn(*args, dispatch.capacity())

    compiled = jax.jit(run).lower(x, experts, weights, *w).compile()
    y, dropped_b = compiled(x, experts, weights, *w)
    dropped = assert_group_equals_the_loop(y, dropped_b, x, experts, weights, w, capacity)
    assert_reported_drops(experts, dropped_b, dropped, capacity, w[0].shape[0])
    assert "all-to-all" not in compiled.as_text() and "all-reduce" in compiled.as_text()


def test_the_cache_is_split_like_the_keys(model):
    require_devices(8)
    mesh, rules = mesh_lib.build(mesh_lib.parse("data=2,model=4")), rules_lib.make()
    with context.use(context.Compute(mesh, rules)):
        k, _ = jax.jit(lambda: model.init_cache(2, 16))()
    assert k.sharding.spec == P(None, "data", None, "model")  # [L, B, S, K, H]: rows over data, kv heads over model
    assert k.addressable_shards[0].data.shape == (2, 1, 16, 1, 8)


def test_sampling(model):
    mesh, rules = one_device(), rules_lib.make()
    run = lambda **kw: generate.generate(model, PROMPT, NEW, mesh, rules, generate.Sampling(**kw))
    greedy = run()
    np.testing.assert_array_equal(run(temperature=1.0, top_k=1, seed=5), greedy)  # one candidate: the argmax
    np.testing.assert_array_equal(run(temperature=1.0, top_p=1e-6, seed=5), greedy)  # the most likely alone
    hot = run(temperature=5.0, seed=1)
    np.testing.assert_array_equal(hot, run(temperature=5.0, seed=1))  # a seed gives the same draw
    assert not np.array_equal(hot, run(temperature=5.0, seed=2))
    assert not np.array_equal(hot, greedy)


def test_each_row_stops_at_its_first_stop_id(model, recomputed):
    """With stop ids each row is cut after its first one (the tokens unchanged before it); rows that meet none
    keep all their tokens."""
    run = lambda stop_ids: generate.generate(model, PROMPT, NEW, one_device(), rules_lib.make(), stop_ids=stop_ids)
    stop_ids = [int(recomputed[0, 2]), int(recomputed[1, 5])]
    for row, whole in zip(run(stop_ids), recomputed):
        end = next((i + 1 for i, token in enumerate(whole) if token in stop_ids), NEW)
        assert row.tolist() == whole[:end].tolist()
    assert len(run(stop_ids)[0]) <= 3
    assert [row.tolist() for row in run(recomputed[:, 0].tolist())] == [[t] for t in recomputed[:, 0]]
    never = [i for i in range(CFG.vocab_size) if i not in recomputed][:2]
    assert [row.tolist() for row in run(never)] == recomputed.tolist()


def test_next_token_keeps_only_the_top_k_and_top_p():
    logits_BV = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = lambda s: {int(generate.next_token(logits_BV, s, jax.random.key(i))[0]) for i in range(200)}
    assert draws(generate.Sampling(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(generate.Sampling(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 < 0.7 ≤ 0.8
    assert draws(generate.Sampling(temperature=1.0, top_p=0.9)) == {0, 1, 2}


def test_bad_requests_are_refused(model):
    require_devices(8)
    rules = rules_lib.make()
    with pytest.raises(InputError, match="this mesh has sequence = 2"):
        generate.generate(model, PROMPT, NEW, mesh_lib.build(mesh_lib.parse("sequence=2,fsdp=4")), rules)
    with pytest.raises(InputError, match=r"must be in \[0, 256\)"):
        generate.generate(model, [[1, 300]], NEW, one_device(), rules)
    with pytest.raises(InputError, match="exceeds the model's max_seq_len = 64"):
        generate.generate(model, PROMPT, 60, one_device(), rules)
    with pytest.raises(InputError, match=r"stop ids \[1, 256\] must be in \[0, 256\)"):
        generate.generate(model, PROMPT, NEW, one_device(), rules, stop_ids=[1, 256])
    with pytest.raises(InputError, match="top-p 0 must be in"):
        generate.Sampling(top_p=0)


def test_the_command_line(model, tmp_path, capsys):
    from launch.generate import main

    checkpoint.export_params(tmp_path / "params", nnx.state(model, nnx.Param), {"model": dataclasses.asdict(CFG)})
    main(["--checkpoint", str(tmp_path / "params"), "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", str(NEW),
          "--mesh", "fsdp=8", "--json"])
    printed = json.loads(capsys.readouterr().out)
    expected = generate.generate(model, PROMPT[:1], NEW, one_device(), rules_lib.make())[0]
    assert printed["ids"] == expected.tolist()
    assert printed["text"] == bytes(expected.tolist()).decode("utf-8", errors="replace")
    with pytest.raises(SystemExit, match="holds no checkpoint"):
        main(["--checkpoint", str(tmp_path), "--prompt", "hi"])


def test_the_command_line_with_a_tokenizer(model, tmp_path, capsys):
    """--tokenizer encodes the prompt and decodes the new tokens with a Hugging Face tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from launch.generate import main

    words = [f"w{i}" for i in range(CFG.vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    checkpoint.export_params(tmp_path / "params", nnx.state(model, nnx.Param), {"model": dataclasses.asdict(CFG)})
    main(["--checkpoint", str(tmp_path / "params"), "--tokenizer", str(tmp_path / "tokenizer.json"),
          "--prompt", "w1 w2 w3 w4 w5", "--max-new-tokens", str(NEW), "--json"])
    printed = json.loads(capsys.readouterr().out)
    expected = generate.generate(model, PROMPT[:1], NEW, one_device(), rules_lib.make())[0].tolist()
    assert printed["ids"] == expected
    assert printed["text"] == " ".join(words[i] for i in expected)


def test_the_command_line_with_a_family_s_tokenizer_stops_at_its_eos(model, tmp_path, capsys):
    """A Llama 3 instruct directory: the prompt gets <|begin_of_text|>, generation stops at the first id of
    generation_config.json's eos_token_id, and the text leaves the special tokens out. Its special tokens
    fill the ids after the BPE's, as Llama 3's do; <|eot_id|> is given an id the model generates."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from launch.generate import main

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    backend.train_from_iterator(["the cat sat on the mat", "a dog sat on a log"], trainers.BpeTrainer(vocab_size=60))
    bos = backend.get_vocab_size()  # <|begin_of_text|>: the first special token
    prompt = [bos] + backend.encode("the cat sat").ids
    whole = generate.generate(model, [prompt], NEW, one_device(), rules_lib.make())[0].tolist()
    eot = next(t for t in whole[:-1] if t > bos)  # the one the model stops at
    end_of_text = next(i for i in range(bos + 1, CFG.vocab_size) if i not in whole)  # one it never generates
    names = {bos: "<|begin_of_text|>", end_of_text: "<|end_of_text|>", eot: "<|eot_id|>"}
    backend.add_special_tokens([names.get(i, f"<|reserved_special_token_{i}|>") for i in range(bos, CFG.vocab_size)])
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", bos)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                "eos_token": "<|eot_id|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_of_text, eot]}))
    checkpoint.export_params(tmp_path / "params", nnx.state(model, nnx.Param), {"model": dataclasses.asdict(CFG)})
    main(["--checkpoint", str(tmp_path / "params"), "--tokenizer", str(tmp_path / "tokenizer.json"),
          "--prompt", "the cat sat", "--max-new-tokens", str(NEW), "--json"])
    printed = json.loads(capsys.readouterr().out)
    expected = whole[:whole.index(eot) + 1]
    assert printed["ids"] == expected and len(expected) < NEW
    assert printed["text"] == backend.decode(expected) and "<|" not in printed["text"]
