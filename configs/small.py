"""About 124M parameters (GPT-2 small's shape, Llama-style blocks, tied embeddings).

    python -m launch.train --config small --cpu-devices 8 --mesh fsdp=8 --steps 20
"""

from configs import Config
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="small",
        model=TransformerConfig(vocab_size=50_304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=2048,
                                max_seq_len=1024, tie_embeddings=True),
        train=TrainConfig(steps=1000, global_batch=32, seq_len=512, lr=6e-4, warmup_steps=100),
    )
