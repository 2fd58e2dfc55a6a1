"""Prefill (more than cpu.SMALL tokens) through a quantized or 16-bit float weight W: out[T, N] (+)= x[T, K]
@ W.T, and W as float32 (whole, or the rows of an embedding lookup).

Prefill is bound by arithmetic: a tile of rows is made float32 once (dequantized: a prepared
QuantizedTensor; widened: a HalfTensor, see half.py) and multiplied with a register-blocked float
micro-kernel (simd.py vectors), exact in float32. `float_row` is the one step that knows W's kind.
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from nibble.formats.half import HalfTensor
from nibble.quant.affine import QuantizedTensor
from . import half
from .cpu import INNER, _jit
from .simd import fma, group_scale_bias, high_of, hsum, level, load_f32x8, plane_count, zero_f32

f32 = np.float32

TILE = 24   # rows made float32 at a time: 24 x K float32 (55 KB at K = 576) stays in L2


def float_row(w, n, row):
    """row[:K] = W[n] as float32, for a quantized or 16-bit weight (njit code only: chosen at
    compile time from w's numba type)."""


def dims(w):
    """(N, K) of a quantized or 16-bit weight (njit code only: numba sees a named tuple's fields,
    not its properties)."""


def _is(w, cls) -> bool:
    return isinstance(w, types.BaseNamedTuple) and issubclass(w.instance_class, cls)


@overload(float_row)
def _float_row(w, n, row):
    if _is(w, QuantizedTensor):
        return lambda w, n, row: _dequantize_row(w, n, row)
    if _is(w, HalfTensor):
        return lambda w, n, row: half.widen_row(w, n, row)


@overload(dims)
def _dims(w):
    if _is(w, QuantizedTensor):
        return lambda w: (w.weight.shape[0], w.weight.shape[1] * 32 // w.bits)
    if _is(w, HalfTensor):
        return lambda w: w.bits.shape


@njit(**_jit, **INNER)
def _dequantize_row(qw, n, w):
    """w[K] = scales * q + biases (q's level, where qw has a table; with its high bits, where it has
    planes) for row n of qw, its words q viewed as bytes (slices keep
    every index provably >= 0, which lets LLVM vectorize)."""
    q = qw.weight.view(np.uint8)                           # [N, K*bits/8]
    G = qw.group_size
    hb = plane_count(qw.high, w.shape[0])
    for g in range(qw.weight.shape[1] * 32 // qw.bits // G):
        s, b = group_scale_bias(qw, n, g)
        wg = w[g * G:(g + 1) * G]
        if qw.bits == 8:
            qg = q[n, g * G:(g + 1) * G]
            for k in range(G):
                wg[k] = s * f32(qg[k]) + b
        else:
            qg = q[n, g * G // 2:(g + 1) * G // 2]
            for j in range(G // 2):
                k = g * G + 2 * j
                wg[2 * j] = s * f32(level(qw.values, qg[j] & 15) | high_of(qw.high, n, k, hb) << 4) + b
                wg[2 * j + 1] = s * f32(level(qw.values, qg[j] >> 4) | high_of(qw.high, n, k + 1, hb) << 4) + b


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
def _put2(out, t, n, v0, v1, accumulate):
    if accumulate:
        v0 += out[t, n]
        v1 += out[t, n + 1]
    out[t, n], out[t, n + 1] = v0, v1


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


@njit(**_jit)
def matmul(x, w, out, accumulate):
    """out[T, N] (+)= x[T, K] @ W.T, shapes checked by the caller (linear.qmatmul).

    The micro-kernel steps 8 lanes along k: a K that is no multiple of 8 (a 16-bit weight's;
    a quantized row is whole groups) runs on a copy of x padded with zeros."""
    T, K = x.shape
    if K % 8 == 0:
        _tiles(x, w, out, accumulate)
    else:
        xp = np.zeros((T, K + 8 - K % 8), np.float32)      # [T, Kp]
        xp[:, :K] = x
        _tiles(xp, w, out, accumulate)


@njit(parallel=True, **_jit, **INNER)
def _tiles(x, w, out, accumulate):
    """out (+)= x[T, Kp] @ W.T, x's columns from K on zeros (and so the tiles')."""
    T, Kp = x.shape
    N, K = dims(w)
    for tile in prange((N + TILE - 1) // TILE):
        n0 = tile * TILE
        rows = min(N, n0 + TILE) - n0
        wt = np.empty((TILE, Kp), np.float32)              # [rows, Kp] W[n0:n0+rows] as float32
        for r in range(rows):
            float_row(w, n0 + r, wt[r])
            for k in range(K, Kp):
                wt[r, k] = 0
        t = 0
        while t + 4 <= T:
            r = 0
            while r + 3 <= rows:
                _tile_4x3(x, wt, out, t, r, n0 + r, accumulate)
                r += 3
            _dots(x, wt, out, t, t + 4, r, rows, n0, accumulate)
            t += 4
        _dots(x, wt, out, t, T, 0, rows, n0, accumulate)


@njit(parallel=True, **_jit)
def dequantize(w):
    """W as float32 [N, K]."""
    N, K = dims(w)
    out = np.empty((N, K), np.float32)
    for n in prange(N):
        float_row(w, n, out[n])
    return out


@njit(**_jit)
def dequantize_rows(w, ids):
    """W[ids] as float32 [len(ids), K]: the embedding lookup of a quantized or 16-bit table."""
    N, K = dims(w)
    out = np.empty((len(ids), K), np.float32)
    for i in range(len(ids)):
        if ids[i] < 0 or ids[i] >= N:
            raise IndexError("dequantize_rows: token id out of range")
        float_row(w, ids[i], out[i])
    return out
