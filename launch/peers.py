"""Side by side on the same dims and meshes: meshpar (defaults), a hand-written plain-JAX step, MaxText.

    python -m launch.peers                                   # every mesh, 3 rounds
    python -m launch.peers --meshes fsdp=8 --rounds 5 --json runs/peers.json

A benchmark, not a test. Dims (Llama-style): d_model 256, 4 layers, 8 heads, 4 kv heads (8 on model=8,
which splits them), d_ff 1024, vocab 256, T 128, global batch 16, float32, 8 fake CPU devices. Each round
runs every (framework, JAX, mesh) once, interleaved, so that the machine's drift hits all alike; the table
shows medians over rounds of each run's median step time, and the ratios that count, within one JAX:
- this venv's JAX: meshpar (its defaults) and the plain step (`BENCH_DIR/baseline.py`); and meshpar with
  the plain step's settings (`train.remat=none`) against the plain step in one process (launch.overhead),
  whose ratio is the one that resolves a few percent;
- the newest JAX (a Python 3.12 venv built on first use in `$TMPDIR/meshpar-newest`, from PyPI): the
  same, and MaxText (`BENCH_DIR/peer_maxtext.sh`, which builds its own venv on that JAX).
BENCH_DIR defaults to `../shared/bench` beside the checkout.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MESHES = ("fsdp=8", "data=8", "data=2,fsdp=2,model=2", "model=8")
DIMS = dict(d=256, layers=4, heads=8, kv=4, ff=1024, vocab=256, seq=128, batch=16)
NEWEST = ("jax", "flax", "optax", "orbax-checkpoint")


def kv_heads(mesh: str) -> int:
    return 8 if "model=8" in mesh else DIMS["kv"]  # kv heads must divide over `model`


def last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def meshpar_sets(mesh: str, remat: str = "auto") -> list[str]:
    """The `--set` overrides that give the tiny preset these dims."""
    sets = {"model.d_model": DIMS["d"], "model.n_layers": DIMS["layers"], "model.n_heads": DIMS["heads"],
            "model.n_kv_heads": kv_heads(mesh), "model.d_ff": DIMS["ff"], "model.vocab_size": DIMS["vocab"],
            "train.seq_len": DIMS["seq"], "train.global_batch": DIMS["batch"], "train.remat": remat}
    return [f"{k}={v}" for k, v in sets.items()]


def run_meshpar(python: str, mesh: str, steps: int) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, "-m", "launch.bench", "--mesh", mesh, "--steps", str(steps),
               "--cpu-devices", "8", "--json", out.name] + [a for kv in meshpar_sets(mesh) for a in ("--set", kv)]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        return json.loads(Path(out.name).read_text())[0]["step_time_s_median"]


def run_baseline(python: str, bench: Path, mesh: str, steps: int) -> float:
    dims = {**DIMS, "kv": kv_heads(mesh), "steps": steps}
    cmd = [python, str(bench / "baseline.py"), "--mesh", mesh] + [a for k, v in dims.items() for a in (f"--{k}", str(v))]
    return last_json(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["step_s"]


def run_paired(python: str, bench: Path, mesh: str, steps: int) -> float:
    """plain / meshpar step time with the plain step's settings, both in one process (launch.overhead)."""
    cmd = [python, "-m", "launch.overhead", "--mesh", mesh, "--steps", str(steps), "--bench-dir", str(bench)]
    return last_json(subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout)["plain_over_meshpar"]


def run_maxtext(bench: Path, mesh: str, steps: int) -> float:
    env = {**os.environ, "KV": str(kv_heads(mesh))}
    out = subprocess.run(["bash", str(bench / "peer_maxtext.sh"), mesh, str(steps)], check=True,
                         capture_output=True, text=True, env=env)
    return last_json(out.stdout)["step_s"]


