"""Numba CPU kernels for MLX affine-quantized weights (4 and 8 bits): out (+)= x @ W.T.

A weight stays in MLX's layout, memory-mapped and never copied: uint32 words packed low bits first
along the input dimension, so row n is little-endian bytes; w[n, k] = scales[n, k//G] * q[n, k] +
biases[n, k//G]. Decode (one token) reads each weight once and is bound by memory bandwidth: the
activation row is quantized to int16 per group (dx: its scale), and the dot products run on
integers, 16 multiply-adds an instruction (x86 vpmaddwd), 8 lanes wide. Per row,

    out[n] = sum_g scales[n, g] * dx[g] * sum_k xq[k] q[n, k]  +  sum_g biases[n, g] * sum_k x[k]

Prefill (several tokens) is bound by arithmetic: a tile of rows is dequantized to float32 once and
multiplied with a register-blocked float micro-kernel, exact in float32.

LLVM's auto-vectorizer flips between good and bad code on these loops with small source changes
(it vectorized across groups with gathers, or widened int32 sums to int64), so the inner loops are
written with explicit 256-bit vectors: a numba type for an LLVM vector and a few portable LLVM
vector operations as intrinsics (no x86-specific intrinsic: ARM gets its own instructions).
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, models, overload, register_model

from nibble.quant.affine import BITS, GROUP_SIZES, QuantizedTensor
from . import cpu


_jit = dict(fastmath=True, cache=True, nogil=True)
f32 = np.float32


def prepare(qt: QuantizedTensor) -> QuantizedTensor:
    """`qt` as the kernels take it: called once at load.

    The packed weight is kept, not copied (a read-only np.memmap stays one; the kernels read its
    uint32 words as little-endian bytes); scales and biases (float16 on disk) become float32,
    1/16 of the weight's size at 8 bits. Refuses what the kernels would read out of bounds.
    """
    bits, group_size, weight = qt.bits, qt.group_size, qt.weight
    if bits not in BITS or group_size not in GROUP_SIZES:
        raise ValueError(f"no kernel for {bits}-bit weights in groups of {group_size}: "
                         f"bits must be one of {BITS} and group_size one of {GROUP_SIZES}")
    if weight.dtype != np.uint32 or weight.ndim != 2 or not weight.flags.c_contiguous:
        raise ValueError(f"weight must be a C-contiguous uint32 matrix, got {weight.dtype} {weight.shape}")
    if qt.scales.shape != qt.groups_shape or qt.biases.shape != qt.scales.shape:
        N, K = qt.shape
        raise ValueError(f"scales and biases must be {list(qt.groups_shape)} for a {N}x{K} weight in "
                         f"groups of {group_size}, got {qt.scales.shape} and {qt.biases.shape}")
    as32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)
    return qt._replace(scales=as32(qt.scales), biases=as32(qt.biases))


# ---- explicit SIMD: an LLVM vector type for numba and the operations the kernels use ----------

class Vec(types.Type):
    """An LLVM vector <count x dtype>, kept in a register."""

    def __init__(self, dtype, count):
        self.dtype, self.count = dtype, count
        super().__init__(name=f"Vec({dtype}x{count})")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _ll(fe_type))


I16, I32, F32 = Vec(types.int16, 16), Vec(types.int32, 8), Vec(types.float32, 8)   # 256 bits each
_i32 = ir.IntType(32)
_FAST = ("fast",)


def _ll(t):
    return ir.VectorType(ir.FloatType() if t.dtype == types.float32 else ir.IntType(t.dtype.bitwidth), t.count)


def _shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_i32, len(idx)), list(idx)))


def _splat(builder, t, x):
    v = builder.insert_element(ir.Constant(_ll(t), None), x, ir.Constant(_i32, 0))
    return _shuffle(builder, v, v, [0] * t.count)


def _load(context, builder, sig, args, lltype, align):
    """Load lltype from the address of element i of a C-contiguous array, counting row-major
    across rows (indexing with a flat offset creates no row view, hence no reference counting)."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), lltype.as_pointer())
    return builder.load(ptr, align=align)


