"""`python -m launch.train` end to end: the metrics file and report contracts, and its errors."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import configs
from meshpar import config as config_lib

from conftest import require_devices

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "launch.train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    metrics_file, report_file = out / "runs" / "metrics.jsonl", out / "runs" / "report.json"
    proc = launch("--config", "tiny", "--cpu-devices", "8", "--mesh", "data=2,fsdp=4", "--steps", str(STEPS),
                  "--set", "model.n_layers=1", "--metrics-file", str(metrics_file), "--report", str(report_file))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, metrics_file, report_file


def test_train_writes_one_metrics_line_per_step(trained):
    _, metrics_file, _ = trained
    lines = metrics_file.read_text().splitlines()
    assert len(lines) == STEPS
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert {"step", "loss", "grad_norm", "step_time_s", "tokens_per_s"} <= r.keys()
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 10  # byte vocabulary: ln 256 ≈ 5.5 at the start
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        # tiny: 16 rows of 128 tokens per step
        assert r["tokens_per_s"] == pytest.approx(16 * 128 / r["step_time_s"], rel=1e-6)


def test_train_writes_the_report(trained):
    _, _, report_file = trained
    report = json.loads(report_file.read_text())
    assert {"mesh", "devices", "processes", "params", "memory_per_device", "collectives", "flops_per_device",
            "compile_s"} <= report.keys()
    assert report["devices"] == 8
    assert report["processes"] == 1
    assert report["mesh"] == {"data": 2, "stage": 1, "fsdp": 4, "expert": 1, "sequence": 1, "model": 1}
    # tiny with one layer: 2·V·D embeddings + one block + the final norm
    model = config_lib.apply(configs.load("tiny"), ["model.n_layers=1"]).model
    D, F, V = model.d_model, model.d_ff, model.vocab_size
    assert report["params"] == 2 * V * D + (4 * D * D + 3 * D * F + 2 * D) + D
    memory = report["memory_per_device"]
    assert {"arguments_bytes", "outputs_bytes", "temp_bytes", "alias_bytes"} <= memory.keys()
    assert all(isinstance(memory[k], int) and memory[k] >= 0 for k in memory)
    # state (params + 2 moments in float32) split 4 ways by fsdp, plus the tokens: at least that
    assert memory["arguments_bytes"] >= 3 * 4 * report["params"] // 4
    assert report["collectives"], "data × fsdp must compile to collectives"
    for op, entry in report["collectives"].items():
        assert set(entry) == {"count", "bytes"}, op
        assert entry["count"] >= 1 and entry["bytes"] > 0, op
    assert report["flops_per_device"] > 0
    assert report["compile_s"] > 0


def test_unknown_set_key_lists_the_valid_keys_on_stderr():
    proc = launch("--config", "tiny", "--set", "model.n_layer=1", timeout=120)
    assert proc.returncode != 0
    assert "unknown key 'model.n_layer'" in proc.stderr
    valid = proc.stderr.split("valid keys: ")[1].strip().split(", ")
    assert valid == config_lib.keys(configs.load("tiny"))


def test_bad_mesh_names_the_device_count():
    proc = launch("--config", "tiny", "--cpu-devices", "4", "--mesh", "data=3", timeout=120)
    assert proc.returncode != 0
    assert "mesh data=3 has 3 devices, but 4 are present" in proc.stderr


# In-process: these exit before the backend is touched, and pass no --cpu-devices.


def test_unknown_config_exits_in_process():
    from launch.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "nope"])
    assert str(exit_info.value.code).startswith("error: unknown config 'nope'; presets: ")
    assert "tiny" in str(exit_info.value.code)


@pytest.mark.parametrize(("argv", "message"), [
    (["--set", "model.n_layers"], "error: --set 'model.n_layers': expected KEY=VALUE"),
    (["--set", "model.n_layers=abc"], "error: --set model.n_layers=abc: expected int"),
    (["--set", "train.compute_dtype=float8"], "error: train.compute_dtype = 'float8' is not one of"),
    (["--steps", "0"], "error: train.steps = 0 must be >= 1"),
    (["--mesh", "data=2,tensor=4"], "error: unknown mesh axis 'tensor'"),
])
def test_bad_arguments_exit_in_process(argv, message):
    from launch.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "tiny", *argv])
    assert str(exit_info.value.code).startswith(message)


def test_bad_mesh_in_process_names_the_device_count():
    require_devices(2)
    from launch.train import main

    n = jax.device_count()  # the test backend's, which main must leave alone
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "tiny", "--mesh", f"fsdp={2 * n}"])
    assert exit_info.value.code == f"error: mesh fsdp={2 * n} has {2 * n} devices, but {n} are present"
    assert jax.device_count() == n


def test_mesh_auto_trains_with_the_planners_layout(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = launch("--config", "tiny", "--cpu-devices", "8", "--mesh", "auto", "--steps", "2",
                  "--set", "model.n_layers=1", "--metrics-file", str(metrics))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--mesh auto: " in proc.stdout
    assert len(metrics.read_text().splitlines()) == 2
