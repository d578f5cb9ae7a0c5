"""Qwen 2.5 7B: its config.json's dimensions, with the biases of q, k and v.

    python -m launch.convert from-hf --hf-dir Qwen2.5-7B --out runs/qwen2.5-7b --cpu-devices 8
    python -m launch.train --config qwen2_5_7b --init-from runs/qwen2.5-7b --mesh fsdp=8 \
        --set data.source=bin --set data.path=data/corpus.bin
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="qwen2_5_7b",
        model=TransformerConfig(vocab_size=152_064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, d_ff=18_944,
                                max_seq_len=131_072, rope_theta=1_000_000.0, norm_eps=1e-6, qkv_bias=True),
        train=TrainConfig(steps=10_000, global_batch=512, seq_len=8192, lr=3e-5, warmup_steps=100,
                          compute_dtype="bfloat16"),
    )
