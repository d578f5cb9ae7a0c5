"""Test setup: 8 fake CPU devices, set before JAX starts its backend; XLA:CPU told to compile for speed; and
compiled programs kept in one folder outside the checkout that every run on this machine shares.

Compiling is what the suite spends its time on, and many tests compile the same program (one device's step,
the tiny preset's FSDP step, ...), in this process, in the other pytest-xdist worker, in a subprocess or in
an earlier run (CI's clean clone included). So:
- JAX's persistent compilation cache lives in `$MESHPAR_TEST_CACHE/jax` (default `~/.cache/meshpar-tests`),
  handed to subprocesses through the environment, and bounded to `CACHE_BYTES`: a run starts by evicting the
  least recently used programs past it (JAX's own eviction, on every write, scans the folder under a lock:
  minutes of a run). JAX's key is the lowered program with the compile options, XLA_FLAGS, the devices and the
  jax and jaxlib versions: a program changed in any way compiles anew (tests/test_compile_cache.py).
- Programs compiled for a described GPU cluster, which JAX's cache cannot hold, go to meshpar's own store of
  GPU programs (`meshpar.compiler.program_store`) in `$MESHPAR_TEST_CACHE/gpu-programs`.
- Where the environment sets no XLA_FLAGS, XLA:CPU compiles without LLVM's optimisation of the generated code
  (and, on jaxlib 0.10, with the emitters from before its fusion emitters): the same HLO, the same losses to
  float32's rounding, compiled 2-5× faster, run about 2× slower (`FAST_CPU_COMPILE`). The fusion emitters decide
  which updates are in place: the memory figures of compile-only checks pin them on
  (`meshpar.compiler.fit.DEFAULT_EMITTERS`); a subprocess that trains for hundreds of steps takes XLA's own
  settings (`long_run_env`); the GPU leg sets XLA_FLAGS to compile as users do.
Each run ends with one line of what the cache served: hits, misses and the seconds XLA spent compiling.
"""

import collections
import gc
import importlib.metadata
import importlib.util
import os
from pathlib import Path

CACHE = Path(os.environ.get("MESHPAR_TEST_CACHE") or Path.home() / ".cache" / "meshpar-tests")
CACHE_BYTES = 2 << 30  # a whole CI run writes about 0.2 GiB
JAXLIB = tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])
FAST_CPU_COMPILE = ["--xla_backend_optimization_level=0"] + (["--xla_cpu_use_fusion_emitters=false"]
                                                             if JAXLIB < (0, 11) else [])  # 0.11 removed the flag

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE / "jax"))
# every program, not only those that take over a second: the tests' subprocesses compile the same small steps
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("MESHPAR_GPU_PROGRAM_CACHE", str(CACHE / "gpu-programs"))
os.environ.setdefault("XLA_FLAGS", " ".join(FAST_CPU_COMPILE))

import jax  # noqa: E402
import pytest  # noqa: E402
from jax import monitoring  # noqa: E402

from meshpar.compiler import program_store  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# XLA's GPU compiler needs jax's CUDA plugin and cuDNN's wheel, which `make test-gpu-compile` adds to .venv312;
# the other legs never download them, and run what needs no GPU compiler (test_gpu_cluster.py). The run's
# header says which files it leaves out.
if not (importlib.util.find_spec("jax_cuda12_plugin") and importlib.util.find_spec("nvidia.cudnn")):
    collect_ignore = ["test_gpu_compile.py", "test_gpu_fit.py"]


def pytest_report_header() -> str | None:
    if "collect_ignore" in globals():
        return (f"not collected: {', '.join(collect_ignore)}, the GPU program's checks (no jax CUDA plugin or cuDNN "
                f"wheel in this Python: `make test-gpu-compile` runs them)")
    return None


def long_run_env() -> dict[str, str]:
    """The environment for a subprocess that trains for hundreds of steps: XLA_FLAGS without `FAST_CPU_COMPILE`,
    whose programs run about 2× slower (`tiny` on fsdp=8: 281 ms a step against 133); its few compiles are cached."""
    flags = [flag for flag in os.environ["XLA_FLAGS"].split() if flag not in FAST_CPU_COMPILE]
    return {**os.environ, "XLA_FLAGS": " ".join(flags)}


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
# longest (measured: `make test` on 2 cores) go first, so that none is left running alone at the end while the
# other worker idles. A run names any file of over `HEAVY_S` seconds missing here.
LONGEST_FIRST = ("test_pipeline_1f1b.py", "test_parallel.py", "test_hf_training.py", "test_readme.py",
                 "test_faults.py", "test_fit.py", "test_moe.py", "test_checkpoint.py", "test_run.py",
                 "test_attention.py", "test_lora.py", "test_hf_moe.py", "test_train.py", "test_pipeline_moe.py",
                 "test_plan.py", "test_window.py", "test_gpu_compile.py", "test_gpu_fit.py", "test_hf.py",
                 "test_documents.py", "test_own_model.py", "test_offload.py", "test_flash.py", "test_generate.py",
                 "test_fp8.py", "test_context_parallel_documents.py", "test_pipeline.py", "test_gpucheck.py",
                 "test_cli.py", "test_gpu.py", "test_sinks.py", "test_layer_pattern.py", "test_plan_moe.py",
                 "test_split_backward.py", "test_distributed.py", "test_peft.py", "test_lora_cli.py",
                 "test_fp8_training.py", "test_routing.py", "test_layer_prefix.py", "test_mtp.py",
                 "test_hf_deepseek.py", "test_lora_latent.py")
