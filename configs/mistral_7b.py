"""Mistral 7B v0.3: its config.json's dimensions (no sliding window, vocabulary 32,768).

    python -m launch.convert from-hf --hf-dir Mistral-7B-v0.3 --out runs/mistral-7b --cpu-devices 8
    python -m launch.train --config mistral_7b --init-from runs/mistral-7b --mesh fsdp=8 \
        --set data.source=bin --set data.path=data/corpus.bin
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="mistral_7b",
        model=TransformerConfig(vocab_size=32_768, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14_336,
                                max_seq_len=32_768, rope_theta=1_000_000.0, norm_eps=1e-5),
        train=TrainConfig(steps=10_000, global_batch=512, seq_len=8192, lr=3e-5, warmup_steps=100,
                          compute_dtype="bfloat16"),
    )
