"""Kimi K2: DeepSeek-V3's architecture at 1T parameters (32B active). 64 latent-attention heads, 1 dense layer
then 60 of 384 experts (width 2,048) and one shared expert, sigmoid scores routed to 8 in one group, scaled
by 2.827; YaRN ×32 over 4k (its mscale 1 = mscale_all_dim: no softmax factor).

    python -m launch.train --config kimi_k2 --mesh stage=4,expert=32,fsdp=-1 --set train.remat=full \
        --set parallel.expert_capacity=1.25                  # 60 stacked layers: 2, 3, 4, 5, 6, 10 ... stages
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python -m launch.compile --config kimi_k2 --target h100 --hosts 64 \
        --mesh auto --top 1
"""

from configs import Config
from meshpar.train import TrainConfig
from models.rope import RopeScaling, yarn_mscale
from models.transformer import LayerKind, TransformerConfig

MSCALE = yarn_mscale(32.0)  # YaRN's mscale for factor 32, mscale_all_dim 1: the softmax scale × its square


def config() -> Config:
    return Config(
        name="kimi_k2",
        model=TransformerConfig(
            vocab_size=163_840, d_model=7168, n_layers=61, n_heads=64, n_kv_heads=64, d_ff=18_432,
            max_seq_len=131_072, rope_theta=50_000.0, norm_eps=1e-6,
            rope_scaling=RopeScaling("yarn", 32.0, 4096, beta_fast=1.0, beta_slow=1.0, attention_factor=1.0),
            query_scale=192 / MSCALE**4,
            kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_experts=384, experts_per_token=8, d_expert=2048, n_shared_experts=1, norm_topk_prob=True,
            router_score="sigmoid", routed_scaling=2.827, selection_bias=True,
            layer_prefix=(LayerKind(dense=True),)),
        train=TrainConfig(steps=10_000, global_batch=1920, seq_len=4096, lr=2e-4, warmup_steps=500,
                          compute_dtype="bfloat16"),
    )
