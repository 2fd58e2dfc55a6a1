"""High-bit planes: the bits of 5- and 6-bit integers above their low four, beside the 4-bit words
(packing) that hold the low four. GGUF's Q5 types keep a fifth bit the same way (Q6_K: two), so a
file's 5-bit weights stay 5 bits, not a byte each.

A row's high bits are bytes [S * planes * 32], S = ceil(K / 256) (the last super-block of 256
weights padded with zeros): for each block of 64 weights, 8 * planes bytes. A byte of the 4-bit
words holds weights 2p and 2p + 1 of a block (p = 0..31); their high parts (`planes` bits each)
lie in byte p % (8 * planes) of the block's bytes, at bits s and 4 + s, s = planes * (p // (8 *
planes)). The decode kernels widen a block's bits to the 32 bytes they multiply by copying its
bytes across the vector, one variable shift of its 32-bit lanes and two masks (AVX2's
vpbroadcast, vpsrlvd, vpand), where a plane a bit took a shuffle, a mask and a compare a plane and
half a block.
"""
from __future__ import annotations

import numpy as np

SUPER = 256   # weights in a super-block
BYTES = SUPER // 8   # a super-block's bytes for each plane


def places(planes: int) -> tuple[np.ndarray, np.ndarray]:
    """For each weight w of a block of 64: the byte of the block's 8 * planes that holds its high
    part, and the bit it starts at."""
    w = np.arange(64)
    p, width = w // 2, 8 * planes
    return p % width, planes * (p // width) + 4 * (w % 2)


def width(cols: int, planes: int) -> int:
    """Bytes a row of `cols` weights takes for `planes` planes."""
    return -(-cols // SUPER) * planes * BYTES


def count(high: np.ndarray, cols: int) -> int:
    """How many planes `high` [..., width] holds for rows of `cols` weights."""
    return high.shape[-1] // (-(-cols // SUPER) * BYTES)


def pack(top: np.ndarray, planes: int) -> np.ndarray:
    """The integers' high parts top [n, K] (each below 2**planes) -> uint8 [n, width]."""
    n, K = top.shape
    S = -(-K // SUPER)
    padded = np.zeros((n, S * SUPER // 64, 64), np.uint8)
    padded.reshape(n, -1)[:, :K] = top
    out = np.zeros((n, S * SUPER // 64, 8 * planes), np.uint8)
    byte, shift = places(planes)
    for w in range(64):
        out[..., byte[w]] |= padded[..., w] << np.uint8(shift[w])
    return out.reshape(n, -1)


def unpack(high: np.ndarray, cols: int) -> np.ndarray:
    """uint8 [n, width] -> the high parts [n, cols], the inverse of `pack`."""
    n = high.shape[0]
    planes = count(high, cols)
    byte, shift = places(planes)
    blocks = high.reshape(n, -1, 8 * planes)
    top = (blocks[..., byte] >> shift.astype(np.uint8)) & np.uint8((1 << planes) - 1)
    return top.reshape(n, -1)[:, :cols]
