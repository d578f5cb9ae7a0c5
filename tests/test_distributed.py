"""Multi-process runs for real: 2 local processes × 4 CPU devices (jax.distributed over loopback, gloo)
against 1 process × 8; checkpoints across process counts; per-process data; a dead worker; settings."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from meshpar import distributed, mesh as mesh_lib

# real multi-process runs: `make test-slow`, which CI runs beside `make test`
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config", "tiny", "--set", "model.n_layers=1", "--set", "train.seq_len=64",
         "--set", "checkpoint.every=100"]


def run_cmd(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHPAR_", "JAX_NUM_CPU"))}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=timeout)


def train(processes: int, mesh: str, steps: int, workdir: Path, name: str) -> tuple[list[float], str]:
    """Train to `steps` (resuming from workdir/ckpt) as `processes` × 8/processes devices; (the new losses,
    the output)."""
    metrics = workdir / f"{name}.jsonl"
    command = ["-m", "launch.train", *SMALL, "--mesh", mesh, "--steps", str(steps), "--metrics-file", str(metrics),
               "--checkpoint-dir", str(workdir / "ckpt")]
    if processes == 1:
        proc = run_cmd([*command, "--cpu-devices", "8"])
    else:
        proc = run_cmd(["-m", "launch.local", "--processes", str(processes), "--devices-per-process",
                        str(8 // processes), "--", sys.executable, *command])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(1, "fsdp=8", 6, tmp_path_factory.mktemp("reference"), "all")[0]


def test_two_processes_match_one_across_checkpoints(reference, tmp_path):
    """2 × 4 = 1 × 8 for fsdp=8 and data=2,fsdp=2,model=2, with the checkpoint passed between process counts:
    steps 1–2 on 2 processes (fsdp=8), 3–4 resumed on 1 process; then, step 4's checkpoint damaged (a file
    altered), 3–6 on 2 processes (3-D mesh), resumed from step 2 after both processes found the damage."""
    from test_checkpoint import spoil

    first, _ = train(2, "fsdp=8", 2, tmp_path, "a")
    # the same program on 2 × 4 devices as on 1 × 8: bit for bit with jax 0.10; 8e-8 apart with 0.12, whose
    # all-reduce across processes sums in another order
    np.testing.assert_allclose(first, reference[:2], rtol=1e-6)
    second, _ = train(1, "data=8", 4, tmp_path, "b")
    np.testing.assert_allclose(second, reference[2:4], rtol=1e-6)  # another mesh: float32 rounding
    damaged = spoil(tmp_path / "ckpt" / "4", "altered")
    last, out = train(2, "data=2,fsdp=2,model=2", 6, tmp_path, "c")
    assert f"[p0] warning: {tmp_path / 'ckpt'}: step 4 is damaged: {damaged} (" in out, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2", "4.damaged", "6"]
    np.testing.assert_allclose(last, reference[2:], rtol=1e-6)


ROWS = textwrap.dedent("""
    import jax, numpy as np
    from meshpar import data, distributed, mesh, rules, sharding
    distributed.initialize(distributed.from_environment())
    m = mesh.build(mesh.parse("data=8"))
    batches = data.Batches(np.arange(10_000, dtype=np.uint16), global_batch=16, seq_len=8, seed=0,
                           sharding=sharding.batch_sharding(m, rules.default(), (16, 9)))
    rows = batches.process_rows()
    batch = next(batches).tokens
    local = {int(s.index[0].start or 0) for s in batch.addressable_shards}
    print("ROWS", jax.process_index(), rows.start, rows.stop, min(local), max(local), flush=True)
