"""transformers (PyTorch) as the reference of the Hugging Face tests, run in this process or in another.

The tests reach torch and transformers only through `call`. Where torch is installed the functions run
here; where it is not (CI's newest-JAX leg: no CPU build of torch exists for its Python on this index),
in the interpreter MESHPAR_TORCH_PYTHON names (the main leg's venv, which has both), one subprocess per
call: arguments as JSON, the result as JSON with arrays as lists.

    python tests/hf_reference.py FUNCTION ARGS_JSON      # what `call` runs in the other interpreter
"""

import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np

HERE = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None

# The small random model of each family the tests check (transformers config fields): GQA (4 query, 2 kv
# heads), rope_theta and the norm epsilon off their defaults, and each family's options on. Heads, kv heads,
# d_ff and vocab divide by model=2, layers by stage=2. Fields left out take transformers' defaults, which
# are full-size ones: qwen3's head_dim is 128 and mistral's sliding_window 4096 unless given.
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5 / 3)
FAMILIES = {
    # Llama 3.1's RoPE scaling, over an original context of 16 so that T = 16..32 spans every band
    "llama": {**SMALL, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    # a head dim other than hidden / heads; a sliding window shorter than the test's sequences
    "mistral": {**SMALL, "sliding_window": 5, "head_dim": 32},
    # q, k, v biases; tied embeddings, as the small Qwen 2.5 models have; YaRN
    "qwen2": {**SMALL, "tie_word_embeddings": True,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    # q/k norms, a head dim of its own, linear scaling
    "qwen3": {**SMALL, "head_dim": 32, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    # Gemma 2's layer (GeGLU, (1 + w) norms around both sublayers, √D embeddings), tied; attention and final
    # logits soft-capped at values the scores and logits reach; four layers alternating a sliding window of 5
    # with full attention; a query scalar other than the head dim
    "gemma2": {**SMALL, "num_hidden_layers": 4, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 5,
               "layer_types": ["sliding_attention", "full_attention"] * 2, "attn_logit_softcapping": 2.0,
               "final_logit_softcapping": 10.0},
    # Gemma 3's layer (GeGLU, (1 + w) norms around both sublayers, √D embeddings, q/k norms), tied; four layers
    # alternating a sliding window of 5 (its own rotary base, unscaled) with full attention (linear scaling), a
    # query scalar other than the head dim
    "gemma3_text": {**SMALL, "num_hidden_layers": 4, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 5,
                    "layer_types": ["sliding_attention", "full_attention"] * 2,
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}},
}
# The mixtures of experts: 4 experts (expert=2 and expert=4 divide them), each token routed to 2 of width 64
# (model=2 divides it). Mixtral with a sliding window; Qwen3-MoE with q/k norms, its own head dim, and its
# top-2 probabilities renormalised (the tests also run it without: transformers' default); Qwen2-MoE with q/k/v
# biases, its top-2 as they are (its default) and a shared expert two experts wide, gated per token; gpt-oss
# with its layer (q/k/v/o biases, attention sinks, biased router and experts), four layers alternating a window of
# 4 with full attention, YaRN unrounded (truncate false), and its SwiGLU clamped at 1, which the gates reach.
MOE_FAMILIES = {
    "mixtral": {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
                "sliding_window": 8},
    "qwen3_moe": {**SMALL, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "norm_topk_prob": True},
    "qwen2_moe": {**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 128},
    "gpt_oss": {**SMALL, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 64, "head_dim": 32, "sliding_window": 4, "swiglu_limit": 1.0,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}},
}


def hf_config(model_type: str, fields: dict) -> dict:
    """The `config.json` dict of a `model_type` family (llama, qwen2, mistral, ...), from transformers' own
    config class for it: its defaults for what `fields` leaves out."""
    import transformers

    return transformers.AutoConfig.for_model(model_type, **fields).to_dict()


def save_random(directory: str, model_type: str, fields: dict, seed: int, dtype: str = "float32",
                max_shard_size: str | None = None) -> None:
    """A `model_type` causal LM (`AutoModelForCausalLM.from_config`) with weights far from transformers'
    init, so that attention, rotary positions, norm scales and biases all shape the logits: every parameter
    with "norm" in its name uniform in [0.5, 1.5], embeddings std 1, every other matrix and bias std 0.2, and
    DeepSeek's router selection biases (buffers) std 0.2; saved as safetensors in `dtype` (sharded with an index
    when `max_shard_size` asks for it)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied embedding is one parameter, listed once
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else 0.2)
        for name, b in model.named_buffers():  # DeepSeek's router selection bias, 0 at init, steers the routes
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))


def save_fp8_blocks(directory: str, out: str, block: int) -> None:
    """DeepSeek's FP8 checkpoint of the float32 one in `directory`, written to `out`: every linear layer's weight
    but the router's and the head (as DeepSeek-V3's) as float8 e4m3 in `block` × `block` blocks, each scaled by
    its amax / 448 (`<name>_scale_inv`), with config.json's quantization_config; `directory`'s weights are then
    replaced by the dequantised ones, so that transformers computes the model `out` holds."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{directory}/model.safetensors")
    quantised, dequantised = {}, {}
    for name, w in weights.items():
        if w.ndim != 2 or not name.endswith("proj.weight") and not name.endswith("_mqa.weight"):
            quantised[name] = dequantised[name] = w
            continue
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = torch.zeros(rows * block, cols * block)
        padded[:w.shape[0], :w.shape[1]] = w
        amax = padded.reshape(rows, block, cols, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = amax / 448.0
        expand = lambda x: x.repeat_interleave(block, 0).repeat_interleave(block, 1)[:w.shape[0], :w.shape[1]]
        codes = (w / expand(scale)).to(torch.float8_e4m3fn)
        quantised[name], quantised[name + "_scale_inv"] = codes, scale.contiguous()
        dequantised[name] = codes.float() * expand(scale)
    shutil.copytree(directory, out)
    save_file(quantised, f"{out}/model.safetensors", metadata={"format": "pt"})
    save_file(dequantised, f"{directory}/model.safetensors", metadata={"format": "pt"})
    config = json.loads(open(f"{out}/config.json").read())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    open(f"{out}/config.json", "w").write(json.dumps(config))


def _load(directory: str, adapter: str | None = None):
    """The model in `directory`, in float32; with `adapter`, PEFT's `PeftModel` of that LoRA adapter directory
    over it, the adapters trainable (and nothing else)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if adapter is None:
        return model
    import peft

    return peft.PeftModel.from_pretrained(model, adapter, is_trainable=True).eval()


def save_peft(directory: str, out: str, targets: list, rank: int, alpha: float, rslora: bool, seed: int) -> None:
    """A PEFT LoRA adapter (`peft.LoraConfig`) of the model in `directory` on the `targets` modules, written to
    `out`, its B matrices drawn non-zero (std 0.1; PEFT starts them at 0), so that the adapters shape the logits
    and the first step's gradients reach every A."""
    import peft
    import torch

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(_load(directory), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)


def logits(directory: str, tokens: list, adapter: str | None = None) -> list:
    """transformers' float32 logits of the model in `directory` (with a PEFT `adapter`) for int tokens [B, T]."""
    import torch

    with torch.no_grad():
        return _load(directory, adapter)(torch.tensor(tokens)).logits.float().numpy().tolist()


def mtp_logits(directory: str, tokens: list) -> list:
    """transformers' float32 logits [B, T, V] of the first multi-token prediction module (`MtpModel`: the
    checkpoint's layer n_layers) for int tokens [B, T + 1]: at position i (rotary position i) from the main
    model's last layer's output there, before its final norm (taken by a hook), and the token t_{i+1}."""
    import torch
    from transformers.modeling_layers import MtpModel

    model = _load(directory)
    # transformers finds the MTP layer by DeepSeek-V3's number, 61: point it at this checkpoint's
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{model.config.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(model).eval()
    inputs, captured = torch.tensor(tokens), []
    hook = model.model.layers[-1].register_forward_hook(
        lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        model(inputs[:, :-1])
        hook.remove()
        positions = torch.arange(inputs.shape[1] - 1)[None].expand(inputs.shape[0], -1)
        hidden = mtp.forward_layer(0, captured[0], positions, None, input_ids=inputs[:, 1:])
        return mtp._project_to_logits(hidden).float().numpy().tolist()


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


def learning_rate(step: int, settings: dict) -> float:
    """The learning rate of update `step` (0 first): linear warmup from lr / (warmup + 1) to lr over
    `warmup_steps`, then a cosine from lr to lr / 10 that ends at max(decay_steps or steps, warmup + 1)."""
    peak, warmup = settings["lr"], settings["warmup_steps"]
    first, end = peak / (warmup + 1), peak / 10
    total = max(settings["decay_steps"] or settings["steps"], warmup + 1)
    if step < warmup:
        return first + (peak - first) * step / warmup
    done = min(step - warmup, total - warmup) / (total - warmup)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * done))


def train_losses(directory: str, batches: list, settings: dict, masks: list | None = None,
                 adapter: str | None = None) -> list:
    """The loss of each step (before its update) of a plain PyTorch loop training the model in `directory`
    in float32 on `batches` (int tokens [steps][B, T + 1]): the mean cross-entropy of tokens[:, 1:] given
    tokens[:, :-1], from the logits (with `masks` [steps][B, T], 0 or 1 per target: the targets masked 0
    get label -100, which the mean leaves out, as transformers' fine-tuning does); clipping by the global
    norm as one multiply by min(1, clip_norm / norm);
    `torch.optim.AdamW` (betas 0.9, 0.95, eps 1e-8) at `learning_rate(step, settings)`, with weight decay on
    every parameter but those with "norm" or "bias" in their name. `settings`: lr, warmup_steps, steps,
    decay_steps, weight_decay, clip_norm; for a mixture of experts also router_aux_loss_coef, the weight of
    its load-balancing loss (`output_router_logits`), added as transformers' models add it to their loss, and
    optionally router_pools (`_loss`). With `adapter`, PEFT's LoRA model of it (`_load`): only the adapters
    train."""
    import torch

    model = _load(directory, adapter).train()
    step = _adamw(model, settings)
    losses = []
    for i, batch in enumerate(batches):
        tokens = torch.tensor(batch)
        labels = tokens[:, 1:] if masks is None else torch.where(torch.tensor(masks[i]) > 0, tokens[:, 1:], -100)
        loss = _loss(model, tokens[:, :-1], labels, settings.get("router_aux_loss_coef"),
                     settings.get("router_pools", 1))
        step(loss, i)
        losses.append(loss.item())
    return losses


def _adamw(model, settings: dict):
    """`(loss, step) → None`: backward, clipping by the global norm as one multiply by min(1, clip_norm / norm),
    then `torch.optim.AdamW` (betas 0.9, 0.95, eps 1e-8) at `learning_rate(step, settings)`, with weight decay on
    the trainable parameters but those with "norm" or "bias" in their name."""
    import torch

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # a tied embedding is one parameter
    plain = [p for n, p in named if "norm" in n or "bias" in n]
    decayed = [p for n, p in named if not ("norm" in n or "bias" in n)]
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": settings["weight_decay"]},
                             {"params": plain, "weight_decay": 0.0}], lr=settings["lr"], betas=(0.9, 0.95), eps=1e-8)

    def step(loss, i: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            grads = [p.grad for _, p in named if p.grad is not None]
            norm = torch.sqrt(sum((g * g).sum() for g in grads))
            scale = torch.clamp(settings["clip_norm"] / norm, max=1.0)
            for g in grads:
                g.mul_(scale)
        for group in opt.param_groups:
            group["lr"] = learning_rate(i, settings)
        opt.step()

    return step


def dpo_steps(directory: str, batches: list, masks: list, settings: dict, adapter: str | None = None) -> list:
    """The DPO loss and TRL's metrics of each step (before its update) of a PyTorch loop training the model in
    `directory` (with `adapter`: PEFT's LoRA model, its reference the base with the adapters disabled, as TRL
    takes it; without: every weight, its reference a frozen copy of the starting model) on `batches` of pairs
    (rows 2i chosen, 2i + 1 rejected; [steps][B, T + 1]) whose `masks` [steps][B, T] mark the response targets.
    A sequence's log-probability is the sum of its response targets' (TRL's `selective_log_softmax` of
    transformers' logits); the loss −log σ(β·((π_c − ref_c) − (π_r − ref_r))) averaged over the pairs and the
    metrics are TRL `DPOTrainer._compute_loss`'s (its sigmoid loss); `settings` as `train_losses`' and beta.
    TRL 1.x computes its loss inside that method, so this loop, not its trainer, is the reference."""
    import torch
    from trl.trainer.utils import selective_log_softmax

    model = _load(directory, adapter).train()
    reference = None if adapter else _load(directory)
    step, beta, out = _adamw(model, settings), settings["beta"], []

    def logps(m, tokens, mask):
        logp = selective_log_softmax(m(input_ids=tokens[:, :-1]).logits.float(), tokens[:, 1:])
        return (logp * mask).sum(dim=1)

    for i, batch in enumerate(batches):
        tokens, mask = torch.tensor(batch), torch.tensor(masks[i], dtype=torch.float32)
        policy = logps(model, tokens, mask)
        with torch.no_grad():
            if reference is None:
                with model.disable_adapter():
                    ref = logps(model, tokens, mask)
            else:
                ref = logps(reference, tokens, mask)
        chosen, rejected = beta * (policy[0::2] - ref[0::2]), beta * (policy[1::2] - ref[1::2])
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
        out.append({"loss": loss.item(), "rewards/chosen": chosen.mean().item(),
                    "rewards/rejected": rejected.mean().item(), "rewards/margins": (chosen - rejected).mean().item(),
                    "rewards/accuracies": (chosen > rejected).float().mean().item(),
                    "logps/chosen": policy[0::2].mean().item(), "logps/rejected": policy[1::2].mean().item()})
        step(loss, i)
    return out


def _loss(model, inputs, labels, aux_coef: float | None, pools: int = 1):
    """The mean cross-entropy of `labels` (-100: left out) given `inputs`, plus `aux_coef` × the load-balancing
    loss of a mixture of experts (None: no router loss): transformers' over the batch, or with `pools` > 1
    the mean of its function over each pipeline microbatch's rows (m, pools + m, …), as Megatron pools it."""
    import torch

    out = model(input_ids=inputs, **({"output_router_logits": True} if aux_coef is not None else {}))
    logits = out.logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100)
    if aux_coef is None:
        return loss
    if pools == 1:
        return loss + aux_coef * out.aux_loss
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    rows = [layer.reshape(inputs.shape[0], -1, layer.shape[-1]) for layer in out.router_logits]  # [B, T, E] each
    pooled = [balance(tuple(layer[m::pools].reshape(-1, layer.shape[-1]) for layer in rows), model.num_experts,
                      model.num_experts_per_tok) for m in range(pools)]
    return loss + aux_coef * sum(pooled) / pools


