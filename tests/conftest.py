"""Test setup: 8 fake CPU devices, set before JAX starts its backend, and one compilation cache per session.

Many tests compile the same program (one device's step, the tiny preset's FSDP step, ...), in this process,
in the other pytest-xdist worker, or in a subprocess: JAX's persistent compilation cache, in a directory made
for this session and handed on through the environment, compiles each once.
"""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="meshpar-tests-jax-cache-"))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def require_devices(n: int) -> None:
    """Skip the calling test when fewer than `n` devices exist."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, {jax.device_count()} present")
