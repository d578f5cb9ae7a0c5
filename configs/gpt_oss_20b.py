"""gpt-oss-20b: its config.json's dimensions. 24 layers alternating a sliding window of 128 keys with full
attention (12 periods); 64 query heads of 64 and 8 kv heads, biases on q, k, v and o, a sink logit per head;
32 experts of width 2,880 in every layer, top-4, a router and experts with biases and the clamped SwiGLU;
YaRN ×32 over 4,096 positions, unrounded; 20.9B parameters, 3.6B of them active per token. `d_ff` is the
checkpoint's `intermediate_size`, which is the experts' width (no layer is dense).

    python -m launch.convert from-hf --hf-dir gpt-oss-20b --out runs/gpt-oss-20b --cpu-devices 8
    python -m launch.train --config gpt_oss_20b --init-from runs/gpt-oss-20b --mesh fsdp=8 \
        --set parallel.expert_capacity=1.25 --set parallel.offload=optimizer \
        --set data.source=bin --set data.path=data/corpus.bin
    python -m launch.compile --config gpt_oss_20b --target h100 --devices-per-host 8 --mesh fsdp=8 \
        --set train.global_batch=8 --set parallel.expert_capacity=1.25 --set parallel.offload=optimizer
"""

from configs import Config
from meshpar.train import TrainConfig
from models.rope import RopeScaling
from models.transformer import LayerKind, TransformerConfig


def config() -> Config:
    return Config(
        name="gpt_oss_20b",
        model=TransformerConfig(vocab_size=201_088, d_model=2880, n_layers=24, n_heads=64, n_kv_heads=8, d_ff=2880,
                                max_seq_len=131_072, rope_theta=150_000.0,
                                rope_scaling=RopeScaling("yarn", 32.0, 4096, truncate=False), norm_eps=1e-5,
                                head_dim=64, qkv_bias=True, o_bias=True, attn_sinks=True,
                                mlp_activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=7.0,
                                n_experts=32, experts_per_token=4, moe_bias=True,
                                layer_pattern=(LayerKind(window=128), LayerKind())),
        train=TrainConfig(steps=10_000, global_batch=512, seq_len=8192, lr=3e-5, warmup_steps=100,
                          compute_dtype="bfloat16"),
    )
