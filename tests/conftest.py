"""Test setup: 8 fake CPU devices, set before JAX starts its backend, and one compilation cache per session.

Many tests compile the same program (one device's step, the tiny preset's FSDP step, ...), in this process,
in the other pytest-xdist worker, or in a subprocess: JAX's persistent compilation cache, in a directory made
for this session and handed on through the environment, compiles each once.
"""

import atexit
import importlib.util
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first pytest process makes it, and removes it at exit
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshpar-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# every program, not only those that take over a second: the tests' subprocesses compile the same small steps
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# XLA's GPU compiler needs jax's CUDA plugin and cuDNN's wheel, which `make test-gpu-compile` adds to .venv312;
# the other legs never download them.
if not (importlib.util.find_spec("jax_cuda12_plugin") and importlib.util.find_spec("nvidia.cudnn")):
    collect_ignore = ["test_gpu_compile.py", "test_gpu_fit.py"]


def require_devices(n: int) -> None:
    """Skip the calling test when fewer than `n` devices exist."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, {jax.device_count()} present")


# The README's compiler figures hold for the JAX releases CI runs: the main legs' 0.10 and the newest leg's
# 0.12. Where those compile other temp bytes, a cell gives both, "0.10's / 0.12's"; one number holds for both.
README_RELEASES = ("0.10", "0.12")
JAX_RELEASE = "%d.%d" % jax.__version_info__[:2]


def readme_figure(cell: str) -> float:
    """This JAX release's number in a README table cell ("23.20", or "23.20 / 16.38" per README_RELEASES),
    units and thousands separators dropped. A release the README does not state fails: measure it, and add it."""
    values = [float(value.split()[0].replace(",", "")) for value in cell.split("/")]
    if len(values) == 1:
        return values[0]
    assert len(values) == len(README_RELEASES), f"'{cell}': one value per release of {README_RELEASES}"
    assert JAX_RELEASE in README_RELEASES, f"the README states its compiler figures for JAX {README_RELEASES}, " \
                                           f"not {JAX_RELEASE}: measure them there and add them"
    return values[README_RELEASES.index(JAX_RELEASE)]


# pytest-xdist (`--dist loadfile --no-loadscope-reorder`) hands out whole files in collection order: the
# longest (measured) go first, so that none is left running alone at the end while the other worker idles.
LONGEST_FIRST = ("test_parallel.py", "test_readme.py", "test_fit.py", "test_faults.py", "test_hf_training.py",
                 "test_pipeline.py", "test_documents.py", "test_offload.py", "test_run.py", "test_pipeline_1f1b.py",
                 "test_checkpoint.py", "test_window.py", "test_attention.py", "test_train.py", "test_plan.py",
                 "test_own_model.py", "test_distributed.py", "test_hf.py", "test_hf_moe.py",
                 "test_generate.py", "test_flash.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
               else len(LONGEST_FIRST))  # a stable sort: the rest keep their order