@intrinsic
def load_u8x16(typingctx, arr, i):
    """uint8 arr.flat[i:i+16] zero-extended to 16 int16 lanes."""
    def codegen(context, builder, sig, args):
        return builder.zext(_load(context, builder, sig, args, ir.VectorType(ir.IntType(8), 16), 1), _ll(I16))
    return I16(arr, i), codegen


@intrinsic
def load_16x16(typingctx, arr, i):
    """16 lanes of 16 bits from arr.flat[i:]: int16 activations, or 32 bytes of packed 4-bit weights."""
    def codegen(context, builder, sig, args):
        return _load(context, builder, sig, args, _ll(I16), 1)
    return I16(arr, i), codegen


@intrinsic
def load_f32x8(typingctx, arr, i):
    """float32 arr.flat[i:i+8]."""
    def codegen(context, builder, sig, args):
        return _load(context, builder, sig, args, _ll(F32), 4)
    return F32(arr, i), codegen


@intrinsic(prefer_literal=True)
def nibble(typingctx, v, t):
    """(v >> 4t) & 15 in each 16-bit lane; t a literal 0..3."""
    if not isinstance(t, types.IntegerLiteral):
        return None
    shift = 4 * t.literal_value

    def codegen(context, builder, sig, args):
        v = builder.lshr(args[0], ir.Constant(_ll(I16), [shift] * 16)) if shift else args[0]
        return v if shift == 12 else builder.and_(v, ir.Constant(_ll(I16), [15] * 16))
    return I16(v, t), codegen


@intrinsic
def madd(typingctx, a, b):
    """int32 lanes a[2i]*b[2i] + a[2i+1]*b[2i+1]: LLVM emits vpmaddwd on x86."""
    def codegen(context, builder, sig, args):
        wide = ir.VectorType(_i32, 16)
        m = builder.mul(builder.sext(args[0], wide), builder.sext(args[1], wide))
        return builder.add(_shuffle(builder, m, m, range(0, 16, 2)), _shuffle(builder, m, m, range(1, 16, 2)))
    return I32(a, b), codegen


