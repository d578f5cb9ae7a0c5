"""Accelerator presets (the planner's hardware, and the datasheet peaks MFU is measured against), and a
custom spec from the command line.

Every number is per GPU and in bytes, bytes/s or FLOP/s (decimal units: 1 GB = 1e9 bytes, as the
datasheets print them). `link_bw` is NVLink (inside a host), one direction; `net_bw` is the network
(across hosts) per GPU, one direction: one 400 Gb/s (H100, H200) or 200 Gb/s (A100) NIC per GPU, as in
the DGX systems. Collective times use these with `net_efficiency` (NCCL reaches ~80% of a link's
bandwidth on large messages) and a per-step latency (`link_latency`, `net_latency`). Host offload
(`parallel.offload`, `train.remat=offload`) uses `host_bw`, the host↔device link per GPU, one direction
(PCIe, or NVLink-C2C on a Grace Hopper superchip), at the same `net_efficiency` (an assumption: not
measured here), and `host_mem`, the host's memory per GPU (a DGX host's RAM over its 8 GPUs); a spec
without them (0) is never planned with offload.

    h100                     the presets below
    h100,hbm=94e9            a preset with fields replaced
    flops=312e12,hbm=40e9,hbm_bw=1.6e12,link_bw=300e9,net_bw=25e9   every required field given
    ...,host_bw=32e9,host_mem=250e9                                  and the host, for offload
"""

from __future__ import annotations

import dataclasses

from meshpar.errors import InputError


REQUIRED = ("flops", "hbm", "hbm_bw", "link_bw", "net_bw")


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # peak dense bf16 FLOP/s (no sparsity)
    hbm: float  # memory bytes
    hbm_bw: float  # memory bandwidth, bytes/s
    link_bw: float  # NVLink bandwidth per GPU per direction, bytes/s
    net_bw: float  # network bandwidth per GPU per direction, bytes/s
    link_latency: float = 5e-6  # seconds per step of a collective inside a host
    net_latency: float = 15e-6  # seconds per step across hosts
    net_efficiency: float = 0.8  # fraction of link bandwidth a large collective (or host copy) reaches
    fp32_flops: float = 0.0  # float32 matmul FLOP/s (0: bf16 peak / 2); JAX runs f32 matmuls as TF32 on GPUs
    fp8_flops: float = 0.0  # FP8 matmul FLOP/s, dense (0: no FP8 tensor cores)
    host_bw: float = 0.0  # host↔device bandwidth per GPU per direction, bytes/s (0: not given, no offload)
    host_mem: float = 0.0  # host memory per GPU, bytes (0: not given, no offload)

    def __post_init__(self):
        for field in REQUIRED:
            if not getattr(self, field) > 0:
                raise InputError(f"hardware '{self.name}': {field} = {getattr(self, field)} must be > 0")
        for field in ("host_bw", "host_mem", "fp8_flops"):
            if getattr(self, field) < 0:
                raise InputError(f"hardware '{self.name}': {field} = {getattr(self, field)} must be >= 0 "
                                 f"(0: not given)")

    @property
    def offloads(self) -> bool:
        """Whether the host is known well enough to plan host offload."""
        return self.host_bw > 0 and self.host_mem > 0

    def peak(self, dtype_bytes: int) -> float:
        """Peak matmul FLOP/s for the compute dtype (1 byte: FP8, 0 where there are no FP8 tensor cores;
        2: bf16; 4: float32)."""
        if dtype_bytes == 1:
            return self.fp8_flops
        return self.flops if dtype_bytes == 2 else (self.fp32_flops or self.flops / 2)


