"""MXFP4 (the OCP microscaling format): 4-bit E2M1 values, and for each block of 32 one power of
two, an E8M0 byte e (the scale 2^(e - 127)). gpt-oss's checkpoints store their experts so
(`*_blocks`: 16 bytes a block, byte j holding values 2j and 2j + 1 in its low and high nibble, as
MLX packs 4 bits; `*_scales`: the bytes e). nibble holds them exactly at their size, as 4-bit
integers read through a table of levels (quant.affine.QuantizedTensor.values): the level of a
code is 2 * E2M1 + 12 (0..24), so that w = 2^(e - 128) * level - 12 * 2^(e - 128), a bfloat16
scale and bias (powers of two and 1.5 times them: exact, where float16's range is too narrow).
"""
from __future__ import annotations

import numpy as np

from .errors import FormatError
from .half import HalfTensor

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
LEVELS = (2 * E2M1 + 12).astype(np.uint8)   # the table of levels, one a 4-bit code
OFFSET = 12


def words(blocks: np.ndarray) -> np.ndarray:
    """Blocks uint8 [..., K/32, 16] as MLX's packed 4-bit words uint32 [..., K/8] (a view when
    they are contiguous)."""
    return np.ascontiguousarray(blocks).reshape(*blocks.shape[:-2], -1).view("<u4")


def scales_biases(e: np.ndarray, name: str) -> tuple[HalfTensor, HalfTensor]:
    """The bfloat16 scale 2^(e - 128) and bias -12 * 2^(e - 128) of each block, e its E8M0 byte."""
    e = np.asarray(e)
    if e.dtype != np.uint8:
        raise FormatError(f"{name} should hold MXFP4's scales as uint8, got {e.dtype}")
    if e.size and e.max() > 251:   # 255 is E8M0's NaN; from 252 a level times its scale overflows float32
        raise FormatError(f"{name} holds an MXFP4 scale of 2^{int(e.max()) - 127}, beyond what nibble reads")
    scale = np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)
    bf16 = lambda a: HalfTensor((a.view(np.uint32) >> 16).astype(np.uint16), True)   # exact: the low bits are 0
    return bf16(scale), bf16(np.float32(-OFFSET) * scale)
