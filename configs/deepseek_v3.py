"""DeepSeek-V3 (and R1): its config.json's dimensions. Latent attention (128 heads; q through a 1,536 latent, K
and V from a 512 latent and a 64-dim rotary key shared by the heads; YaRN ×40 over 4k with its softmax mscale),
3 dense layers then 58 of 256 fine-grained experts (width 2,048) and one shared expert, sigmoid scores
routed to 8 experts within the best 4 of 8 groups, scaled by 2.5, balanced by the selection bias.
671B parameters, 37B of them active per token, and one multi-token prediction module (λ = 0.3, the paper's
first 10T tokens) that shares the embedding and the head: 685B with the copies of those two the checkpoint holds
(the model card's figures).

    python -m launch.train --config deepseek_v3 --mesh fsdp=16,expert=16 --set parallel.expert_capacity=1.25 \
        --set parallel.offload=optimizer --set train.remat=full --set train.grad_accum=8     # 256 GPUs
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python -m launch.compile --config deepseek_v3 --target h100 --hosts 32 \
        --mesh auto --top 1                                  # the planner's pick for 256 H100s, compiled
"""

from configs import Config
from meshpar.train import TrainConfig
from models.rope import RopeScaling, yarn_mscale
from models.transformer import LayerKind, TransformerConfig


MSCALE = yarn_mscale(40.0)  # YaRN's mscale for factor 40, mscale_all_dim 1: the softmax scale × its square


def config() -> Config:
    return Config(
        name="deepseek_v3",
        model=TransformerConfig(
            vocab_size=129_280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128, d_ff=18_432,
            max_seq_len=163_840, rope_theta=10_000.0, norm_eps=1e-6,
            rope_scaling=RopeScaling("yarn", 40.0, 4096, beta_fast=32.0, beta_slow=1.0, attention_factor=1.0),
            query_scale=192 / MSCALE**4,
            kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_experts=256, experts_per_token=8, d_expert=2048, n_shared_experts=1, norm_topk_prob=True,
            router_score="sigmoid", expert_groups=8, topk_groups=4, routed_scaling=2.5, selection_bias=True,
            layer_prefix=(LayerKind(dense=True),) * 3, mtp_depth=1),
        train=TrainConfig(steps=10_000, global_batch=2048, seq_len=4096, lr=2.2e-4, warmup_steps=2000,
                          compute_dtype="bfloat16"),
    )