PRESETS = {
    # NVIDIA H100 SXM5 80GB datasheet: BF16 Tensor Core 1,979 TFLOPS *with sparsity* → 989 dense;
    # HBM3 80 GB at 3.35 TB/s; NVLink 4 900 GB/s per GPU (both directions) → 450 GB/s each way.
    # DGX H100 datasheet: 8× ConnectX-7 400 Gb/s (one per GPU) → 50 GB/s per GPU each way.
    # TF32 Tensor Core 989 TFLOPS sparse → 494 dense (JAX's default precision for f32 matmuls on GPUs);
    # FP8 Tensor Core 3,958 TFLOPS sparse → 1,979 dense.
    # Host: PCIe Gen5 x16, 128 GB/s (datasheet, both directions) → 64 GB/s each way; DGX H100: 2 TB of
    # system memory for 8 GPUs → 250 GB per GPU.
    "h100": Hardware("h100", flops=989e12, hbm=80e9, hbm_bw=3.35e12, link_bw=450e9, net_bw=50e9,
                     fp32_flops=494e12, fp8_flops=1979e12, host_bw=64e9, host_mem=250e9),
    # NVIDIA H200 SXM datasheet: same compute as H100 (BF16 1,979 TFLOPS sparse → 989 dense, FP8 1,979 dense);
    # HBM3e 141 GB at 4.8 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s. DGX H200: 8× 400 Gb/s ConnectX-7,
    # 2 TB of system memory.
    "h200": Hardware("h200", flops=989e12, hbm=141e9, hbm_bw=4.8e12, link_bw=450e9, net_bw=50e9,
                     fp32_flops=494e12, fp8_flops=1979e12, host_bw=64e9, host_mem=250e9),
    # NVIDIA A100 80GB SXM datasheet: BF16 Tensor Core 312 TFLOPS dense (624 sparse); HBM2e 80 GB at
    # 2,039 GB/s; NVLink 3 600 GB/s per GPU → 300 each way; PCIe Gen4 64 GB/s → 32 each way. DGX A100
    # (640 GB): 8× 200 Gb/s HDR InfiniBand (one per GPU) → 25 GB/s each way; 2 TB of system memory.
    # TF32 156 TFLOPS dense. No FP8 tensor cores (Ampere).
    "a100": Hardware("a100", flops=312e12, hbm=80e9, hbm_bw=2.039e12, link_bw=300e9, net_bw=25e9,
                     fp32_flops=156e12, host_bw=32e9, host_mem=250e9),
    # NVIDIA HGX B200 datasheet: BF16 Tensor Core 4.5 PFLOPS *with sparsity* → 2.25 dense (TF32 2.2 → 1.1,
    # FP8 9 → 4.5).
    # DGX B200 datasheet, over its 8 GPUs: 1,440 GB of HBM3e at 64 TB/s → 180 GB at 8 TB/s; NVLink 5 1.8 TB/s per GPU → 900 GB/s each way; 8× ConnectX-7 400 Gb/s →
    # 50 GB/s; PCIe Gen5 64 GB/s each way; 2 TB of system memory → 250 GB per GPU.
    "b200": Hardware("b200", flops=2.25e15, hbm=180e9, hbm_bw=8e12, link_bw=900e9, net_bw=50e9,
                     fp32_flops=1.1e15, fp8_flops=4.5e15, host_bw=64e9, host_mem=250e9),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: the H100 GPU's compute (BF16 1,979 TFLOPS sparse →
    # 989 dense, FP8 1,979 dense) with 96 GB HBM3 at 4 TB/s; NVLink 900 GB/s to other GPUs; NVLink-C2C 900 GB/s to the
    # Grace CPU (both directions → 450 each way) and its 480 GB LPDDR5X (at up to 512 GB/s, so the
    # link is the limit), one GPU per superchip. Network: one 400 Gb/s NIC per superchip assumed, as in
    # the DGX systems. (Its device kind contains "h200": meshpar.mfu finds that preset, the same peak.)
    "gh200": Hardware("gh200", flops=989e12, hbm=96e9, hbm_bw=4e12, link_bw=450e9, net_bw=50e9,
                      fp32_flops=494e12, fp8_flops=1979e12, host_bw=450e9, host_mem=480e9),
}
ALIASES = {"h100-sxm": "h100", "h100_sxm": "h100", "a100-80gb": "a100", "a100_80gb": "a100"}
_FIELDS = [f.name for f in dataclasses.fields(Hardware) if f.name != "name"]


def for_device_kind(kind: str) -> Hardware | None:
    """The preset of a GPU by its device kind (e.g. "NVIDIA H100 80GB HBM3"); None where none matches."""
    return next((hw for name, hw in PRESETS.items() if name in kind.lower()), None)


def parse(text: str) -> Hardware:
    """A preset name, `preset,key=value,...`, or a full `key=value,...` spec (see the module docstring)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise InputError(f"empty hardware spec; presets: {', '.join(PRESETS)}")
    base, changes = None, {}
    if "=" not in items[0]:
        name = ALIASES.get(items[0].lower(), items[0].lower())
        if name not in PRESETS:
            raise InputError(f"unknown hardware '{items[0]}'; presets: {', '.join(PRESETS)}, or a custom spec "
                             f"'flops=...,hbm=...,hbm_bw=...,link_bw=...,net_bw=...'")
        base, items = PRESETS[name], items[1:]
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _FIELDS:
            raise InputError(f"hardware spec item '{item}': expected KEY=VALUE with KEY one of {', '.join(_FIELDS)}")
        try:
            changes[key] = float(value)
        except ValueError:
            raise InputError(f"hardware spec item '{item}': '{value}' is not a number") from None
    if base is not None:
        return dataclasses.replace(base, name=text, **changes) if changes else base
    missing = [f for f in REQUIRED if f not in changes]
    if missing:
        raise InputError(f"custom hardware spec '{text}' lacks {', '.join(missing)} (or start from a preset: "
                         f"{', '.join(PRESETS)})")
    return Hardware(name="custom", **changes)