HEAVY_S = 20


# Tracing makes millions of short-lived objects, and Python's collector, at its default thresholds, walks the whole
# heap (jax, torch, transformers, the shared references) often: collecting less often, and never walking what
# the imports and the collection made (`gc.freeze`), cuts a tenth of the suite's time (test_parallel.py on one
# core: 45.6 s → 39.6 s) for about 3% more memory.
gc.set_threshold(50_000, 20, 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
               else len(LONGEST_FIRST))  # a stable sort: the rest keep their order


# --- what the compiler did: counted in every pytest process, summed by the one that reports ---------------

COMPILE_STATS = collections.Counter()
FILE_SECONDS = collections.Counter()
_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses",
           program_store.HIT: "gpu_hits", program_store.MISS: "gpu_misses"}


def _count_event(event: str, **_) -> None:
    if event in _EVENTS:
        COMPILE_STATS[_EVENTS[event]] += 1


_DURATIONS = {"/jax/core/compile/backend_compile_duration": "compile_s",
              "/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "trace_s"}


def _count_duration(event: str, seconds: float, **_) -> None:
    if event in _DURATIONS:
        COMPILE_STATS[_DURATIONS[event]] += seconds


monitoring.register_event_listener(_count_event)
monitoring.register_event_duration_secs_listener(_count_duration)


def _entries() -> dict[Path, os.stat_result]:
    entries = {}
    for path in Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).glob("*-cache"):
        try:
            entries[path] = path.stat()
        except FileNotFoundError:  # evicted meanwhile
            pass
    return entries


def _evict(entries: dict[Path, os.stat_result]) -> None:
    """The least recently used programs (read or written last) go until the rest fit in `CACHE_BYTES`."""
    budget = CACHE_BYTES
    for path, stat in sorted(entries.items(), key=lambda entry: -max(entry[1].st_atime, entry[1].st_mtime)):
        budget -= stat.st_size
        if budget < 0:
            path.unlink(missing_ok=True)


_ENTRIES_BEFORE = pytest.StashKey[set]()


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # once a run, in the process that reports
        entries = _entries()
        _evict(entries)
        session.config.stash[_ENTRIES_BEFORE] = set(entries)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: hand the counts to the controller
        session.config.workeroutput["compile_stats"] = dict(COMPILE_STATS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    COMPILE_STATS.update(node.workeroutput.get("compile_stats", {}))


def pytest_runtest_logreport(report):
    FILE_SECONDS[report.fspath] += report.duration


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workeroutput"):
        return
    entries = _entries()
    added = set(entries) - config.stash[_ENTRIES_BEFORE]
    size = sum(stat.st_size for stat in entries.values())
    stats = COMPILE_STATS
    line = (f"compile cache: {stats['hits']} hits, {stats['misses']} misses; XLA compiling {stats['compile_s']:.0f} s, "
            f"tracing and lowering {stats['trace_s']:.0f} s (pytest's processes); {len(added)} programs added by every "
            f"process (subprocesses' too), {size / 2**30:.2f} of {CACHE_BYTES / 2**30:.0f} GiB in "
            f"{os.environ['JAX_COMPILATION_CACHE_DIR']}")
    if stats["gpu_hits"] or stats["gpu_misses"]:
        line += (f"; GPU programs: {stats['gpu_hits']} served, {stats['gpu_misses']} compiled and stored in "
                 f"{os.environ[program_store.FOLDER]}")
    terminalreporter.write_line(line)
    unlisted = sorted(f"{Path(f).name} ({s:.0f} s)" for f, s in FILE_SECONDS.items()
                      if s > HEAVY_S and Path(f).name not in LONGEST_FIRST)
    if unlisted:
        terminalreporter.write_line(f"conftest.LONGEST_FIRST lacks files of over {HEAVY_S} s: {', '.join(unlisted)}")
