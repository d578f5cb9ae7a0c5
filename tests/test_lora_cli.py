"""LoRA and DPO through the commands, end to end: a PEFT adapter in (`launch.convert from-peft`), trained by
`launch.train` on one mesh with checkpoints that hold the adapters alone, resumed on another mesh as if never
stopped (and refused over another base), written out for PEFT (`to-peft`) and merged for transformers (`to-hf
--merge-lora`), and run by `launch.generate` with the adapters on and merged; a DPO run on preference pairs
`launch.prepare` wrote."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conftest import require_devices
from hf_reference import FAMILIES, call
from layouts import max_relative_error
from launch import weights
from meshpar import frozen, lora, mesh as mesh_lib, rules as rules_lib
from models.transformer import Transformer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BASE = {**FAMILIES["llama"], "vocab_size": 256}  # the built-in corpus's bytes
TRAIN = ["--config", "tiny", "--cpu-devices", "4", "--set", "train.seq_len=32", "--set", "train.global_batch=4",
         "--set", "train.remat=none"]


def command(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", f"launch.{module}", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A PEFT adapter over a random llama, imported and trained 4 steps on fsdp=2,model=2 with checkpoints at steps 2
    and 4 (`straight`); that run's step-2 checkpoint alone (`ckpt`) trained on to step 4 on data=2,fsdp=2."""
    require_devices(4)
    d = tmp_path_factory.mktemp("lora_cli")
    call("save_random", str(d / "hf"), "llama", BASE, 0)
    call("save_peft", str(d / "hf"), str(d / "peft"), ["q_proj", "v_proj", "down_proj"], 4, 8.0, True, 0)
    ok(command("convert", "from-hf", "--hf-dir", str(d / "hf"), "--out", str(d / "base"), "--cpu-devices", "4"))
    ok(command("convert", "from-peft", "--peft-dir", str(d / "peft"), "--base", str(d / "base"), "--out",
               str(d / "adapters"), "--cpu-devices", "4"))
    run = [*TRAIN, "--init-from", str(d / "adapters"), "--steps", "4", "--set", "checkpoint.every=2"]
    ok(command("train", *run, "--mesh", "fsdp=2,model=2", "--checkpoint-dir", str(d / "straight"),
               "--metrics-file", str(d / "straight.jsonl")))
    shutil.copytree(d / "straight", d / "ckpt")
    shutil.rmtree(d / "ckpt" / "4")
    ok(command("train", *run, "--mesh", "data=2,fsdp=2", "--checkpoint-dir", str(d / "ckpt"),
               "--metrics-file", str(d / "resumed.jsonl")))
    return d


def load(checkpoint: Path) -> weights.Weights:
    """A LoRA checkpoint's model config, parameters (the base made again from --init-from) and adapters' settings."""
    return weights.load(checkpoint, mesh_lib.build(mesh_lib.parse("fsdp=4"), jax.devices()[:4]), rules_lib.default())


@pytest.fixture(scope="module")
def adapted(trained):
    """meshpar's model of the resumed run's step 4, its adapters beside the base."""
    cfg, params, adapters = load(trained / "ckpt")
    return nnx.merge(Transformer.abstract(cfg, adapters)[0], params)


def test_a_run_resumed_on_another_mesh_is_the_uninterrupted_run(trained):
    """Resumed from step 2 on another mesh, steps 3 and 4 are the uninterrupted run's: their losses, and every
    adapter at step 4, to float32's rounding (the meshes add up in other orders)."""
    straight, resumed = ([json.loads(line) for line in (trained / f"{name}.jsonl").read_text().splitlines()]
                         for name in ("straight", "resumed"))
    assert [r["step"] for r in resumed] == [3, 4]
    for one, other in zip(straight[2:], resumed):
        assert other["loss"] == pytest.approx(one["loss"], rel=1e-5)
    adapters = [jax.tree.map(np.asarray, lora.adapters(load(trained / name).params)) for name in ("ckpt", "straight")]
    assert max_relative_error(*adapters) < 1e-5
    assert max_relative_error(adapters[1], lora.adapters(load(trained / "adapters").params)) > 1e-3  # they trained


def test_checkpoints_hold_the_adapters_and_the_bases_fingerprint(trained, adapted):
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(trained / "ckpt", item_handlers=handlers) as manager:
        saved = manager.item_metadata(4)["state"].tree["model"]
        meta = manager.restore(4, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    leaves = jax.tree_util.tree_leaves_with_path(saved, is_leaf=lambda m: hasattr(m, "shape"))
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    assert names and all("_lora" in name for name in names), names  # no base weight
    base = lora.base(nnx.state(adapted, (nnx.Param, frozen.Frozen)))
    frozen.check({path.removeprefix("model/"): sums for path, sums in meta["frozen"].items()}, frozen.fingerprint(base),
                 "the resumed run")  # every base weight's, and no other
    assert meta["config"]["init_from"] == str(trained / "adapters")


def test_resuming_over_another_base_is_refused(trained, tmp_path):
    d = trained
    call("save_random", str(tmp_path / "hf"), "llama", BASE, 1)
    ok(command("convert", "from-hf", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "base"),
               "--cpu-devices", "4"))
    lora = ["--set", "train.lora_rank=4", "--set", "train.lora_alpha=8.0", "--set", "train.lora_targets=q,v,down",
            "--set", "train.lora_rslora=true"]
    proc = command("train", *TRAIN, *lora, "--init-from", str(tmp_path / "base"), "--mesh", "fsdp=4", "--steps", "6",
                   "--checkpoint-dir", str(d / "ckpt"))
    assert proc.returncode == 1 and "was trained over other frozen weights" in proc.stderr, proc.stderr[-2000:]


