"""Scales or biases in two levels, as GGUF's K-quants keep them: per super-block of 256 weights a
float16, and per group of the super-block one small integer; a group's value is the float16 times
its integer. A K-quant's d * sc is no float16 in general: one float per group would take 32 bits
where these take 8, plus 16 a super-block (Q4_K's weights at 4.625 bits, not 6).

Stored as one byte array [N, K/256, 2 + 256/G]: for each super-block the float16's two bytes
(little-endian), then its groups' integers, uint8 (Q4_K's and Q5_K's 6-bit scales and mins) or
int8 where they have a sign (IQ4_XS's ls - 32): the array's dtype says which. A group's
value is float32(f16) * float32(integer): the one product ggml's dequantization takes, so a
weight comes out as the file's exactly.
"""
from __future__ import annotations

import numpy as np

SUPER = 256   # weights in a super-block


def shape(rows: int, cols: int, group_size: int) -> tuple[int, int, int]:
    """The array's shape for a matrix [rows, cols] in groups of group_size."""
    return rows, cols // SUPER, 2 + SUPER // group_size


def is_two_level(a) -> bool:
    """Whether scales or biases `a` are stored in two levels (bytes; else one float a group)."""
    return getattr(a, "dtype", None) in (np.uint8, np.int8)


def pack(supers: np.ndarray, ints: np.ndarray) -> np.ndarray:
    """float16 supers [n, S] and integers [n, S*P] (uint8, or int8 with a sign) -> [n, S, 2 + P]
    of their dtype."""
    n, S = supers.shape
    out = np.empty((n, S, 2 + ints.shape[1] // S), ints.dtype)
    out.view(np.uint8)[:, :, :2] = np.ascontiguousarray(supers, "<f2").view(np.uint8).reshape(n, S, 2)
    out[:, :, 2:] = ints.reshape(n, S, -1)
    return out


def supers(a: np.ndarray) -> np.ndarray:
    """The float16 of each super-block, as float32 [N, S]."""
    return np.ascontiguousarray(a[:, :, :2]).view(np.uint8).view("<f2")[..., 0].astype(np.float32)


def expand(a: np.ndarray) -> np.ndarray:
    """Every group's value, float32 [N, K/G]."""
    return (supers(a)[..., None] * a[:, :, 2:].astype(np.float32)).reshape(len(a), -1)