@intrinsic
def vadd(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return I32(a, b), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c lane by lane (float32)."""
    def codegen(context, builder, sig, args):
        return builder.fadd(builder.fmul(args[0], args[1], flags=_FAST), args[2], flags=_FAST)
    return F32(a, b, c), codegen


@intrinsic
def zero_i32(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_ll(I32), None)
    return I32(), codegen


@intrinsic
def zero_f32(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_ll(F32), None)
    return F32(), codegen


@intrinsic
def scale_add(typingctx, acc, a, s0, s1):
    """acc + float(a) * [s0 s0 s0 s0 s1 s1 s1 s1]: a group's integer sums into the float sum
    (s1 for the upper lanes, which hold the next group when a 4-bit block spans two)."""
    def codegen(context, builder, sig, args):
        s = _shuffle(builder, _splat(builder, F32, args[2]), _splat(builder, F32, args[3]), [0, 1, 2, 3, 12, 13, 14, 15])
        return builder.fadd(args[0], builder.fmul(builder.sitofp(args[1], _ll(F32)), s, flags=_FAST), flags=_FAST)
    return F32(acc, a, s0, s1), codegen


@intrinsic
def hsum(typingctx, v):
    """Sum of the 8 float lanes."""
    def codegen(context, builder, sig, args):
        v = args[0]
        v = builder.fadd(_shuffle(builder, v, v, range(4)), _shuffle(builder, v, v, range(4, 8)), flags=_FAST)
        v = builder.fadd(_shuffle(builder, v, v, range(2)), _shuffle(builder, v, v, range(2, 4)), flags=_FAST)
        lane = lambda i: builder.extract_element(v, ir.Constant(_i32, i))
        return builder.fadd(lane(0), lane(1), flags=_FAST)
    return types.float32(v), codegen


# ---- decode: one token, integer dot products ----------------------------------------------------

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


@njit(parallel=True, **_jit)
def _decode8(xq, dx, xs, q, s, b, G, out, accumulate):
    N = q.shape[0]
    H = (N + 1) // 2
    for j in prange(H):        # each thread: a range of rows and the same range + H
        i = np.int64(j)        # prange's index is unsigned: i + H would type as float
        m = i + H if i + H < N else i
        if G == 64:
            v0, v1 = _pair8(xq, dx, xs, q, s, b, i, m, 64)
        elif G == 32:
            v0, v1 = _pair8(xq, dx, xs, q, s, b, i, m, 32)
        else:
            v0, v1 = _pair8(xq, dx, xs, q, s, b, i, m, 128)
        out[0, i] = out[0, i] + v0 if accumulate else v0
        if m != i:
            out[0, m] = out[0, m] + v1 if accumulate else v1


@njit(parallel=True, **_jit)
def _decode4(xq, dx, xs, x, q, s, b, G, out, accumulate):
    N = q.shape[0]
    H = (N + 1) // 2
    for j in prange(H):
        i = np.int64(j)
        m = i + H if i + H < N else i
        if G == 64:
            v0, v1 = _pair4(xq, dx, xs, x, q, s, b, i, m, 64)
        elif G == 32:
            v0, v1 = _pair4(xq, dx, xs, x, q, s, b, i, m, 32)
        else:
            v0, v1 = _pair4(xq, dx, xs, x, q, s, b, i, m, 128)
        out[0, i] = out[0, i] + v0 if accumulate else v0
        if m != i:
            out[0, m] = out[0, m] + v1 if accumulate else v1


# ---- prefill: dequantize a tile of rows, then a float register-blocked micro-kernel -------------

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
def _prefill(x, qw, out, accumulate):
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


# ---- public entry points -------------------------------------------------------------------------

@njit(**_jit)
def qmatmul(x, qw, out, accumulate):
    """out[T, N] (+)= x[T, K] @ W.T for a prepared QuantizedTensor W; x, out float32.

    T = 1 quantizes x to int16 per group and takes the integer decode path; T > 1 the float
    prefill path. Callable from Python and from inside other njit functions.
    """
    T, K = x.shape
    q = qw.weight.view(np.uint8)                           # [N, K*bits/8] little-endian bytes
    N, G = q.shape[0], qw.group_size
    if q.shape[1] * 8 != K * qw.bits or out.shape[0] != T or out.shape[1] != N:
        raise ValueError("qmatmul: x must be [T, K] and out [T, N] for a weight of N rows of K")
    if T == 1:
        xq = np.empty(K, np.int16)
        dx = np.empty(K // G, np.float32)
        xs = np.empty(K // G, np.float32)
        quantize_activation(x[0], G, qw.bits, xq, dx, xs)
        if qw.bits == 8:
            _decode8(xq, dx, xs, q, qw.scales, qw.biases, G, out, accumulate)
        else:
            _decode4(xq, dx, xs, x[0], q, qw.scales, qw.biases, G, out, accumulate)
    else:
        _prefill(x, qw, out, accumulate)


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


def linear(x, w, out, accumulate):
    """out (+)= x @ w.T for a float32 [N, K] weight or a QuantizedTensor.

    Inside njit code the choice is made at compile time from w's numba type (the overload below),
    so one jitted decoder layer serves float and quantized models.
    """
    if isinstance(w, QuantizedTensor):
        qmatmul(x, w, out, accumulate)
    else:
        cpu.matmul(x, w, out, accumulate)


@overload(linear)
def _linear_typed(x, w, out, accumulate):
    if isinstance(w, types.Array):
        return lambda x, w, out, accumulate: cpu.matmul(x, w, out, accumulate)
    if isinstance(w, types.BaseNamedTuple) and w.instance_class is QuantizedTensor:
        return lambda x, w, out, accumulate: qmatmul(x, w, out, accumulate)
