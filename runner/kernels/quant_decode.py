"""Quantized decode (one token): out[1, N] (+)= x[1, K] @ W.T for a prepared QuantizedTensor W.

Decode reads each weight once and is bound by memory bandwidth. The activation row is quantized
to int16 per group (dx: its scale) and the dot products run on integers, 16 multiply-adds an
instruction (x86 vpmaddwd), 8 lanes wide (simd.py). Per row,

    out[n] = sum_g scales[n, g] * dx[g] * sum_k xq[k] q[n, k]  +  sum_g biases[n, g] * sum_k x[k]

where q are the weight's integers, read as the little-endian bytes of MLX's uint32 words.
"""
import numpy as np
from numba import njit, prange

from .cpu import _jit
from .simd import hsum, load_16x16, load_u8x16, madd, nibble, scale_add, vadd, zero_f32, zero_i32

f32 = np.float32


@njit(**_jit)
def matvec(x, qw, out, accumulate):
    """out[1, N] (+)= x[1, K] @ W.T, shapes checked by the caller (linear.qmatmul)."""
    K, G = x.shape[1], qw.group_size
    xq = np.empty(K, np.int16)
    dx = np.empty(K // G, np.float32)
    xs = np.empty(K // G, np.float32)
    quantize_activation(x[0], G, qw.bits, xq, dx, xs)
    _rows(xq, dx, xs, x[0], qw.weight.view(np.uint8), qw.scales, qw.biases, qw.bits, G, out, accumulate)


@njit(parallel=True, **_jit)
def _rows(xq, dx, xs, x, q, s, b, bits, G, out, accumulate):
    """Every row's dot product with x, two rows a task."""
    N = q.shape[0]
    H = (N + 1) // 2
    for j in prange(H):        # each thread: a range of rows and the same range + H
        i = np.int64(j)        # prange's index is unsigned: i + H would type as float
        m = i + H if i + H < N else i
        v0, v1 = _pair(xq, dx, xs, x, q, s, b, i, m, bits, G)
        out[0, i] = out[0, i] + v0 if accumulate else v0
        if m != i:
            out[0, m] = out[0, m] + v1 if accumulate else v1


@njit(inline="always", **_jit)
def _pair(xq, dx, xs, x, q, s, b, n, m, bits, G):
    """(row n, row m) . x, with G passed on as a constant: each inner loop gets fixed bounds."""
    if bits == 8:
        if G == 64:
            return _pair8(xq, dx, xs, q, s, b, n, m, 64)
        if G == 32:
            return _pair8(xq, dx, xs, q, s, b, n, m, 32)
        return _pair8(xq, dx, xs, q, s, b, n, m, 128)
    if G == 64:
        return _pair4(xq, dx, xs, x, q, s, b, n, m, 64)
    if G == 32:
        return _pair4(xq, dx, xs, x, q, s, b, n, m, 32)
    return _pair4(xq, dx, xs, x, q, s, b, n, m, 128)


@njit(**_jit)
def quantize_activation(x, G, bits, xq, dx, xs):
    """x[K] -> xq int16 [K] with one scale dx[g] per group of G, and the group sums xs[g].

    For 4 bits, xq is reordered within each block of 64 to match the nibbles of 16-bit lanes:
    position 64c + 16t + j holds x[64c + 4j + t] (nibble t of lane j).
    """
    K = x.shape[0]
    inv = np.empty(K // G, np.float32)
    for g in range(K // G):
        xg = x[g * G:(g + 1) * G]
        top, total = f32(0.0), f32(0.0)
        for k in range(G):
            top = max(top, abs(xg[k]))
            total += xg[k]
        xs[g] = total
        dx[g] = top / f32(32767.0)
        inv[g] = f32(32767.0) / top if top > 0 else f32(0.0)
    if bits == 8:
        for g in range(K // G):
            xg, qg, r = x[g * G:(g + 1) * G], xq[g * G:(g + 1) * G], inv[g]
            for k in range(G):
                qg[k] = np.int16(np.rint(xg[k] * r))
        return
    for c in range(K // 64):
        xb, qb = x[64 * c:64 * c + 64], xq[64 * c:64 * c + 64]
        r0, r1 = inv[64 * c // G], inv[(64 * c + 32) // G]
        for t in range(4):
            for j in range(8):
                qb[16 * t + j] = np.int16(np.rint(xb[4 * j + t] * r0))
                qb[16 * t + j + 8] = np.int16(np.rint(xb[4 * j + t + 32] * r1))


@njit(inline="always", **_jit)
def _pair8(xq, dx, xs, q, s, b, n, m, G):
    """(row n, row m) . x for 8 bits: two rows far apart are two sequential streams (two adjacent
    rows read in step defeat the hardware prefetcher: 2-3x slower from DRAM)."""
    Kb = q.shape[1]
    f0, f1 = zero_f32(), zero_f32()
    t0, t1 = f32(0.0), f32(0.0)
    for g in range(s.shape[1]):
        a0, a1 = zero_i32(), zero_i32()
        for k in range(g * G, g * G + G, 16):
            xv = load_16x16(xq, k)
            a0 = vadd(a0, madd(load_u8x16(q, n * Kb + k), xv))
            a1 = vadd(a1, madd(load_u8x16(q, m * Kb + k), xv))
        f0 = scale_add(f0, a0, s[n, g] * dx[g], s[n, g] * dx[g])
        f1 = scale_add(f1, a1, s[m, g] * dx[g], s[m, g] * dx[g])
        t0 += b[n, g] * xs[g]
        t1 += b[m, g] * xs[g]
    return hsum(f0) + t0, hsum(f1) + t1


@njit(inline="always", **_jit)
def _block4(a0, a1, q, i0, i1, xq, c):
    """Add block c (64 weights) of the 4-bit rows starting at bytes i0, i1 of q: 32 bytes = 16
    lanes of 4 nibbles; xq is in the matching order."""
    v0, v1 = load_16x16(q, i0 + 32 * c), load_16x16(q, i1 + 32 * c)
    x = load_16x16(xq, 64 * c)
    a0, a1 = vadd(a0, madd(nibble(v0, 0), x)), vadd(a1, madd(nibble(v1, 0), x))
    x = load_16x16(xq, 64 * c + 16)
    a0, a1 = vadd(a0, madd(nibble(v0, 1), x)), vadd(a1, madd(nibble(v1, 1), x))
    x = load_16x16(xq, 64 * c + 32)
    a0, a1 = vadd(a0, madd(nibble(v0, 2), x)), vadd(a1, madd(nibble(v1, 2), x))
    x = load_16x16(xq, 64 * c + 48)
    return vadd(a0, madd(nibble(v0, 3), x)), vadd(a1, madd(nibble(v1, 3), x))


@njit(inline="always", **_jit)
def _pair4(xq, dx, xs, x, q, s, b, n, m, G):
    """(row n, row m) . x for 4 bits. A block of 64 holds one group, half of one, or (G = 32) two:
    int32 lanes 0-3 then sum its first 32 weights, lanes 4-7 the next 32."""
    Kb = q.shape[1]
    K = 2 * Kb
    f0, f1 = zero_f32(), zero_f32()
    t0, t1 = f32(0.0), f32(0.0)
    if G == 32:
        for c in range(K // 64):
            a0, a1 = _block4(zero_i32(), zero_i32(), q, n * Kb, m * Kb, xq, c)
            g = 2 * c
            f0 = scale_add(f0, a0, s[n, g] * dx[g], s[n, g + 1] * dx[g + 1])
            f1 = scale_add(f1, a1, s[m, g] * dx[g], s[m, g + 1] * dx[g + 1])
            t0 += b[n, g] * xs[g] + b[n, g + 1] * xs[g + 1]
            t1 += b[m, g] * xs[g] + b[m, g + 1] * xs[g + 1]
    else:
        for g in range(K // G):
            a0, a1 = zero_i32(), zero_i32()
            for c in range(g * (G // 64), (g + 1) * (G // 64)):
                a0, a1 = _block4(a0, a1, q, n * Kb, m * Kb, xq, c)
            f0 = scale_add(f0, a0, s[n, g] * dx[g], s[n, g] * dx[g])
            f1 = scale_add(f1, a1, s[m, g] * dx[g], s[m, g] * dx[g])
            t0 += b[n, g] * xs[g]
            t1 += b[m, g] * xs[g]
    if K % 64:   # G = 32 and an odd number of groups: the last one in float
        g = K // 32 - 1
        e0, e1 = f32(0.0), f32(0.0)
        for k in range(32 * g, K):
            e0 += x[k] * f32((q[n, k >> 1] >> (4 * (k & 1))) & 15)
            e1 += x[k] * f32((q[m, k >> 1] >> (4 * (k & 1))) & 15)
        t0 += s[n, g] * e0 + b[n, g] * xs[g]
        t1 += s[m, g] * e1 + b[m, g] * xs[g]
    return hsum(f0) + t0, hsum(f1) + t1