def python312() -> str:
    for candidate in [os.environ.get("PYTHON312", ""), *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")))]:
        if candidate and subprocess.run([candidate, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 12))"],
                                        capture_output=True).returncode == 0:
            return candidate
    sys.exit("no Python 3.12 found for the newest JAX (set PYTHON312)")


def newest_venv() -> tuple[str, str]:
    """(python, jax version) of a venv with meshpar and the newest jax/flax/optax/orbax."""
    venv = Path(os.environ.get("TMPDIR", "/tmp")) / "meshpar-newest"
    python = str(venv / "bin" / "python")
    if not (venv / ".ok").exists():
        subprocess.run([python312(), "-m", "venv", str(venv)], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", *NEWEST, "-e", str(ROOT)], check=True)
        (venv / ".ok").touch()
    version = subprocess.run([python, "-c", "import jax; print(jax.__version__)"], check=True, capture_output=True,
                             text=True).stdout.strip()
    return python, version


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.peers", description=__doc__.split("\n")[0])
    p.add_argument("--meshes", default=";".join(MESHES), help="semicolon-separated, e.g. 'fsdp=8;data=2,model=4'")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bench-dir", default=str(ROOT.parent / "shared" / "bench"))
    p.add_argument("--no-maxtext", action="store_true")
    p.add_argument("--json", help="also write the medians (step seconds; none/plain: the ratio) to this file")
    args = p.parse_args(argv)
    meshes = args.meshes.split(";")
    bench = Path(args.bench_dir)
    import jax

    here = (sys.executable, jax.__version__)
    newest = newest_venv()
    runs = {}  # (framework, jax version, mesh) → a function giving one step time
    for mesh in meshes:
        for python, version in (here, newest):
            runs[("meshpar", version, mesh)] = lambda python=python, mesh=mesh: run_meshpar(python, mesh, args.steps)
            runs[("none/plain", version, mesh)] = (lambda python=python, mesh=mesh:  # the plain step's settings
                                                   run_paired(python, bench, mesh, args.steps))
            runs[("plain JAX", version, mesh)] = (lambda python=python, mesh=mesh:
                                                  run_baseline(python, bench, mesh, args.steps))
        if not args.no_maxtext:
            runs[("MaxText", newest[1], mesh)] = lambda mesh=mesh: run_maxtext(bench, mesh, args.steps)
    times: dict[tuple, list[float]] = {key: [] for key in runs}
    for r in range(args.rounds):
        for key, measure in runs.items():
            times[key].append(measure())
            value = f"{times[key][-1]:.3f}×" if key[0] == "none/plain" else f"{times[key][-1] * 1e3:.0f} ms"
            print(f"round {r + 1}/{args.rounds} {key[0]:<10} jax {key[1]:<9} {key[2]:<22} {value:>9}", flush=True)
    median = {key: statistics.median(values) for key, values in times.items()}
    print("\n| mesh | jax | meshpar ms | plain JAX ms | MaxText ms | meshpar speed vs plain | meshpar vs MaxText "
          "| none vs plain, one process |")
    print("|---|---|---|---|---|---|---|---|")
    for mesh in meshes:
        for version in dict.fromkeys((here[1], newest[1])):
            ours, paired = median[("meshpar", version, mesh)], median[("none/plain", version, mesh)]
            plain, peer = median[("plain JAX", version, mesh)], median.get(("MaxText", version, mesh))
            peer_text = (f"{peer * 1e3:.0f}", f"{peer / ours:.2f}×") if peer else ("–", "–")
            print(f"| {mesh} | {version} | {ours * 1e3:.0f} | {plain * 1e3:.0f} | {peer_text[0]} "
                  f"| {plain / ours:.2f}× | {peer_text[1]} | {paired:.3f}× |")
    if args.json:
        Path(args.json).write_text(json.dumps([{"framework": k[0], "jax": k[1], "mesh": k[2], "median": v,
                                                "runs": times[k]} for k, v in median.items()], indent=2))


if __name__ == "__main__":
    main()
