"""FP8 block-quantised weights, as DeepSeek-V3's and Kimi K2's checkpoints store them, read lazily and
dequantised.

A weight W [out, in] is stored as float8 e4m3 (`<name>`, F8_E4M3) beside `<name>_scale_inv` [⌈out/b⌉, ⌈in/b⌉]
float32, one factor per b × b block (config.json's `quantization_config`: quant_method fp8, fmt e4m3,
`weight_block_size` [b, b], 128 on the Hub): W = fp8 · scale_inv of its block. Each device reads only the
blocks its part of W covers. safetensors' numpy reader has no float8 type, so the codes are memory-mapped from
the file as bytes and viewed as `ml_dtypes.float8_e4m3fn`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from meshpar.errors import InputError

SUFFIX = "_scale_inv"


def scaled_names(names) -> set[str]:
    """The tensors a checkpoint holds block-quantised: each `<name>` with a `<name>_scale_inv` beside it."""
    names = set(names)
    return {n for n in names if n + SUFFIX in names}


def block_size(config: dict) -> int | None:
    """b of a config.json's `quantization_config` (None: none), refused where meshpar cannot read it."""
    quant = config.get("quantization_config")
    if not quant or quant.get("quant_method") == "mxfp4":  # gpt-oss's experts: `mxfp4`
        return None
    b = quant.get("weight_block_size") or [128, 128]
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3" or len(b) != 2 or b[0] != b[1]:
        raise InputError(f"config.json: quantization_config = {json.dumps(quant)} is not implemented: meshpar reads "
                         f"FP8 e4m3 weights in square blocks (quant_method fp8, weight_block_size [b, b])")
    return int(b[0])


def _codes(path: Path, name: str) -> np.ndarray:
    """The float8 codes of tensor `name` of the safetensors file `path`, memory-mapped [out, in]."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(size))[name]
    if entry["dtype"] != "F8_E4M3" or len(entry["shape"]) != 2:
        raise InputError(f"{name}: {entry['dtype']} {entry['shape']} beside {name}{SUFFIX}: block-quantised weights "
                         f"are F8_E4M3 matrices")
    start = 8 + size + entry["data_offsets"][0]
    return np.memmap(path, np.uint8, "r", offset=start, shape=tuple(entry["shape"]))


class BlockScaled:
    """One block-quantised weight, sliceable as a safetensors slice of the dequantised W [out, in] is."""

    def __init__(self, name: str, path: Path, scales, block: int):
        self.codes, self.scales, self.block = _codes(path, name), scales, block  # scales: a safetensors slice
        out, inp = self.codes.shape
        wanted = [-(-out // block), -(-inp // block)]
        if list(scales.get_shape()) != wanted or scales.get_dtype() != "F32":
            raise InputError(f"{name}{SUFFIX} is {scales.get_dtype()} {scales.get_shape()}; weight_block_size "
                             f"{block} needs F32 {wanted} for {name} [{out}, {inp}]")

    def get_shape(self) -> list[int]:
        return list(self.codes.shape)

    def get_dtype(self) -> str:
        return "FP8_BLOCKS"

    def __getitem__(self, index: tuple[slice, slice]) -> np.ndarray:
        (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(index, self.codes.shape))
        b = self.block
        scale = self.scales[r0 // b:-(-r1 // b), c0 // b:-(-c1 // b)]
        scale_rc = np.repeat(np.repeat(scale, b, 0), b, 1)[r0 % b:r0 % b + r1 - r0, c0 % b:c0 % b + c1 - c0]
        return self.codes[r0:r1, c0:c1].view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale_rc
