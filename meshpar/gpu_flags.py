"""XLA flags for NVIDIA GPUs: in XLA_FLAGS before JAX starts its backend on a GPU machine, or as the compile
options of a step compiled for a described GPU cluster (`meshpar.compiler.gpu`); a flag in the user's
XLA_FLAGS wins.

The set the best-tuned JAX GPU trainers use (MaxText's and Paxml's GPU recipes, NVIDIA's JAX-Toolbox):
what each does, and why a transformer step wants it, is beside it. XLA refuses an unknown flag at
start-up on every backend, so `tests/test_gpu.py` checks on CPU that this jaxlib knows each of them, and
`tests/test_gpu_compile.py` what each changes in the H100 program (README, "On GPUs").
"""

from __future__ import annotations

import importlib.util
import os

import jax

# XLA's enum for the collective pipeliner (jaxlib 0.11 and later; a boolean before, see _BEFORE_0_11).
PIPELINE_ON = "COLLECTIVE_PIPELINING_MODE_ON"

FLAGS: dict[str, bool | int | str] = {
    # Schedule collectives asynchronously and overlap them with independent compute (FSDP's gathers of
    # the next layer's weights behind this layer's matmuls, the gradient reduce-scatters behind the
    # backward pass) instead of waiting for each where it is issued.
    "xla_gpu_enable_latency_hiding_scheduler": True,
    # Let the scheduler overlap across the layer scan's iterations: issue iteration i+1's all-gather (FSDP)
    # and finish iteration i−1's all-reduce (DDP's gradients) while iteration i computes. (Its reduce-scatter
    # twin changed nothing in any meshpar program compiled for H100s, FSDP, ZeRO-2 or HSDP: not set.)
    "xla_gpu_pipeline_all_gather": PIPELINE_ON,
    "xla_gpu_pipeline_all_reduce": PIPELINE_ON,
    # Unroll the layer loop by two with double-buffered carries, so that the pipelined collectives of
    # one iteration have a buffer to land in while the other computes.
    "xla_gpu_enable_while_loop_double_buffering": True,
    # Combine small collectives (per-parameter gradients, norms) into few large ones: NCCL's bandwidth is
    # reached only at MBs per call. Thresholds in bytes.
    "xla_gpu_all_gather_combine_threshold_bytes": 134217728,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 134217728,
    "xla_gpu_all_reduce_combine_threshold_bytes": 134217728,
    # Combine gathers and reduce-scatters along any dimension together, not only those along the same one.
    "xla_gpu_enable_all_gather_combine_by_dim": False,
    "xla_gpu_enable_reduce_scatter_combine_by_dim": False,
    # Collectives on the highest-priority stream, so that compute kernels do not delay them.
    "xla_gpu_enable_highest_priority_async_stream": True,
    # cuBLAS rather than Triton for the dense matmuls: faster for a transformer's large GEMMs.
    "xla_gpu_enable_triton_gemm": False,
}

# jaxlib 0.10 names the collective pipeliner's switches as booleans; 0.11 made them enums of new names
# and keeps the old ones as flags that do nothing.
_BEFORE_0_11 = {"xla_gpu_pipeline_all_gather": "xla_gpu_enable_pipelined_all_gather",
                "xla_gpu_pipeline_all_reduce": "xla_gpu_enable_pipelined_all_reduce"}


def for_this_jaxlib(version: tuple[int, ...] | None = None) -> dict[str, bool | int | str]:
    """`FLAGS` under the names and value types of the running jaxlib (or of `version`)."""
    if (version or jax.__version_info__)[:2] >= (0, 11):
        return dict(FLAGS)
    return {_BEFORE_0_11.get(name, name): value == PIPELINE_ON if name in _BEFORE_0_11 else value
            for name, value in FLAGS.items()}


def _flag_text(value: bool | int | str) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).removeprefix("COLLECTIVE_PIPELINING_MODE_").lower()  # XLA_FLAGS spells enums short


def user_flags(xla_flags: str) -> dict[str, str]:
    """The flags an XLA_FLAGS value sets: name → value text."""
    return {name: value for name, _, value in (item.lstrip("-").partition("=") for item in xla_flags.split())}


def merged(xla_flags: str) -> str:
    """`xla_flags` (an XLA_FLAGS value) with every flag of `FLAGS` that it does not set itself."""
    named = user_flags(xla_flags)
    ours = [f"--{name}={_flag_text(value)}" for name, value in for_this_jaxlib().items() if name not in named]
    return " ".join([*ours, xla_flags]).strip()


def compile_options(xla_flags: str = "") -> dict[str, bool | int | str]:
    """`FLAGS` as the compile options of one compile (`Lowered.compile(compiler_options=...)`), less those
    `xla_flags` (the user's XLA_FLAGS) sets: XLA applies the environment's flags to every compile."""
    named = user_flags(xla_flags)
    return {name: value for name, value in for_this_jaxlib().items() if name not in named}


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
