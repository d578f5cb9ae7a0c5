"""Gemma 3 12B (its text decoder): its config.json's dimensions. Five sliding-window layers (1,024 keys, rotary
base 10,000) to one global layer (base 1,000,000, linear scaling ×8), 48 layers in 8 periods; GeGLU, (1 + w)
norms around both sublayers, q/k norms, √D embeddings, tied; 11.77B parameters.

    python -m launch.convert from-hf --hf-dir gemma-3-12b --out runs/gemma3-12b --cpu-devices 8
    python -m launch.train --config gemma3_12b --init-from runs/gemma3-12b --mesh fsdp=8 \
        --set data.source=bin --set data.path=data/corpus.bin
    python -m launch.compile --config gemma3_12b --target h100 --devices-per-host 8 --mesh fsdp=8 \
        --set train.global_batch=8
"""

from configs import Config
from meshpar.train import TrainConfig
from models.rope import RopeScaling
from models.transformer import LayerKind, TransformerConfig

LOCAL = LayerKind(window=1024, rope_theta=10_000.0, rope_scaling=RopeScaling())


def config() -> Config:
    return Config(
        name="gemma3_12b",
        model=TransformerConfig(vocab_size=262_208, d_model=3840, n_layers=48, n_heads=16, n_kv_heads=8, d_ff=15_360,
                                max_seq_len=131_072, tie_embeddings=True, rope_theta=1_000_000.0,
                                rope_scaling=RopeScaling("linear", 8.0), norm_eps=1e-6, norm_plus_one=True,
                                sandwich_norms=True, embed_scale=True, mlp_activation="gelu_tanh", head_dim=256,
                                qk_norm=True, layer_pattern=(LOCAL,) * 5 + (LayerKind(),)),
        train=TrainConfig(steps=10_000, global_batch=512, seq_len=8192, lr=3e-5, warmup_steps=100,
                          compute_dtype="bfloat16"),
    )
