"""gpucheck's measurements: each runs in a child process (`python -m launch.gpucheck --job NAME`) and yields
its result rows, printed for the parent as they come (`run_here`). JAX is imported inside them: the parent
imports this module too, and must not start JAX's backend.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform as platform_lib
import statistics
import time
import traceback
from collections.abc import Callable, Iterator

ROW, ERROR = "gpucheck-row ", "gpucheck-error "  # a job's stdout lines for the parent: a result row, its error
KERNELS_CHECKED = ("dense", "blockwise", "cudnn")  # dense: the error plain bf16 attention makes, for scale
ERRORS = ("out", "dq", "dk", "dv")  # a numerics row's relative errors: the output's, then the gradients'
CUDA_PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                 "nvidia-cudnn-cu12", "nvidia-cudnn-cu13")


def machine() -> Iterator[dict]:
    """The devices, their memory, the versions and the XLA flags in force."""
    import jax
    import jaxlib

    device = jax.devices()[0]
    yield {"platform": device.platform, "device_kind": device.device_kind, "device_count": jax.device_count(),
           "memory_stats": device.memory_stats(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
           "cuda_packages": installed_versions(CUDA_PACKAGES), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "python": platform_lib.python_version(), "environment": jax.print_environment_info(return_string=True),
           **(gpu_description(jax.local_devices()) if device.platform == "gpu" else {})}


def gpu_description(devices: list) -> dict:
    """The device's own description, as XLA's GPU compiler sees it (read from the devices' topology), and
    where it differs from the packaged target of its kind (`meshpar.gpu_target`, what `launch.compile
    --target` compiles for)."""
    from jax.experimental import topologies

    from meshpar import gpu_target

    try:
        own = gpu_target.read_device_info(topologies.TopologyDescription(devices).serialize())
    except Exception as err:  # this jax's topology of real devices may carry no description
        return {"gpu_target": {"error": f"{type(err).__name__}: {err}"}}
    packaged = gpu_target.for_device_kind(devices[0].device_kind)
    return {"gpu_target": {"own": own, "packaged": packaged.name if packaged else None,
                           "differences": gpu_target.differences(own, packaged) if packaged else None}}


def attention_numerics(T: int, heads: int, kv_heads: int, head_dims: list[int] | None = None,
                       batch: int = 1) -> Iterator[dict]:
    """Each kernel's bf16 output and gradients against float32 attention of the same inputs, per head dim
    (default: the presets'): the largest relative error, max |got − want| / max |want|, of each."""
    import jax
    import jax.numpy as jnp

    from meshpar.attention.kernels import causal_attention

    platform = jax.default_backend()
    for H in head_dims or preset_head_dims():
        q, k, v, d_out = attention_inputs(batch, T, heads, kv_heads, H)
        want = jax.jit(functools.partial(attention_vjp, reference_attention))(
            *(x.astype(jnp.float32) for x in (q, k, v, d_out)))
        for kernel in KERNELS_CHECKED:
            row = {"kernel": kernel, "head_dim": H, "T": T, "heads": heads, "kv_heads": kv_heads}
            if reason := kernel_unavailable(kernel, platform, H):
                yield {**row, "note": reason}
                continue
            attention = functools.partial(causal_attention, kernel=kernel, platform=platform)
            yield measured(row, kernel_errors, attention, (q, k, v, d_out), want)


def attention_speed(T: int, kernels: list[str], heads: int, kv_heads: int, head_dim: int, batch: int = 1,
                    repeats: int = 5) -> Iterator[dict]:
    """Each kernel's forward, and forward + backward, time in ms: the median of `repeats` calls after a first."""
    import jax

    from meshpar.attention.kernels import causal_attention

    platform = jax.default_backend()
    q, k, v, d_out = attention_inputs(batch, T, heads, kv_heads, head_dim)
    for kernel in kernels:
        row = {"kernel": kernel, "T": T, "batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
        if reason := kernel_unavailable(kernel, platform, head_dim):
            yield {**row, "note": reason}
            continue
        attention = functools.partial(causal_attention, kernel=kernel, platform=platform)
        yield measured(row, kernel_times, attention, (q, k, v, d_out), repeats)


def train(config: str, overrides: list[str], mesh: str, devices: int, steps: int) -> Iterator[dict]:
    """`steps` steps of a preset on the first `devices` devices, as launch.bench runs a layout (meshpar.run):
    the report's medians and compiled memory, and the devices' measured peak."""
    import jax

    import configs
    from launch.configure import flops_per_token
    from meshpar import config as config_lib, mesh as mesh_lib, mfu, rules
    from meshpar.attention.kernels import resolve_kernel
    from meshpar.run import Outputs, Throughput, run

    cfg = config_lib.apply(configs.load(config), [*overrides, f"train.steps={steps}"])
    on = mesh_lib.build(mesh_lib.parse(mesh), jax.devices()[:devices])
    peak, peak_source = mfu.device_peak(2 if cfg.train.compute_dtype == "bfloat16" else 4)  # as launch.train
    throughput = Throughput(flops_per_token(cfg), peak) if peak else None
    result = run(cfg.model_factory(), cfg.train, cfg.data, on, rules.make(cfg.parallel),
                 outputs=Outputs(progress=False), throughput=throughput)
    report, platform = result.report, on.devices.flat[0].platform
    peaks_in_use = [(device.memory_stats() or {}).get("peak_bytes_in_use") for device in on.devices.flat]
    yield {"config": config, "mesh": mesh_lib.describe(report["mesh"]), "devices": on.size,
           "seq_len": cfg.train.seq_len, "global_batch": cfg.train.global_batch, "remat": report["remat"],
           "attention_kernel": resolve_kernel(cfg.train.attention_kernel, cfg.train.seq_len, platform,
                                              cfg.train.dtype, cfg.model.head_size),
           "offload": cfg.parallel.offload, "step_time_s": report["step_time_s_median"],
           "tokens_per_s": report["tokens_per_s_median"], "mfu": report.get("mfu_median"),
           "peak_flops_source": peak_source, "compiled_peak_bytes": report["memory_per_device"]["peak_bytes"],
           "measured_peak_bytes": None if None in peaks_in_use else max(peaks_in_use), "compile_s": report["compile_s"],
           "params": report["params"], "loss_first": result.records[0]["loss"], "loss_last": result.records[-1]["loss"]}


def compile_peak(config: str, overrides: list[str], mesh: str) -> Iterator[dict]:
    """launch.compile's figures for a preset's step on this process's (fake CPU) devices: XLA:CPU's peak per
    device and the planner's prediction (launch.configure.compile_check)."""
    from launch.configure import compile_check, configure

    cfg, *_ = configure(config, mesh, overrides)
    report = compile_check(cfg)
    yield {"layout": report["layout"], "compiled_cpu_peak_bytes": report["memory_per_device"]["peak_bytes"],
           "planner_peak_bytes": report["predicted_peak_bytes"],
           "planner_cpu_peak_bytes": report["predicted_cpu_peak_bytes"], "compile_s": report["compile_s"]}


JOBS: dict[str, Callable[..., Iterator[dict]]] = {
    "machine": machine, "attention_numerics": attention_numerics, "attention_speed": attention_speed,
    "train": train, "compile": compile_peak}


def installed_versions(packages: tuple[str, ...]) -> dict[str, str]:
    """{package: version} of those of `packages` that are installed."""
    found = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def preset_head_dims() -> list[int]:
    import configs

    return sorted({configs.load(name).model.head_size for name in configs.names()})


def attention_inputs(batch: int, T: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """q [B, T, N, H], k and v [B, T, K, H], and an output cotangent [B, T, N, H]: bf16, standard normal."""
    import jax
    import jax.numpy as jnp

    shapes = [(batch, T, heads, head_dim), (batch, T, kv_heads, head_dim), (batch, T, kv_heads, head_dim),
              (batch, T, heads, head_dim)]
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]


def reference_attention(q_BTNH, k_BSKH, v_BSKH):
    """softmax(q kᵀ / √H + causal mask) v, the textbook formula, at full float32 matmul precision (a GPU
    would otherwise run float32 matmuls as TF32)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    T, N, H = q_BTNH.shape[1:]
    S, K = k_BSKH.shape[1:3]
    k_BSNH, v_BSNH = (jnp.repeat(x, N // K, axis=2) for x in (k_BSKH, v_BSKH))  # head n reads kv head n // G
    highest = jax.lax.Precision.HIGHEST
    scores_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH, precision=highest) / np.sqrt(H)
    scores_BNTS = jnp.where(np.tril(np.ones((T, S), bool)), scores_BNTS, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores_BNTS, axis=-1), v_BSNH, precision=highest)


def attention_vjp(attention, q_BTNH, k_BSKH, v_BSKH, d_out_BTNH):
    """(out, dq, dk, dv) of `attention` at q, k, v for the output cotangent `d_out`."""
    import jax

    out_BTNH, vjp = jax.vjp(attention, q_BTNH, k_BSKH, v_BSKH)
    return (out_BTNH, *vjp(d_out_BTNH))


def kernel_unavailable(kernel: str, platform: str, head_dim: int) -> str | None:
    """Why `kernel` cannot run bf16 attention of `head_dim` on `platform`; None where it can."""
    import jax.numpy as jnp

    from meshpar.attention.kernels import cudnn_unsupported

    if kernel != "cudnn":
        return None
    if platform != "gpu":
        return f"not available on {platform}"
    return cudnn_unsupported(jnp.bfloat16, head_dim)


def kernel_errors(attention, inputs, want) -> dict:
    """The largest relative error of `attention`'s output and gradients at `inputs` (q, k, v, the output's
    cotangent) against `want` (the reference's, in float32)."""
    import jax

    got = jax.jit(functools.partial(attention_vjp, attention))(*inputs)
    return {name: relative_error(g, w) for name, g, w in zip(ERRORS, got, want)}


def kernel_times(attention, inputs, repeats: int) -> dict:
    """`attention`'s forward, and forward + backward, time in ms at `inputs` (q, k, v, the output's cotangent)."""
    import jax

    return {"forward_ms": median_ms(jax.jit(attention), *inputs[:3], repeats=repeats),
            "forward_backward_ms": median_ms(jax.jit(functools.partial(attention_vjp, attention)), *inputs,
                                             repeats=repeats)}


def measured(row: dict, measure: Callable[..., dict], *args) -> dict:
    """`row` with what `measure(*args)` gives, or with its error as the row's note: a kernel that fails (out
    of memory, a shape cuDNN refuses) is a finding, and the next kernel goes on. The traceback goes to the log."""
    try:
        row.update(measure(*args))
    except Exception as err:
        traceback.print_exc()
        row["note"] = one_line(err)
    return row


def relative_error(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def median_ms(fn, *args, repeats: int) -> float:
    """Milliseconds per call of `fn(*args)`: the median of `repeats` after one call (compile, warm-up)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def one_line(err: BaseException) -> str:
    """`Type: the message's first line`, for a report cell."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first}"[:300]


def run_here(function: str, args: dict) -> None:
    """Run job `function` in this process (set up by `main`), printing each row for the parent as it comes,
    and the error, if any, in one line before its traceback."""
    from meshpar.metrics import strict

    try:
        for row in JOBS[function](**args):
            print(ROW + json.dumps(strict(row), allow_nan=False), flush=True)
    except Exception as err:
        print(ERROR + one_line(err), flush=True)
        raise
