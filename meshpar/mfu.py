"""Model FLOPs utilisation: the model's FLOPs per token × tokens/s over the devices' peak FLOP/s.

FLOPs per token are PaLM's (Chowdhery et al., arXiv:2204.02311, App. B): 6Ψ + 12·L·N·H·T, Ψ the
parameters that enter a matmul (all but the embedding lookup and the norm scales), L layers, N heads, H
head dim, T the sequence (PaLM's 6N + 12·L·H·Q·T in its letters): the full attention square, not halved
for the causal mask, the convention MFU is reported in. The peak per device (`device_peak`) is, in this
order: what the user gives (`--peak-tflops`); on a GPU, the hardware table (`meshpar.hardware`) for the
device's kind and the compute dtype; on a CPU, a matmul probe measured once: the FLOP/s of a float32
matmul on the process's first device, shared among the process's fake devices (they run on the same cores).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from meshpar.hardware import for_device_kind

PROBE_SIZE = 1024  # the CPU probe's square matmul: large enough to use every core, well under a second


def palm_flops_per_token(matmul_params: float, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    """Model FLOPs per token, PaLM App. B: 6Ψ + 12·L·N·H·T."""
    return 6 * matmul_params + 12 * layers * heads * head_dim * seq_len


def mfu(flops_per_token: float, tokens_per_s: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation (PaLM §4.1): achieved model FLOP/s over the devices' peak FLOP/s."""
    return flops_per_token * tokens_per_s / (devices * peak_flops)


def device_peak(compute_dtype_bytes: int, given_tflops: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s per device, where it comes from); None where meshpar cannot know it."""
    if given_tflops:
        return given_tflops * 1e12, "given"
    device = jax.local_devices()[0]
    if device.platform == "gpu":
        hardware = for_device_kind(device.device_kind)
        if hardware is not None:
            return hardware.peak(compute_dtype_bytes), f"{hardware.name} datasheet"
        return None, f"unknown GPU '{device.device_kind}' (give --peak-tflops)"
    if device.platform == "cpu":
        return _probe(device) / jax.local_device_count(), "matmul probe"
    return None, f"no peak known for {device.platform} (give --peak-tflops)"


@functools.cache
def _probe(device: jax.Device) -> float:
    x = jax.device_put(jnp.ones((PROBE_SIZE, PROBE_SIZE), jnp.float32), device)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - began)
    return 2 * PROBE_SIZE**3 / best
