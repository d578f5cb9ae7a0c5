"""Every command in the README runs as written: the strategy table's rows (for 2 steps, in this process on
its 8 devices) and the `python -m launch.*` commands of its code blocks (as subprocesses, training for at
most a few steps, in a scratch directory)."""

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import long_run_env, require_devices

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BASE = ".venv/bin/python -m launch.train --config tiny --cpu-devices 8"


def table_rows() -> dict[str, str]:
    """strategy → its flags (the first code span of the table's second column)."""
    section = README.split("## Strategies and their commands", 1)[1]
    table = [line for line in section.split("\n\n") if line.startswith("| strategy |")][0]
    rows = {}
    for line in table.splitlines()[2:]:
        strategy, flags = [cell.strip() for cell in line.strip("|").split("|")][:2]
        rows[strategy] = re.match(r"`([^`]+)`", flags).group(1)
    return rows


def block_commands() -> list[list[str]]:
    """The shell commands of the README's ```bash blocks, continuation lines joined, `$T` expanded: each
    block is a list of commands (a block's commands share a directory, e.g. resume after a first run)."""
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        lines = block.replace("\\\n", " ").splitlines()
        variables = dict(re.findall(r'^(\w+)="(.*)"$', block, re.M))
        commands = []
        for line in lines:
            line = line.split("  #")[0].strip()
            for name, value in variables.items():
                line = line.replace(f"${name} ", value + " ")
            if line and not re.match(r"^\w+=\"", line):
                commands.append(line)
        blocks.append(commands)
    return blocks


def test_the_readme_states_the_commands_it_is_checked_on():
    assert BASE in README
    assert len(table_rows()) >= 14
    flat = [c for block in block_commands() for c in block]
    assert sum("-m launch." in c for c in flat) >= 7


@pytest.mark.slow  # `make test-slow`, as the code blocks: test_parallel holds each layout's numbers
@pytest.mark.parametrize("strategy", table_rows())
def test_strategy_table_row_trains(strategy):
    require_devices(8)
    from launch.train import main

    flags = shlex.split(table_rows()[strategy])
    main(["--config", "tiny", *flags, "--steps", "2"])  # raises SystemExit with the error if it fails


def _runnable(command: str, position: int) -> list[str] | None:
    """The command as argv, a launch.train shortened to `position + 2` steps; None for what needs a cluster
    or the whole suite (make, sbatch), and for compiles for a GPU target (`tests/test_gpu_compile.py` runs
    those, where jax's CUDA plugin is installed)."""
    argv = shlex.split(command)
    if argv[0] in ("make", "sbatch") or "--target" in argv:
        return None
    env = list(itertools.takewhile(lambda a: re.match(r"^\w+=", a), argv))  # VAR=value before the command
    argv = [sys.executable if a == ".venv/bin/python" else a for a in argv[len(env):]]
    if argv[:1] == ["bash"]:  # a script of this repository
        return ["env", *env, "bash", str(ROOT / argv[1]), *argv[2:]]
    for i, a in enumerate(argv[:-1]):
        if a == "--steps":
            argv[i + 1] = str(position + 2)  # a resumed run goes on from the one before it
    return argv


@pytest.mark.slow  # `make test-slow`: each command a process of its own
@pytest.mark.parametrize("block", range(len(block_commands())))
def test_code_block_runs(block, tmp_path):
    commands = block_commands()[block]
    ran = 0
    for position, command in enumerate(commands):
        argv = _runnable(command, position)
        if argv is None:
            continue
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
        ran += 1
    assert ran or all(_runnable(c, 0) is None for c in commands), commands


@pytest.mark.parametrize("block", range(len(re.findall(r"```python\n", README))))
def test_python_block_runs(block):
    require_devices(8)
    code = re.findall(r"```python\n(.*?)```", README, re.S)[block]
    exec(compile(code, f"README.md python block {block}", "exec"), {})


@pytest.mark.slow  # four 60-step runs
def test_the_tiny_layouts_give_the_losses_the_readme_states(tmp_path):
    """The speed section's `tiny` layouts train to the same losses, the README's, to its 4 decimals; and the
    two-commands section's first and last figures of `make train` (100 steps) are the same run's."""
    first, last = map(float, re.search(r"All four give the same losses \(([\d.]+) at step 1, ([\d.]+) at step 60\)",
                                       README).groups())
    start, end = map(float, re.search(r"the loss falling from ([\d.]+) to about ([\d.]+) in 100 steps", README).groups())

    def losses(steps: int, *flags: str) -> list[float]:
        metrics = tmp_path / f"{len(os.listdir(tmp_path))}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "launch.train", "--config", "tiny", *flags, "--steps", str(steps),
                               "--metrics-file", str(metrics)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env=long_run_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]

    for flags in (["--cpu-devices", "1"], *(["--cpu-devices", "8", "--mesh", mesh]
                                            for mesh in ("data=8", "fsdp=8", "data=2,fsdp=4"))):
        run = losses(60, *flags)
        assert (round(run[0], 4), round(run[-1], 4)) == (first, last), flags
    run = losses(100, "--cpu-devices", "8", "--mesh", "fsdp=8")  # `make train` (the schedule spans 100 steps)
    assert (round(run[0], 2), round(run[-1], 1)) == (start, end), run[-1]
