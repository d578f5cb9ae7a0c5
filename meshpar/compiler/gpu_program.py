"""What a compiled GPU program runs, read from its text: its kernels, its collectives, and a step time of its own.

The module is XLA:GPU's scheduled program (`compiled.as_text()` of a step compiled for a GPU target,
`meshpar.compiler.gpu`), so each computation's instructions are in the order a GPU stream runs them. Every
figure is per device and per step: a `while` body counts as many times as XLA's recorded trip count says
(`meshpar.compiler.hlo`).

Kernels: cuDNN's fused attention (`__cudnn$fmha*` custom calls, forward and backward), cuBLAS GEMMs
(`__cublas$gemm`, `__cublas$lt$matmul`; FP8 ones, `__cublas$lt$matmul$f8`, apart), Triton GEMMs (fusions
whose computation holds a `dot`) and the other fusions (XLA's generated elementwise and reduction kernels).

Collectives: count, result bytes by dtype, how many the scheduler made asynchronous (a `-start`/`-done`
pair) and how many of those have compute kernels scheduled between their start and done (`overlapped`).

The step time is a roofline of the program as scheduled, the planner's assumptions (`meshpar.plan.time`)
applied to what XLA emitted instead of to the model:
- a GEMM or an attention call costs its FLOPs over the target's peak for its dtype (an FP8 GEMM: the FP8
  peak) times `efficiency` (the planner's); causal cuDNN attention computes half its score square (with a
  sliding window of W keys, query t's min(t + 1, W) keys); its backward pass 2.5 forwards;
- any other kernel costs the bytes it reads and writes over HBM bandwidth;
- a collective costs its ring time (all-gather and all-to-all (S−1)/S of the result, reduce-scatter (S−1)
  times its result, all-reduce twice (S−1)/S, a permute the result) over NVLink or, where its group spans
  hosts, the network, at `net_efficiency`, plus a latency per step; a host↔device copy its bytes over the
  host link. Synchronous, it is exposed; asynchronous, only the part the compute scheduled between its
  start and done does not cover.
It reads no measured kernel time: where it and the planner disagree, the cause is in what each counts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections import Counter

import numpy as np

from meshpar.compiler.hlo import (COLLECTIVES, Instruction, arrays, dot_flops, output_shape, parse_module,
                                  total_bytes)
from meshpar.hardware import Hardware

CUDNN_ATTENTION = "__cudnn$fmha"
CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul")
CUBLAS_FP8 = "__cublas$lt$matmul$f8"  # cuBLASLt's FP8 GEMM (Hopper and later): what `train.fp8` matmuls become
KERNELS = ("attention", "gemm", "fp8_gemm", "triton_gemm", "fusion", "memory", "host_copy")  # the kinds `read` counts
# Instructions that move no data of their own (control flow: what they call is counted).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "while", "call", "conditional", "async-start",
         "async-update", "async-done"}
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_REPLICA_GROUPS = re.compile(r"replica_groups=(?P<groups>\{[\d,{}\s]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                             r"|mesh\[(?P<mesh>[^\]]*)\]\s*\{(?P<axes>[^}]*)\})")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>[\d,{}\s]*)\}")
_IOTA = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the roofline charges, from the planner's hardware and its assumptions."""
    hw: Hardware
    hosts: tuple[int, ...]  # the host of each device of the mesh, in its flat order (partition ids)
    efficiency: float  # the fraction of peak matmuls reach (`meshpar.plan.Run.efficiency`)

    def matmul_s(self, flops: float, dtype: str) -> float:
        """A matmul's seconds at the peak for its operands' `dtype` (the output's, but FP8 GEMMs': "f8")."""
        return flops / (self.hw.peak({"f32": 4, "f8": 1}.get(dtype, 2)) * self.efficiency)

    def collective_s(self, kind: str, result_bytes: int, groups: list[list[int]]) -> float:
        groups = groups or [list(range(len(self.hosts)))]
        size = max(len(group) for group in groups)
        if size <= 1:
            return 0.0
        crosses = any(len({self.hosts[d] for d in group}) > 1 for group in groups)
        bw = (self.hw.net_bw if crosses else self.hw.link_bw) * self.hw.net_efficiency
        latency = self.hw.net_latency if crosses else self.hw.link_latency
        wire, steps = {"all-gather": ((size - 1) / size, size - 1), "all-to-all": ((size - 1) / size, size - 1),
                       "reduce-scatter": (size - 1, size - 1), "all-reduce": (2 * (size - 1) / size, 2 * (size - 1)),
                       "collective-permute": (1, 1)}[kind]
        return result_bytes * wire / bw + steps * latency


