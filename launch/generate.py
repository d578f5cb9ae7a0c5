"""Generate text from a checkpoint (a training run's, or parameters from `launch.convert`).

    python -m launch.generate --checkpoint runs/ckpt --prompt "def main(" --max-new-tokens 64
    python -m launch.generate --checkpoint runs/llama --tokenizer tokenizer.json --prompt "Once upon" \
        --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1 --mesh fsdp=2,model=4 --cpu-devices 8 --json
    python -m launch.generate --checkpoint runs/lora --prompt "def main(" --merge-lora

Greedy unless --temperature > 0. Without --tokenizer, text is bytes (the built-in corpus's tokens: ids
0..255 are the UTF-8 bytes). With --tokenizer (a model directory's tokenizer.json, `launch.tokenizer`), the
prompt is encoded as transformers' tokenizer encodes it (with the family's BOS, if it has one), generation
stops at the first EOS (an id of generation_config.json's eos_token_id, else the tokenizer's EOS:
tokenizer_config.json's eos_token) and the text is printed without special tokens. A LoRA run's checkpoint
(or an adapters directory) runs with its adapters beside the base, or with `--merge-lora` folded into it. `--json` prints
{"ids": [...], "text": ...}: the new tokens, the EOS included.
"""

from __future__ import annotations

import argparse
import json
import sys

from launch import tokenizer
from meshpar.errors import InputError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.generate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory, or a parameters directory")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of probability >= p")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json to encode the prompt and decode the output, "
                                       "with the config files beside it (default: bytes)")
    p.add_argument("--mesh", help="axis sizes (data, fsdp, expert, model), e.g. fsdp=2,model=4 (default: fsdp "
                                  "over all devices)")
    p.add_argument("--cpu-devices", type=int, help="run on this many fake CPU devices")
    p.add_argument("--json", action="store_true", help='print {"ids": [...], "text": ...}')
    p.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into the weights first")
    return p.parse_args(argv)


class ByteCodec:
    """The built-in corpus's tokens: UTF-8 bytes."""

    stop_ids = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def prompt_ids(args: argparse.Namespace, codec) -> list[int]:
    if args.prompt is not None:
        return codec.encode(args.prompt)
    try:
        return [int(i) for i in args.prompt_ids.split(",")]
    except ValueError:
        raise InputError(f"--prompt-ids '{args.prompt_ids}': expected comma-separated integers") from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from launch import devices

    devices.setup(args.cpu_devices)  # before JAX starts a backend

    from flax import nnx

    from launch import weights
    from meshpar import generate, mesh as mesh_lib, rules as rules_lib
    from models.transformer import Transformer

    try:
        codec = tokenizer.load(args.tokenizer) if args.tokenizer else ByteCodec()
        ids = prompt_ids(args, codec)
        sampling = generate.Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        mesh = mesh_lib.build(mesh_lib.parse(args.mesh) if args.mesh else mesh_lib.MeshConfig(fsdp=-1))
        rules = rules_lib.make()
        cfg, params, adapters = weights.load(args.checkpoint, mesh, rules, merge_lora=args.merge_lora)
        graphdef, _ = Transformer.abstract(cfg, adapters)
        new = generate.generate(nnx.merge(graphdef, params), [ids], args.max_new_tokens, mesh, rules, sampling,
                                codec.stop_ids)
    except InputError as err:
        sys.exit(f"error: {err}")
    new_ids = new[0].tolist()
    text = codec.decode(new_ids)
    print(json.dumps({"ids": new_ids, "text": text}) if args.json else text)


if __name__ == "__main__":
    main()
