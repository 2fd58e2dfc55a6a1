"""Prefill (more than cpu.SMALL tokens) through a quantized weight on integer dot products:
out[T, N] (+)= x[T, K] @ W.T for a prepared QuantizedTensor W, on CPUs that multiply bytes (x86:
AVX-512 VNNI's vpdpbusd, else AVX2's vpmaddubsw); elsewhere, and for 16-bit weights, prefill.py's
float tiles. The choice is made when the kernels compile, from the CPU numba compiles for
(quant/target.py: NIBBLE_CPU=avx2 takes AVX2's on a CPU with VNNI too).

x is quantized once per call to int8 per block of 32 (dx: its scale, as llama.cpp's Q8 blocks);
W's integers q (0..15 or 0..255) stay as they are, and

    out[t, n] = sum_b s[n, g(b)] dx[t, b] sum_{k in b} q[n, k] xq[t, k]  +  sum_g b[n, g] xs[t, g]

over x's blocks b and W's groups g (G >= 32: a block lies in one group), xs the sums of x's groups
as rounded (dx xq): the product of the rounded x with W, as exact as float32 sums allow.

An int32 lane of a 256-bit u8 x s8 dot product (`udot`) sums 4 adjacent bytes: the bytes of every
row (x's and W's alike) are reordered so that each lane stays inside one block for a superblock
of 8 steps of 32 bytes (8 blocks, one a lane), and a lane's integer sum becomes float once a
superblock, the 8 lanes' scales a vector. A last superblock of fewer blocks spreads each
over 2, 4 or 8 lanes (SmolLM2's K = 576 is 18 blocks: 2 superblocks and one of 2 blocks); zeros
fill a block count that is not 1, 2, 4 or 8.

A tile of W's rows is unpacked to bytes in that order once, with its scales and biases spread over
the lanes, and multiplied with every row of x by a register-blocked micro-kernel (4 rows of x by 3
of W; on AVX2 4 by 2, two steps at a time, where its instructions allow fewer multiplies: 4-bit
weights add two steps' products before they widen, 8-bit ones take q - 128); tiles run in parallel.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from nibble.formats import planes
from nibble.quant import target
from nibble.quant.affine import QuantizedTensor
from . import prefill
from .cpu import INNER, _jit
from .simd import (F32, I32, Vec, _ll, _load, block_highs, fma, group_scale_bias, high_mask, high_of, hsum, load_f32x8,
                   plane_at, plane_count, splat_f32, table_ops, vadd, widen_bits, zero_f32, zero_i32)

f32 = np.float32
U8 = Vec(types.uint8, 32)
TILE = 24   # W's rows unpacked at a time: 24 x K bytes stay in L1/L2 while every row of x passes


def host_dot():
    """'vnni', 'avx2' or None: the byte dot product of the CPU numba compiles for (quant/target.py:
    NIBBLE_CPU=avx2 takes AVX-512 away; None where the user's NUMBA_CPU_NAME names another CPU
    than this one: a portable cache gets the float tiles)."""
    features = target.features()
    if features is None:
        return None
    if features.get("avx512vnni") and features.get("avx512vl"):
        return "vnni"
    return "avx2" if features.get("avx2") else None


DOT = host_dot()


def matmul(x, w, out, accumulate):
    """out[T, N] (+)= x[T, K] @ W.T for more than cpu.SMALL rows of x, shapes checked by the caller
    (njit code only): integer dot products for a quantized W where the CPU has them, else
    prefill.py's float tiles."""


@overload(matmul)
def _matmul(x, w, out, accumulate):
    if DOT and issubclass(w.instance_class, QuantizedTensor):
        return lambda x, w, out, accumulate: matmul_int8(x, w, out, accumulate)
    return lambda x, w, out, accumulate: prefill.matmul(x, w, out, accumulate)


# ---- the byte dot product --------------------------------------------------------------------

def _call(builder, name, ret, *args):
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ret, [a.type for a in args]))
    return builder.call(fn, args)


def _vnni(builder, acc, w, x, small):
    i32x8 = _ll(I32)
    return _call(builder, "llvm.x86.avx512.vpdpbusd.256", i32x8, acc, builder.bitcast(w, i32x8),
                 builder.bitcast(x, i32x8))


def _avx2(builder, acc, w, x, small):
    """vpmaddubsw sums pairs of products into int16, which holds 2 * 63 * 127 but not 2 * 255 * 127:
    bytes above 63 (8-bit weights, `small` false) go as two nibbles, 16 * hi + lo."""
    i16x16, i8x32 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(8), 32)

    def pairs(a, weight):   # int32 lanes: weight * (sum of 4 adjacent a * x)
        p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", i16x16, a, x)
        return _call(builder, "llvm.x86.avx2.pmadd.wd", _ll(I32), p, ir.Constant(i16x16, [weight] * 16))

    lo = builder.and_(w, ir.Constant(i8x32, [15] * 32))
    hi = builder.lshr(w, ir.Constant(i8x32, [4] * 32))
    whole = builder.add(acc, pairs(w, 1))
    split = builder.add(acc, builder.add(pairs(hi, 16), pairs(lo, 1)))
    return builder.select(small, whole, split)


