"""Llama 3 8B's shape; for multi-GPU runs and planning.

    python -m launch.train --config llama_8b --mesh data=-1,fsdp=8 --set train.compute_dtype=bfloat16
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="llama_8b",
        model=TransformerConfig(vocab_size=128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                d_ff=14_336, max_seq_len=8192, rope_theta=500_000.0),
        train=TrainConfig(steps=10_000, global_batch=512, seq_len=8192, lr=3e-4, warmup_steps=2000,
                          compute_dtype="bfloat16"),
    )
