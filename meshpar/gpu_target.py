"""NVIDIA GPUs described for XLA's GPU compiler, so that a step compiles for them on a machine with none.

A `GpuTarget` holds what XLA's `GpuTargetConfig` needs of a device: the fields of CUDA's device properties
(`cudaGetDeviceProperties`) that the compiler's fusion, tiling and scheduling decisions read, and the cuDNN
and CUDA runtime versions that decide which kernels it may call (cuDNN fused attention, cuBLASLt FP8
GEMMs). Each preset is named as its peaks in `meshpar.hardware` are; the sources are beside each:
- the CUDA C Programming Guide's table of compute capabilities (shared memory, threads, registers per SM
  and per block: the same on compute capability 8.0, 9.0 and 10.0 but for shared memory on 8.0);
- the values XLA's own specs carry for the same GPU (`xla/tools/hlo_opt/gpu_specs/*.txtpb` in the XLA
  repository, read off real devices: SM count, FP32 lanes per SM, clock, L2, the bytes CUDA reports);
- the datasheets, where XLA has no spec (H200: memory size and bandwidth).
On a GPU machine `launch.gpucheck` reads the device's own description back (`read_device_info`) and prints
where it differs from the packaged one.
"""

from __future__ import annotations

import dataclasses
import struct

from meshpar.errors import InputError


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    name: str  # the meshpar.hardware preset with this GPU's peaks
    description: str  # the device kind CUDA reports (jax's `device_kind`)
    compute_capability: tuple[int, int]
    core_count: int  # streaming multiprocessors
    fpus_per_core: int  # FP32 lanes per SM
    clock_rate_ghz: float  # boost clock
    memory_bandwidth: int  # bytes/s
    device_memory_size: int  # bytes CUDA reports (less than the datasheet's GB: ECC and reserved)
    l2_cache_size: int  # bytes
    shared_memory_per_core: int  # bytes per SM
    shared_memory_per_block_optin: int  # bytes a block may opt in to
    # The same on every NVIDIA GPU since Volta (the programming guide's table).
    shared_memory_per_block: int = 49152
    threads_per_block_limit: int = 1024
    threads_per_warp: int = 32
    threads_per_core_limit: int = 2048
    registers_per_core_limit: int = 65536
    registers_per_block_limit: int = 65536
    block_dim_limit: tuple[int, int, int] = (2147483647, 65535, 65535)
    # What jax 0.12's CUDA 12 plugin runs with at least: cuDNN 9.10 (its `with-cuda` extra requires it) and
    # CUDA 12.8 (the first to know compute capability 10.0; cuBLASLt's FP8 rewrite needs a runtime version).
    cudnn: tuple[int, int] = (9, 10)
    cuda_runtime: tuple[int, int] = (12, 8)

    def device_info(self) -> dict[str, int | float]:
        """The `gpu_device_info` fields by name, as `read_device_info` returns them."""
        x, y, z = self.block_dim_limit
        major, minor = self.compute_capability
        return {"threads_per_block_limit": self.threads_per_block_limit, "threads_per_warp": self.threads_per_warp,
                "shared_memory_per_block": self.shared_memory_per_block,
                "shared_memory_per_core": self.shared_memory_per_core,
                "threads_per_core_limit": self.threads_per_core_limit, "core_count": self.core_count,
                "fpus_per_core": self.fpus_per_core, "block_dim_limit_x": x, "block_dim_limit_y": y,
                "block_dim_limit_z": z, "memory_bandwidth": self.memory_bandwidth, "l2_cache_size": self.l2_cache_size,
                "clock_rate_ghz": self.clock_rate_ghz, "device_memory_size": self.device_memory_size,
                "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
                "compute_capability": f"{major}.{minor}",
                "registers_per_core_limit": self.registers_per_core_limit,
                "registers_per_block_limit": self.registers_per_block_limit}

    def config_text(self) -> str:
        """XLA's `GpuTargetConfig` as protobuf text (`get_topology_desc(target_config=...)`)."""
        info = self.device_info()
        major, minor = self.compute_capability
        fields = " ".join(f"{name}: {value}" for name, value in info.items() if name != "compute_capability")
        return (f"gpu_device_info {{ {fields} cuda_compute_capability {{ major: {major} minor: {minor} }} }} "
                f'platform_name: "CUDA" dnn_version_info {{ major: {self.cudnn[0]} minor: {self.cudnn[1]} }} '
                f"runtime_version {{ major: {self.cuda_runtime[0]} minor: {self.cuda_runtime[1]} }} "
                f'device_description_str: "{self.description}"')


# XLA's h100_sxm spec (read off an H100 SXM5 80GB): 132 SMs of 128 FP32 lanes at 1.98 GHz, HBM3 at 3.35 TB/s,
# 50 MiB of L2, 79.1 GiB that CUDA reports; 228 KiB of shared memory per SM, 227 per block.
_H100 = GpuTarget("h100", "NVIDIA H100 80GB HBM3", (9, 0), core_count=132, fpus_per_core=128, clock_rate_ghz=1.98,
                  memory_bandwidth=3_352_320_000_000, device_memory_size=84_978_434_048, l2_cache_size=52_428_800,
                  shared_memory_per_core=233_472, shared_memory_per_block_optin=232_448)
