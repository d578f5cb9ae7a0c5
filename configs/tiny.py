"""Trains in seconds on CPU; heads divisible by 8 so every mesh of 8 devices can split them.

    python -m launch.train --config tiny --cpu-devices 8 --mesh fsdp=8
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="tiny",
        model=TransformerConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=512,
                                max_seq_len=1024),
        train=TrainConfig(steps=100, global_batch=16, seq_len=128, lr=3e-3, warmup_steps=10),
    )
