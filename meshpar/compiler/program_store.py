"""GPU programs kept on disk: a described cluster's step is compiled once, whoever asks for it again.

XLA's GPU compiler takes 5-30 s for a step, and JAX's persistent cache cannot keep what compile-only devices
compile (loading an executable needs a client that runs it). What meshpar reads of such a program is its
optimised module's text and XLA's memory and cost analyses: those are kept, one compressed file a program,
in the folder `MESHPAR_GPU_PROGRAM_CACHE` names (nothing is kept where it names none).

The key is everything the compile depends on: the lowered module's text (the program, its shardings and
donations, the number of devices), the compile options, XLA_FLAGS, the devices' own description (kind, every
field XLA was told of, hosts) and the versions of jax, jaxlib, the CUDA plugin and cuDNN. A program that differs
in any of them is compiled anew (tests/test_gpu_compile.py). The folder is bounded
(`MESHPAR_GPU_PROGRAM_CACHE_BYTES`, 1 GiB unless set): past it the least recently read programs go first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import tempfile
import types
import zlib
from pathlib import Path
from typing import Any

from jax import monitoring

FOLDER = "MESHPAR_GPU_PROGRAM_CACHE"
MAX_BYTES = "MESHPAR_GPU_PROGRAM_CACHE_BYTES"
HIT, MISS = "/meshpar/gpu_program_store/hits", "/meshpar/gpu_program_store/misses"
_VERSIONED = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cudnn-cu12")
# a custom partitioner (cuDNN attention's) is named in the module by its Python object's address, another in
# every lowering: the key reads the module without it (the partitioner itself is jax's code, whose version it holds)
_PARTITIONER_ADDRESS = re.compile(r'(@CustomSPMDPartitioning\(.*?backend_config = ")\d+(")')
_MEMORY = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
           "generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
           "host_temp_size_in_bytes", "host_alias_size_in_bytes")


@dataclasses.dataclass(frozen=True)
class StoredProgram:
    """What a compiled GPU program tells, as `jax.stages.Compiled` tells it: its text and its analyses."""
    text: str
    memory: dict[str, int]
    cost: dict[str, float] | None

    def as_text(self) -> str:
        return self.text

    def memory_analysis(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(**self.memory)

    def cost_analysis(self) -> dict[str, float] | None:
        return self.cost


def compile(lowered: Any, devices: Any, compiler_options: dict | None = None) -> Any:
    """`lowered.compile(compiler_options)` for the GPU `devices` it was lowered for, or the program an identical
    compile stored (then a `StoredProgram`: read it, never run it)."""
    folder = os.environ.get(FOLDER)
    if not folder:
        return lowered.compile(compiler_options=compiler_options)
    path = Path(folder) / f"{_key(lowered, devices, compiler_options)}.json.z"
    try:
        stored = json.loads(zlib.decompress(path.read_bytes()))
        os.utime(path)  # read now: the last to be evicted
        monitoring.record_event(HIT)
        return StoredProgram(stored["text"], stored["memory"], stored["cost"])
    except (FileNotFoundError, zlib.error, json.JSONDecodeError, KeyError):  # absent, or half-written by a crash
        pass
    monitoring.record_event(MISS)
    compiled = lowered.compile(compiler_options=compiler_options)
    memory = compiled.memory_analysis()
    _write(path, {"text": compiled.as_text(), "memory": {name: getattr(memory, name) for name in _MEMORY},
                  "cost": compiled.cost_analysis()})
    return compiled


def _key(lowered: Any, devices: Any, compiler_options: dict | None) -> str:
    from jax.experimental import topologies

    versions = {}
    for package in _VERSIONED:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    module = _PARTITIONER_ADDRESS.sub(r"\1\2", lowered.as_text())
    options = json.dumps(sorted((compiler_options or {}).items()), default=str)
    digest = hashlib.sha256()
    for part in (module, options, os.environ.get("XLA_FLAGS", ""), json.dumps(versions)):
        digest.update(part.encode() + b"\0")
    digest.update(topologies.TopologyDescription(list(devices)).serialize())
    digest.update(repr([d.process_index for d in devices]).encode())
    return digest.hexdigest()


def _write(path: Path, entry: dict) -> None:
    """Written whole or not at all (a temporary file renamed), then the oldest read evicted past the bound."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as out:
        out.write(zlib.compress(json.dumps(entry).encode(), 6))
    os.replace(out.name, path)
    entries = []
    for entry_path in path.parent.glob("*.json.z"):
        try:
            stat = entry_path.stat()
        except FileNotFoundError:  # evicted meanwhile by another process
            continue
        entries.append((stat.st_mtime, stat.st_size, entry_path))
    budget = int(os.environ.get(MAX_BYTES) or 1 << 30)
    for _, size, entry_path in sorted(entries, reverse=True):
        budget -= size
        if budget < 0 and entry_path != path:
            entry_path.unlink(missing_ok=True)
