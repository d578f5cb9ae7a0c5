"""A mixture of experts that trains in seconds on CPU: 8 experts, top-2, so `expert` can take 2, 4 or 8 devices.

    python -m launch.train --config tiny_moe --cpu-devices 8 --mesh data=2,expert=4
"""

from configs import Config
from meshpar.mesh import MeshConfig
from meshpar.train import TrainConfig
from models.transformer import TransformerConfig


def config() -> Config:
    return Config(
        name="tiny_moe",
        model=TransformerConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=512,
                                max_seq_len=1024, n_experts=8, experts_per_token=2, d_expert=256),
        train=TrainConfig(steps=100, global_batch=16, seq_len=128, lr=3e-3, warmup_steps=10),
        mesh=MeshConfig(expert=-1),  # the experts and the batch over every device unless --mesh says otherwise
    )
