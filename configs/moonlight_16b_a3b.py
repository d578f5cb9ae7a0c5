"""Moonlight-16B-A3B: DeepSeek-V3's architecture, small. 16 latent-attention heads with the query direct (no
query latent), 1 dense layer then 26 of 64 experts (width 1,408) and two shared experts, sigmoid scores routed
to 6 and scaled by 2.446. 16.0B parameters, 3.0B of them active per token.

    python -m launch.train --config moonlight_16b_a3b --mesh expert=8,fsdp=-1 --set train.remat=full
    python -m launch.compile --config moonlight_16b_a3b --target h100 --devices 16 --mesh auto
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import LayerKind, TransformerConfig


def config() -> Config:
    return Config(
        name="moonlight_16b_a3b",
        model=TransformerConfig(
            vocab_size=163_840, d_model=2048, n_layers=27, n_heads=16, n_kv_heads=16, d_ff=11_264,
            max_seq_len=8192, rope_theta=50_000.0, norm_eps=1e-5,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_experts=64, experts_per_token=6, d_expert=1408, n_shared_experts=2, norm_topk_prob=True,
            router_score="sigmoid", routed_scaling=2.446, selection_bias=True,
            layer_prefix=(LayerKind(dense=True),)),
        train=TrainConfig(steps=10_000, global_batch=512, seq_len=8192, lr=4.2e-4, warmup_steps=500,
                          compute_dtype="bfloat16"),
    )
