"""What a real run needs: evaluation on held-out tokens, TensorBoard, a profiler trace, the NaN guard, and
the catalogue of bad input, each with the message it gets (`launch.train` in process: the test's 8 devices)."""

import dataclasses
import json
import math
import socket
import struct
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import require_devices
from layouts import CORPUS, MODEL, TRAIN, shared_run
from meshpar import checkpoint, mesh as mesh_lib, remat, rules, train
from meshpar.errors import TrainingStopped
from meshpar.run import Checkpoints, Outputs, run
from models.transformer import Transformer

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "tiny", "--set", "model.n_layers=1"]


def main(*argv: str) -> str | None:
    """launch.train's main in this process: None when it finishes, else its error line."""
    from launch.train import main as train_main

    try:
        train_main([*TINY, *argv])
    except SystemExit as stop:
        return str(stop.code)
    return None


def events(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of a TensorBoard event file: tag → [(step, value)] (TFRecord framing, tensorboardX's protos)."""
    from tensorboardX.proto import event_pb2

    (path,) = directory.glob("events.out.tfevents.*")
    data, i, out = path.read_bytes(), 0, {}
    while i < len(data):
        n = struct.unpack("<Q", data[i:i + 8])[0]
        event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def strict_json(line: str) -> dict:
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    require_devices(8)
    out = tmp_path_factory.mktemp("run")
    error = main("--mesh", "data=2,fsdp=4", "--steps", "4", "--set", "train.eval_every=2", "--set", "train.sample_every=4",
                 "--set",
                 "train.eval_batches=2", "--metrics-file", str(out / "m.jsonl"), "--report", str(out / "r.json"),
                 "--tensorboard-dir", str(out / "tb"), "--profile-steps", "2:3")
    assert error is None, error
    return out


def test_evaluation_joins_the_metrics_and_the_report(logged):
    records = [strict_json(line) for line in (logged / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    evaluated = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    for r in evaluated:
        assert 0 < r["eval_loss"] < 10 and r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
    assert evaluated[1]["eval_loss"] < evaluated[0]["eval_loss"]  # the same held-out batches, a better model
    report = json.loads((logged / "r.json").read_text())
    assert report["eval_loss_last"] == evaluated[1]["eval_loss"]
    assert 0 < report["mfu_median"] < 1
    assert all(0 < r["lr"] <= 3e-3 for r in records) and records[1]["lr"] > records[0]["lr"]  # warmup


def test_samples_join_the_metrics(logged):
    records = [strict_json(line) for line in (logged / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "sample" in r] == [4]
    assert isinstance(records[-1]["sample"], str) and records[-1]["sample"]


def test_a_run_starts_from_given_weights(tmp_path):
    """--init-from takes the model and its parameters from a directory (here a checkpoint trained 8 steps):
    the first loss is the trained model's, far below a fresh model's ln 256 ≈ 5.5."""
    from launch.train import main as train_main

    assert main("--steps", "8", "--checkpoint-dir", str(tmp_path / "ckpt")) is None
    train_main(["--config", "tiny", "--steps", "1", "--init-from", str(tmp_path / "ckpt"),
                "--metrics-file", str(tmp_path / "m.jsonl")])
    first = strict_json((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert first["loss"] < 4.0, first
    assert "sets the model; model.n_layers=1 cannot change it" in main("--steps", "1", "--init-from",
                                                                       str(tmp_path / "ckpt"))


def test_tensorboard_has_every_curve(logged):
    scalars = events(logged / "tb")
    assert {"train/loss", "train/grad_norm", "train/lr", "eval/loss", "eval/perplexity", "perf/tokens_per_s",
            "perf/step_time_s", "perf/mfu"} <= scalars.keys()
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [step for step, _ in scalars["eval/loss"]] == [2, 4]


def test_profile_trace_is_written(logged):
    assert list((logged / "tb" / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))


def test_evaluation_compiles_once_and_is_the_training_loss():
    """The eval step is one jitted program for every held-out batch (its cache holds one entry after three
    batches), and it computes the training step's loss on the training layout, with the batch's count of
    targets (every token of a batch without weights)."""
    require_devices(8)
    layout = shared_run("data=2,fsdp=2,model=2")
    evaluate = train.make_eval_step(layout.sharded, layout.tokens_sharding, layout.cfg)
    results = [evaluate(layout.state, layout.batch(step)) for step in range(3)]
    losses = [float(loss) for loss, _ in results]
    assert all(int(count) == layout.cfg.global_batch * layout.cfg.seq_len for _, count in results)
    assert evaluate._cache_size() == 1
    reference, _ = train.loss_and_grads(layout.sharded, layout.tokens_sharding, layout.cfg)(layout.state, layout.batch(2))
    assert losses[2] == pytest.approx(float(reference), rel=1e-6)


# --- the NaN guard -----------------------------------------------------------------------------------------


DIVERGE = ["--mesh", "fsdp=8", "--steps", "30", "--set", "train.lr=1e3", "--set", "train.clip_norm=1e9",
           "--set", "checkpoint.every=2", "--set", "checkpoint.keep=2"]


def saved_states(directory: Path) -> dict[int, list[np.ndarray]]:
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(directory) as manager:
        return {step: jax.tree.leaves(manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore()))["state"]) for step in manager.all_steps()}


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(tmp_path):
    require_devices(8)
    error = main(*DIVERGE, "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-file", str(tmp_path / "m.jsonl"))
    assert error is not None and error.startswith("error: step ")
    stopped_at = int(error.split()[2].rstrip(":"))
    assert "not finite. The run stopped and the last checkpoint (step" in error
    records = [strict_json(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == stopped_at and None in (records[-1]["loss"], records[-1]["grad_norm"])
    saved = saved_states(tmp_path / "ckpt")
    assert saved and max(saved) < stopped_at
    for step, leaves in saved.items():
        assert all(np.isfinite(leaf).all() for leaf in leaves), step


@pytest.mark.parametrize("offload", ["none", "optimizer"])  # offload skips inside its streamed update
def test_skip_mode_leaves_the_state_finite(tmp_path, offload):
    require_devices(8)
    mesh = mesh_lib.build(mesh_lib.parse("fsdp=8"))
    cfg = dataclasses.replace(TRAIN, steps=12, lr=1e3, clip_norm=1e9, on_nonfinite="skip")
    parallel = rules.make(rules.ParallelConfig(offload=offload))
    result = run(Transformer.factory(MODEL), cfg, CORPUS, mesh, parallel, outputs=Outputs(progress=False),
                 checkpoints=Checkpoints(str(tmp_path), checkpoint.CheckpointConfig(every=4)))
    skipped = [r["step"] for r in result.records if r["skipped"]]
    assert skipped, [r["loss"] for r in result.records]
    assert all(not math.isfinite(r["loss"]) or not math.isfinite(r["grad_norm"])
               for r in result.records if r["skipped"])
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(result.state))
    assert all(all(np.isfinite(leaf).all() for leaf in leaves) for leaves in saved_states(tmp_path).values())


def test_stopping_raises_with_the_step_in_python():
    require_devices(8)
    mesh = mesh_lib.build(mesh_lib.parse("data=8"))
    cfg = dataclasses.replace(TRAIN, steps=30, lr=1e3, clip_norm=1e9)
    with pytest.raises(TrainingStopped, match=r"step \d+: loss .* not finite. The run stopped and no checkpoint"):
        run(Transformer.factory(MODEL), cfg, CORPUS, mesh, rules.default(), outputs=Outputs(progress=False))


# --- bad input: each gets a message naming the culprit --------------------------------------------------------


def test_tokens_out_of_the_vocabulary(tmp_path):
    path = tmp_path / "wide.bin"
    np.arange(100_000, dtype=np.uint32).astype(np.uint16).tofile(path)  # a 65,536-token vocabulary's ids
    error = main("--steps", "1", "--set", "data.source=bin", "--set", f"data.path={path}")
    assert error.startswith(f"error: {path} (bin, uint16): token ") and "out of range for model.vocab_size = 256" in error


def test_a_file_whose_size_does_not_fit_its_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01" * 4097)
    error = main("--steps", "1", "--set", "data.source=bin", "--set", f"data.path={path}")
    assert error == (f"error: {path}: size 4097 bytes is not a multiple of 2 (data.token_dtype = uint16); is it a "
                     f"file of another token type?")


def test_a_missing_data_path(tmp_path):
    error = main("--steps", "1", "--set", "data.source=text", "--set", f"data.path={tmp_path / 'nope'}")
    assert error == f"error: data.path: text corpus not found: {tmp_path / 'nope'}"


def test_an_unwritable_checkpoint_directory(tmp_path):
    (tmp_path / "file").write_text("")
    error = main("--steps", "1", "--checkpoint-dir", str(tmp_path / "file" / "ckpt"))
    assert error == f"error: checkpoint directory {tmp_path / 'file' / 'ckpt'} is not writable: Not a directory"


def test_resuming_with_other_settings_is_refused_unless_allowed(tmp_path):
    require_devices(8)
    ckpt = str(tmp_path / "ckpt")
    assert main("--steps", "2", "--checkpoint-dir", ckpt) is None
    error = main("--steps", "4", "--checkpoint-dir", ckpt, "--set", "train.seq_len=64", "--set", "train.seed=3")
    assert error == (f"error: {Path(ckpt).absolute()} step 2 was trained with other settings: train.seed: 0 in the "
                     "checkpoint, 3 now; train.seq_len: 128 in the checkpoint, 64 now. Resume with the saved settings, "
                     "or pass --allow-config-change (Python: allow_config_change=True) to go on with these")
    # a layout, remat or evaluation change is the same training run: no flag needed
    assert main("--steps", "3", "--checkpoint-dir", ckpt, "--mesh", "data=2,model=4", "--set", "train.remat=full",
                "--set", "train.eval_every=5") is None
    assert main("--steps", "4", "--checkpoint-dir", ckpt, "--set", "train.seed=3", "--allow-config-change") is None


def test_steps_not_past_the_checkpoint(tmp_path):
    require_devices(8)
    ckpt = str(tmp_path / "ckpt")
    assert main("--steps", "2", "--checkpoint-dir", ckpt) is None
    error = main("--steps", "2", "--checkpoint-dir", ckpt)
    assert error == (f"error: {ckpt} is at step 2, and train.steps = 2 counts from the start of training: nothing "
                     "to do; pass --steps > 2 to train on")


def test_an_unreachable_coordinator():
    error = main("--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1",
                 "--coordinator-timeout", "1")
    assert error.startswith("error: coordinator '127.0.0.1:9' unreachable after 1 s (")
    assert error.endswith("is process 0 running, and is the address right?")


def test_a_coordinator_port_in_use():
    with socket.create_server(("", 0)) as busy:
        port = busy.getsockname()[1]
        error = main("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0")
    assert error == (f"error: coordinator '127.0.0.1:{port}': process 0 cannot listen on port {port} (Address already "
                     "in use); choose a free port")


def test_profile_steps_are_checked():
    assert main("--profile-steps", "3:1") == "error: --profile-steps '3:1': need 1 <= FIRST <= LAST"


def test_the_dry_run_refuses_unknown_flags():
    proc = subprocess.run([sys.executable, "-m", "launch.slurm.dryrun", "--nodes", "2", "--config", "tiny",
                           "--chekpoint-dir", "x"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: unrecognized arguments: --chekpoint-dir x" in proc.stderr


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only meshpar's own errors become one line; anything else is raised as it is."""
    import meshpar.run

    def broken(*args, **kwargs):
        raise ValueError("a bug deep in the step")

    monkeypatch.setattr(meshpar.run, "run", broken)
    with pytest.raises(ValueError, match="a bug deep in the step"):
        main("--steps", "1")


def test_remat_auto_takes_the_fastest_policy_that_fits(monkeypatch):
    """On CPU auto is `dots` (measured fastest); where the device memory is known, the candidates are
    compiled in order and the first whose step fits is kept, else the last."""
    import meshpar.run as run_module

    assert remat.candidates("auto", "cpu") == ("dots",)
    assert remat.candidates("auto", "gpu") == ("none", "dots", "full")
    mesh, rule = mesh_lib.build(mesh_lib.parse(""), jax.devices()[:1]), rules.make()
    model = lambda rngs: Transformer(dataclasses.replace(MODEL, n_layers=1), rngs=rngs)
    auto = dataclasses.replace(TRAIN, steps=1, remat="auto")
    chosen = lambda: run(model, auto, CORPUS, mesh, rule, outputs=Outputs(progress=False)).report["remat"]
    monkeypatch.setitem(remat.AUTO, "cpu", ("full", "dots"))
    monkeypatch.setattr(run_module, "device_memory_limit", lambda: 2**40)
    assert chosen() == "full"  # the first fits
    monkeypatch.setattr(run_module, "device_memory_limit", lambda: 1)
    assert chosen() == "dots"  # nothing fits: the last candidate