def _vnni2(builder, acc, w, x, v, y, small):
    return _vnni(builder, _vnni(builder, acc, w, x, small), v, y, small)


def _avx2_2(builder, acc, w, x, v, y, small):
    """_avx2 twice, w . x + v . y; of `small` bytes the two vpmaddubsw's int16 pairs are added
    before they widen (2 * 2 * 63 * 127 fits int16): one vpmaddwd and one add fewer."""
    i16x16 = ir.VectorType(ir.IntType(16), 16)
    pairs = builder.add(_call(builder, "llvm.x86.avx2.pmadd.ub.sw", i16x16, w, x),
                        _call(builder, "llvm.x86.avx2.pmadd.ub.sw", i16x16, v, y))
    whole = builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", _ll(I32), pairs, ir.Constant(i16x16, [1] * 16)))
    return builder.select(small, whole, _avx2(builder, _avx2(builder, acc, w, x, small), v, y, small))


def dot_intrinsic(kind):
    """udot(acc, w, x, small): acc (int32 x 8) + in each lane the sum of 4 adjacent products of w
    (uint8 x 32) and x (int8 x 32, the same bits as U8), with `kind`'s instructions; `small`: every
    byte of w is at most 63 (4-bit weights, with up to 2 high planes), which the AVX2 sequence
    makes use of. udot2(acc, w, x, v, y, small): udot(udot(acc, w, x, small), v, y, small), the
    same sums in fewer instructions on AVX2."""
    emit, emit2 = {"vnni": (_vnni, _vnni2), "avx2": (_avx2, _avx2_2)}[kind]

    @intrinsic
    def udot(typingctx, acc, w, x, small):
        def codegen(context, builder, sig, args):
            return emit(builder, *args)
        return I32(acc, w, x, small), codegen

    @intrinsic
    def udot2(typingctx, acc, w, x, v, y, small):
        def codegen(context, builder, sig, args):
            return emit2(builder, *args)
        return I32(acc, w, x, v, y, small), codegen
    return udot, udot2


udot, udot2 = dot_intrinsic(DOT or "avx2")   # compiled only where DOT is set (see _matmul)


@intrinsic
def sdot(typingctx, acc, w, x):
    """acc + in each lane the sum of 4 adjacent products of (w - 128) (w uint8 x 32) and x (int8
    x 32, each within +-127): AVX2's products of 8-bit weights in one vpmaddubsw and one vpmaddwd,
    where udot's take two of each. w - 128 is a signed byte: its magnitude times x with its sign
    (vpabsb, vpsignb) stays within int16 in pairs (2 * 128 * 127); the caller adds 128 * x's sums."""
    def codegen(context, builder, sig, args):
        acc, w, x = args
        i8x32, i16x16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16)
        signed = builder.xor(w, ir.Constant(i8x32, [-128] * 32))
        magnitude = _call(builder, "llvm.abs.v32i8", i8x32, signed, ir.Constant(ir.IntType(1), 0))
        p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", i16x16, magnitude,
                  _call(builder, "llvm.x86.avx2.psign.b", i8x32, x, signed))
        return builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", _ll(I32), p, ir.Constant(i16x16, [1] * 16)))
    return I32(acc, w, x), codegen


@njit(parallel=True, **_jit)
def peak_products(steps, sums):
    """The byte dot products at their peak, the figure prefill's speed is judged against: on each
    of len(sums) threads, `steps` steps of the tiles' products of 4-bit weights (udot2, 64
    multiply-adds), 8 independent ones a step on registers, the weight bytes loaded anew each
    step so that none is computed once for all. sums: each thread's total, kept so that none is
    optimized away. -> operations done (a multiply and an add each)."""
    for i in prange(sums.shape[0]):
        w, x = np.arange(64).astype(np.uint8) % 16, np.arange(128).astype(np.int8)
        x0, x1, x2, x3 = load_u8x32(x, 0), load_u8x32(x, 32), load_u8x32(x, 64), load_u8x32(x, 96)
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero_i32()
        for s in range(steps):
            w0, w1 = load_u8x32(w, s % 32), load_u8x32(w, 31 - s % 32)
            a0, a1 = udot2(a0, w0, x0, w1, x1, True), udot2(a1, w0, x1, w1, x2, True)
            a2, a3 = udot2(a2, w0, x2, w1, x3, True), udot2(a3, w0, x3, w1, x0, True)
            a4, a5 = udot2(a4, w1, x0, w0, x2, True), udot2(a5, w1, x1, w0, x3, True)
            a6, a7 = udot2(a6, w1, x2, w0, x0, True), udot2(a7, w1, x3, w0, x1, True)
        total = vadd(vadd(vadd(a0, a1), vadd(a2, a3)), vadd(vadd(a4, a5), vadd(a6, a7)))
        one = splat_f32(np.float32(1.0))
        sums[i] = hsum(scale_add(zero_f32(), total, one, one))
    return np.float64(sums.shape[0]) * steps * 8 * 64 * 2