""")


def test_each_process_reads_only_its_rows():
    proc = run_cmd(["-m", "launch.local", "--processes", "2", "--devices-per-process", "4", "--",
                    sys.executable, "-c", ROWS])
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = sorted(tuple(map(int, line.split("ROWS ")[1].split())) for line in proc.stdout.splitlines() if "ROWS" in line)
    # process 0 holds rows 0..7 on its 4 devices, process 1 rows 8..15
    assert rows == [(0, 0, 8, 0, 6), (1, 8, 16, 8, 14)]


DIES = textwrap.dedent("""
    import os, jax, jax.numpy as jnp
    from meshpar import distributed
    distributed.initialize(distributed.from_environment())
    if jax.process_index() == 1:
        os._exit(3)  # a worker dies mid-run
    x = jnp.ones(jax.local_device_count())
    while True:  # process 0 waits in collectives for a peer that is gone
        jax.block_until_ready(jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(x))
""")


def test_a_dead_worker_stops_the_launcher_within_60_seconds():
    start = time.monotonic()
    proc = run_cmd(["-m", "launch.local", "--processes", "2", "--devices-per-process", "2", "--",
                    sys.executable, "-c", DIES], timeout=120)
    assert time.monotonic() - start < 60
    assert proc.returncode == 3
    assert "process 1 exited with code 3; stopping the others" in proc.stderr


# --- settings -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "missing"), [
    ({"coordinator": "127.0.0.1:1234"}, "num_processes \\(MESHPAR_NUM_PROCESSES\\), process_id"),
    ({"coordinator": "127.0.0.1:1234", "num_processes": 2}, "process_id \\(MESHPAR_PROCESS_ID\\) missing"),
    ({"process_id": 0}, "coordinator \\(MESHPAR_COORDINATOR\\), num_processes"),
])
def test_half_given_settings_are_an_error(given, missing, monkeypatch):
    for var in distributed.ENV.values():
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=f"half given: .* {missing}"):
        distributed.from_environment(**given).explicit()


def test_settings_come_from_flags_then_environment(monkeypatch):
    monkeypatch.setenv("MESHPAR_COORDINATOR", "10.0.0.1:9999")
    monkeypatch.setenv("MESHPAR_NUM_PROCESSES", "4")
    monkeypatch.setenv("MESHPAR_PROCESS_ID", "2")
    settings = distributed.from_environment(process_id=3)
    assert settings == distributed.Settings("10.0.0.1:9999", 4, 3) and settings.explicit()
    monkeypatch.setenv("MESHPAR_PROCESS_ID", "two")
    with pytest.raises(ValueError, match="MESHPAR_PROCESS_ID = 'two' is not an integer"):
        distributed.from_environment()
    with pytest.raises(ValueError, match=r"process_id = 4 is not in 0..3"):
        distributed.Settings("h:1", 4, 4).explicit()


def test_half_given_flags_fail_the_cli():
    proc = run_cmd(["-m", "launch.train", "--cpu-devices", "1", "--coordinator", "127.0.0.1:1"])
    assert proc.returncode != 0 and "distributed settings are half given" in proc.stderr


def test_cluster_detection(monkeypatch):
    for markers in distributed.CLUSTER_MARKERS.values():
        for var in markers:
            monkeypatch.delenv(var, raising=False)
    assert distributed.detected_cluster() is None
    for var in distributed.CLUSTER_MARKERS["SLURM"]:
        monkeypatch.setenv(var, "1")
    assert distributed.detected_cluster() == "SLURM"


# --- multi-host device layout ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def hosts(n_hosts: int, per_host: int) -> list[FakeDevice]:
    return [FakeDevice(h * per_host + i, h) for h in range(n_hosts) for i in range(per_host)]


def processes_along(grid: np.ndarray, axis: str) -> set[int]:
    """How many hosts one line of the grid along `axis` touches (1: the axis stays inside a host)."""
    moved = np.moveaxis(grid, mesh_lib.AXES.index(axis), -1).reshape(-1, grid.shape[mesh_lib.AXES.index(axis)])
    return {len({d.process_index for d in line}) for line in moved}


def test_model_and_sequence_stay_inside_a_host():
    sizes = mesh_lib.parse("data=4,fsdp=2,sequence=2,model=2").resolve(32).sizes()
    grid = mesh_lib.device_grid(sizes, hosts(4, 8))
    assert grid.shape == (4, 1, 2, 1, 2, 2)
    assert processes_along(grid, "model") == {1} and processes_along(grid, "sequence") == {1}
    assert processes_along(grid, "fsdp") == {1} and processes_along(grid, "data") == {4}
    assert sorted(d.id for d in grid.flat) == list(range(32))
    assert mesh_lib.host_split(sizes, 8) == (
        {"data": 1, "stage": 1, "fsdp": 2, "expert": 1, "sequence": 2, "model": 2},
        {"data": 4, "stage": 1, "fsdp": 1, "expert": 1, "sequence": 1, "model": 1})


def test_an_axis_larger_than_a_host_is_split_inside_and_across():
    sizes = mesh_lib.parse("fsdp=16").resolve(16).sizes()
    inside, across = mesh_lib.host_split(sizes, 8)
    assert (inside["fsdp"], across["fsdp"]) == (8, 2)
    assert processes_along(mesh_lib.device_grid(sizes, hosts(2, 8)), "fsdp") == {2}


def test_model_spanning_hosts_warns(monkeypatch):
    import jax

    devices = jax.devices()  # 8 devices in one process, so it does not warn
    with_warning = hosts(2, 4)
    monkeypatch.setattr(jax, "devices", lambda: with_warning)
    with pytest.warns(UserWarning, match=r"mesh axis 'model' = 8 spans 2 hosts"):
        mesh_lib.build(mesh_lib.parse("model=8"))
    assert mesh_lib.build(mesh_lib.parse("model=8"), devices).shape["model"] == 8


def test_unequal_hosts_are_refused():
    with pytest.raises(ValueError, match=r"processes hold different numbers of devices \(\[2, 4\]\)"):
        mesh_lib.device_grid({"data": 6, "stage": 1, "fsdp": 1, "expert": 1, "sequence": 1, "model": 1},
                             hosts(1, 4) + [FakeDevice(10, 1), FakeDevice(11, 1)])


# --- SLURM ----------------------------------------------------------------------------------------------


def test_sbatch_script_parses_and_its_dry_run_describes_every_process():
    assert subprocess.run(["bash", "-n", str(ROOT / "launch/slurm/train.sbatch")]).returncode == 0
    env = {**os.environ, "DRY_RUN": "1", "SLURM_NNODES": "4", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "launch/slurm/train.sbatch"), "--config", "llama_8b",
                           "--mesh", "data=4,fsdp=8"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "llama_8b on 4 nodes × 8 GPUs, mesh data=4,fsdp=8" in out
    assert "process 3 (SLURM_PROCID=3, node 3): devices 24-31" in out
    assert "reads batch rows 384-511 of 512" in out
    assert "axes inside a node: fsdp=8" in out and "axes across nodes:  data=4" in out
    assert "warning" not in out


@pytest.mark.parametrize(("srun_exit", "requeued"), [(75, True), (0, False), (1, False)])
def test_sbatch_script_requeues_a_run_that_stopped_on_a_signal(tmp_path, srun_exit, requeued):
    """With srun and scontrol stubbed on PATH: exit 75 (saved on SIGTERM) requeues the job, others do not."""
    for name, body in (("srun", f"echo srun \"$@\"; exit {srun_exit}"), ("scontrol", "echo scontrol \"$@\"")):
        (tmp_path / name).write_text(f"#!/bin/bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"}
    proc = subprocess.run(["bash", str(ROOT / "launch/slurm/train.sbatch"), "--config", "tiny"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == srun_exit
    assert "-m launch.train --config tiny" in proc.stdout
    assert ("scontrol requeue 42" in proc.stdout) == requeued
    assert ("stopped on a signal and saved; requeued (restart 3)" in proc.stdout) == requeued


def test_dry_run_warns_when_model_spans_nodes():
    from configs import load
    from launch.slurm.dryrun import describe

    lines = describe(2, 4, load("tiny"), "model=8")
    assert lines[-1] == "warning: mesh axis 'model' spans 2 nodes; its per-layer collectives cross the network"
    assert "  reads batch rows 0-15 of 16 (16 × 129 tokens per step)" in lines  # TP ranks read the same rows
