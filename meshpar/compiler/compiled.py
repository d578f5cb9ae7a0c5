"""What the compiler says about a jitted step, per device: memory, FLOPs, collectives and compile time.

Memory and FLOPs come from XLA's own `memory_analysis()` and `cost_analysis()`, the collectives from the
compiled module's text (`meshpar.compiler.hlo`).
"""

import time
from typing import Any

from meshpar.compiler import program_store
from meshpar.compiler.hlo import collectives, host_entry_bytes
from meshpar.errors import InputError


def memory_per_device(compiled: Any) -> dict[str, int]:
    """Argument, output, temporary and aliased bytes per device in device memory, from XLA's memory
    analysis, and the peak they imply: arguments + temp + outputs − aliased (outputs that reuse a donated
    argument's buffer count once). XLA's own `peak_memory_in_bytes` is not meaningful on CPU (arguments
    only). The same in host memory (`host_*`, meshpar.offload): XLA's host fields where it fills them;
    XLA:CPU does not (its host memory is device memory), so arguments and outputs placed in host memory
    are read from the compiled module's entry layout there and taken out of the device figures."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise InputError("this backend gives no memory analysis")
    out = {
        "arguments_bytes": stats.argument_size_in_bytes,
        "outputs_bytes": stats.output_size_in_bytes,
        "temp_bytes": stats.temp_size_in_bytes,
        "alias_bytes": stats.alias_size_in_bytes,
        "host_arguments_bytes": stats.host_argument_size_in_bytes,
        "host_outputs_bytes": stats.host_output_size_in_bytes,
        "host_temp_bytes": stats.host_temp_size_in_bytes,
        "host_alias_bytes": stats.host_alias_size_in_bytes,
    }
    if not (out["host_arguments_bytes"] or out["host_outputs_bytes"]):
        host = host_entry_bytes(compiled.as_text() or "")
        for kind in ("arguments", "outputs", "alias"):
            out[f"host_{kind}_bytes"] = host[kind]
            out[f"{kind}_bytes"] -= host[kind]
    out["peak_bytes"] = out["arguments_bytes"] + out["temp_bytes"] + out["outputs_bytes"] - out["alias_bytes"]
    out["host_peak_bytes"] = (out["host_arguments_bytes"] + out["host_temp_bytes"] + out["host_outputs_bytes"]
                              - out["host_alias_bytes"])
    return out


def flops_per_device(compiled: Any) -> float | None:
    """Floating-point operations per device per call, from XLA's cost analysis; None where it gives none (a
    GPU program compiled for a described cluster: `meshpar.compiler.gpu_program` counts its kernels')."""
    cost = compiled.cost_analysis()
    if cost is None:
        return None
    if not isinstance(cost, dict):
        raise InputError(f"expected a dict from cost_analysis(), got {type(cost).__name__}")
    # XLA leaves the key out when no instruction counted flops (e.g. a lone all-gather).
    return float(cost.get("flops", 0.0))


def compile_report(jitted: Any, *args: Any, compiler_options: dict | None = None, gpu_devices: Any = None,
                   **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """Lowers and compiles `jitted` for these arguments (concrete, or `jax.ShapeDtypeStruct`s with
    shardings: nothing is allocated); returns the compiled step and its report. For `gpu_devices` (a GPU
    program only read, never run) through the store of GPU programs (`program_store`)."""
    lowered = jitted.lower(*args, **kwargs)
    start = time.perf_counter()
    if gpu_devices is None:
        compiled = lowered.compile(compiler_options=compiler_options)
    else:
        compiled = program_store.compile(lowered, gpu_devices, compiler_options)
    compile_s = time.perf_counter() - start
    hlo_text = compiled.as_text()
    if hlo_text is None:
        raise InputError("this backend gives no text for the compiled module")
    return compiled, {
        "memory_per_device": memory_per_device(compiled),
        "collectives": collectives(hlo_text),
        "flops_per_device": flops_per_device(compiled),
        "compile_s": compile_s,
    }
