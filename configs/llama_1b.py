"""Llama 3.2 1B's shape (tied embeddings, 8 kv heads); for GPUs and planning.

    python -m launch.train --config llama_1b --mesh fsdp=-1 --set train.compute_dtype=bfloat16
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="llama_1b",
        model=TransformerConfig(vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                d_ff=8192, max_seq_len=8192, tie_embeddings=True, rope_theta=500_000.0),
        train=TrainConfig(steps=10_000, global_batch=256, seq_len=4096, lr=3e-4, warmup_steps=500,
                          compute_dtype="bfloat16"),
    )