def save_gradients(directory: str, tokens: list, aux_coef: float | None, out_dir: str,
                   adapter: str | None = None) -> float:
    """The loss of the model in `directory` on int tokens [B, T + 1] as `train_losses` takes a step's (no
    update), float32; its gradient, in place of each parameter, saved in `out_dir` as the model's own
    checkpoint would be (save_pretrained: the Hub's tensor names and layouts, the experts one by one). With
    `adapter`, PEFT's LoRA model of it (`_load`): the adapters' gradients, saved as PEFT saves adapters."""
    import torch

    model = _load(directory, adapter).train()
    tokens = torch.tensor(tokens)
    loss = _loss(model, tokens[:, :-1], tokens[:, 1:], aux_coef)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # a LoRA model's base is frozen
                p.copy_(p.grad)
    model.save_pretrained(out_dir)
    return loss.item()


def save_mxfp4(directory: str, packed_dir: str, dequantized_dir: str, seed: int) -> None:
    """The gpt-oss checkpoint in `directory` with random MXFP4 experts, as the Hub's hold them: in `packed_dir`
    each `mlp.experts.{gate_up,down}_proj` as `_blocks` (uint8 [E, out, in / 32, 16]) and `_scales` (uint8
    [E, out, in / 32], exponents 2^-6 … 2^-4: weights of the others' size) with config.json's
    `quantization_config`; in `dequantized_dir` the same weights as transformers' own
    `convert_moe_packed_tensors` dequantises them, float32."""
    import shutil

    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(seed)
    tensors = load_file(f"{directory}/model.safetensors")
    packed, dequantized = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, inputs, outputs = w.shape
            blocks = rng.integers(0, 256, (E, outputs, inputs // 32, 16), dtype=np.uint8)
            scales = rng.integers(121, 124, (E, outputs, inputs // 32), dtype=np.uint8)
            del packed[name]
            packed |= {name + "_blocks": blocks, name + "_scales": scales}
            dequantized[name] = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                                           dtype=torch.float32).numpy()
    config = json.loads(open(f"{directory}/config.json").read())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    for out, weights in ((packed_dir, packed), (dequantized_dir, dequantized)):
        os.makedirs(out, exist_ok=True)
        save_file(weights, f"{out}/model.safetensors", metadata={"format": "pt"})
        shutil.copy(f"{directory}/config.json", f"{out}/config.json")
    with open(f"{packed_dir}/config.json", "w") as f:
        json.dump(config, f, indent=2)


FUNCTIONS = {f.__name__: f for f in (hf_config, save_random, train_losses, save_gradients, logits, mtp_logits, greedy,
                                     describe, save_mxfp4, save_fp8_blocks, save_peft, dpo_steps)}


@contextlib.contextmanager
def _one_thread():
    """torch on one thread while a reference function runs. These models are tiny, and beside JAX's threads
    and a second test worker torch's pool mostly waits: 20 training steps of the test model took 0.7-8.6 s on
    2 busy cores with 2 threads, 0.15 s with one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def call(function: str, *args):
    """`FUNCTIONS[function](*args)`, here or in MESHPAR_TORCH_PYTHON (module docstring); lists come back as
    numpy arrays."""
    if HERE:
        with _one_thread():
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
    with _one_thread():
        print(json.dumps(FUNCTIONS[sys.argv[1]](*json.loads(sys.argv[2]))))
