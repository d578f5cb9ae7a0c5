"""meshpar's step with the plain step's settings against the hand-written plain-JAX step, in one process.

    python -m launch.overhead --mesh model=8 --steps 24

Both steps are compiled (meshpar: `train.remat=none`, float32, launch.peers' dims; the plain step:
`BENCH_DIR/baseline.py`, loaded as it is) and their steps alternate, so the machine's drift hits both
alike; separate processes differ by more than the few percent this measures. Prints one JSON line: each
step's median time and the median of the per-pair ratios plain / meshpar (≥ 1: meshpar is at least as
fast). The first two pairs are left out. A benchmark, not a test; launch.peers runs it for its
`none vs plain` column.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

from launch.peers import DIMS, ROOT, kv_heads, meshpar_sets


def plain_step(bench: Path, mesh: str) -> Callable[[], None]:
    """One step of the baseline script's own jitted step on its own state (the script run with one step)."""
    dims = {**DIMS, "kv": kv_heads(mesh), "steps": 1}
    argv, sys.argv = sys.argv, [str(bench / "baseline.py"), "--mesh", mesh,
                                *[a for k, v in dims.items() for a in (f"--{k}", str(v))]]
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its median of no timed steps
            script = runpy.run_path(sys.argv[0])
    finally:
        sys.argv = argv

    def step() -> None:
        script["params"], script["opt"], loss = script["step"](script["params"], script["opt"], script["tok"])
        loss.block_until_ready()

    return step


def meshpar_step(mesh_text: str) -> Callable[[], None]:
    """One meshpar training step on the tiny preset at launch.peers' dims, remat none."""
    import jax
    import numpy as np

    from launch.configure import configure
    from meshpar import sharding, train

    cfg, mesh, rules, make_model = configure("tiny", mesh_text, meshpar_sets(mesh_text, remat="none"))
    tx = train.optimizer(cfg.train)
    sharded = train.sharded_abstract(make_model, tx, mesh, rules, cfg.train.seed)
    state = train.init_state(make_model, tx, sharded, cfg.train.seed)
    shape = (cfg.train.global_batch, cfg.train.seq_len + 1)
    tokens_sharding = sharding.batch_sharding(mesh, rules, shape)
    tokens_BT = jax.device_put(np.random.default_rng(0).integers(0, cfg.model.vocab_size, shape, np.int32),
                               tokens_sharding)
    jitted = train.make_step(sharded, tokens_sharding, cfg.train)

    def step() -> None:
        nonlocal state
        state, metrics = jitted(state, tokens_BT)
        metrics["loss"].block_until_ready()

    return step


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--steps", type=int, default=24, help="pairs of steps, the first two left out (at least 3)")
    p.add_argument("--bench-dir", default=str(ROOT.parent / "shared" / "bench"))
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error(f"--steps {args.steps}: at least 3 (the first two pairs are left out)")
    bench = Path(args.bench_dir)
    if not (bench / "baseline.py").exists():
        p.error(f"--bench-dir {bench}: no baseline.py there")
    from launch import devices

    devices.setup(8)
    import jax

    from meshpar.errors import InputError

    jax.devices()  # the backend starts here, on 8 CPU devices, before the script sets its XLA flags
    try:
        steps = {"meshpar": meshpar_step(args.mesh), "plain": plain_step(bench, args.mesh)}
    except InputError as err:  # the mesh or the dims: say what, without a traceback
        sys.exit(f"error: {err}")
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    ours, plain = times["meshpar"][2:], times["plain"][2:]
    print(json.dumps({"mesh": args.mesh, "jax": jax.__version__, "pairs": len(ours),
                      "meshpar_s": statistics.median(ours), "plain_s": statistics.median(plain),
                      "plain_over_meshpar": statistics.median(p / m for p, m in zip(plain, ours))}))


if __name__ == "__main__":
    main()
