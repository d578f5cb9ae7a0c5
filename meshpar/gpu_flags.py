"""XLA flags for NVIDIA GPUs, set before JAX starts its backend; a flag in the user's XLA_FLAGS wins.

The set the best-tuned JAX GPU trainers use (MaxText's and Paxml's GPU recipes, NVIDIA's JAX-Toolbox):
what each does, and why a transformer step wants it, is beside it. XLA refuses an unknown flag at
start-up on every backend, so `tests/test_gpu.py` checks on CPU that this jaxlib knows each of them.
"""

from __future__ import annotations

import importlib.util
import os

FLAGS = {
    # Schedule collectives asynchronously and overlap them with independent compute (FSDP's gathers of
    # the next layer's weights behind this layer's matmuls, the gradient reduce-scatters behind the
    # backward pass) instead of waiting for each where it is issued.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Let the scheduler overlap across the layer scan's iterations: issue iteration i+1's all-gather and
    # finish iteration i−1's reduce-scatter while iteration i computes.
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # Unroll the layer loop by two with double-buffered carries, so that the pipelined collectives of
    # one iteration have a buffer to land in while the other computes.
    "xla_gpu_enable_while_loop_double_buffering": "true",
    # Combine small collectives (per-parameter gradients, norms) into few large ones: NCCL's bandwidth is
    # reached only at MBs per call. Thresholds in bytes.
    "xla_gpu_all_gather_combine_threshold_bytes": "134217728",
    "xla_gpu_reduce_scatter_combine_threshold_bytes": "134217728",
    "xla_gpu_all_reduce_combine_threshold_bytes": "134217728",
    # Combine gathers and reduce-scatters along any dimension together, not only those along the same one.
    "xla_gpu_enable_all_gather_combine_by_dim": "false",
    "xla_gpu_enable_reduce_scatter_combine_by_dim": "false",
    # Collectives on the highest-priority stream, so that compute kernels do not delay them.
    "xla_gpu_enable_highest_priority_async_stream": "true",
    # cuBLAS rather than Triton for the dense matmuls: faster for a transformer's large GEMMs.
    "xla_gpu_enable_triton_gemm": "false",
}


def merged(user_flags: str) -> str:
    """`user_flags` (an XLA_FLAGS value) with every flag of `FLAGS` that it does not set itself."""
    named = {item.split("=", 1)[0].lstrip("-") for item in user_flags.split()}
    ours = [f"--{name}={value}" for name, value in FLAGS.items() if name not in named]
    return " ".join([*ours, user_flags]).strip()


def cuda_installed() -> bool:
    """Whether JAX's CUDA plugin is installed (then JAX runs on GPUs unless told otherwise)."""
    return any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def apply() -> bool:
    """Add `FLAGS` to XLA_FLAGS when this process will run on GPUs; call it before JAX's backend starts.
    Returns whether it did."""
    if not cuda_installed() or os.environ.get("JAX_PLATFORMS", "") not in ("", "cuda", "gpu"):
        return False
    os.environ["XLA_FLAGS"] = merged(os.environ.get("XLA_FLAGS", ""))
    return True
