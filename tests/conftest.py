"""Test setup: 8 fake CPU devices, set before JAX starts its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def require_devices(n: int) -> None:
    """Skip the calling test when fewer than `n` devices exist."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, {jax.device_count()} present")
