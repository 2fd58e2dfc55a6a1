"""16-bit float weights (bfloat16, float16; a formats.half.HalfTensor) run from their bits:
widened to float32 on the fly, never copied whole.

Decode (a few tokens) reads each weight once and is bound by memory bandwidth: half the bytes of
float32. More tokens go through prefill.py's tiles, a row at a time widened by `widen_row`.
"""
import numpy as np
from numba import njit, prange

from .cpu import _jit
from .simd import fma, half_to_f32, hsum, load_f32x8, load_half_f32x8, zero_f32


@njit(parallel=True, **_jit)
def matvec_rows(x, w, out, accumulate):
    """out[B, N] (+)= x[B, K] @ W.T for a HalfTensor W [N, K], shapes checked by the caller
    (linear.qmatmul). Each thread a range of rows, each row one sequential stream (read from
    memory once, from L1 for the other rows of x) of 16 values a step into two accumulators of
    8 float32 lanes; K % 16 leftovers one by one. Each output in the same order whatever B."""
    bits, bf16 = w.bits, w.bf16
    N, K = bits.shape
    K16 = K - K % 16
    for j in prange(N):
        n = np.int64(j)              # prange's index is unsigned: n * K would type as float
        row = n * K                  # flat index of W[n, 0]
        for r in range(x.shape[0]):
            xr = r * K               # flat index of x[r, 0]
            a0, a1 = zero_f32(), zero_f32()
            for k in range(0, K16, 16):
                a0 = fma(load_f32x8(x, xr + k), load_half_f32x8(bits, row + k, bf16), a0)
                a1 = fma(load_f32x8(x, xr + k + 8), load_half_f32x8(bits, row + k + 8, bf16), a1)
            s = hsum(a0) + hsum(a1)
            for k in range(K16, K):
                s += x[r, k] * half_to_f32(bits[n, k], bf16)
            out[r, n] = out[r, n] + s if accumulate else s


@njit(inline="always", **_jit)
def widen_row(w, n, row):
    """row[:K] = W[n] as float32 (exact)."""
    bits, bf16 = w.bits, w.bf16
    for k in range(bits.shape[1]):
        row[k] = half_to_f32(bits[n, k], bf16)
