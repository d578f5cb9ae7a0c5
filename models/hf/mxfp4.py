"""MXFP4 expert weights (OCP Microscaling FP4), as gpt-oss's checkpoints store them, read lazily and dequantised.

A weight W [E, in, out] (Hugging Face's fused-expert layout) is stored transposed and in blocks of 32 along
`in`: `<name>_blocks` [E, out, in / 32, 16] uint8, each byte two FP4 (E2M1) codes, the low nibble first, and
`<name>_scales` [E, out, in / 32] uint8, one power-of-two exponent per block (E8M0, bias 127). An element is
FP4_E2M1[code] · 2^(scale − 127); every such value is exact in float32 (and in bfloat16).
"""

from __future__ import annotations

import numpy as np

from meshpar.errors import InputError

# The 16 values of an E2M1 code: sign bit, 2 exponent bits, 1 mantissa bit
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # elements per scale
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents → [..., G · 32] float32."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    exponents = scales.astype(np.int32)[..., None] - 127
    return np.ldexp(FP4_E2M1[codes], exponents).reshape(*blocks.shape[:-2], -1)


def packed_names(names) -> set[str]:
    """The tensors a checkpoint holds as MXFP4: each `<name>` with both `<name>_blocks` and `<name>_scales`."""
    names = set(names)
    return {n[:-len(SUFFIXES[0])] for n in names
            if n.endswith(SUFFIXES[0]) and n[:-len(SUFFIXES[0])] + SUFFIXES[1] in names}


class Packed:
    """One MXFP4 tensor, sliceable as a safetensors slice of the dequantised W [E, in, out] is: an index of
    contiguous slices reads only the blocks it covers."""

    def __init__(self, name: str, blocks, scales):
        self.blocks, self.scales = blocks, scales  # safetensors slices
        shape, dtypes = tuple(blocks.get_shape()), (blocks.get_dtype(), scales.get_dtype())
        if len(shape) != 4 or shape[3] != BLOCK // 2 or tuple(scales.get_shape()) != shape[:3] or dtypes != ("U8",) * 2:
            raise InputError(f"{name}_blocks {list(shape)} {dtypes[0]} and {name}_scales {scales.get_shape()} "
                             f"{dtypes[1]} are not MXFP4: uint8 [E, out, in / 32, 16] and [E, out, in / 32]")

    def get_shape(self) -> list[int]:
        E, out, G, _ = self.blocks.get_shape()
        return [E, G * BLOCK, out]

    def get_dtype(self) -> str:
        return "MXFP4"

    def __getitem__(self, index: tuple[slice, slice, slice]) -> np.ndarray:
        (e0, e1, _), (i0, i1, _), (o0, o1, _) = (s.indices(n) for s, n in zip(index, self.get_shape()))
        g0, g1 = i0 // BLOCK, -(-i1 // BLOCK)
        w_EOI = dequantize(self.blocks[e0:e1, o0:o1, g0:g1], self.scales[e0:e1, o0:o1, g0:g1])
        return w_EOI[:, :, i0 - g0 * BLOCK:i1 - g0 * BLOCK].transpose(0, 2, 1)
