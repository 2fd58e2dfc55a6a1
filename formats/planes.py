"""High-bit planes: the bits of 5- and 6-bit integers above their low four, a plane a bit, beside
the 4-bit words (packing) that hold the low four. GGUF's Q5 types keep a fifth bit the same way
(Q6_K: two), so a file's 5-bit weights stay 5 bits, not a byte each.

A row's planes are bytes [S * planes * 32], S = ceil(K / 256): for each super-block of 256
weights (the last one padded with zeros) and each plane j (bit 4 + j of the integers) 32 bytes,
the 64-bit little-endian words of its four blocks of 64 weights. Weight i of a block has bit
(i % 2) * 32 + i // 2 of its word: a byte of the 4-bit words holds weights 2p and 2p + 1, so the
even weights' bits are the word's low half and the odd weights' its high half, each in the order
of the bytes (the decode kernels widen a half to the 32 bytes they multiply in one step).
"""
from __future__ import annotations

import numpy as np

SUPER = 256   # weights in a super-block
BYTES = SUPER // 8   # a plane's bytes a super-block
# PLACE[b]: the weight (of a block of 64) whose bit is bit b of the block's word
PLACE = np.array([2 * (b % 32) + b // 32 for b in range(64)])


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
    padded = np.zeros((n, S * SUPER), np.uint8)
    padded[:, :K] = top
    blocks = padded.reshape(n, S, 1, 4, 64)[..., PLACE]                 # [n, S, 1, 4, bit]
    bits = (blocks >> np.arange(planes, dtype=np.uint8).reshape(1, 1, planes, 1, 1)) & np.uint8(1)
    return np.packbits(bits, axis=-1, bitorder="little").reshape(n, -1)  # [n, S * planes * 32]


def unpack(high: np.ndarray, cols: int) -> np.ndarray:
    """uint8 [n, width] -> the high parts [n, cols], the inverse of `pack`."""
    n = high.shape[0]
    planes = count(high, cols)
    bits = np.unpackbits(high.reshape(n, -1, planes, 4, 8), axis=-1, bitorder="little")   # [n, S, planes, 4, 64]
    top = np.zeros(bits.shape[:2] + (4, 64), np.uint8)
    for j in range(planes):
        top[..., PLACE] |= bits[:, :, j] << np.uint8(j)
    return top.reshape(n, -1)[:, :cols]
