"""Explicit SIMD for the quantized and 16-bit float kernels: a numba type for an LLVM vector and
the few portable LLVM vector operations they use, as intrinsics.

LLVM's auto-vectorizer flips between good and bad code on the quantized loops with small source
changes (it vectorized across groups with gathers, or widened int32 sums to int64), so their inner
loops are written with explicit 256-bit vectors. No x86-specific intrinsic: ARM gets its own
instructions for the same LLVM operations.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, models, overload, register_model

from nibble.quant import target


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


def _wide_lanes() -> int:
    """float32 lanes of the widest vector the CPU compiled for holds: 16 with AVX-512 (a Zen 5
    multiplies them at full width), else 8."""
    features = target.features()
    return 16 if features is not None and features.get("avx512f") else 8


LANES = _wide_lanes()
FW = Vec(types.float32, LANES)   # the float tiles' vectors (cpu.matmul)
_i32 = ir.IntType(32)
# Fast math short of regrouping or fusing sums ("reassoc", "contract"): LLVM may not sum a row's
# products differently in one copy of a loop than in another (decode's rows summed alike in a
# batch and alone); a fused multiply-add is asked for by name (fma, scale_add).
_FAST = ("nnan", "ninf", "nsz", "arcp", "afn")


def _ll(t):
    return ir.VectorType(ir.FloatType() if t.dtype == types.float32 else ir.IntType(t.dtype.bitwidth), t.count)


def _shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_i32, len(idx)), list(idx)))


def _element(context, builder, sig, args, at):
    """The address of element i of a C-contiguous array (args[at], i args[at + 1]), counting
    row-major across rows (indexing with a flat offset creates no row view, hence no reference
    counting)."""
    ary = context.make_array(sig.args[at])(context, builder, args[at])
    return builder.gep(ary.data, [args[at + 1]])


def _load(context, builder, sig, args, lltype, align, at=0):
    """Load lltype from _element's address."""
    return builder.load(builder.bitcast(_element(context, builder, sig, args, at), lltype.as_pointer()), align=align)


@intrinsic
def borrowed(typingctx, arr):
    """arr without its reference count (no meminfo): code that passes it on, inlined or called,
    takes and drops no reference, each an atomic add to one cache line that threads fight over
    (half a row's time in decode's loops). The caller keeps arr alive meanwhile."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ary.meminfo = ir.Constant(ary.meminfo.type, None)
        ary.parent = ir.Constant(ary.parent.type, None)
        return ary._getvalue()
    return arr(arr), codegen


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
def prefetch(typingctx, arr, i):
    """Ask for the cache line of arr.flat[i] before it is loaded (llvm.prefetch: a read, kept in
    every cache level). A hint: an address past the array's end does not fault."""
    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_element(context, builder, sig, args, 0), ir.IntType(8).as_pointer())
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type] + [_i32] * 3)
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=fnty)
        # read (0), to every level (locality 3), of data (1)
        builder.call(fn, [ptr, ir.Constant(_i32, 0), ir.Constant(_i32, 3), ir.Constant(_i32, 1)])
        return context.get_dummy_value()
    return types.none(arr, i), codegen


def _float_io(vec, name: str):
    """load_<name>(arr, i) -> float32 arr.flat[i:i+n] as `vec` (n lanes), and store_<name>(arr, i, v)."""
    def load(typingctx, arr, i):
        def codegen(context, builder, sig, args):
            return _load(context, builder, sig, args, _ll(vec), 4)
        return vec(arr, i), codegen

    def store(typingctx, arr, i, v):
        def codegen(context, builder, sig, args):
            ptr = builder.bitcast(_element(context, builder, sig, args, 0), _ll(vec).as_pointer())
            builder.store(args[2], ptr, align=4)
            return context.get_dummy_value()
        return types.none(arr, i, v), codegen
    load.__name__, store.__name__ = f"load_{name}", f"store_{name}"
    return intrinsic(load), intrinsic(store)


load_f32x8, store_f32x8 = _float_io(F32, "f32x8")
load_f32w, store_f32w = _float_io(FW, "f32w")   # LANES lanes


