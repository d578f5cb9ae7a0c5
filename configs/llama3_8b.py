"""Llama 3.1 8B: its config.json's dimensions, with Llama 3.1's RoPE scaling (factor 8 over an 8,192 context).

    python -m launch.convert from-hf --hf-dir Llama-3.1-8B --out runs/llama3-8b --cpu-devices 8
    python -m launch.train --config llama3_8b --init-from runs/llama3-8b --mesh fsdp=8 \
        --set data.source=bin --set data.path=data/corpus.bin
"""

from configs import Config
from meshpar.train import TrainConfig
from models.rope import RopeScaling
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="llama3_8b",
        model=TransformerConfig(vocab_size=128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14_336,
                                max_seq_len=131_072, rope_theta=500_000.0, norm_eps=1e-5,
                                rope_scaling=RopeScaling("llama3", factor=8.0, original_max_seq_len=8192,
                                                         low_freq_factor=1.0, high_freq_factor=4.0)),
        train=TrainConfig(steps=10_000, global_batch=512, seq_len=8192, lr=3e-5, warmup_steps=100,
                          compute_dtype="bfloat16"),
    )