@intrinsic
def load_u8x32(typingctx, arr, i):
    """32 bytes of arr.flat[i:] (uint8 or int8)."""
    def codegen(context, builder, sig, args):
        return _load(context, builder, sig, args, _ll(U8), 1)
    return U8(arr, i), codegen


@intrinsic(prefer_literal=True)
def nibbles(typingctx, v, high):
    """Each byte's low (high: a literal False) or high 4 bits, as bytes 0..15."""
    if not isinstance(high, types.BooleanLiteral):
        return None

    def codegen(context, builder, sig, args):
        if high.literal_value:
            return builder.lshr(args[0], ir.Constant(_ll(U8), [4] * 32))
        return builder.and_(args[0], ir.Constant(_ll(U8), [15] * 32))
    return U8(v, high), codegen


@intrinsic
def _load_levels(typingctx, values):
    """A table's 16 levels (uint8 values[16]) in both 128-bit halves of 32 bytes, as vpshufb
    looks them up (each half from its own 16 bytes)."""
    def codegen(context, builder, sig, args):
        u8x16 = ir.VectorType(ir.IntType(8), 16)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        v = builder.load(builder.bitcast(data, u8x16.as_pointer()), align=1)
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), 32), list(range(16)) * 2))
    return U8(values), codegen


@intrinsic
def _lookup(typingctx, table, v):
    """table[v[i]] for each byte i (0..15): AVX2's vpshufb, as llama.cpp reads IQ4_NL and MXFP4."""
    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.x86.avx2.pshuf.b", _ll(U8), args[0], args[1])
    return U8(table, v), codegen


levels, lookup = table_ops(_load_levels, _lookup)   # bytes


@intrinsic(prefer_literal=True)
def _or_high(typingctx, v, arr, i, hb, odd):
    """v | the high part of weight 2p + odd of a block of 64 (formats.planes: its 8 * hb bytes at
    arr.flat[i:]) << 4 in each byte p: a block's high bits joined to its low or high nibbles (odd:
    a literal bool)."""
    if not isinstance(odd, types.BooleanLiteral):
        return None
    high = odd.literal_value

    def codegen(context, builder, sig, args):
        hb = context.cast(builder, args[3], sig.args[3], types.int64)
        highs = block_highs(context, builder, sig, args, 1, hb)
        if not high:   # an even weight's bits at s: up to where the odd weight's are (a byte's low
            i32x8 = ir.VectorType(ir.IntType(32), 8)   # bits move within it: AVX2 shifts no bytes)
            highs = builder.bitcast(builder.shl(builder.bitcast(highs, i32x8), ir.Constant(i32x8, [4] * 8)), highs.type)
        return builder.or_(args[0], builder.and_(highs, high_mask(builder, hb, 32)))
    return U8(v, arr, i, hb, odd), codegen


def with_high(v, hi, i, hb, odd):
    """Bytes v (0..15: nibbles of weights 2p + odd of a block of 64) with their high bits from the
    `hb` planes of hi at byte i (the block's bytes: formats.planes), or v itself where hi is None
    (njit code only)."""


@overload(with_high, inline="always")
def _with_high_typed(v, hi, i, hb, odd):
    if isinstance(hi, types.NoneType):
        return lambda v, hi, i, hb, odd: v
    return lambda v, hi, i, hb, odd: _or_high(v, hi, i, hb, odd)


def small_bytes(qw):
    """Whether every byte a weight unpacks to is at most 63 (udot's `small`): 4-bit integers, with
    up to 2 high planes, not levels from a table; a constant where the kernels compile, so that
    AVX2's loops hold only the sequence it picks (njit code only)."""


@overload(small_bytes, inline="always")
def _small_bytes_typed(qw):
    small = qw.instance_class.KIND[0] == 4 and isinstance(dict(zip(qw.fields, qw.types))["values"], types.NoneType)
    return lambda qw: small


def signed_bytes(qw):
    """Whether a weight's products take q - 128 (sdot), its biases 128 times its scales more:
    8-bit weights on AVX2, where udot splits each byte in two nibbles (njit code only)."""


@overload(signed_bytes, inline="always")
def _signed_bytes_typed(qw):
    signed = DOT == "avx2" and qw.instance_class.KIND[0] == 8
    return lambda qw: signed


