"""Convert between Hugging Face checkpoints (Llama, Mistral, Qwen 2, Qwen 3, Mixtral, Qwen3-MoE, Qwen2-MoE) and meshpar
parameters.

    python -m launch.convert from-hf --hf-dir llama-3.2-1b --out runs/llama-1b --cpu-devices 8
    python -m launch.convert from-hf --hf-dir qwen3-0.6b --out runs/qwen3 --mesh fsdp=2,model=4
    python -m launch.convert from-hf --hf-dir qwen3-30b-a3b --out runs/qwen3-moe --mesh expert=8
    python -m launch.convert to-hf --checkpoint runs/ckpt --out runs/hf --cpu-devices 8 [--family mistral]
    python -m launch.convert to-hf --checkpoint runs/lora --out runs/hf --merge-lora
    python -m launch.convert to-peft --checkpoint runs/lora --out runs/adapter
    python -m launch.convert from-peft --peft-dir adapter --base runs/llama-1b --out runs/llama-1b-adapter

`from-hf` reads `config.json` and the safetensors weights (float32, bfloat16 or float16; one file or
shards with an index), each device reading only its own block, and writes a parameters directory
(`meshpar.checkpoint.export_params`) that `launch.train --init-from` and `launch.generate` read. `to-hf`
takes such a directory or a training checkpoint (`launch.train --checkpoint-dir`) and writes a directory
that `transformers.AutoModelForCausalLM.from_pretrained` loads: config.json and float32 safetensors, of
the family `--family` names, else the one the parameters were imported from, else the one the model's
options name (`models.hf.families.family_of`); a LoRA run's with its adapters merged into the weights
(`--merge-lora`). `to-peft` writes a LoRA run's adapters as a PEFT adapter directory (`models.hf.peft`),
which `peft.PeftModel.from_pretrained` loads over the base; `from-peft` reads one over a base meshpar
imported (`from-hf`'s output) into an adapters directory, which `launch.train --init-from` trains on and
`launch.generate` runs. A LoRA checkpoint's base is made again from the directory the run began from and
checked against the fingerprint the run took of it (`launch.weights`). The mesh (default: fsdp over all
devices) only decides where the parameters live while converting. A mixture of experts' `router_aux_loss_coef`
is a training setting in meshpar (`train.router_aux_loss_coef`): `from-hf` prints the `--set` that trains with it.

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
    to_hf.add_argument("--merge-lora", action="store_true",
                       help="a LoRA run's checkpoint: write its adapters merged into the weights")
    to_peft = commands.add_parser("to-peft", help="a LoRA run's checkpoint → a PEFT adapter directory")
    to_peft.add_argument("--checkpoint", required=True, help="a LoRA run's checkpoint, or an adapters directory")
    to_peft.add_argument("--out", required=True, help="the adapter directory to write")
    to_peft.add_argument("--base", help="adapter_config.json's base_model_name_or_path (default: the Hugging Face "
                                        "directory the base was imported from)")
    to_peft.add_argument("--family", help="the base's model_type (default: as to-hf)")
    from_peft = commands.add_parser("from-peft", help="a PEFT adapter directory → a meshpar adapters directory")
    from_peft.add_argument("--peft-dir", required=True, help="holds adapter_config.json and adapter_model.safetensors")
    from_peft.add_argument("--base", required=True, help="the base model, as from-hf wrote it")
    from_peft.add_argument("--out", required=True, help="the adapters directory to write")
    for command in (from_hf, to_hf, to_peft, from_peft):
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
        convert = {"from-hf": from_hf, "to-hf": to_hf, "to-peft": to_peft, "from-peft": from_peft}[args.command]
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

    cfg, params, adapters = weights.load(args.checkpoint, mesh, rules, merge_lora=args.merge_lora)
    if adapters is not None:
        raise InputError(f"{args.checkpoint} holds LoRA adapters: --merge-lora writes them merged into the weights, "
                         f"and to-peft writes them as a PEFT adapter")
    hf.export(params, cfg, args.out, model_type=args.family or weights.source(args.checkpoint).get("model_type"))
    return cfg, param_count(params)


def to_peft(args: argparse.Namespace, mesh, rules):
    """--checkpoint's LoRA adapters → a PEFT directory at --out; (config, adapter parameter count)."""
    from launch import weights
    from meshpar import lora
    from models.hf import peft
    from meshpar.run import param_count

    cfg, params, adapters = weights.load(args.checkpoint, mesh, rules)
    if adapters is None:
        raise InputError(f"{args.checkpoint} holds no LoRA adapters (train.lora_rank = 0): to-hf writes its weights")
    origin = weights.source(args.checkpoint)
    base = args.base or origin.get("hf_dir")
    if base is None:
        raise InputError(f"{args.checkpoint}: its base was not imported from a Hugging Face directory; name the "
                         f"base model for adapter_config.json with --base")
    peft.export(params, cfg, adapters, args.out, base, args.family or origin.get("model_type"))
    return cfg, param_count(lora.adapters(params))


def from_peft(args: argparse.Namespace, mesh, rules):
    """--peft-dir's adapters over --base → an adapters directory at --out; (config, adapter parameter count)."""
    from launch import weights
    from meshpar import checkpoint
    from models.hf import peft
    from models.transformer import TransformerConfig
    from meshpar.run import param_count

    config = weights.saved_config(args.base)[0]
    cfg = TransformerConfig.from_dict(config["model"])
    model_type = weights.source(args.base).get("model_type")
    if model_type is None:
        raise InputError(f"--base {args.base} does not say which Hugging Face family it was imported from "
                         f"(launch.convert from-hf records it)")
    adapters, params = peft.import_adapters(args.peft_dir, cfg, model_type, mesh, rules)
    settings = {"lora_rank": adapters.rank, "lora_alpha": adapters.alpha, "lora_targets": ",".join(adapters.targets),
                "lora_rslora": adapters.rslora}
    checkpoint.export_params(args.out, params, config={"model": config["model"], "train": settings,
                                                        "init_from": str(Path(args.base).absolute())})
    return cfg, param_count(params)


if __name__ == "__main__":
    main()
