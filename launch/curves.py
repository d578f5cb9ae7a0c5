"""Plot the loss curves of runs side by side, from the metrics files `launch.train --metrics-file` writes.

    python -m launch.curves runs/bf16.jsonl runs/fp8.jsonl --labels bf16,"FP8 tensorwise" --out curves.png

Each curve is the per-step training loss (on a log scale); the legend gives each run's final loss (the mean of its last
`WINDOW` steps: one step's loss is one batch's) and its difference from the first run's. Needs matplotlib
(a test extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshpar.errors import InputError

WINDOW = 20  # steps a final loss is averaged over


def losses(path: str) -> list[tuple[int, float]]:
    """(step, loss) of every step record of a metrics file."""
    try:
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        raise InputError(f"metrics file '{path}': {err}") from None
    points = [(r["step"], r["loss"]) for r in records if "loss" in r and "step" in r]
    if not points:
        raise InputError(f"metrics file '{path}' holds no step with a loss")
    return points


def final(points: list[tuple[int, float]]) -> float:
    """A run's final loss: the mean of its last `WINDOW` steps'."""
    tail = [loss for _, loss in points[-WINDOW:]]
    return sum(tail) / len(tail)


def plot(paths: list[str], labels: list[str], out: str, title: str) -> list[float]:
    """Draw the curves into `out` (PNG); returns each run's final loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [losses(p) for p in paths]
    ends = [final(points) for points in runs]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (points, label) in enumerate(zip(runs, labels)):
        steps, loss = zip(*points)
        change = f", {100 * (ends[i] - ends[0]) / ends[0]:+.2f}%" if i else ""
        ax.plot(steps, loss, label=f"{label} (final {ends[i]:.3f}{change})", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")  # a run's first steps can be orders of magnitude above where it settles
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return ends


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.curves", description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="metrics files (JSON lines), the first the baseline")
    p.add_argument("--labels", help="comma-separated, one per file (default: the file names)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="training loss")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [Path(f).stem for f in args.files]
    try:
        if len(labels) != len(args.files):
            raise InputError(f"--labels gives {len(labels)} labels for {len(args.files)} files")
        ends = plot(args.files, labels, args.out, args.title)
    except InputError as err:
        sys.exit(f"error: {err}")
    for label, end in zip(labels, ends):
        change = 100 * (end - ends[0]) / ends[0]
        print(f"{label}: final loss {end:.4f} (mean of the last {WINDOW} steps; {change:+.2f}% against {labels[0]})")


if __name__ == "__main__":
    main()
