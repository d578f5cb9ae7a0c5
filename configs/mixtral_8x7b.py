"""Mixtral 8x7B: its config.json's dimensions (8 experts of width 14,336 in every layer, top-2 routing);
46.7B parameters, 12.9B of them active per token.

    python -m launch.train --config mixtral_8x7b --mesh expert=8,fsdp=-1 --set train.remat=full
    python -m launch.compile --config mixtral_8x7b --devices 64 --mesh expert=8,fsdp=8 --set train.remat=full
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="mixtral_8x7b",
        model=TransformerConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14_336,
                                max_seq_len=32_768, rope_theta=1_000_000.0, norm_eps=1e-5, n_experts=8,
                                experts_per_token=2, norm_topk_prob=True),
        train=TrainConfig(steps=10_000, global_batch=512, seq_len=4096, lr=3e-5, warmup_steps=100,
                          compute_dtype="bfloat16"),
    )
