"""Quantized prefill (several tokens): out[T, N] (+)= x[T, K] @ W.T for a prepared
QuantizedTensor W, and W's dequantization (whole, or the rows of an embedding lookup).

Prefill is bound by arithmetic: a tile of rows is dequantized to float32 once and multiplied with
a register-blocked float micro-kernel (simd.py vectors), exact in float32.
"""
import numpy as np
from numba import njit, prange

from .simd import fma, hsum, load_f32x8, zero_f32

_jit = dict(fastmath=True, cache=True, nogil=True)
f32 = np.float32

TILE = 24   # rows dequantized at a time: 24 x K float32 (55 KB at K = 576) stays in L2


@njit(**_jit)
def _dequantize_row(qw, q, n, w):
    """w[K] = scales * q + biases for row n of qw, whose words q views as bytes (slices keep
    every index provably >= 0, which lets LLVM vectorize)."""
    G = qw.group_size
    for g in range(qw.scales.shape[1]):
        s, b = qw.scales[n, g], qw.biases[n, g]
        wg = w[g * G:(g + 1) * G]
        if qw.bits == 8:
            qg = q[n, g * G:(g + 1) * G]
            for k in range(G):
                wg[k] = s * f32(qg[k]) + b
        else:
            qg = q[n, g * G // 2:(g + 1) * G // 2]
            for j in range(G // 2):
                wg[2 * j] = s * f32(qg[j] & 15) + b
                wg[2 * j + 1] = s * f32(qg[j] >> 4) + b


@njit(inline="always", **_jit)
def _tile_4x3(x, w, out, t, r, n, accumulate):
    """out[t:t+4, n:n+3] (+)= x[t:t+4] @ w[r:r+3].T: 12 accumulators of 8 lanes along k, 7 loads
    for 12 FMAs a step; the lanes are summed once at the end."""
    a00 = a01 = a02 = a10 = a11 = a12 = a20 = a21 = a22 = a30 = a31 = a32 = zero_f32()
    w0, w1, w2 = w[r], w[r + 1], w[r + 2]
    x0, x1, x2, x3 = x[t], x[t + 1], x[t + 2], x[t + 3]
    for k in range(0, x.shape[1], 8):
        v0, v1, v2 = load_f32x8(w0, k), load_f32x8(w1, k), load_f32x8(w2, k)
        u = load_f32x8(x0, k)
        a00, a01, a02 = fma(u, v0, a00), fma(u, v1, a01), fma(u, v2, a02)
        u = load_f32x8(x1, k)
        a10, a11, a12 = fma(u, v0, a10), fma(u, v1, a11), fma(u, v2, a12)
        u = load_f32x8(x2, k)
        a20, a21, a22 = fma(u, v0, a20), fma(u, v1, a21), fma(u, v2, a22)
        u = load_f32x8(x3, k)
        a30, a31, a32 = fma(u, v0, a30), fma(u, v1, a31), fma(u, v2, a32)
    _put3(out, t, n, hsum(a00), hsum(a01), hsum(a02), accumulate)
    _put3(out, t + 1, n, hsum(a10), hsum(a11), hsum(a12), accumulate)
    _put3(out, t + 2, n, hsum(a20), hsum(a21), hsum(a22), accumulate)
    _put3(out, t + 3, n, hsum(a30), hsum(a31), hsum(a32), accumulate)


@njit(inline="always", **_jit)
def _put3(out, t, n, v0, v1, v2, accumulate):
    if accumulate:
        v0 += out[t, n]
        v1 += out[t, n + 1]
        v2 += out[t, n + 2]
    out[t, n], out[t, n + 1], out[t, n + 2] = v0, v1, v2


@njit(inline="always", **_jit)
def _dots(x, w, out, t0, t1, r0, r1, n0, accumulate):
    """The edges of a tile, one dot product at a time."""
    for t in range(t0, t1):
        for r in range(r0, r1):
            a = zero_f32()
            for k in range(0, x.shape[1], 8):
                a = fma(load_f32x8(x[t], k), load_f32x8(w[r], k), a)
            out[t, n0 + r] = out[t, n0 + r] + hsum(a) if accumulate else hsum(a)


@njit(parallel=True, **_jit)
def matmul(x, qw, out, accumulate):
    """out[T, N] (+)= x[T, K] @ W.T, shapes checked by the caller (linear.qmatmul)."""
    T, K = x.shape
    q = qw.weight.view(np.uint8)                           # [N, K*bits/8]
    N = q.shape[0]
    for tile in prange((N + TILE - 1) // TILE):
        n0 = tile * TILE
        rows = min(N, n0 + TILE) - n0
        w = np.empty((TILE, K), np.float32)                # [rows, K] dequantized
        for r in range(rows):
            _dequantize_row(qw, q, n0 + r, w[r])
        t = 0
        while t + 4 <= T:
            r = 0
            while r + 3 <= rows:
                _tile_4x3(x, w, out, t, r, n0 + r, accumulate)
                r += 3
            _dots(x, w, out, t, t + 4, r, rows, n0, accumulate)
            t += 4
        _dots(x, w, out, t, T, 0, rows, n0, accumulate)


@njit(parallel=True, **_jit)
def dequantize(qw):
    """W as float32 [N, K]."""
    q = qw.weight.view(np.uint8)
    N, K = q.shape[0], q.shape[1] * 8 // qw.bits
    w = np.empty((N, K), np.float32)
    for n in prange(N):
        _dequantize_row(qw, q, n, w[n])
    return w


@njit(**_jit)
def dequantize_rows(qw, ids):
    """W[ids] as float32 [len(ids), K]: the embedding lookup of a quantized embedding table."""
    q = qw.weight.view(np.uint8)
    N, K = q.shape[0], q.shape[1] * 8 // qw.bits
    w = np.empty((len(ids), K), np.float32)
    for i in range(len(ids)):
        if ids[i] < 0 or ids[i] >= N:
            raise IndexError("dequantize_rows: token id out of range")
        _dequantize_row(qw, q, ids[i], w[i])
    return w
