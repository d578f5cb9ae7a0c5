"""Print what each process of a multi-node job would do, without a cluster or a GPU.

    python -m launch.slurm.dryrun --nodes 4 --gpus-per-node 8 --config llama_8b --mesh data=4,fsdp=8

One process per node drives its node's GPUs (as launch/slurm/train.sbatch starts them). For each
process: its global devices, where they sit in the mesh, which rows of the global batch it reads, and
what it writes. Then which mesh axes stay inside a node and which cross the network.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import numpy as np

from meshpar.errors import InputError


@dataclasses.dataclass(frozen=True)
class PlannedDevice:
    id: int
    process_index: int


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def describe(nodes: int, gpus_per_node: int, config, mesh_text: str) -> list[str]:
    from meshpar import mesh as mesh_lib, rules as rules_lib, sharding

    devices = [PlannedDevice(n * gpus_per_node + g, n) for n in range(nodes) for g in range(gpus_per_node)]
    sizes = mesh_lib.parse(mesh_text).resolve(len(devices)).sizes()
    grid = mesh_lib.device_grid(sizes, devices)
    inside, across = mesh_lib.host_split(sizes, gpus_per_node)
    B, T = config.train.global_batch, config.train.seq_len
    sharding.spec_for(("batch", None), (B, T + 1), rules_lib.make(config.parallel).table("activations"), sizes,
                      f"token batch [{B}, {T + 1}]")  # the batch's rows divide over the batch axes
    batch = [mesh_lib.AXES.index(axis) for axis in rules_lib.BATCH_AXES]
    row_blocks = math.prod(sizes[axis] for axis in rules_lib.BATCH_AXES)
    lines = [f"{config.name} on {nodes} nodes × {gpus_per_node} GPUs, mesh {mesh_lib.describe(sizes)}; "
             f"global batch {B} × {T} tokens"]
    for node in range(nodes):
        coords = [np.argwhere(np.vectorize(lambda d: d.id == dev.id)(grid))[0] for dev in devices
                  if dev.process_index == node]
        per_axis = {axis: _span([int(c[i]) for c in coords]) for i, axis in enumerate(mesh_lib.AXES) if sizes[axis] > 1}
        blocks = sorted({int(np.ravel_multi_index([c[i] for i in batch], [sizes[mesh_lib.AXES[i]] for i in batch]))
                         for c in coords})
        rows = (blocks[0] * B // row_blocks, (blocks[-1] + 1) * B // row_blocks)
        duties = "progress, metrics, report and its checkpoint shards" if node == 0 else "its checkpoint shards"
        lines += [f"process {node} (SLURM_PROCID={node}, node {node}): devices {_span([d.id for d in devices if d.process_index == node])}",
                  f"  mesh coordinates: {', '.join(f'{a} {v}' for a, v in per_axis.items()) or 'all (one device)'}",
                  f"  reads batch rows {rows[0]}-{rows[1] - 1} of {B} ({rows[1] - rows[0]} × {T + 1} tokens per step)",
                  f"  writes: {duties}"]
    lines.append("axes inside a node: " + (", ".join(f"{a}={inside[a]}" for a in mesh_lib.AXES if inside[a] > 1) or "none"))
    lines.append("axes across nodes:  " + (", ".join(f"{a}={across[a]}" for a in mesh_lib.AXES if across[a] > 1) or "none"))
    lines += [f"warning: mesh axis '{a}' spans {across[a]} nodes; its per-layer collectives cross the network"
              for a in ("model", "sequence") if across[a] > 1]
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.slurm.dryrun", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--config", default="tiny")
    p.add_argument("--mesh", help="default: the preset's mesh")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args, rest = p.parse_known_args(argv)  # the rest must be launch.train flags (they do not change the plan)
    from launch import train

    train.parse_args([*rest, *(["--mesh", args.mesh] if args.mesh else [])])  # an unknown flag exits here, named

    import configs
    from meshpar import config as config_lib

    try:
        cfg = config_lib.apply(configs.load(args.config), args.set)
        mesh_text = args.mesh or ",".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg.mesh).items())
        print("\n".join(describe(args.nodes, args.gpus_per_node, cfg, mesh_text)))
    except InputError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
