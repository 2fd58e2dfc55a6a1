"""Bit packing: the one place that knows how quantized integers sit in MLX's uint32 words.

Element k of a row lives in word k*bits//32 at bit offset (k*bits) % 32: low bits first along the
input dimension. For bits that divide 8 that is exactly little-endian bytes with element 2j in the
low nibble of byte j (4-bit) or element j in byte j (8-bit), so we pack bytes and view them as
'<u4' instead of shifting 32-bit words.
"""
from __future__ import annotations

import numpy as np

PACKABLE_BITS = (2, 4, 8)  # widths that divide a byte; 3, 5 and 6 would straddle words


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack integers q (uint8 [out, in], each < 2**bits) into uint32 [out, in*bits//32]."""
    per_byte = _per_byte(bits)
    rows, n = q.shape
    if n * bits % 32:
        raise ValueError(f"a row of {n} {bits}-bit values does not fill whole 32-bit words")
    q = q.astype(np.uint8, copy=False)
    packed = np.zeros((rows, n // per_byte), dtype=np.uint8)  # [out, in*bits/8]
    for j in range(per_byte):
        packed |= q[:, j::per_byte] << np.uint8(j * bits)
    return packed.view("<u4").astype(np.uint32, copy=False)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Unpack uint32 [out, in*bits//32] into uint8 [out, in], the inverse of `pack`."""
    per_byte = _per_byte(bits)
    rows = packed.shape[0]
    data = np.ascontiguousarray(packed, dtype="<u4").view(np.uint8)  # [out, in*bits/8]
    mask = np.uint8((1 << bits) - 1)
    q = np.empty((rows, data.shape[1], per_byte), dtype=np.uint8)  # [out, in*bits/8, per_byte]
    for j in range(per_byte):
        q[:, :, j] = (data >> np.uint8(j * bits)) & mask
    return q.reshape(rows, -1)


def _per_byte(bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"cannot pack {bits}-bit values: supported widths are {PACKABLE_BITS}")
    return 8 // bits