def _widen_half(builder, v, bf16):
    """i16 bits (a scalar or a vector) -> float32: the top half of a float32 if bf16 (an i1) else
    IEEE half. Both are made and one selected: bf16 is constant in a loop, and LLVM folds or
    unswitches the choice."""
    n = v.type.count if isinstance(v.type, ir.VectorType) else None
    i32 = ir.VectorType(_i32, n) if n else _i32
    f32, half = (ir.VectorType(t, n) if n else t for t in (ir.FloatType(), ir.HalfType()))
    shift = ir.Constant(i32, [16] * n) if n else ir.Constant(i32, 16)
    as_bf16 = builder.bitcast(builder.shl(builder.zext(v, i32), shift), f32)
    as_f16 = builder.fpext(builder.bitcast(v, half), f32)
    return builder.select(bf16, as_bf16, as_f16)


@intrinsic
def load_half_f32x8(typingctx, arr, i, bf16):
    """uint16 arr.flat[i:i+8], bfloat16 (bf16) or float16 bits, widened to 8 float32 lanes."""
    def codegen(context, builder, sig, args):
        return _widen_half(builder, _load(context, builder, sig, args, ir.VectorType(ir.IntType(16), 8), 2), args[2])
    return F32(arr, i, bf16), codegen


@intrinsic
def half_to_f32(typingctx, b, bf16):
    """One uint16, bfloat16 (bf16) or float16 bits, as float32."""
    def codegen(context, builder, sig, args):
        return _widen_half(builder, args[0], args[1])
    return types.float32(b, bf16), codegen


@intrinsic
def f32_from_bits(typingctx, i):
    """The float32 whose bits are the int32 i."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


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
def _load_levels16(typingctx, values):
    """A table's 16 levels (uint8 values[16]) as 16 int16 lanes."""
    def codegen(context, builder, sig, args):
        u8x16 = ir.VectorType(ir.IntType(8), 16)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.zext(builder.load(builder.bitcast(data, u8x16.as_pointer()), align=1), _ll(I16))
    return I16(values), codegen


@intrinsic
def _lookup16(typingctx, table, v):
    """table[v[i]] in each 16-bit lane i (v's lanes 0..15): a lane at a time, portable LLVM (the
    int16 decode serves CPUs without byte dot products, where speed matters less than that it runs)."""
    def codegen(context, builder, sig, args):
        table, v = args
        out = ir.Constant(_ll(I16), None)
        for i in range(16):
            out = builder.insert_element(out, builder.extract_element(table, builder.extract_element(v, _i32(i))), _i32(i))
        return out
    return I16(table, v), codegen


def table_ops(load, look):
    """(levels, lookup) for one kind of vector, from its intrinsics load(values) and look(table, v):
    levels(values) is a table of levels (QuantizedTensor.values) as lookup takes it, None where
    there is none; lookup(table, v) each lane's 4-bit integer as its level, or as it is where the
    table is None (both njit code only)."""
    def levels(values):
        pass

    @overload(levels, inline="always")
    def _levels_typed(values):
        if isinstance(values, types.NoneType):
            return lambda values: None
        return lambda values: load(values)

    def lookup(table, v):
        pass

    @overload(lookup, inline="always")
    def _lookup_typed(table, v):
        if isinstance(table, types.NoneType):
            return lambda table, v: v
        return lambda table, v: look(table, v)
    return levels, lookup


levels16, lookup16 = table_ops(_load_levels16, _lookup16)   # int16 lanes


