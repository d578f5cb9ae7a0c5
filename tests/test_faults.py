"""Faults with real signals and real processes (loopback), not mocks.

Stop requests: SIGTERM at a random step of a 1-process run ends it after the step in flight with a
checkpoint and exit code 75, and the resumed run ends where an uninterrupted one does, bit for bit; a
second signal (after SIGINT) ends the process at once; `--exit-after-s` stops like SIGTERM; a signal
while the step compiles (nothing to save yet) ends the process at once with exit 75. Faults: a
2-process job under `launch.local --max-restarts` with a process killed (SIGKILL) three times, once
mid-save, then SIGTERM to one process only (both stop after the same step, save it and exit 75; the
launcher, which was not signalled, restarts the job), ends with the uninterrupted run's parameters, bit
for bit; a paused process (SIGSTOP) ends the job within the heartbeat timeout, named."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import require_devices
from meshpar import mesh as mesh_lib, rules
from meshpar.signals import EXIT_REQUEUE

# chaos and preemption runs of real processes: `make test-slow`, which CI runs beside `make test`
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
TRAIN = ["-m", "launch.train", "--config", "tiny", "--set", "model.n_layers=1", "--set", "train.seq_len=64",
         "--set", "checkpoint.every=1000", "--mesh", "fsdp=8", "--steps", str(STEPS)]


def command(processes: int, workdir: Path, name: str, *launcher: str) -> list[str]:
    """A run of TRAIN as `processes` × 8/processes devices, resuming from workdir/ckpt; `launcher`: more
    flags for launch.local."""
    train = [*TRAIN, "--checkpoint-dir", str(workdir / "ckpt"), "--metrics-file", str(workdir / f"{name}.jsonl")]
    if processes == 1:
        return [sys.executable, *train, "--cpu-devices", "8"]
    return [sys.executable, "-m", "launch.local", "--processes", str(processes), "--devices-per-process",
            str(8 // processes), *launcher, "--", sys.executable, *train]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    """The command, its output going to `log` (a pipe nobody reads would fill and stop it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHPAR_", "JAX_NUM_CPU"))}
    proc = subprocess.Popen(argv, cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def finish(proc: subprocess.Popen, code: int) -> str:
    proc.wait(timeout=300)
    out = proc.log.read_text()
    assert proc.returncode == code, out[-3000:]
    return out


def losses(workdir: Path, *names: str) -> list[float]:
    return [json.loads(line)["loss"] for name in names for line in (workdir / f"{name}.jsonl").read_text().splitlines()]


def last_step(workdir: Path, name: str) -> int:
    """The last step in the metrics file (a restarted job writes it anew from the step it resumed at)."""
    lines = (workdir / f"{name}.jsonl").read_text().splitlines() if (workdir / f"{name}.jsonl").exists() else []
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except json.JSONDecodeError:  # a line being written
        return 0


def wait_for_step(workdir: Path, name: str, step: int, proc: subprocess.Popen) -> None:
    while last_step(workdir, name) < step:
        assert proc.poll() is None, proc.log.read_text()[-3000:]
        time.sleep(0.005)


def trainer_pid(launcher: subprocess.Popen, process_id: int, not_in: set[int] = frozenset()) -> int:
    """The pid of `launch.local`'s process `process_id`, other than `not_in` (a restarted job's)."""
    for _ in range(6000):
        for pid in map(int, Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()):
            try:
                if (pid not in not_in and f"MESHPAR_PROCESS_ID={process_id}".encode()
                        in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")):
                    return pid
            except (FileNotFoundError, ProcessLookupError):
                continue
        assert launcher.poll() is None, launcher.log.read_text()[-3000:]
        time.sleep(0.01)
    raise AssertionError(f"no process {process_id} under launch.local")


def final_params(workdir: Path) -> list[np.ndarray]:
    from launch import weights

    mesh = mesh_lib.build(mesh_lib.parse("fsdp=8"))
    return [np.asarray(x) for x in jax.tree.leaves(weights.load(workdir / "ckpt", mesh, rules.default())[1])]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """processes → (losses, final parameters) of the run without a stop."""
    out = {}
    for processes in (1, 2):
        workdir = tmp_path_factory.mktemp(f"uninterrupted{processes}")
        finish(start(command(processes, workdir, "all"), workdir / "all.log"), 0)
        out[processes] = losses(workdir, "all"), final_params(workdir)
    return out


def test_a_stopped_run_resumes_to_the_uninterrupted_one_bit_for_bit(uninterrupted, tmp_path):
    require_devices(8)
    at = random.Random().randint(8, 25)
    proc = start(command(1, tmp_path, "stopped"), tmp_path / "stopped.log")
    wait_for_step(tmp_path, "stopped", at, proc)
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = finish(proc, EXIT_REQUEUE)
    print(f"stop requested at step >= {at}: exited {time.monotonic() - began:.2f} s after the signal")
    stopped = len(losses(tmp_path, "stopped"))
    assert at <= stopped < STEPS
    assert f"stopped after step {stopped} (SIGTERM); checkpoint of step {stopped} saved" in out, out[-3000:]
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir()) == [stopped]
    out = finish(start(command(1, tmp_path, "resumed"), tmp_path / "resumed.log"), 0)
    assert f"at step {stopped} (saved for the stop: SIGTERM)" in out, out[-3000:]
    reference, params = uninterrupted[1]
    assert losses(tmp_path, "stopped", "resumed") == reference
    assert all(np.array_equal(a, b) for a, b in zip(final_params(tmp_path), params, strict=True))


def test_a_second_signal_ends_the_process_at_once_and_keeps_the_checkpoint(tmp_path):
    """The first signal (SIGINT, as Ctrl-C sends) asks for a stop; one more before the stop is done ends the
    process by that signal. The checkpoint saved before stays the latest, whole, and the run resumes from
    it; there `--exit-after-s` (its budget spent on its own time) stops it as SIGTERM would."""
    argv = [*command(1, tmp_path, "a"), "--set", "checkpoint.every=4", "--set", "model.n_layers=2",
            "--set", "train.seq_len=256"]  # steps long enough that the second signal lands before the stop is done
    proc = start(argv, tmp_path / "a.log")
    wait_for_step(tmp_path, "a", 6, proc)
    proc.send_signal(signal.SIGINT)
    while "SIGINT: stopping after the step in flight" not in proc.log.read_text():
        assert proc.poll() is None
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    finish(proc, -signal.SIGTERM)
    saved = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert saved
    argv[argv.index("--steps") + 1] = "1000000"  # more than 3 s can train
    out = finish(start([*argv, "--exit-after-s", "3"], tmp_path / "b.log"), EXIT_REQUEUE)
    # a periodic one: the stop's own save never began
    assert f"resumed from {tmp_path / 'ckpt'} at step {saved[-1]} (saved every 4 steps)" in out, out[-3000:]
    stopped = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[-1])["step"]
    assert f"stopped after step {stopped} (time budget (--exit-after-s) spent)" in out
    assert max(int(p.name) for p in (tmp_path / "ckpt").iterdir()) == stopped


@pytest.mark.parametrize("signum, resumes", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["new", "resumed"])
def test_a_signal_while_the_step_compiles_exits_75_at_once(tmp_path, signum, resumes):
    """Before the first step there is nothing to save: a signal while the step compiles, in a new run or in
    one that restored a checkpoint, ends the process at once with exit 75 (a requeue), not by the signal,
    and leaves the checkpoints as they were."""
    if resumes:
        finish(start([*command(1, tmp_path, "first"), "--steps", "2"], tmp_path / "first.log"), 0)
    proc = start(command(1, tmp_path, "a"), tmp_path / "a.log")
    while "compiling the step" not in proc.log.read_text():
        assert proc.poll() is None, proc.log.read_text()[-3000:]
        time.sleep(0.002)
    began = time.monotonic()
    proc.send_signal(signum)
    out = finish(proc, EXIT_REQUEUE)
    print(f"{signum.name} while compiling: exited {time.monotonic() - began:.2f} s after the signal")
    assert "compiled in" not in out, out[-3000:]  # the signal landed before the compilation was done
    assert f"{signum.name} before the first step: nothing to save, exiting with 75" in out, out[-3000:]
    assert not (tmp_path / "a.jsonl").exists() or not (tmp_path / "a.jsonl").read_text()
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir()) if (tmp_path / "ckpt").exists() else []
    assert saved == (["2"] if resumes else [])
    if resumes:
        assert f"resumed from {tmp_path / 'ckpt'} at step 2 (saved for the last step)" in out, out[-3000:]


