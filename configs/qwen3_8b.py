"""Qwen 3 8B: its config.json's dimensions, with q/k norms and a head dim of 128.

    python -m launch.convert from-hf --hf-dir Qwen3-8B --out runs/qwen3-8b --cpu-devices 8
    python -m launch.train --config qwen3_8b --init-from runs/qwen3-8b --mesh fsdp=8 \
        --set data.source=bin --set data.path=data/corpus.bin
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="qwen3_8b",
        model=TransformerConfig(vocab_size=151_936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, d_ff=12_288,
                                max_seq_len=40_960, rope_theta=1_000_000.0, norm_eps=1e-6, head_dim=128,
                                qk_norm=True),
        train=TrainConfig(steps=10_000, global_batch=512, seq_len=8192, lr=3e-5, warmup_steps=100,
                          compute_dtype="bfloat16"),
    )
