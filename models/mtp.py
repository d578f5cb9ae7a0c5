"""Multi-token prediction (DeepSeek-V3 §2.2): `model.mtp_depth` = D modules after the stack, module k
predicting the token k + 1 places ahead of the main model's next one.

Module k (1 … D) at position i combines the previous depth's representation h^{k-1}_i (h^0: the stack's
output BEFORE the final norm, as Megatron-Core takes it) with the embedding of token t_{i+k}:

    h'_i = [RMSNorm_e(Emb(t_{i+k})), RMSNorm_h(h^{k-1}_i)] · W_proj      (W_proj [2D, D], the embedding first)
    h^k  = Block_k(h')                                                   (one block of the model's kind)
    out  = RMSNorm_k(h^k)                                                (its own final norm)

and the shared output head turns `out` into logits for t_{i+k+1}; the embedding is the main model's too.
The D modules stack on a leading logical axis of their own, `mtp_layers` (whole on every device, as no rule
splits it; every other dimension is laid out as the stack's blocks are), and run as one `lax.scan`, the
representation carried from depth to depth. The loss (`meshpar.loss`) builds each depth's shifted tokens,
targets and weights; generation never runs these modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar import context, lora, moe, remat
from meshpar.sharding import constrain, gathered
from models import transformer as base


class Depth(nnx.Module):
    """One MTP module: `enorm`, `hnorm`, `proj_CD` (C = 2D: the two normed inputs side by side), `block` and
    `final_norm` (module docstring)."""

    def __init__(self, cfg: base.TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs,
                 adapters: lora.LoraConfig | None = None):
        self.enorm, self.hnorm, self.final_norm = (base.RMSNorm(cfg, dtype) for _ in range(3))
        # C whole on every device (D split over fsdp at rest, as `embed` is): with C over `model`, XLA:CPU's
        # partitioner gave other weights wrong gradients under data × fsdp × model with accumulation
        self.proj_CD = base.param(rngs, (2 * cfg.d_model, cfg.d_model), (None, "embed"), (2 * cfg.d_model) ** -0.5)
        kind = cfg.kinds[-1]  # the kind of the stack's last layer (DeepSeek-V3: experts)
        self.block = base.Block(cfg, dtype, rngs, kind, adapters)
        self.dtype, self.routed = dtype, bool(cfg.n_experts)

    def __call__(self, h_BTD: jax.Array, e_BTD: jax.Array, positions: jax.Array, segments_BT: jax.Array | None,
                 stats: moe.RouterStats | None) -> tuple[jax.Array, jax.Array, moe.RouterStats | None]:
        """(h^k, its final norm's output, the router statistics with this block's added) from h^{k-1} and the
        embeddings e of the tokens k ahead."""
        x_BTC = jnp.concatenate([self.enorm(e_BTD), self.hnorm(h_BTD)], axis=-1)
        x_BTD = constrain(jnp.einsum("btc,cd->btd", x_BTC, gathered(self.proj_CD, self.dtype, matmul=True)),
                          base.RESIDUAL)
        carry = self.block((x_BTD, stats) if self.routed else x_BTD, positions, segments_BT)
        h_BTD, stats = carry if self.routed else (carry, stats)
        return h_BTD, self.final_norm(h_BTD), stats


def stack(cfg: base.TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs,
          adapters: lora.LoraConfig | None = None) -> Depth:
    """The D modules, stacked on `mtp_layers`."""
    return base.stack_of(lambda r: Depth(cfg, dtype, r, adapters), cfg.mtp_depth, "mtp_layers")(rngs)


def hidden_states(depths: Depth, h_BTD: jax.Array, e_KBTD: jax.Array, positions: jax.Array,
                  segments_BT: jax.Array | None, stats: moe.RouterStats | None
                  ) -> tuple[jax.Array, moe.RouterStats | None]:
    """The D modules' final-norm outputs [K, B, T, D] (K = D depths) from the stack's output h^0 and the
    embeddings of each depth's tokens `e_KBTD`, and the router statistics with theirs added."""
    graphdef, stacked = nnx.split(depths)

    def one_depth(carry, inputs):
        h_BTD, stats = carry
        depth, e_BTD = inputs
        h_BTD, out_BTD, stats = nnx.merge(graphdef, depth)(h_BTD, e_BTD, positions, segments_BT, stats)
        return (h_BTD, stats), out_BTD

    compute = context.active()
    if compute is not None and compute.remat != "none":  # as the stack's layers are
        one_depth = jax.checkpoint(one_depth, policy=remat.policy(compute.remat), prevent_cse=False)
    (_, stats), out_KBTD = jax.lax.scan(one_depth, (h_BTD, stats), (stacked, e_KBTD))
    return out_KBTD, stats