def test_the_trained_adapters_go_out_to_peft_and_merged_to_transformers(trained, adapted):
    d = trained
    ok(command("convert", "to-peft", "--checkpoint", str(d / "ckpt"), "--out", str(d / "peft_out"),
               "--cpu-devices", "4"))
    ok(command("convert", "to-hf", "--checkpoint", str(d / "ckpt"), "--out", str(d / "merged"), "--merge-lora",
               "--cpu-devices", "4"))
    refused = command("convert", "to-hf", "--checkpoint", str(d / "ckpt"), "--out", str(d / "plain"),
                      "--cpu-devices", "4")
    assert refused.returncode == 1 and "holds LoRA adapters: --merge-lora" in refused.stderr
    config = json.loads((d / "peft_out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(d / "hf") and config["use_rslora"] is True
    tokens = (np.arange(2 * 20).reshape(2, 20) * 7 % 256).astype(np.int32)
    ours = np.asarray(adapted(tokens))
    with lora.disabled():
        base = np.asarray(adapted(tokens))
    scale = np.max(np.abs(ours))
    peft_logits = np.asarray(call("logits", str(d / "hf"), tokens.tolist(), str(d / "peft_out")))
    merged_logits = np.asarray(call("logits", str(d / "merged"), tokens.tolist()))
    imported = np.asarray(call("logits", str(d / "hf"), tokens.tolist(), str(d / "peft")))
    assert np.max(np.abs(peft_logits - ours)) < 1e-5 * scale
    assert np.max(np.abs(merged_logits - ours)) < 1e-5 * scale
    assert np.max(np.abs(base - ours)) > 1e-2 * scale  # the adapters change the output: PEFT's and the merged too
    assert np.max(np.abs(imported - ours)) > 1e-3 * scale  # 4 steps moved the adapters


def test_generation_with_the_adapters_on_and_merged(trained, adapted):
    """launch.generate's greedy ids, with the adapters beside the base and merged into it, are the adapted model's
    choices (its argmax at each position of prompt and output, in one pass), which the base's alone are not."""
    args = ["--checkpoint", str(trained / "ckpt"), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "8", "--json",
            "--cpu-devices", "4", "--mesh", "fsdp=4"]
    on, merged = (json.loads(ok(command("generate", *args, *extra)).splitlines()[-1])["ids"]
                  for extra in ([], ["--merge-lora"]))
    tokens = np.asarray([[5, 6, 7, 8, *on[:-1]]], np.int32)
    greedy = lambda: np.asarray(adapted(tokens))[0, 3:].argmax(-1).tolist()
    assert len(on) == 8 and on == merged == greedy()
    with lora.disabled():
        assert greedy() != on  # the adapters change what is generated


def test_dpo_on_prepared_preference_pairs(tmp_path):
    """launch.prepare's pairs, trained by DPO with LoRA: the run reports TRL's metrics in its metrics file."""
    require_devices(4)
    pytest.importorskip("datasets")
    from test_prepare import instruct_tokenizer

    tokenizer_file = instruct_tokenizer(tmp_path / "tok")
    rows = [{"prompt": f"question {i}?", "chosen": "a good answer.", "rejected": "no."} for i in range(12)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok(command("prepare", "--tokenizer", str(tokenizer_file), "--format", "jsonl", "--input",
               str(tmp_path / "pairs.jsonl"), "--out", str(tmp_path / "pairs")))
    metrics = tmp_path / "metrics.jsonl"
    ok(command("train", *TRAIN, "--mesh", "data=2,fsdp=2", "--steps", "3", "--set", "model.vocab_size=300",
               "--set", "data.source=prepared", "--set", f"data.path={tmp_path / 'pairs'}", "--set",
               "data.packing=pairs", "--set", "train.objective=dpo", "--set", "train.lora_rank=4",
               "--metrics-file", str(metrics), "--checkpoint-dir", str(tmp_path / "ckpt")))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 3 and all(0 <= r["rewards/accuracies"] <= 1 for r in records)
    assert records[0]["loss"] == pytest.approx(np.log(2), rel=1e-5)  # adapters start at B = 0: the reference
    # The run began from random weights: its checkpoint's base is made again from the seed, and it is the run's
    # own, as the fingerprint the run took of it when it saved says.
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(tmp_path / "ckpt", item_handlers=handlers) as manager:
        saved = manager.restore(3, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]["frozen"]
    mesh = mesh_lib.build(mesh_lib.parse("fsdp=4"), jax.devices()[:4])
    base = lora.base(weights.load(tmp_path / "ckpt", mesh, rules_lib.default()).params)
    frozen.check({path.removeprefix("model/"): sums for path, sums in saved.items()}, frozen.fingerprint(base),
                 "the seeded base")
    refused = command("train", *TRAIN, "--mesh", "fsdp=4", "--steps", "1", "--set", "model.vocab_size=300",
                      "--set", "data.source=prepared", "--set", f"data.path={tmp_path / 'pairs'}",
                      "--set", "train.objective=dpo", "--set", "train.lora_rank=4")
    assert refused.returncode == 1 and "data.packing must be pairs" in refused.stderr
