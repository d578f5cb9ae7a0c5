"""Qwen3-30B-A3B: its config.json's dimensions (128 experts of width 768 in every layer, top-8 routing, the
chosen probabilities renormalised, q/k norms); 30.5B parameters, 3.3B of them active per token. `d_ff` is
the checkpoint's dense width, which no layer uses (every layer is a mixture).

    python -m launch.train --config qwen3_30b_a3b --mesh expert=8,fsdp=-1 --set train.remat=full
    python -m launch.compile --config qwen3_30b_a3b --devices 64 --mesh expert=8,fsdp=8 --set train.remat=full
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="qwen3_30b_a3b",
        model=TransformerConfig(vocab_size=151_936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, d_ff=6144,
                                max_seq_len=40_960, rope_theta=1_000_000.0, norm_eps=1e-6, head_dim=128,
                                qk_norm=True, n_experts=128, experts_per_token=8, d_expert=768,
                                norm_topk_prob=True),
        train=TrainConfig(steps=10_000, global_batch=512, seq_len=4096, lr=3e-5, warmup_steps=100,
                          compute_dtype="bfloat16"),
    )
