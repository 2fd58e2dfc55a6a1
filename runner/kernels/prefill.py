"""Prefill (more than cpu.SMALL tokens) through a quantized or 16-bit float weight W: out[T, N] (+)= x[T, K]
@ W.T, and W as float32 (whole, or the rows of an embedding lookup).

Prefill is bound by arithmetic: W's rows are made float32 once (dequantized: a prepared
QuantizedTensor; widened: a HalfTensor, see half.py) into cpu.matmul's panels and multiplied by its
register-blocked float tiles, exact in float32. `float_row` is the one step that knows W's kind.
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from nibble.formats.half import HalfTensor
from nibble.quant.affine import QuantizedTensor
from . import half
from .cpu import INNER, _jit, panel_matmul, weight_row
from .simd import group_scale_bias, high_of, level, plane_count

f32 = np.float32


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


@overload(weight_row, jit_options=_jit)
def _weight_row(w, n, row):
    if _is(w, QuantizedTensor) or _is(w, HalfTensor):
        return lambda w, n, row: float_row(w, n, row)


@njit(**_jit)
def matmul(x, w, out, accumulate):
    """out[T, N] (+)= x[T, K] @ W.T, shapes checked by the caller (linear.qmatmul): W's rows made
    float32 (float_row) into cpu.matmul's panels and multiplied by its tiles (cpu.panel_matmul)."""
    panel_matmul(x, w, out, accumulate)


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
