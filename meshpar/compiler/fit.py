"""Will it fit? The real training step compiled for abstract state: per-device memory, nothing allocated.

The state is described, never created: every leaf is a `jax.ShapeDtypeStruct` carrying its shape, dtype
and sharding on the mesh (`train.sharded_abstract`), and so is the token batch; `jit(step).lower(...).compile()`
then gives XLA's own memory analysis of the program that would run — arguments, temporaries, outputs,
aliased (donated) buffers and the peak they imply, per device — plus the collectives and FLOPs, at any
size: `llama_70b` on 512 fake CPU devices allocates nothing. What XLA's CPU backend emits differs from a
GPU's in substance (it all-reduces where a GPU reduce-scatters, widens bf16 collectives to float32, calls no
cuBLAS or cuDNN), so on fake CPU devices the figures are those of the CPU program; on the devices of a
described GPU cluster (`meshpar.compiler.gpu`) they are XLA:GPU's, the program a GPU runs. The planner
(`meshpar.plan`) is checked against both.

`CHECK_OPTIONS`, three choices of XLA's CPU compiler for this check, each measured:
- the memory-optimised instruction scheduler: by default XLA's CPU backend orders independent work for
  concurrency (e.g. it zero-fills every layer's gradient buffer before the loss's backward pass runs),
  which a GPU compiler, scheduling under a memory limit, does not; the peak of the memory-optimised
  order is the one to compare with an accelerator's memory (llama_8b, ring over sequence=4 at 32k
  tokens: 80.3 → 73.4 GB);
- no while-loop-invariant code motion: the CPU backend computes in float32 where a GPU computes in
  bfloat16, so it converts each layer's saved bfloat16 input to float32 inside the backward loop, and
  this pass then hoists that conversion out of the loop as one float32 copy of every layer's input
  (llama_8b, fsdp=8, 4 sequences of 8192: 9 GB that no GPU program holds);
- no LLVM optimisation of the generated code: the HLO, its buffer assignment and the collectives are the
  same, and compiling is about 2× faster.
Beside them, `DEFAULT_EMITTERS` pins XLA:CPU's fusion emitters on (XLA's default) where jaxlib lets XLA_FLAGS turn
them off (0.10; the test suite does, to compile faster): they decide which updates of a buffer happen in place,
and so the temporaries of a pipeline's step (llama_8b on stage=2,fsdp=4, batch 16, remat full: a peak of 77.9 GB
per device with them, 63.9 GB without).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshpar import gpu_target, hardware, offload, sharding
from meshpar.batch import Batch
from meshpar.compiler import gpu, gpu_program
from meshpar.compiler.compiled import compile_report
from meshpar.errors import InputError
from meshpar.plan.layout import EFFICIENCY
from meshpar.rules import Rules
from meshpar.train import ModelFactory, Sharded, TrainConfig, make_step, optimizer, sharded_abstract

DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True} if jax.__version_info__[:2] < (0, 11) else {}
CHECK_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                 "xla_disable_hlo_passes": "while-loop-invariant-code-motion", "xla_backend_optimization_level": 0,
                 **DEFAULT_EMITTERS}


def abstract_inputs(sharded: Sharded, cfg: TrainConfig, documents: bool = False) -> tuple[Any, Any]:
    """The step's arguments as shapes with shardings: the state and one token batch, or with `documents` a
    packed batch (`meshpar.batch.Batch`: tokens, document ids and target weights)."""
    state = sharding.placed_shapes(sharded.abstract, sharded.shardings)
    shape = (cfg.global_batch, cfg.seq_len + 1)
    field = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(sharded.mesh,
                                                                                              sharded.rules, shape))
    return state, Batch(field(jnp.int32), field(jnp.int32), field(jnp.float32)) if documents else field(jnp.int32)


def compile_step(make_model: ModelFactory, cfg: TrainConfig, mesh: Mesh, rules: Rules,
                 documents: bool = False) -> dict[str, Any]:
    """The report of the training step of `make_model` on `mesh` (`compiled.compile_report`), compiled
    for abstract inputs (of packed documents with `documents`): on CPU devices with `CHECK_OPTIONS`; on GPU
    devices (real, or a described cluster's: `meshpar.compiler.gpu`) with meshpar's GPU flags, and with what
    the GPU program runs beside it (`gpu_program`: kernels, collectives by dtype and overlap, a roofline
    step time), its FLOPs the kernels' own."""
    sharded = sharded_abstract(make_model, optimizer(cfg), mesh, rules, cfg.seed, cfg.reference)
    state, batch = abstract_inputs(sharded, cfg, documents)
    platform = mesh.devices.flat[0].platform
    options = CHECK_OPTIONS if platform == "cpu" else gpu.compile_options() if platform == "gpu" else None
    tokens = batch.tokens if documents else batch
    compiled, report = compile_report(make_step(sharded, tokens.sharding, cfg), state, batch, compiler_options=options,
                                      gpu_devices=mesh.devices.flat if platform == "gpu" else None)
    if platform == "gpu":
        report["gpu"] = gpu_program.read(compiled.as_text(), program_costs(mesh))
        report["flops_per_device"] = report["gpu"]["flops_per_device"]
        if not mesh.devices.flat[0].addressable_memories():
            _place_offloaded_state(report["memory_per_device"], sharded, rules)
    return report


def _place_offloaded_state(memory: dict[str, int], sharded: Sharded, rules: Rules) -> None:
    """A described GPU cluster's devices have no memory spaces (jax 0.12's compile-only devices list none, and
    a sharding's `pinned_host` is dropped on them), so the compiler puts the state that `parallel.offload`
    keeps in host memory on the devices: move those bytes (per device; donated, so argument, output and
    alias alike) to the host figures."""
    shardings = dict(nnx.to_flat_state(sharded.shardings))
    host = sum(math.prod(shardings[path].get_value().shard_shape(variable.shape)) * variable.dtype.itemsize
               for path, variable in nnx.to_flat_state(sharded.abstract) if offload.in_host_memory(variable, rules.parallel))
    for kind in ("arguments", "outputs", "alias"):
        memory[f"{kind}_bytes"] -= host
        memory[f"host_{kind}_bytes"] += host
    memory["peak_bytes"] -= host
    memory["host_peak_bytes"] += host


def program_costs(mesh: Mesh) -> gpu_program.Costs:
    """The roofline's costs for a mesh of GPUs: the planner's hardware of their kind, and their hosts."""
    kind = mesh.devices.flat[0].device_kind
    target = gpu_target.for_device_kind(kind)
    if target is None:
        raise InputError(f"no hardware preset for GPU '{kind}' (known: "
                         f"{', '.join(t.description for t in gpu_target.TARGETS.values())})")
    return gpu_program.Costs(hardware.PRESETS[target.name], tuple(d.process_index for d in mesh.devices.flat),
                             EFFICIENCY)
