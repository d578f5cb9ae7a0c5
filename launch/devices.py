"""Where a launch command runs, decided before JAX starts its backend: fake CPU devices, or the GPUs
with meshpar's XLA flags (`meshpar.gpu_flags`)."""

from __future__ import annotations

import os
import sys


def setup(cpu_devices: int | None, flag: str = "--cpu-devices") -> None:
    """`cpu_devices` fake CPU devices if given (exits with a one-line error naming `flag` below 1), else GPU
    flags."""
    import jax

    if cpu_devices is None:
        from meshpar import gpu_flags

        gpu_flags.apply()  # on GPUs only; the user's XLA_FLAGS win
        return
    if cpu_devices < 1:
        sys.exit(f"error: {flag} {cpu_devices}: must be >= 1")
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", cpu_devices)
