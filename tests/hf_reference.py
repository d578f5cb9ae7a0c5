"""transformers (PyTorch) as the reference of the Hugging Face tests, run in this process or in another.

The tests reach torch and transformers only through `call`. Where torch is installed the functions run
here; where it is not (CI's newest-JAX leg: no CPU build of torch exists for its Python on this index),
in the interpreter MESHPAR_TORCH_PYTHON names (the main leg's venv, which has both), one subprocess per
call: arguments as JSON, the result as JSON with arrays as lists.

    python tests/hf_reference.py FUNCTION ARGS_JSON      # what `call` runs in the other interpreter
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np

HERE = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


def llama_config(fields: dict) -> dict:
    """A LlamaConfig's `config.json` dict, transformers' defaults for what `fields` leaves out."""
    import transformers

    return transformers.LlamaConfig(**fields).to_dict()


def save_random_llama(directory: str, config: dict, seed: int, dtype: str = "float32",
                      max_shard_size: str | None = None) -> None:
    """A LlamaForCausalLM with weights far from transformers' init (std 0.2 matrices, std 1 embeddings,
    norm scales in [0.5, 1.5]), so that attention, rotary positions and norm scales all shape the logits;
    saved as safetensors (sharded with an index when `max_shard_size` asks for it)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else 0.2)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))


def _load(directory: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def logits(directory: str, tokens: list) -> list:
    """transformers' float32 logits of the model in `directory` for int tokens [B, T]."""
    import torch

    with torch.no_grad():
        return _load(directory)(torch.tensor(tokens)).logits.float().numpy().tolist()


def greedy(directory: str, prompt: list, new_tokens: int) -> list:
    """transformers' greedy continuation of each prompt row: [B, new_tokens] token ids."""
    import torch

    with torch.no_grad():
        out = _load(directory).generate(torch.tensor(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                        do_sample=False)
    return out[:, len(prompt[0]):].numpy().tolist()


def describe(directory: str) -> dict:
    """What transformers makes of a checkpoint directory: its class and whether its embeddings are tied."""
    model = _load(directory)
    return {"class": type(model).__name__, "tied": bool(model.config.tie_word_embeddings)}


FUNCTIONS = {f.__name__: f for f in (llama_config, save_random_llama, logits, greedy, describe)}


def call(function: str, *args):
    """`FUNCTIONS[function](*args)`, here or in MESHPAR_TORCH_PYTHON (module docstring); lists come back as
    numpy arrays."""
    if HERE:
        result = FUNCTIONS[function](*args)
    else:
        python = os.environ.get("MESHPAR_TORCH_PYTHON")
        if not python:
            raise RuntimeError("the Hugging Face tests need torch and transformers: install them (pip install "
                               "torch==2.13.0 transformers), or set MESHPAR_TORCH_PYTHON to a Python that has them")
        proc = subprocess.run([python, __file__, function, json.dumps(args)], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if proc.returncode:
            raise RuntimeError(f"{function} in {python} failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.splitlines()[-1])
    return np.asarray(result) if isinstance(result, list) else result


if __name__ == "__main__":
    print(json.dumps(FUNCTIONS[sys.argv[1]](*json.loads(sys.argv[2]))))