def nibble_sized(values):
    """Whether the levels of a 4-bit weight are at most 15 (udot's `small`): its own integers are."""


@overload(nibble_sized, inline="always")
def _nibble_sized_typed(values):
    small = isinstance(values, types.NoneType)
    return lambda values: small


@intrinsic
def scale_add(typingctx, acc, a, sw, sx):
    """acc + float(a) * sw * sx, lane by lane: a superblock's integer sums into the float sum."""
    def codegen(context, builder, sig, args):
        s = builder.fmul(args[2], args[3], flags=("fast",))
        return builder.fadd(args[0], builder.fmul(builder.sitofp(args[1], _ll(F32)), s, flags=("fast",)),
                            flags=("fast",))
    return F32(acc, a, sw, sx), codegen


def _address(context, builder, aryty, ary, i, lltype):
    """The address of element i of a C-contiguous array, counting row-major across rows, as lltype*."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [i]), lltype.as_pointer())


def _transpose(kind):
    """A whole superblock of W's row unpacked: the words q[j:] of its 8 blocks (8 words a block at
    8 bits, 4 at 4 bits) stored to out[i:i+64] (uint32) in the layout, step s holding unit s of
    every block: one shuffle of the 64 or 32 words in registers instead of 64 scalar moves."""
    words = 8 if kind == 8 else 4
    i32 = ir.IntType(32)

    def codegen(context, builder, sig, args):
        src = builder.load(_address(context, builder, sig.args[2], args[2], args[3], ir.VectorType(i32, 8 * words)), align=4)
        # by_word[w * 8 + l] = word w of block l
        by_word = builder.shuffle_vector(src, src, ir.Constant(ir.VectorType(i32, 8 * words),
                                                               [l * words + w for w in range(words) for l in range(8)]))
        if kind == 8:
            units = by_word
        else:   # unit 2w: the low nibbles of word w, unit 2w + 1 its high ones
            nib = ir.Constant(by_word.type, [0x0F0F0F0F] * 32)
            lo = builder.and_(by_word, nib)
            hi = builder.and_(builder.lshr(by_word, ir.Constant(by_word.type, [4] * 32)), nib)
            units = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 64),
                                                               [h * 32 + w * 8 + l for w in range(4) for h in range(2) for l in range(8)]))
        builder.store(units, _address(context, builder, sig.args[0], args[0], args[1], units.type), align=4)
        return context.get_dummy_value()

    @intrinsic
    def transpose(typingctx, out, i, q, j):
        return types.none(out, i, q, j), codegen
    return transpose


transpose8, transpose4 = _transpose(8), _transpose(4)

def _plane_bits(plane, hb):
    """For each byte 4 o + j of transpose4's output, the bit of a super-block's high bits
    (formats.planes: 4 blocks of 8 * hb bytes) that holds bit `plane` of its weight's high part:
    output word o (step s = o // 8 holds unit s of block l = o % 8 of 32) has weights 32 l + 8 (s //
    2) + 2 j + s % 2, j = 0..3."""
    bits = []
    byte, shift = planes.places(hb)
    for o in range(64):
        s, l = divmod(o, 8)
        for j in range(4):
            w = 32 * l + 8 * (s // 2) + 2 * j + s % 2
            bits.append(8 * (8 * hb * (w // 64) + byte[w % 64]) + shift[w % 64] + plane)
    return bits


@intrinsic(prefer_literal=True)
def _or_high_words(typingctx, out, i, hi, j, plane, hb):
    """out[i:i+64] (uint32, a super-block as transpose4 stored it) |= bit `plane` of each weight's
    high part, from the super-block's 32 * hb bytes at hi.flat[j:] (formats.planes), << 4 + plane
    in its byte; plane and hb literals."""
    if not isinstance(plane, types.IntegerLiteral) or not isinstance(hb, types.IntegerLiteral):
        return None
    k, h = plane.literal_value, hb.literal_value
    i32 = ir.IntType(32)

    def codegen(context, builder, sig, args):
        src = builder.load(_address(context, builder, sig.args[2], args[2], args[3], ir.VectorType(ir.IntType(8), 32 * h)),
                           align=1)
        wide = widen_bits(builder, src, _plane_bits(k, h), ir.Constant(ir.IntType(8), 1 << 4 + k))
        words = builder.bitcast(wide, ir.VectorType(i32, 64))
        ptr = _address(context, builder, sig.args[0], args[0], args[1], words.type)
        builder.store(builder.or_(builder.load(ptr, align=4), words), ptr, align=4)
        return context.get_dummy_value()
    return types.none(out, i, hi, j, plane, hb), codegen


def or_high(out, i, hi, j, hb):
    """A super-block's high bits from the `hb` planes of hi at j into out at i, as _or_high_words
    (njit code only; nothing where hi is None)."""


@overload(or_high, inline="always")
def _or_high_typed(out, i, hi, j, hb):
    if isinstance(hi, types.NoneType):
        return lambda out, i, hi, j, hb: None

    def joined(out, i, hi, j, hb):
        if hb == 1:
            _or_high_words(out, i, hi, j, 0, 1)
        else:
            _or_high_words(out, i, hi, j, 0, 2)
            _or_high_words(out, i, hi, j, 1, 2)
    return joined


# ---- the layout ------------------------------------------------------------------------------

@njit(**_jit)
def layout(K):
    """Where a row's bytes go, 4 at a time: units[i] = 8 b + u, the unit u (0..7) of block b that
    positions 4i..4i+3 of a reordered row hold (-1: zeros), and lane_block[v] the block that lane v
    (8 a superblock) sums (-1: none). A unit is a uint32 word of W's row at 8 bits (weights 4u..4u+3
    of the block), and its low or high nibbles at 4 bits (word u // 2: weights 8 (u // 2) + 2j +
    u % 2, j = 0..3), so that a row unpacks a word at a time."""
    blocks = K // 32
    full = blocks // 8
    rest = blocks - 8 * full
    last = 0 if rest == 0 else 1 if rest == 1 else 2 if rest == 2 else 4 if rest <= 4 else 8
    units = np.full(64 * full + 8 * last, -1, np.int64)
    lane_block = np.full(8 * (full + (last > 0)), -1, np.int64)
    for i in range(units.shape[0]):
        c, step, lane = i // 64, (i // 8) % 8, i % 8
        steps = 8 if c < full else last                  # steps of this superblock
        per = 8 // steps                                 # lanes a block
        block = 8 * c + lane // per
        if block < blocks:
            units[i] = 8 * block + (lane % per) * steps + step
            lane_block[8 * c + lane] = block
    return units, lane_block


@njit(inline="always", **_jit)
def _k(unit, j, bits):
    """The k of byte j of a unit."""
    return 4 * unit + j if bits == 8 else 8 * (unit >> 1) + 2 * j + (unit & 1)


@njit(parallel=True, **_jit, **INNER)
def quantize_rows(x, units, lane_block, bits, halves):
    """x [T, K] -> (xq int8 [T, Kp] in the layout, each block of 32 rounded to +-127 dx;
    dx and xs float32 [T, lanes]: a lane's block scale and its bytes' sum of x as rounded,
    dx * sum xq; with `halves` (weights in groups of 16, whole superblocks) [T, 2 * lanes], for
    each superblock its lanes over steps 0-3 (the first 16 weights of each block), then over
    steps 4-7 (the second 16). Not the exact sum: the biases' term would then carry x's rounding error times
    the weights' offset (128 d for a symmetric int8 stored unsigned), where the rounded x alike in
    both terms leaves it times the weights themselves, as llama.cpp's Q8_1 sums do.)"""
    T, K = x.shape
    lanes = lane_block.shape[0] * (2 if halves else 1)
    xq = np.zeros((T, 4 * units.shape[0]), np.int8)
    dx = np.zeros((T, lanes), np.float32)
    xs = np.zeros((T, lanes), np.float32)
    for t in prange(T):
        scale, inv = np.empty(K // 32, np.float32), np.empty(K // 32, np.float32)
        for b in range(K // 32):
            top = f32(0.0)
            for k in range(32 * b, 32 * b + 32):
                top = max(top, abs(x[t, k]))
            scale[b], inv[b] = top / f32(127.0), inverse_scale(top)
        for i in range(units.shape[0]):
            if units[i] >= 0:
                r = inv[units[i] // 8]
                v = (16 * (i // 64) + 8 * (i // 32 % 2) if halves else 8 * (i // 64)) + i % 8
                for j in range(4):
                    q = np.rint(x[t, _k(units[i], j, bits)] * r)
                    xq[t, 4 * i + j] = np.int8(q)
                    xs[t, v] += q
        for v in range(lanes):
            block = lane_block[v // 16 * 8 + v % 8] if halves else lane_block[v]
            if block >= 0:
                dx[t, v] = scale[block]
                xs[t, v] *= scale[block]
    return xq, dx, xs


@njit(**dict(_jit, fastmath=False))
def inverse_scale(top):
    """127 / top, what a block of x is multiplied by before rounding (0 for a block of zeros):
    divided exactly, not as 127 * (1 / top) as fast math may, which sends some x * 127 / top
    that are ties (n + 0.5) to the other side (the twin in the tests, and llama.cpp, divide)."""
    return f32(127.0) / top if top > 0 else f32(0.0)


@njit(**_jit, **INNER)
def _unpack(qw, n, units, lane_group, wq, sw, bw):
    """Row n of qw into the layout: its integers as bytes wq [Kp], a word of W (or its low or high
    nibbles) at a time, and its scales and biases spread over the lanes, sw and bw [lanes]."""
    out, q = wq.view(np.uint32), qw.weight[n]            # [Kp/4], [K*bits/32]
    full = qw.weight.shape[1] // (8 * qw.bits)           # whole superblocks: 8 blocks of 32 weights
    hb = plane_count(qw.high, qw.weight.shape[1] * 32 // qw.bits)
    for c in range(full):
        if qw.bits == 8:
            transpose8(out, 64 * c, q, 64 * c)
        else:
            transpose4(out, 64 * c, q, 32 * c)
            or_high(out, 64 * c, qw.high, plane_at(qw.high, n, 4 * c, hb), hb)
    if qw.bits == 8:
        for i in range(64 * full, units.shape[0]):
            out[i] = q[units[i]] if units[i] >= 0 else 0
    else:
        for i in range(64 * full, units.shape[0]):
            u = units[i]
            out[i] = (q[u >> 1] >> (4 * (u & 1))) & 0x0F0F0F0F if u >= 0 else 0
            if u >= 0:
                for j in range(4):
                    out[i] |= np.uint32(high_of(qw.high, n, _k(u, j, 4), hb) << 4) << np.uint32(8 * j)
        to_levels(qw.values, wq)
    for v in range(lane_group.shape[0]):
        if lane_group[v] < 0:
            sw[v] = bw[v] = 0
        else:
            sw[v], bw[v] = group_scale_bias(qw, n, lane_group[v])


def to_levels(values, wq):
    """wq's 4-bit integers as their levels, in place (njit code only; None: they are their own)."""


@overload(to_levels, inline="always")
def _to_levels_typed(values, wq):
    if isinstance(values, types.NoneType):
        return lambda values, wq: None

    def impl(values, wq):
        for i in range(wq.shape[0]):
            wq[i] = values[wq[i]]
    return impl


# ---- the kernel ------------------------------------------------------------------------------

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


@njit(**_jit)
def matmul_int8(x, qw, out, accumulate):
    """out[T, N] (+)= x[T, K] @ W.T on integer dot products (where DOT is set)."""
    matmul_rounded(round_rows(x, qw.group_size, qw.bits), qw, out, accumulate)


@njit(**_jit)
def round_rows(x, G, bits):
    """x [T, K] rounded for weights of `bits` bits in groups of G: (xq, dx, xs, units, lane_block)
    as quantize_rows and layout give them; several weights of those bits and groups may share it."""
    units, lane_block = layout(x.shape[1])
    xq, dx, xs = quantize_rows(x, units, lane_block, bits, G == 16)
    return xq, dx, xs, units, lane_block


@njit(**_jit, **INNER)
def matmul_rounded(rounded, qw, out, accumulate):
    """matmul_int8 on x as round_rows(x, qw.group_size, qw.bits) gave it."""
    xq, dx, xs, units, lane_block = rounded
    G = qw.group_size
    lane_group = np.empty(dx.shape[1], np.int64)   # W's group of each lane (each half lane: G = 16)
    for v in range(dx.shape[1]):
        if G == 16:   # lanes' first 16 weights, then their second (quantize_rows' halves)
            block = lane_block[v // 16 * 8 + v % 8]
            lane_group[v] = 2 * block + v // 8 % 2 if block >= 0 else -1
        else:
            lane_group[v] = 32 * lane_block[v] // G if lane_block[v] >= 0 else -1
    _tiles(xq, dx, xs, qw, units, lane_group, out, accumulate)


@njit(parallel=True, **_jit, **INNER)
def _tiles(xq, dx, xs, qw, units, lane_group, out, accumulate):
    T, Kp = xq.shape
    N, lanes = qw.weight.shape[0], lane_group.shape[0]
    small = small_bytes(qw)
    signed = signed_bytes(qw)
    pairs = signed or (small and DOT == "avx2")   # VNNI adds each step's products in one instruction
    span = 128 if qw.group_size == 16 else 256   # bytes of a lane's integer sum: 4 steps or 8
    for tile in prange((N + TILE - 1) // TILE):
        n0 = tile * TILE
        rows = min(N, n0 + TILE) - n0
        wq = np.empty((TILE, Kp), np.uint8)              # [rows, Kp] W[n0:n0+rows]'s integers
        sw = np.empty((TILE, lanes), np.float32)         # their scales and biases by lane
        bw = np.empty((TILE, lanes), np.float32)
        for r in range(rows):
            _unpack(qw, n0 + r, units, lane_group, wq[r], sw[r], bw[r])
            if signed:   # the products take q - 128 (sdot): 128 q's scale . x's sums back with the biases
                bw[r] += f32(128.0) * sw[r]
        t = 0
        while t + 4 <= T:
            r = 0
            if pairs:
                while r + 2 <= rows:
                    _tile_4x2(xq, dx, xs, wq, sw, bw, out, t, r, n0, signed, span, accumulate)
                    r += 2
            else:
                while r + 3 <= rows:
                    _tile_4x3(xq, dx, xs, wq, sw, bw, out, t, r, n0, small, span, accumulate)
                    r += 3
            _dots(xq, dx, xs, wq, sw, bw, out, t, t + 4, r, rows, n0, small, signed, span, accumulate)
            t += 4
        _dots(xq, dx, xs, wq, sw, bw, out, t, T, 0, rows, n0, small, signed, span, accumulate)


@njit(inline="always", **_jit)
def _finish(f, a, dx, xs, sw, bw, t, r, v):
    """A superblock's integer lanes a of (x row t, tile row r) into the float lanes f, with the
    biases' part."""
    return fma(load_f32x8(bw, r * bw.shape[1] + v), load_f32x8(xs, t * xs.shape[1] + v),
               scale_add(f, a, load_f32x8(sw, r * sw.shape[1] + v), load_f32x8(dx, t * dx.shape[1] + v)))


@njit(inline="always", **_jit)
def _tile_4x3(xq, dx, xs, wq, sw, bw, out, t, r, n0, small, span, accumulate):
    """out[t:t+4, n0+r:n0+r+3] (+)= 12 dot products: 7 loads for 12 udots a step; the lanes' sums
    made float every `span` bytes (a superblock, or half of one)."""
    Kp = xq.shape[1]
    f00 = f01 = f02 = f10 = f11 = f12 = f20 = f21 = f22 = f30 = f31 = f32_ = zero_f32()
    for c in range(0, Kp, span):
        a00 = a01 = a02 = a10 = a11 = a12 = a20 = a21 = a22 = a30 = a31 = a32 = zero_i32()
        for k in range(c, min(c + span, Kp), 32):
            w0, w1, w2 = load_u8x32(wq, r * Kp + k), load_u8x32(wq, (r + 1) * Kp + k), load_u8x32(wq, (r + 2) * Kp + k)
            u = load_u8x32(xq, t * Kp + k)
            a00, a01, a02 = udot(a00, w0, u, small), udot(a01, w1, u, small), udot(a02, w2, u, small)
            u = load_u8x32(xq, (t + 1) * Kp + k)
            a10, a11, a12 = udot(a10, w0, u, small), udot(a11, w1, u, small), udot(a12, w2, u, small)
            u = load_u8x32(xq, (t + 2) * Kp + k)
            a20, a21, a22 = udot(a20, w0, u, small), udot(a21, w1, u, small), udot(a22, w2, u, small)
            u = load_u8x32(xq, (t + 3) * Kp + k)
            a30, a31, a32 = udot(a30, w0, u, small), udot(a31, w1, u, small), udot(a32, w2, u, small)
        v = c * 8 // span
        f00, f01, f02 = (_finish(f00, a00, dx, xs, sw, bw, t, r, v), _finish(f01, a01, dx, xs, sw, bw, t, r + 1, v),
                         _finish(f02, a02, dx, xs, sw, bw, t, r + 2, v))
        f10, f11, f12 = (_finish(f10, a10, dx, xs, sw, bw, t + 1, r, v), _finish(f11, a11, dx, xs, sw, bw, t + 1, r + 1, v),
                         _finish(f12, a12, dx, xs, sw, bw, t + 1, r + 2, v))
        f20, f21, f22 = (_finish(f20, a20, dx, xs, sw, bw, t + 2, r, v), _finish(f21, a21, dx, xs, sw, bw, t + 2, r + 1, v),
                         _finish(f22, a22, dx, xs, sw, bw, t + 2, r + 2, v))
        f30, f31, f32_ = (_finish(f30, a30, dx, xs, sw, bw, t + 3, r, v), _finish(f31, a31, dx, xs, sw, bw, t + 3, r + 1, v),
                          _finish(f32_, a32, dx, xs, sw, bw, t + 3, r + 2, v))
    n = n0 + r
    _put3(out, t, n, hsum(f00), hsum(f01), hsum(f02), accumulate)
    _put3(out, t + 1, n, hsum(f10), hsum(f11), hsum(f12), accumulate)
    _put3(out, t + 2, n, hsum(f20), hsum(f21), hsum(f22), accumulate)
    _put3(out, t + 3, n, hsum(f30), hsum(f31), hsum(f32_), accumulate)


@njit(inline="always", **_jit)
def _tile_4x2(xq, dx, xs, wq, sw, bw, out, t, r, n0, signed, span, accumulate):
    """_tile_4x3 on 4 rows of x by 2 of W, two steps at a time, for small bytes (small_bytes: udot2
    adds two steps' products before they widen, on AVX2 a third fewer multiplies) or signed ones
    (signed_bytes: sdot, half the multiplies of 8-bit bytes split in nibbles); its 8 accumulators
    leave AVX2's 16 registers room for two steps' weights, where a 4x3 tile's would not."""
    Kp = xq.shape[1]
    f00 = f01 = f10 = f11 = f20 = f21 = f30 = f31 = zero_f32()
    for c in range(0, Kp, span):
        a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = zero_i32()
        end = min(c + span, Kp)
        for k in range(c, end - 32, 64):
            w0, v0 = load_u8x32(wq, r * Kp + k), load_u8x32(wq, r * Kp + k + 32)
            w1, v1 = load_u8x32(wq, (r + 1) * Kp + k), load_u8x32(wq, (r + 1) * Kp + k + 32)
            a00, a01 = _two(a00, a01, w0, v0, w1, v1, xq, t * Kp + k, signed)
            a10, a11 = _two(a10, a11, w0, v0, w1, v1, xq, (t + 1) * Kp + k, signed)
            a20, a21 = _two(a20, a21, w0, v0, w1, v1, xq, (t + 2) * Kp + k, signed)
            a30, a31 = _two(a30, a31, w0, v0, w1, v1, xq, (t + 3) * Kp + k, signed)
        if (end - c) % 64:   # a last superblock of one step
            k = end - 32
            w0, w1 = load_u8x32(wq, r * Kp + k), load_u8x32(wq, (r + 1) * Kp + k)
            a00, a01 = _one(a00, a01, w0, w1, xq, t * Kp + k, signed)
            a10, a11 = _one(a10, a11, w0, w1, xq, (t + 1) * Kp + k, signed)
            a20, a21 = _one(a20, a21, w0, w1, xq, (t + 2) * Kp + k, signed)
            a30, a31 = _one(a30, a31, w0, w1, xq, (t + 3) * Kp + k, signed)
        v = c * 8 // span
        f00, f01 = _finish(f00, a00, dx, xs, sw, bw, t, r, v), _finish(f01, a01, dx, xs, sw, bw, t, r + 1, v)
        f10, f11 = _finish(f10, a10, dx, xs, sw, bw, t + 1, r, v), _finish(f11, a11, dx, xs, sw, bw, t + 1, r + 1, v)
        f20, f21 = _finish(f20, a20, dx, xs, sw, bw, t + 2, r, v), _finish(f21, a21, dx, xs, sw, bw, t + 2, r + 1, v)
        f30, f31 = _finish(f30, a30, dx, xs, sw, bw, t + 3, r, v), _finish(f31, a31, dx, xs, sw, bw, t + 3, r + 1, v)
    n = n0 + r
    _put2(out, t, n, hsum(f00), hsum(f01), accumulate)
    _put2(out, t + 1, n, hsum(f10), hsum(f11), accumulate)
    _put2(out, t + 2, n, hsum(f20), hsum(f21), accumulate)
    _put2(out, t + 3, n, hsum(f30), hsum(f31), accumulate)


@njit(inline="always", **_jit)
def _two(a0, a1, w0, v0, w1, v1, xq, j, signed):
    """Two steps (weights w then v of two rows) times the x bytes at j and j + 32, into a0 and a1."""
    u, y = load_u8x32(xq, j), load_u8x32(xq, j + 32)
    if signed:
        return sdot(sdot(a0, w0, u), v0, y), sdot(sdot(a1, w1, u), v1, y)
    return udot2(a0, w0, u, v0, y, True), udot2(a1, w1, u, v1, y, True)


@njit(inline="always", **_jit)
def _one(a0, a1, w0, w1, xq, j, signed):
    """One step of two rows times the x bytes at j, into a0 and a1."""
    u = load_u8x32(xq, j)
    return _dot(a0, w0, u, True, signed), _dot(a1, w1, u, True, signed)


@njit(inline="always", **_jit)
def _dot(a, w, u, small, signed):
    """a + the step's products: sdot's of q - 128 where `signed`, else udot's."""
    return sdot(a, w, u) if signed else udot(a, w, u, small)


@njit(inline="always", **_jit)
def _dots(xq, dx, xs, wq, sw, bw, out, t0, t1, r0, r1, n0, small, signed, span, accumulate):
    """The edges of a tile, one dot product at a time."""
    Kp = xq.shape[1]
    for t in range(t0, t1):
        for r in range(r0, r1):
            f = zero_f32()
            for c in range(0, Kp, span):
                a = zero_i32()
                for k in range(c, min(c + span, Kp), 32):
                    a = _dot(a, load_u8x32(wq, r * Kp + k), load_u8x32(xq, t * Kp + k), small, signed)
                f = _finish(f, a, dx, xs, sw, bw, t, r, c * 8 // span)
            n = n0 + r
            out[t, n] = out[t, n] + hsum(f) if accumulate else hsum(f)