TARGETS = {
    "h100": _H100,
    # H200 SXM: the H100's GH100 die (its SMs, clock, L2 and shared memory) with HBM3e: 141 GB at 4.8 TB/s
    # (datasheet); CUDA reports 143,771 MiB of it (nvidia-smi on an H200 SXM).
    "h200": dataclasses.replace(_H100, name="h200", description="NVIDIA H200", memory_bandwidth=4_800_000_000_000,
                                device_memory_size=150_754_820_096),
    # XLA's a100_sxm_80 spec: 108 SMs of 64 FP32 lanes at 1.41 GHz, HBM2e at 2.04 TB/s, 40 MiB of L2;
    # compute capability 8.0 has 164 KiB of shared memory per SM, 163 per block.
    "a100": GpuTarget("a100", "NVIDIA A100-SXM4-80GB", (8, 0), core_count=108, fpus_per_core=64,
                      clock_rate_ghz=1.41, memory_bandwidth=2_039_040_000_000, device_memory_size=85_100_068_864,
                      l2_cache_size=41_943_040, shared_memory_per_core=167_936,
                      shared_memory_per_block_optin=166_912),
    # XLA's b200 spec: 148 SMs of 128 FP32 lanes at 1.965 GHz, HBM3e at 7.67 TB/s (the datasheet's 8 TB/s
    # peak), 126.5 MiB of L2, 178.4 GiB that CUDA reports of the 180 GB; compute capability 10.0 keeps
    # Hopper's shared memory per SM and per block.
    "b200": dataclasses.replace(_H100, name="b200", description="NVIDIA B200", compute_capability=(10, 0),
                                core_count=148, clock_rate_ghz=1.965, memory_bandwidth=7_672_320_000_000,
                                device_memory_size=191_514_673_152, l2_cache_size=132_644_864),
}


def get(name: str) -> GpuTarget:
    """The packaged target of that name (case-insensitive)."""
    if (target := TARGETS.get(name.lower())) is None:
        raise InputError(f"unknown GPU target '{name}'; known: {', '.join(TARGETS)}")
    return target


def for_device_kind(kind: str) -> GpuTarget | None:
    """The packaged target whose device CUDA names `kind`, if any."""
    return next((t for t in TARGETS.values() if t.description == kind), None)


# Field numbers of XLA's GpuDeviceInfoProto (xla/stream_executor/device_description.proto), in the order
# its text form lists them; `tests/test_gpu_compile.py` reads a packaged target back through them.
_DEVICE_INFO_FIELDS = {1: "threads_per_block_limit", 2: "threads_per_warp", 3: "shared_memory_per_block",
                       4: "shared_memory_per_core", 5: "threads_per_core_limit", 6: "core_count", 7: "fpus_per_core",
                       8: "block_dim_limit_x", 9: "block_dim_limit_y", 10: "block_dim_limit_z",
                       11: "memory_bandwidth", 12: "l2_cache_size", 13: "clock_rate_ghz", 14: "device_memory_size",
                       15: "shared_memory_per_block_optin", 16: "compute_capability",
                       18: "registers_per_core_limit", 19: "registers_per_block_limit"}
# Where the device info sits in a serialized GPU topology (PjRtTopologyDescriptionProto): its platform-specific
# Any (9), the Any's value (2), GpuTopologyProto's target config (8), the config's device info (1).
_DEVICE_INFO_PATH = (9, 2, 8, 1)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        value, shift, pos = value | (byte & 0x7F) << shift, shift + 7, pos + 1
        if byte < 0x80:
            return value, pos


def _fields(data: bytes) -> dict[int, int | float | bytes]:
    """One protobuf message's fields by number (the last of a repeated one): integers, floats, or the bytes of
    a nested message or string. The wire format is all this needs: XLA ships no Python classes for it."""
    fields, pos = {}, 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields[number], pos = _varint(data, pos)
        elif wire == 5:
            fields[number], pos = round(struct.unpack_from("<f", data, pos)[0], 6), pos + 4
        elif wire == 1:
            fields[number], pos = struct.unpack_from("<d", data, pos)[0], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            fields[number], pos = data[pos:pos + size], pos + size
        else:
            raise InputError(f"unexpected protobuf wire type {wire} in a GPU topology")
    return fields


def read_device_info(serialized_topology: bytes) -> dict[str, int | float | str]:
    """The `gpu_device_info` of a serialized GPU topology (`jax.experimental.topologies.TopologyDescription
    .serialize()`, of the GPUs at hand or of a described cluster), by field name."""
    message = serialized_topology
    for number in _DEVICE_INFO_PATH:
        if not isinstance(message, bytes) or number not in (fields := _fields(message)):
            raise InputError("this topology carries no GPU device description (not a CUDA topology?)")
        message = fields[number]
    info = {_DEVICE_INFO_FIELDS[n]: value for n, value in _fields(message).items() if n in _DEVICE_INFO_FIELDS}
    capability = _fields(info.pop("compute_capability", b""))
    info["compute_capability"] = f"{capability.get(1, 0)}.{capability.get(2, 0)}"
    return info


def differences(own: dict, packaged: GpuTarget) -> list[tuple[str, object, object]]:
    """(field, the device's value, the packaged value) where a device's own description differs."""
    expected = packaged.device_info()
    return [(name, own.get(name), value) for name, value in expected.items() if own.get(name) != value]