def widen_bits(builder, src, bits, value):
    """<len(bits) x i8>: lane l `value` (an i8) where bit bits[l] of the bytes src (<n x i8>) is
    set, else 0. A byte shuffle, a mask and a compare (AVX2's vpshufb, vpand, vpcmpeqb): LLVM
    turns a bitcast to <n x i1> widened to bytes into one instruction on AVX-512 but into a lane at
    a time on AVX2, which made a 5-bit decode twice an 8-bit one's time."""
    i8 = ir.IntType(8)
    picked = _shuffle(builder, src, src, [b // 8 for b in bits])
    masks = ir.Constant(ir.VectorType(i8, len(bits)), [1 << b % 8 for b in bits])
    on = builder.icmp_unsigned("!=", builder.and_(picked, masks), ir.Constant(masks.type, None))
    return builder.select(on, _splat(builder, value, len(bits)), ir.Constant(masks.type, None))


def block_highs(context, builder, sig, args, at, hb):
    """The high bits of weights 2p and 2p + 1 of a block of 64 (formats.planes), p = 0..31, as byte
    p of 32, each still at its bits s(p) and 4 + s(p): the block's 8 * hb bytes (at _element's
    address of args[at]) copied across the vector, then the 32-bit lanes shifted right by s (hb:
    an i64 value, 1 or 2; the shifts a select LLVM takes out of the loop)."""
    i8x8, i32x8 = ir.VectorType(ir.IntType(8), 8), ir.VectorType(_i32, 8)
    ptr = builder.bitcast(_element(context, builder, sig, args, at), i8x8.as_pointer())
    second = builder.sub(hb, ir.Constant(hb.type, 1))                       # 0 or 1: the bytes 8..15
    first, other = builder.load(ptr, align=1), builder.load(builder.gep(ptr, [second]), align=1)
    copies = builder.bitcast(_shuffle(builder, first, other, list(range(16)) * 2), i32x8)
    two = builder.icmp_signed("==", hb, ir.Constant(hb.type, 2))
    shifts = builder.select(two, ir.Constant(i32x8, [0, 0, 0, 0, 2, 2, 2, 2]), ir.Constant(i32x8, [0, 0, 1, 1, 2, 2, 3, 3]))
    return builder.bitcast(builder.lshr(copies, shifts), ir.VectorType(ir.IntType(8), 32))


def high_mask(builder, hb, n):
    """<n x i8> of (2**hb - 1) << 4: a weight's high part where a nibble above it would be."""
    bits = builder.trunc(builder.sub(builder.shl(ir.Constant(hb.type, 1), hb), ir.Constant(hb.type, 1)), ir.IntType(8))
    return _splat(builder, builder.shl(bits, ir.Constant(ir.IntType(8), 4)), n)


@intrinsic(prefer_literal=True)
def _or_high16(typingctx, v, arr, i, t, hb):
    """v | the high part of weight 4j + t of a block of 64 (formats.planes: its 8 * hb bytes at
    arr.flat[i:]) << 4 in each 16-bit lane j, nibble(., t)'s weights; t a literal 0..3."""
    if not isinstance(t, types.IntegerLiteral):
        return None
    nib = t.literal_value

    def codegen(context, builder, sig, args):
        hb = context.cast(builder, args[4], sig.args[4], types.int64)
        highs = block_highs(context, builder, sig, args, 1, hb)
        picked = _shuffle(builder, highs, highs, [2 * j + nib // 2 for j in range(16)])
        if nib % 2 == 0:   # an even weight's bits at s: up to where the odd weight's are
            picked = builder.shl(picked, ir.Constant(picked.type, [4] * 16))
        high = builder.and_(picked, high_mask(builder, hb, 16))
        return builder.or_(args[0], builder.zext(high, _ll(I16)))
    return I16(v, arr, i, t, hb), codegen


def with_high16(v, hi, i, t, hb):
    """nibble(., t)'s 16 lanes v with their high bits from the `hb` planes of hi at byte i (the
    block's bytes, formats.planes), or v itself where hi is None (njit code only)."""


@overload(with_high16, inline="always")
def _with_high16_typed(v, hi, i, t, hb):
    if isinstance(hi, types.NoneType):
        return lambda v, hi, i, t, hb: v
    return lambda v, hi, i, t, hb: _or_high16(v, hi, i, t, hb)


def high_of(hi, n, k, hb):
    """The high part (0..2**hb - 1) of integer k of row n, from the planes hi [rows, width]
    (formats.planes); 0 where hi is None (njit code only)."""


@overload(high_of, inline="always")
def _high_of_typed(hi, n, k, hb):
    if isinstance(hi, types.NoneType):
        return lambda hi, n, k, hb: 0

    def read(hi, n, k, hb):   # no branch: numba's inliner loses a branch's variables (a warning)
        p = (k % 64) >> 1
        at = (k // 64) * 8 * hb + (p & (8 * hb - 1))
        return (hi[n, at] >> (hb * (p >> (2 + hb)) + 4 * (k & 1))) & ((1 << hb) - 1)
    return read


def plane_at(hi, n, c, hb):
    """The flat index in hi of the high bits of block c (64 weights) of row n (njit code only; 0
    where hi is None)."""


@overload(plane_at, inline="always")
def _plane_at_typed(hi, n, c, hb):
    if isinstance(hi, types.NoneType):
        return lambda hi, n, c, hb: 0
    return lambda hi, n, c, hb: n * hi.shape[1] + c * 8 * hb


def plane_count(hi, K):
    """How many high planes hi holds for rows of K weights; 0 for None (njit code only)."""


@overload(plane_count, inline="always")
def _plane_count_typed(hi, K):
    if isinstance(hi, types.NoneType):
        return lambda hi, K: 0
    return lambda hi, K: hi.shape[-1] // ((K + 255) // 256 * 32)


def level(values, q):
    """The level of 4-bit integer q: values[q], or q itself where values is None (njit code only)."""


@overload(level, inline="always")
def _level_typed(values, q):
    if isinstance(values, types.NoneType):
        return lambda values, q: q
    return lambda values, q: values[q]


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
    """a * b + c lane by lane (float32 vectors of any width), rounded once."""
    def codegen(context, builder, sig, args):
        return _fma(builder, *args)
    return a(a, b, c), codegen


def _fma(builder, a, b, c):
    ty = a.type   # <n x float>
    fn = builder.module.declare_intrinsic(f"llvm.fma.v{ty.count}f32", fnty=ir.FunctionType(ty, [ty, ty, ty]))
    return builder.call(fn, [a, b, c])


@intrinsic
def zero_i32(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_ll(I32), None)
    return I32(), codegen


@intrinsic
def splat_f32(typingctx, x):
    """x in all 8 float32 lanes."""
    def codegen(context, builder, sig, args):
        return _splat(builder, args[0], 8)
    return F32(x), codegen


@intrinsic
def zero_f32(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_ll(F32), None)
    return F32(), codegen


@intrinsic
def splat_f32w(typingctx, x):
    """x in all LANES float32 lanes."""
    def codegen(context, builder, sig, args):
        return _splat(builder, args[0], LANES)
    return FW(x), codegen


@intrinsic
def zero_f32w(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_ll(FW), None)
    return FW(), codegen


def _load_first(context, builder, sig, args, lltype, align, count, at=0):
    """Like _load, the first `count` lanes only (an i64, at most the lanes'), the rest zero: no
    read past them (llvm.masked.load), a plain load where all are there. AVX2 has no masked load
    of 16-bit lanes: LLVM makes it a test, a branch and an insert a lane, which cost decode a
    fifth of its time where every row of scales took it."""
    ptr = _element(context, builder, sig, args, at)
    n = lltype.count
    with builder.if_else(builder.icmp_signed(">=", count, ir.Constant(count.type, n))) as (whole, part):
        with whole:
            full, whole_block = builder.load(builder.bitcast(ptr, lltype.as_pointer()), align=align), builder.block
        with part:
            lanes = ir.Constant(ir.VectorType(ir.IntType(64), n), list(range(n)))
            mask = builder.icmp_signed("<", lanes, _splat(builder, count, n))
            name = f"llvm.masked.load.v{n}{'f32' if isinstance(lltype.element, ir.FloatType) else 'i16'}.p0"
            fnty = ir.FunctionType(lltype, [ptr.type, _i32, mask.type, lltype])
            first = builder.call(builder.module.declare_intrinsic(name, fnty=fnty),
                                 [ptr, ir.Constant(_i32, align), mask, ir.Constant(lltype, None)])
            part_block = builder.block
    value = builder.phi(lltype)
    value.add_incoming(full, whole_block)
    value.add_incoming(first, part_block)
    return value


def _splat(builder, value, n):
    v = builder.insert_element(ir.Constant(ir.VectorType(value.type, n), None), value, ir.Constant(_i32, 0))
    return _shuffle(builder, v, v, [0] * n)


@intrinsic
def _values8(typingctx, a, i, bf16, count):
    """Lanes k = 0..7: a.flat[i + k] as float32 (float32, or 16-bit bits widened together, bf16
    saying which), lanes past the first `count` zero (and not read)."""
    if a.dtype not in (types.float32, types.uint16) or not isinstance(count, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        count = context.cast(builder, args[3], sig.args[3], types.int64)
        if a.dtype == types.uint16:
            return _widen_half(builder, _load_first(context, builder, sig, args, ir.VectorType(ir.IntType(16), 8), 2, count), args[2])
        return _load_first(context, builder, sig, args, _ll(F32), 4, count)
    return F32(a, i, bf16, count), codegen


@intrinsic
def load_super(typingctx, arr, i):
    """The little-endian float16 at bytes arr.flat[i:i+2] (a uint8 array), as float32."""
    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_element(context, builder, sig, args, 0), ir.HalfType().as_pointer())
        return builder.fpext(builder.load(ptr, align=1), ir.FloatType())
    return types.float32(arr, i), codegen


@intrinsic
def _ints8(typingctx, arr, i):
    """arr.flat[i:i+8] as 8 float32 lanes: uint8, or int8 with their signs."""
    signed = arr.dtype == types.int8

    def codegen(context, builder, sig, args):
        ints = _load(context, builder, sig, args, ir.VectorType(ir.IntType(8), 8), 1)
        return builder.sitofp(ints, _ll(F32)) if signed else builder.uitofp(ints, _ll(F32))
    return F32(arr, i), codegen


@intrinsic(prefer_literal=True)
def _spread_values(typingctx, a, i, bf16, count):
    """Lanes k = 0..7: a.flat[i + k * count // 8] as float32, `count` values (a literal 1, 2 or 4)
    spread over the 8 lanes: float32, or 16-bit bits widened (bf16 saying which)."""
    if not isinstance(count, types.IntegerLiteral):
        return None
    c, dtype = count.literal_value, a.dtype

    def codegen(context, builder, sig, args):
        if dtype == types.float32:
            v = _load(context, builder, sig, args, ir.VectorType(ir.FloatType(), c), 4)
        else:
            v = _widen_half(builder, _load(context, builder, sig, args, ir.VectorType(ir.IntType(16), c), 2), args[2])
        return _shuffle(builder, v, v, [k * c // 8 for k in range(8)])
    return F32(a, i, bf16, count), codegen


@njit(inline="always")
def unit_scales(s, n, g, count, bf16):
    """Lanes k = 0..7: the value of group g + k * count // 8 of row n of a prepared weight's scales
    in one level (float32 or 16-bit), `count` groups (a literal 1, 2 or 4) spread over the lanes of
    a unit of decode's byte products."""
    return _spread_values(s, n * s.shape[1] + g, bf16, count)


@njit(inline="always")
def _super_at(a, g):
    """Which super-block of scales or biases in two levels holds group g, and where in it. P = 256
    / G groups a super-block, 8 or 16: a shift and a mask, not an integer division (tens of
    cycles, once each chunk of a row in decode)."""
    P = a.shape[2] - 2
    return g >> (3 + (P >> 4)), g & (P - 1)


@njit(inline="always")
def super_values8(a, n, g):
    """The values of groups g..g+7 (g a multiple of 8) of row n of scales or biases in two levels:
    float32(f16) * float32(integer), as formats.superblocks.expand computes them."""
    S, p = _super_at(a, g)
    i = (n * a.shape[1] + S) * a.shape[2]
    return vmul(_ints8(a, i + 2 + p), splat_f32(load_super(a, i)))


@intrinsic
def vmul(typingctx, a, b):
    """a * b, lane by lane."""
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1], flags=_FAST)
    return F32(a, b), codegen


@intrinsic
def load_first_f32x8(typingctx, arr, i, count):
    """float32 arr.flat[i:i+8], lanes past the first `count` zero (and not read)."""
    def codegen(context, builder, sig, args):
        return _load_first(context, builder, sig, args, _ll(F32), 4, context.cast(builder, args[2], sig.args[2], types.int64))
    return F32(arr, i, count), codegen


def chunk_scales(s, n, g, dx, r, bf16):
    """Lanes k = 0..7: s[n, g + k] * dx[r, g + k] (zero past the last group), s a prepared
    weight's scales as group_value reads them, dx x's float32 scales by group [rows, groups], g a
    multiple of 8 (njit code only)."""


@overload(chunk_scales, inline="always")
def _chunk_scales_typed(s, n, g, dx, r, bf16):
    def scales(s, n, g, dx, r, bf16):
        groups = group_count(s)
        return vmul(group_values8(s, n, g, bf16), load_first_f32x8(dx, r * groups + g, min(groups - g, 8)))
    return scales


@intrinsic(prefer_literal=True)
def spread(typingctx, v, per):
    """The lanes that scale a unit's integer sums, from chunk_scales' vector (its first group in
    lane 0): lane 0 in all 8 for a unit of per = 1 group, [lane 0 x4, lane 1 x4] for per = 2
    (its int32 lanes 0-3 sum the first group), [lane 0 x2, ..., lane 3 x2] for per = 4."""
    if not isinstance(per, types.IntegerLiteral):
        return None
    lanes = [k * per.literal_value // 8 for k in range(8)]

    def codegen(context, builder, sig, args):
        return _shuffle(builder, args[0], args[0], lanes)
    return F32(v, per), codegen


@intrinsic(prefer_literal=True)
def next_scales(typingctx, v, per):
    """v's lanes moved down by per (a literal), zeros shifted in: the next unit's scales first."""
    if not isinstance(per, types.IntegerLiteral):
        return None
    k = per.literal_value

    def codegen(context, builder, sig, args):
        return _shuffle(builder, args[0], ir.Constant(_ll(F32), None), [i + k for i in range(8)])
    return F32(v, per), codegen


@intrinsic
def scale_add(typingctx, acc, a, scale):
    """acc + float(a) * scale, lane by lane, rounded once: a block's integer sums into the float sum."""
    def codegen(context, builder, sig, args):
        return _fma(builder, builder.sitofp(args[1], _ll(F32)), args[2], args[0])
    return F32(acc, a, scale), codegen


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


@njit(inline="always")
def group_scale_bias(qw, n, g):
    """(scale, bias) of row n, group g of a prepared QuantizedTensor, as float32: every kernel
    reads them through here or group_value, whichever width they are stored in (linear.prepare)."""
    return group_value(qw.scales, n, g, qw.bf16), group_value(qw.biases, n, g, qw.bf16)


def group_value(a, n, g, bf16):
    """a[n, g] as float32: float32, or uint16 bits of a bfloat16 (bf16) or float16 (njit code
    only: chosen at compile time from a's dtype)."""


@overload(group_value)
def _group_value_typed(a, n, g, bf16):
    if a.ndim == 3:   # two levels: a float16 and P = 256 / G integers a super-block
        def two_level(a, n, g, bf16):
            S, p = _super_at(a, g)
            return load_super(a, (n * a.shape[1] + S) * a.shape[2]) * np.float32(a[n, S, 2 + p])
        return two_level
    if a.dtype == types.float32:
        return lambda a, n, g, bf16: a[n, g]
    if a.dtype == types.uint16:
        return lambda a, n, g, bf16: half_to_f32(a[n, g], bf16)


@njit(inline="always")
def row_dot(w, bf16, n, v, r):
    """sum over g of w[n, g] * v[r, g]: w the scales or biases of a prepared weight (stored as
    group_value reads them), v float32 [rows, groups]; 8 lanes at a time."""
    groups = group_count(w)
    acc = zero_f32()
    for g in range(0, groups - 7, 8):
        acc = fma(group_values8(w, n, g, bf16), load_f32x8(v, r * groups + g), acc)
    total = hsum(acc)
    for g in range(groups - groups % 8, groups):
        total += group_value(w, n, g, bf16) * v[r, g]
    return total


def group_count(a):
    """Groups a row of scales or biases has (njit code only)."""


@overload(group_count)
def _group_count_typed(a):
    if a.ndim == 3:
        return lambda a: a.shape[1] * (a.shape[2] - 2)
    return lambda a: a.shape[1]


def group_values8(a, n, g, bf16):
    """Values of groups g..g+7 of row n of scales or biases (g a multiple of 8), 8 float32 lanes,
    zero past the last group (njit code only)."""


@overload(group_values8, inline="always")
def _group_values8_typed(a, n, g, bf16):
    if a.ndim == 3:   # two levels: whole super-blocks of 8 or 16 groups
        return lambda a, n, g, bf16: super_values8(a, n, g)

    def one_level(a, n, g, bf16):
        groups = a.shape[1]
        return _values8(a, n * groups + g, bf16, min(groups - g, 8))
    return one_level
