"""Llama 3 70B's shape; for clusters and planning.

    python -m launch.train --config llama_70b --mesh data=-1,fsdp=8,model=8 --set train.compute_dtype=bfloat16
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="llama_70b",
        model=TransformerConfig(vocab_size=128_256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                d_ff=28_672, max_seq_len=8192, rope_theta=500_000.0),
        train=TrainConfig(steps=10_000, global_batch=1024, seq_len=8192, lr=1.5e-4, warmup_steps=2000,
                          compute_dtype="bfloat16"),
    )