def test_a_budget_that_is_not_positive_is_refused(capsys):
    from launch.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--exit-after-s", "0"])
    assert "--exit-after-s: 0 is not a number of seconds > 0" in capsys.readouterr().err


def test_a_job_killed_three_times_and_stopped_once_ends_with_the_uninterrupted_parameters(uninterrupted, tmp_path):
    """The chaos run: 2 processes under `launch.local --max-restarts 5`, checkpoints every 5 steps; one of
    them (chosen at random) killed with SIGKILL at a random step, then in the middle of a save (an orbax
    temporary directory on disk), then at a random step again. Each time the launcher stops the other,
    starts the job again, and it resumes from the latest whole checkpoint. Then SIGTERM reaches process 1
    only: both processes stop after the same step (the logger says which, once) and save it, and the
    restarted job resumes from exactly there."""
    require_devices(8)
    rng = random.Random()
    argv = command(2, tmp_path, "chaos", "--max-restarts", "5")
    argv[argv.index("checkpoint.every=1000")] = "checkpoint.every=5"
    proc = start(argv, tmp_path / "chaos.log")
    killed_at, old = 0, set()
    for moment in ("a step", "a save", "a step", "SIGTERM"):
        job = [trainer_pid(proc, i, old) for i in (0, 1)]  # the job's next start
        if moment == "a save":
            wait_for_step(tmp_path, "chaos", killed_at + 1, proc)  # resumed: stale temporary directories are gone
            while not any(".orbax-checkpoint-tmp" in name for name in os.listdir(tmp_path / "ckpt")):
                assert proc.poll() is None, proc.log.read_text()[-3000:]
                time.sleep(0.001)
        else:
            wait_for_step(tmp_path, "chaos", killed_at + rng.randint(3, 6), proc)
        os.kill(job[1] if moment == "SIGTERM" else rng.choice(job), signal.SIGTERM if moment == "SIGTERM" else
                signal.SIGKILL)
        killed_at = last_step(tmp_path, "chaos")
        print(f"{'stopped' if moment == 'SIGTERM' else 'killed'} in {moment}, after step {killed_at}")
        old |= set(job)
    out = finish(proc, 0)
    reasons = re.findall(r"launch.local: restart (\d) of 5: (.*)", out)
    assert [int(n) for n, _ in reasons] == [1, 2, 3, 4], out[-3000:]
    assert all("exited with code -9" in why for _, why in reasons[:3]) and "stopped on request" in reasons[3][1], reasons
    (stopped,) = map(int, re.findall(r"\[p0\] stopped after step (\d+) \(", out))
    assert "[p1] stopped after step" not in out  # the logger (process 0) says it
    assert f"resumed from {tmp_path / 'ckpt'} at step {stopped}" in out
    reference, params = uninterrupted[2]
    assert losses(tmp_path, "chaos") == reference[stopped:]  # the last start's metrics: from the stop on
    assert all(np.array_equal(a, b) for a, b in zip(final_params(tmp_path), params, strict=True))


def test_a_paused_process_ends_the_job_within_the_heartbeat_timeout_named(tmp_path):
    """Process 1 stopped with SIGSTOP (a stalled host) while process 0 waits for it in the step's
    collectives: with `--heartbeat-timeout 10`, JAX's coordination service names process 1 and ends
    process 0, and the launcher the rest, instead of the job waiting forever."""
    argv = [*command(2, tmp_path, "a"), "--heartbeat-timeout", "10"]
    argv[argv.index("--steps") + 1] = "1000000"
    proc = start(argv, tmp_path / "a.log")
    wait_for_step(tmp_path, "a", 5, proc)
    os.kill(trainer_pid(proc, 1), signal.SIGSTOP)
    paused = time.monotonic()
    proc.wait(timeout=120)
    print(f"the job ended {time.monotonic() - paused:.1f} s after process 1 was paused")
    assert time.monotonic() - paused < 60
    out = proc.log.read_text()
    assert proc.returncode != 0
    assert re.search(r"unhealthy \(stopped sending heartbeats\):\n\[p0\] 1\n", out), out[-3000:]
