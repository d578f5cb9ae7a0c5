"""Convert between Hugging Face checkpoints (Llama, Mistral, Qwen 2, Qwen 3, Mixtral, Qwen3-MoE, Qwen2-MoE) and meshpar
parameters.

    python -m launch.convert from-hf --hf-dir llama-3.2-1b --out runs/llama-1b --cpu-devices 8
    python -m launch.convert from-hf --hf-dir qwen3-0.6b --out runs/qwen3 --mesh fsdp=2,model=4
    python -m launch.convert from-hf --hf-dir qwen3-30b-a3b --out runs/qwen3-moe --mesh expert=8
    python -m launch.convert to-hf --checkpoint runs/ckpt --out runs/hf --cpu-devices 8 [--family mistral]

`from-hf` reads `config.json` and the safetensors weights (float32, bfloat16 or float16; one file or
shards with an index), each device reading only its own block, and writes a parameters directory
(`meshpar.checkpoint.export_params`) that `launch.train --init-from` and `launch.generate` read. `to-hf`
takes such a directory or a training checkpoint (`launch.train --checkpoint-dir`) and writes a directory
that `transformers.AutoModelForCausalLM.from_pretrained` loads: config.json and float32 safetensors, of
the family `--family` names, else the one the parameters were imported from, else the one the model's
options name (`models.hf.families.family_of`). The mesh (default: fsdp over all devices) only decides
where the parameters live while converting. A mixture of experts' `router_aux_loss_coef` is a training
setting in meshpar (`train.router_aux_loss_coef`): `from-hf` prints the `--set` that trains with it.

Errors found by meshpar's own checks (an unsupported config option, a missing tensor, a wrong shape)
print as one line and exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import time
from pathlib import Path

from meshpar.errors import InputError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.convert", description=__doc__.split("\n")[0])
    commands = p.add_subparsers(dest="command", required=True)
    from_hf = commands.add_parser("from-hf", help="a Hugging Face directory → a meshpar parameters directory")
    from_hf.add_argument("--hf-dir", required=True, help="holds config.json and model.safetensors (or shards "
                                                         "and model.safetensors.index.json)")
    from_hf.add_argument("--out", required=True, help="the parameters directory to write")
    to_hf = commands.add_parser("to-hf", help="meshpar parameters or a training checkpoint → a Hugging Face "
                                              "directory")
    to_hf.add_argument("--checkpoint", required=True, help="a parameters directory or a training checkpoint directory")
    to_hf.add_argument("--out", required=True, help="the Hugging Face directory to write")
    to_hf.add_argument("--family", help="the model_type to write: llama, mistral, qwen2, qwen3, gemma2, gemma3_text, "
                                        "mixtral, qwen3_moe, qwen2_moe or gpt_oss (default: the family imported from, "
                                        "else the one the model's options name)")
    for command in (from_hf, to_hf):
        command.add_argument("--mesh", help="axis sizes while converting, e.g. fsdp=2,model=4 (default: fsdp over "
                                            "all devices)")
        command.add_argument("--cpu-devices", type=int, help="run on this many fake CPU devices")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from launch import devices

    devices.setup(args.cpu_devices)  # before JAX starts a backend
    import jax

    from meshpar import distributed, mesh as mesh_lib, rules

    start = time.perf_counter()
    try:
        # stale files would mix with the new ones; checked before the processes join, so before any writes
        if Path(args.out).exists() and any(Path(args.out).iterdir()):
            raise InputError(f"--out {args.out} is not empty; choose a new directory or remove it")
        joined = distributed.initialize(distributed.from_environment())  # launch.local, SLURM, ...: one mesh
        if joined:
            print(joined, flush=True)
        mesh = mesh_lib.build(mesh_lib.parse(args.mesh) if args.mesh else mesh_lib.MeshConfig(fsdp=-1))
        convert = from_hf if args.command == "from-hf" else to_hf
        cfg, n_params = convert(args, mesh, rules.default())
    except InputError as err:
        sys.exit(f"error: {err}")
    if jax.process_index():
        return
    # ru_maxrss is KiB on Linux; it counts the memory-mapped checkpoint pages this process touched
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"model: {dataclasses.asdict(cfg)}")
    print(f"{n_params:,} parameters → {args.out} in {time.perf_counter() - start:.1f}s; "
          f"peak host RSS {peak_rss / 1e9:.2f} GB")


def from_hf(args: argparse.Namespace, mesh, rules):
    """--hf-dir's config and weights → a parameters directory at --out; (config, parameter count)."""
    import jax

    from meshpar import checkpoint, train
    from models import hf
    from meshpar.run import param_count

    cfg = hf.load_config(args.hf_dir)
    params = hf.import_params(args.hf_dir, cfg, mesh, rules)
    hf_config = hf.read_config_json(args.hf_dir)
    source = {"hf_dir": str(Path(args.hf_dir).absolute()), "model_type": hf_config["model_type"]}  # to-hf's family
    checkpoint.export_params(args.out, params, config={"model": dataclasses.asdict(cfg), "source": source})
    coef = hf_config.get("router_aux_loss_coef")
    if cfg.n_experts and coef is not None and jax.process_index() == 0:  # a training setting, not the model's
        print(f"config.json: router_aux_loss_coef = {coef} weighs the load-balancing loss in training; meshpar's is "
              f"train.router_aux_loss_coef (default {train.TrainConfig().router_aux_loss_coef}): to train with "
              f"this checkpoint's, --set train.router_aux_loss_coef={coef}", flush=True)
    return cfg, param_count(params)


def to_hf(args: argparse.Namespace, mesh, rules):
    """--checkpoint's parameters → a Hugging Face directory at --out; (config, parameter count)."""
    from launch import weights
    from models import hf
    from meshpar.run import param_count

    cfg, params = weights.load(args.checkpoint, mesh, rules)
    imported_from = weights.saved_config(args.checkpoint)[0].get("source", {}).get("model_type")
    hf.export(params, cfg, args.out, model_type=args.family or imported_from)
    return cfg, param_count(params)


if __name__ == "__main__":
    main()