def _groups(attributes: str) -> list[list[int]]:
    """The device groups of a collective: explicit, XLA's iota form (`[G,S]<=[dims]T(perm)`), a permute's
    pairs; [] for all devices."""
    if pairs := _PAIRS.search(attributes):
        return [[int(x) for x in pair.split(",")] for pair in re.findall(r"\{([\d,]+)\}", pairs["pairs"])]
    found = _REPLICA_GROUPS.search(attributes)
    if found is None:
        return []
    if found["mesh"] is not None:  # `mesh['data'=2,'fsdp'=4] {'fsdp'}`: devices that differ only along those axes
        names, sizes = zip(*[(n.strip("' "), int(v)) for n, v in (a.split("=") for a in found["mesh"].split(","))])
        inside = [names.index(a.strip("' ")) for a in found["axes"].split(",") if a.strip()]
        outside = [i for i in range(len(names)) if i not in inside]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes).transpose(outside + inside)
        return ids.reshape(-1, int(np.prod([sizes[i] for i in inside]))).tolist()
    if iota := _IOTA.fullmatch(found["groups"]):
        dims = [int(x) for x in iota["dims"].split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota["perm"]:
            ids = ids.transpose([int(x) for x in iota["perm"].split(",")])
        groups, size = (int(x) for x in iota["shape"].split(","))
        return ids.reshape(groups, size).tolist()
    return [[int(x) for x in group.split(",") if x] for group in re.findall(r"\{([\d,\s]*)\}", found["groups"])]


def _backend_config(instruction: Instruction) -> dict:
    start = instruction.attributes.find("backend_config=")
    if start < 0:
        return {}
    return json.JSONDecoder().raw_decode(instruction.attributes, start + len("backend_config="))[0]


def _attention_flops(call: Instruction, target: str) -> float:
    """FLOPs of a cuDNN attention call: the (query, key) pairs it scores times the head dim, 2 matmuls forward,
    5 backward (the scores recomputed, dV, dP, dQ, dK). Of its scores [B, N, T, S] a causal mask leaves half; a
    sliding window of W keys (the query's own included; causal, T = S) leaves query t its min(t + 1, W)
    latest: T·W − W(W − 1)/2 a head where W ≤ T."""
    config = _backend_config(call)["cudnn_fmha_backend_config"]
    B, N, T, S = (int(x) for x in config["intermediate_tensor_shape"]["dimensions"])
    head_dim = arrays(call.shape)[0].dims[-1]
    matmuls = 5 if "Backward" in target else 2
    if window := min(int(config.get("sliding_window_length", 0)), T):  # 0: no window
        pairs = T * window - window * (window - 1) / 2
    else:
        pairs = T * S * (0.5 if config.get("mask_type") == "CAUSAL" else 1.0)
    return 2.0 * matmuls * B * N * pairs * head_dim


def _gemm_flops(call: Instruction, defined: dict[str, Instruction]) -> float:
    """2 · output elements · contracted size of a cuBLAS call (its backend config's dimension numbers)."""
    numbers = _backend_config(call)["gemm_backend_config"]["dot_dimension_numbers"]
    lhs = arrays(defined[call.operands[0]].shape)[0].dims
    contracted = np.prod([lhs[int(i)] for i in numbers["lhs_contracting_dimensions"]])
    return 2.0 * float(np.prod(arrays(call.shape)[0].dims)) * float(contracted)


def _fusion_bytes(fused: list[Instruction]) -> int:
    """HBM bytes a fused kernel reads and writes: its parameters, but only the slices it takes of one that it
    only slices (a layer's weights from the stacked ones) and nothing of one it only updates in place (a
    layer's slot of a stacked buffer), and its results, of an in-place update only the update."""
    users: dict[str, list[Instruction]] = {}
    for instruction in fused:
        for name in instruction.operands:
            users.setdefault(name, []).append(instruction)
    moved = 0
    for parameter in (i for i in fused if i.opcode == "parameter"):
        uses = users.get(parameter.name, [])
        if uses and all(u.opcode in ("dynamic-slice", "slice") for u in uses):
            moved += sum(total_bytes(u.shape) for u in uses)
        elif not (uses and all(u.opcode == "dynamic-update-slice" and u.operands[0] == parameter.name for u in uses)):
            moved += total_bytes(parameter.shape)
    defined = {i.name: i for i in fused}
    root = fused[-1]  # the printer puts ROOT last
    for result in ([defined[n] for n in root.operands] if root.opcode == "tuple" else [root]):
        updates = result.opcode == "dynamic-update-slice"
        moved += total_bytes(defined[result.operands[1]].shape if updates else result.shape)
    return moved


@dataclasses.dataclass
class _Tally:
    """One computation's run: kernel and collective counts, FLOPs and seconds."""
    counts: Counter = dataclasses.field(default_factory=Counter)  # (group, key) -> count, FLOPs or bytes
    seconds: Counter = dataclasses.field(default_factory=Counter)  # see `_CLOCKED` and "collective"

    def add(self, other: "_Tally", times: int) -> None:
        for key, value in other.counts.items():
            self.counts[key] += times * value
        for key, value in other.seconds.items():
            self.seconds[key] += times * value

    @property
    def clocked(self) -> float:
        return sum(self.seconds[key] for key in _CLOCKED)

    @property
    def computed(self) -> float:
        return sum(self.seconds[key] for key in _COMPUTE)


_COMPUTE = ("matmul", "attention", "memory")
_CLOCKED = (*_COMPUTE, "exposed", "host")  # what the stream waits for, in order


def _kernel(instruction: Instruction, defined: dict[str, Instruction],
            computations: dict[str, list[Instruction]]) -> tuple[str, float, str]:
    """(kind, FLOPs or bytes, dtype) of one kernel: attention, gemm or triton_gemm (FLOPs), host_copy,
    fusion or memory (any other op that moves data; bytes)."""
    out = arrays(instruction.shape)
    if instruction.opcode == "custom-call":
        target = _TARGET.search(instruction.attributes)["target"]
        if target.startswith(CUDNN_ATTENTION):
            return "attention", _attention_flops(instruction, target), out[0].dtype
        if target == CUBLAS_FP8:
            return "fp8_gemm", _gemm_flops(instruction, defined), "f8"
        if target.startswith(CUBLAS):
            return "gemm", _gemm_flops(instruction, defined), out[0].dtype
    if instruction.opcode == "fusion":
        fused = computations[instruction.calls[0][0]]
        inner = {i.name: i for i in fused}
        if calls := [i for i in fused if i.opcode == "custom-call"]:  # an address-computing fusion around a GEMM
            return _kernel(calls[0], inner, computations)
        if dots := [i for i in fused if i.opcode == "dot"]:
            return "triton_gemm", float(sum(dot_flops(d, inner) for d in dots)), arrays(dots[0].shape)[0].dtype
        return "fusion", _fusion_bytes(fused), out[0].dtype
    operands = [a for name in instruction.operands if name in defined for a in arrays(defined[name].shape)]
    if instruction.opcode == "copy-start" and any(a.host for a in out + operands):
        return "host_copy", total_bytes(output_shape("copy-start", instruction.shape)), out[0].dtype
    if instruction.opcode == "dynamic-update-slice":  # in place: the update is read and written
        return "memory", 2 * total_bytes(defined[instruction.operands[1]].shape), out[0].dtype
    if instruction.opcode in ("dynamic-slice", "slice"):  # the slice is read and written
        return "memory", 2 * total_bytes(instruction.shape), out[0].dtype
    return "memory", total_bytes(instruction.shape) + sum(a.bytes for a in operands), out[0].dtype


def read(hlo_text: str, costs: Costs) -> dict:
    """The kernels, collectives and roofline step time of one run of a compiled GPU module (see the module
    docstring): {"kernels", "collectives", "flops_per_device", "flops_by_kernel", "step_time"}."""
    computations, entry = parse_module(hlo_text)

    @functools.cache
    def run(name: str) -> _Tally:
        tally, clock = _Tally(), 0.0
        pending = {}  # an async start's name -> (kind, seconds, clock and compute seconds at its start)
        defined = {i.name: i for i in computations[name]}
        for instruction in computations[name]:
            opcode = instruction.opcode
            kind = opcode.removesuffix("-start")
            if opcode in ("while", "call", "conditional") or opcode.endswith("-start") and kind not in COLLECTIVES:
                for callee, times in instruction.calls:  # control flow and async wrappers; not reducers, fusions
                    child = run(callee)
                    tally.add(child, times)
                    clock += times * child.clocked
            if kind in COLLECTIVES:
                result = output_shape(opcode, instruction.shape)
                seconds = costs.collective_s(kind, total_bytes(result), _groups(instruction.attributes))
                tally.counts[kind, "count"] += 1
                for array in arrays(result):
                    tally.counts[kind, f"bytes {array.dtype}"] += array.bytes
                tally.seconds["collective"] += seconds
                if opcode.endswith("-start"):
                    tally.counts[kind, "async"] += 1
                    pending[instruction.name] = (kind, seconds, clock, tally.computed)
                else:
                    tally.seconds["exposed"] += seconds
                    clock += seconds
            elif opcode.endswith("-done") and instruction.operands and instruction.operands[0] in pending:
                kind, seconds, started, computed = pending.pop(instruction.operands[0])
                wait = max(0.0, seconds - (clock - started))
                tally.seconds["host" if kind == "host_copy" else "exposed"] += wait
                if kind != "host_copy":
                    tally.counts[kind, "overlapped"] += tally.computed > computed
                clock += wait
            elif opcode == "copy-start" or opcode not in _FREE and not opcode.endswith(("-start", "-done")):
                what, amount, dtype = _kernel(instruction, defined, computations)
                tally.counts["kernels", what] += 1
                if what == "host_copy":
                    seconds = amount / (costs.hw.host_bw * costs.hw.net_efficiency) if costs.hw.host_bw else 0.0
                    pending[instruction.name] = (what, seconds, clock, tally.computed)
                    continue
                if what in ("attention", "gemm", "fp8_gemm", "triton_gemm"):
                    tally.counts["flops", what] += amount
                    seconds = costs.matmul_s(amount, dtype)
                    tally.seconds["attention" if what == "attention" else "matmul"] += seconds
                else:
                    seconds = amount / costs.hw.hbm_bw
                    tally.seconds["memory"] += seconds
                clock += seconds
        return tally

    tally = run(entry)
    counts = tally.counts
    collectives = {}
    for kind in COLLECTIVES:
        if counts[kind, "count"]:
            by_dtype = {key.split()[1]: value for (group, key), value in counts.items()
                        if group == kind and key.startswith("bytes ")}
            collectives[kind] = {"count": counts[kind, "count"], "bytes": sum(by_dtype.values()),
                                 "bytes_by_dtype": by_dtype, "async": counts[kind, "async"],
                                 "overlapped": counts[kind, "overlapped"]}
    step = {f"{key}_s": tally.seconds[key] for key in (*_CLOCKED, "collective")}
    step["step_s"] = tally.clocked
    return {"kernels": {what: counts["kernels", what] for what in KERNELS}, "collectives": collectives,
            "flops_per_device": sum(value for (group, _), value in counts.items() if group == "flops"),
            "flops_by_kernel": {what: counts["flops", what] for (group, what) in list(counts) if group == "flops"},
            "step_time": step}
