"""Quantized decode (a few tokens): out[B, N] (+)= x[B, K] @ W.T for a prepared QuantizedTensor W.

Decode reads each weight once and is bound by memory bandwidth, or on a fast memory by the
instructions that unpack and multiply. Each activation row is rounded to integers, and the dot
products run on them. Per row,

    out[r, n] = sum_b scales[n, g(b)] * dx[r, b] * sum_{k in b} xq[r, k] q[n, k]  +  sum_g biases[n, g] * xs[r, g]

where q are the weight's integers, read as the little-endian bytes of MLX's uint32 words, and
xs[r, g] the sums of x's groups (as rounded). Where the CPU multiplies bytes (INT8: AVX-512 VNNI's
vpdpbusd, or AVX2, as prefill_int8) x is rounded to int8 in blocks b of 32 as prefill rounds it,
32 u8 x s8 products an instruction, which made SmolLM2's decode a fifth faster on a Xeon where the
int16 path was bound by its instructions (layers and head, 6.2 ms a token then 4.9). Elsewhere x is
rounded to int16 per group (b: the group), 16 multiply-adds an instruction (x86 vpmaddwd), close
to float: matvec_rows16, which the tests run on every CPU.

Several rows of x (the decoded tokens of several sequences) share each weight read from memory: on
int8 x a weight row's bytes are unpacked once for four rows of x (_rows_x8), on int16 x two weight
rows are unpacked for two rows of x. Each output is summed in the same order whatever B and
whichever x rows it is paired with (the integer sums are exact, and each float sum is its own): a
row's result does not depend on the other rows, which makes a batch of sequences decode as each
would alone.

Decode here is bound by the instructions, not by memory: on an AMD EPYC (Zen 1, AVX2) one stream
of SmolLM2 reads its weights at a quarter of the bandwidth, and each x row costs its own byte
products (two vpmaddubsw and a vpmaddwd for 64 weights) and their scaling, which no batch shares.
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from nibble.quant.affine import KERNEL_KINDS, QuantizedTensor

from . import prefill_int8
from .cpu import INNER, _jit
from .prefill_int8 import levels, load_u8x32, lookup, nibble_sized, nibbles, sdot, udot, udot2, with_high
from .simd import (chunk_scales, fma, group_count, group_value, group_values8, high_of, hsum, level, levels16,
                   load_16x16, load_f32x8, load_first_f32x8, load_u8x16, lookup16, madd, next_scales, nibble, plane_at,
                   plane_count, prefetch, row_dot, scale_add, splat_f32, spread, unit_scales, vadd, vmul, with_high16,
                   zero_f32, zero_i32, borrowed)
from .sync import threads

f32 = np.float32
# no reassociation or contraction: LLVM may not regroup or fuse a row's float sums differently for one
# x row than for two (the SLP vectorizer packs some rows' scalar sums into vectors)
_jit = dict(_jit, fastmath={"nnan", "ninf", "nsz", "arcp", "afn"})
# Each weight stream asked for AHEAD bytes early, once a cache line (llvm.prefetch): the hardware
# prefetchers alone left one core's stream from DRAM short of the bandwidth, on AMD's and Intel's
# servers alike; of 1, 2 and 4 KB ahead, 2 KB read fastest (the figures: commit 37f7daa).
AHEAD = 2048
PAIRED = 512   # bytes of a weight row at most that decode reads two rows of in step (_tasks_x8)


@njit(**_jit)
def matvec_rows(x, qw, out, accumulate):
    """out[B, N] (+)= x[B, K] @ W.T, shapes checked by the caller (linear.qmatmul): x rounded to
    int8 where the CPU multiplies bytes (INT8), else to int16."""
    products(round_rows(x, qw.group_size, qw.bits), x, qw, out, accumulate)


@njit(**_jit)
def matvec_rows16(x, qw, out, accumulate):
    """matvec_rows on x rounded to int16 whatever the CPU (what CPUs without byte dot products run)."""
    products(_round16(x, qw.group_size, qw.bits), x, qw, out, accumulate)


def _kind(bits: int, G: int, first: bool) -> type:
    name = f"Int{bits}G{G}" + ("First" if first else "")
    doc = (f"A prepared QuantizedTensor of {bits}-bit weights in groups of {G}: its own numba type"
           + (", for a first run's kernels (see FIRST_KINDS)." if first else "."))
    return type(name, (QuantizedTensor,), {"__slots__": (), "__module__": __name__, "__qualname__": name,
                                          "__doc__": doc, "KIND": (bits, G), "FIRST": first})


# One class of QuantizedTensor for each (bits, G), which linear.prepare gives every weight: numba
# types a named tuple by its class, so a kernel compiles only the decode loop of its weights'
# bits and groups, not all of them. Module globals by name, so that cached kernels name their
# types when loaded again.
KINDS = {(bits, G): _kind(bits, G, False) for bits, G in KERNEL_KINDS}
# The same weights for a first run's kernels, which compile in a fraction of the time: every
# product one x row at a time (_rows_x8's passes of four and two rows are most of its code) and
# no prefill tiles, whatever the rows (linear.py). A first answer runs on them while the kernels
# of KINDS compile in the background (runner/warmup.py).
FIRST_KINDS = {(bits, G): _kind(bits, G, True) for bits, G in KERNEL_KINDS}
globals().update({kind.__name__: kind for kind in (*KINDS.values(), *FIRST_KINDS.values())})


def first_kind(w: QuantizedTensor) -> QuantizedTensor:
    """A prepared weight as its first run's kind (the same arrays)."""
    return FIRST_KINDS[type(w).KIND](*w)


def is_first(w) -> bool:
    """Whether a numba type is a weight of a first run's kind."""
    return isinstance(w, types.BaseNamedTuple) and getattr(w.instance_class, "FIRST", False)


@njit(**_jit)
def products(rounded, x, qw, out, accumulate):
    """matvec_rows on x as round_rows(x, qw.group_size, qw.bits) gave it: several weights of the
    same bits and groups may share it."""
    xq, dx, xs = rounded
    # bool(): a plain bool, as expert_products passes it; a literal would compile _rows again
    _rows_of_kind(xq, dx, xs, x, qw, np.zeros(1, np.int64), bool(False), accumulate, out)


@njit(**_jit)
def expert_products(rounded, x, qw, experts, own_x, out):
    """out[j] = (x row j if own_x, else every x row, at out[j * B + r]) @ W_e.T for the experts
    e = experts[j] of a stacked weight qw [E, N, K], as round_rows(x, ...) gave x: all k experts'
    rows in one parallel loop (a loop for each expert's few rows spent more time starting and
    ending than reading), on the kernel a plain weight of its kind runs."""
    xq, dx, xs = rounded
    _rows_of_kind(xq, dx, xs, x, _merged(qw), experts, own_x, bool(False), out)


def _merged(qw):
    """A stacked weight [E, N, K] as the plain one of its E * N rows, a view (njit code only)."""


@overload(_merged, inline="always", jit_options=_jit)
def _merged_typed(qw):
    kind = qw.instance_class

    def merged(qw):
        E, N = qw.weight.shape[0], qw.weight.shape[1]
        return kind(qw.weight.reshape((E * N, qw.weight.shape[2])), _rows_merged(qw.scales, E * N),
                    _rows_merged(qw.biases, E * N), qw.bits, qw.group_size, qw.bf16, qw.values,
                    _rows_merged(qw.high, E * N))
    return merged


def _rows_merged(a, rows):
    """Scales, biases or high planes [E, N, ...] as [rows = E * N, ...] (njit code only)."""


@overload(_rows_merged, inline="always", jit_options=_jit)
def _rows_merged_typed(a, rows):
    if isinstance(a, types.NoneType):
        return lambda a, rows: None
    if a.ndim == 4:   # in two levels (formats.superblocks)
        return lambda a, rows: a.reshape((rows, a.shape[2], a.shape[3]))
    return lambda a, rows: a.reshape((rows, a.shape[2]))


def _rows_of_kind(xq, dx, xs, x, qw, experts, own_x, accumulate, out):
    """_rows for qw's kind (njit code only)."""


@overload(_rows_of_kind, inline="always", jit_options=_jit)
def _rows_of_kind_typed(xq, dx, xs, x, qw, experts, own_x, accumulate, out):
    # bits and the group shapes as constants: numba compiles a function once for each constant
    # argument's value, so each kernel is its own function, none inlined into another (numba copies
    # a callee's IR to inline it, at a cost that grows with its size squared)
    bits, G = qw.instance_class.KIND
    if xq.dtype == types.int8:
        return lambda xq, dx, xs, x, qw, experts, own_x, accumulate, out: _rows_x8(
            (xq, dx, xs, _lane_scales(dx, bits)), x, qw, experts, own_x, accumulate, out)
    # rep: the groups in a block of 64 where it holds several (2 or 4), else 0; G itself is a
    # value too, for the loop bounds
    rep = 64 // G if G <= 32 else 0
    return lambda xq, dx, xs, x, qw, experts, own_x, accumulate, out: _rows(
        xq, dx, xs, x, bits, rep, qw.group_size, accumulate, qw.weight.view(np.uint8), qw.scales, qw.biases,
        qw.bf16, qw.values, qw.high, plane_count(qw.high, x.shape[1]), experts, own_x, out)


INT8 = prefill_int8.DOT is not None   # decode on int8 activations (set where prefill_int8's is)
# 8-bit weights on AVX2 (int8 x): products of q - 128 (prefill_int8.sdot, half udot's multiplies),
# 128 times the scales . x's group sums added with the biases' part
SIGNED8 = prefill_int8.DOT == "avx2"


def round_rows(x, G, bits):
    """x[B, K] -> (xq, dx, xs) for weights of `bits` bits in groups of G: each row rounded by
    round_int8 where INT8, else by quantize_activation (njit code only)."""


@overload(round_rows, jit_options=_jit)
def _round_rows_typed(x, G, bits):
    if INT8:
        return lambda x, G, bits: _round8(x, G, bits)
    return lambda x, G, bits: _round16(x, G, bits)


@njit(**_jit, **INNER)
def _round16(x, G, bits):
    B, K = x.shape
    xq = np.empty((B, K), np.int16)
    dx = np.empty((B, K // G), np.float32)
    xs = np.empty((B, K // G), np.float32)
    for r in range(B):
        quantize_activation(x[r], G, bits, xq[r], dx[r], xs[r])
    return xq, dx, xs


@njit(**_jit, **INNER)
def _round8(x, G, bits):
    B, K = x.shape
    xq = np.empty((B, K), np.int8)
    dx = np.empty((B, K // 32), np.float32)
    xs = np.empty((B, K // G), np.float32)
    for r in range(B):
        round_int8(x[r], G, bits, xq[r], dx[r], xs[r])
    return xq, dx, xs


@njit(parallel=True, **_jit, **INNER)
def _rows(xq, dx, xs, x, bits, rep, G, accumulate, q, s, b, bf16, lut, hi, hb, experts, own_x, out):
    """Every weight row's dot products with the rows of x (int16), two weight rows (h, h + H) and
    two x rows a task: two
    rows far apart are two sequential streams, a range of tasks two ranges of rows. Of stacked
    experts' rows (expert_products), the N = out.shape[1] rows from experts[j] * N, into out[j]
    on x row j (own_x) or out[j * B + r] on each x row r; a plain weight is expert 0 of itself.
    The loop gets plain arrays and calls nothing that is not inlined: a view made or an array
    passed to a call in it takes and drops a reference to its memory, an atomic write to one
    cache line that the threads then fight over (2 threads ran slower than 1)."""
    N, B = out.shape[1], x.shape[0]
    H = (N + 1) // 2
    for t in prange(experts.shape[0] * H):   # each thread: a range of rows and the same range + H
        j, h = divmod(np.int64(t), H)        # prange's index is unsigned: h + H would type as float
        i = experts[j] * N + h
        pair = h + H < N
        m = i + H if pair else i
        first, stop, o = (j, j + 1, 0) if own_x else (0, B, j * B)
        for r in range(first, stop, 2):
            # `two` a value, not a constant: the pair inlined once, not once for each (half this
            # kernel's compile); the simd intrinsics neither regroup nor fuse sums, so a row sums
            # alike whichever copy of the loop LLVM makes for one row and for two
            two = r + 1 < stop
            v0, v1, v2, v3 = _pair(xq, dx, x, q, s, i, m, r, two, bits, rep, G, bf16, lut, hi, hb)
            # the biases' part: each row's biases dotted with x's group sums, once a row (in the
            # loop over groups, their 16-bit loads and widening cost as much as the weights')
            _put_pair(out, o + r, h, H, pair, v0 + row_dot(b, bf16, i, xs, r),
                 v1 + row_dot(b, bf16, m, xs, r), accumulate)
            if two:
                _put_pair(out, o + r + 1, h, H, pair, v2 + row_dot(b, bf16, i, xs, r + 1),
                     v3 + row_dot(b, bf16, m, xs, r + 1), accumulate)


@njit(inline="always", **_jit)
def _put_pair(out, r, h, H, pair, v0, v1, accumulate):
    out[r, h] = out[r, h] + v0 if accumulate else v0
    if pair:
        out[r, h + H] = out[r, h + H] + v1 if accumulate else v1


def _pair(xq, dx, x, q, s, n, m, r, two, bits, rep, G, bf16, lut, hi, hb):
    """(rows n, m) . (x rows r, and r + 1 if `two`) on int16 x for constant bits and rep, 4-bit
    integers read as their levels in lut where it is a table (QuantizedTensor.values), or with
    their high bits from the hb planes hi (QuantizedTensor.high) where there are some: _pair8,
    _pair4 or _pair4_small, the one chosen from the constants (the overload below), inlined alone."""


@overload(_pair, inline="always", jit_options=_jit)
def _pair_typed(xq, dx, x, q, s, n, m, r, two, bits, rep, G, bf16, lut, hi, hb):
    if not isinstance(bits, types.IntegerLiteral) or not isinstance(rep, types.IntegerLiteral):
        return None
    if bits.literal_value == 8:
        return lambda xq, dx, x, q, s, n, m, r, two, bits, rep, G, bf16, lut, hi, hb: _pair8(xq, dx, q, s, n, m, r, two, bf16, G)
    if rep.literal_value:
        return lambda xq, dx, x, q, s, n, m, r, two, bits, rep, G, bf16, lut, hi, hb: _pair4_small(xq, dx, x, q, s, n, m, r, two, bf16, lut, hi, hb, rep)
    return lambda xq, dx, x, q, s, n, m, r, two, bits, rep, G, bf16, lut, hi, hb: _pair4(xq, dx, q, s, n, m, r, two, bf16, G, lut, hi, hb)


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
        for t in range(4):
            for j in range(8):
                qb[16 * t + j] = np.int16(np.rint(xb[4 * j + t] * inv[(64 * c + 4 * j + t) // G]))
                qb[16 * t + j + 8] = np.int16(np.rint(xb[4 * j + t + 32] * inv[(64 * c + 4 * j + t + 32) // G]))


@njit(inline="always", **_jit)
def _madd4(a0, a1, a2, a3, w0, w1, xq, j0, j1, two):
    """Add weight lanes w0 (row n), w1 (row m) times the 16 activations at j0 of xq to a0, a1,
    and times those at j1 to a2, a3 if `two`."""
    x = load_16x16(xq, j0)
    a0, a1 = vadd(a0, madd(w0, x)), vadd(a1, madd(w1, x))
    if two:
        x = load_16x16(xq, j1)
        a2, a3 = vadd(a2, madd(w0, x)), vadd(a3, madd(w1, x))
    return a0, a1, a2, a3


@njit(inline="always", **_jit)
def _pair8(xq, dx, q, s, n, m, r, two, bf16, G):
    """(rows n, m) . (x rows r, r + 1) for 8 bits: two rows far apart are two sequential streams
    (two adjacent rows read in step defeat the hardware prefetcher: 2-3x slower from DRAM)."""
    Kb = q.shape[1]
    j0, j1 = r * Kb, (r + 1) * Kb
    f0, f1, f2, f3 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    s0, s1, s2, s3 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    for g in range(Kb // G):
        if g % 8 == 0:
            s0, s1, s2, s3 = _chunk(s, n, m, g, dx, r, bf16, two)
        a0, a1, a2, a3 = zero_i32(), zero_i32(), zero_i32(), zero_i32()
        k = g * G
        while True:   # G a multiple of 32: two steps of 16 a pass (a while loop: no trip count to work out)
            _ahead(q, n * Kb, m * Kb, k)
            a0, a1, a2, a3 = _madd4(a0, a1, a2, a3, load_u8x16(q, n * Kb + k), load_u8x16(q, m * Kb + k),
                                    xq, j0 + k, j1 + k, two)
            a0, a1, a2, a3 = _madd4(a0, a1, a2, a3, load_u8x16(q, n * Kb + k + 16), load_u8x16(q, m * Kb + k + 16),
                                    xq, j0 + k + 16, j1 + k + 16, two)
            k += 32
            if k == g * G + G:
                break
        f0, f1, f2, f3, s0, s1, s2, s3 = _scale(f0, f1, f2, f3, a0, a1, a2, a3, s0, s1, s2, s3, two, 1)
    return hsum(f0), hsum(f1), hsum(f2), hsum(f3)


@njit(inline="always", **_jit)
def _chunk(s, n, m, g, dx, r, bf16, two):
    """The scales (weight's times x's) of groups g..g+7 of rows n, m with x rows r and r + 1 (if
    `two`): one vector each, a unit's taken from its front (_scale)."""
    s0, s1 = chunk_scales(s, n, g, dx, r, bf16), chunk_scales(s, m, g, dx, r, bf16)
    if two:
        return s0, s1, chunk_scales(s, n, g, dx, r + 1, bf16), chunk_scales(s, m, g, dx, r + 1, bf16)
    return s0, s1, s0, s1


@njit(inline="always", **_jit)
def _scale(f0, f1, f2, f3, a0, a1, a2, a3, s0, s1, s2, s3, two, per):
    """Add a unit's integer sums a times its scales (a unit of `per` groups, a literal) to f, and
    move the next unit's scales to the front: not widened and multiplied one scalar a group."""
    f0, s0 = scale_add(f0, a0, spread(s0, per)), next_scales(s0, per)
    f1, s1 = scale_add(f1, a1, spread(s1, per)), next_scales(s1, per)
    if two:
        f2, s2 = scale_add(f2, a2, spread(s2, per)), next_scales(s2, per)
        f3, s3 = scale_add(f3, a3, spread(s3, per)), next_scales(s3, per)
    return f0, f1, f2, f3, s0, s1, s2, s3


@njit(inline="always", **_jit)
def _ahead(q, i0, i1, k):
    """_ahead1 for the rows at i0 and i1."""
    _ahead1(q, i0, k)
    _ahead1(q, i1, k)


@njit(inline="always", **_jit)
def _block4(a0, a1, a2, a3, q, i0, i1, xq, j0, j1, c, two, table, hi, h0, h1, hb):
    """Add block c (64 weights) of the 4-bit rows starting at bytes i0, i1 of q, times the x rows
    starting at j0 (and j1) of xq: 32 bytes = 16 lanes of 4 nibbles, as their levels in `table`
    (simd.levels16's), or with their high bits from the planes of hi at h0, h1 (simd.plane_at's);
    xq is in the matching order."""
    _ahead(q, i0, i1, 32 * c)
    v0, v1 = load_16x16(q, i0 + 32 * c), load_16x16(q, i1 + 32 * c)
    k = 64 * c
    a0, a1, a2, a3 = _madd4(a0, a1, a2, a3, _int16(v0, 0, table, hi, h0, hb), _int16(v1, 0, table, hi, h1, hb), xq, j0 + k, j1 + k, two)
    a0, a1, a2, a3 = _madd4(a0, a1, a2, a3, _int16(v0, 1, table, hi, h0, hb), _int16(v1, 1, table, hi, h1, hb), xq, j0 + k + 16, j1 + k + 16, two)
    a0, a1, a2, a3 = _madd4(a0, a1, a2, a3, _int16(v0, 2, table, hi, h0, hb), _int16(v1, 2, table, hi, h1, hb), xq, j0 + k + 32, j1 + k + 32, two)
    return _madd4(a0, a1, a2, a3, _int16(v0, 3, table, hi, h0, hb), _int16(v1, 3, table, hi, h1, hb), xq, j0 + k + 48, j1 + k + 48, two)


@njit(inline="always", **_jit)
def _int16(v, t, table, hi, h, hb):
    """Nibble t of the 16 lanes v as the integers they stand for: their levels, or with their high
    bits (at most one of the two is given)."""
    return with_high16(lookup16(table, nibble(v, t)), hi, h, t, hb)


@njit(inline="always", **_jit)
def _pair4(xq, dx, q, s, n, m, r, two, bf16, G, lut, hi, hb):
    """(rows n, m) . (x rows r, r + 1) for 4 bits in groups of G >= 64 (whole blocks of 64)."""
    Kb = q.shape[1]
    table = levels16(lut)
    j0, j1 = r * 2 * Kb, (r + 1) * 2 * Kb
    f0, f1, f2, f3 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    s0, s1, s2, s3 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    for g in range(2 * Kb // G):
        if g % 8 == 0:
            s0, s1, s2, s3 = _chunk(s, n, m, g, dx, r, bf16, two)
        a0, a1, a2, a3 = zero_i32(), zero_i32(), zero_i32(), zero_i32()
        for c in range(g * (G // 64), (g + 1) * (G // 64)):
            a0, a1, a2, a3 = _block4(a0, a1, a2, a3, q, n * Kb, m * Kb, xq, j0, j1, c, two, table, hi,
                                     plane_at(hi, n, c, hb), plane_at(hi, m, c, hb), hb)
        f0, f1, f2, f3, s0, s1, s2, s3 = _scale(f0, f1, f2, f3, a0, a1, a2, a3, s0, s1, s2, s3, two, 1)
    return hsum(f0), hsum(f1), hsum(f2), hsum(f3)


@njit(inline="always", **_jit)
def _pair4_small(xq, dx, x, q, s, n, m, r, two, bf16, lut, hi, hb, per):
    """(rows n, m) . (x rows r, r + 1) for 4 bits in groups of 32 or 16: a block of 64 holds per
    (a literal 2 or 4) of them, int32 lane l summing weights 8l..8l+7 (lanes 0-3 the first 32)."""
    Kb = q.shape[1]
    K = 2 * Kb
    j0, j1 = r * K, (r + 1) * K
    table = levels16(lut)
    f0, f1, f2, f3 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    s0, s1, s2, s3 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    for c in range(K // 64):
        if c % (8 // per) == 0:
            s0, s1, s2, s3 = _chunk(s, n, m, per * c, dx, r, bf16, two)
        a0, a1, a2, a3 = _block4(zero_i32(), zero_i32(), zero_i32(), zero_i32(), q, n * Kb, m * Kb, xq, j0, j1, c, two,
                                 table, hi, plane_at(hi, n, c, hb), plane_at(hi, m, c, hb), hb)
        f0, f1, f2, f3, s0, s1, s2, s3 = _scale(f0, f1, f2, f3, a0, a1, a2, a3, s0, s1, s2, s3, two, per)
    t0, t1, t2, t3 = f32(0.0), f32(0.0), f32(0.0), f32(0.0)
    if K % 64:   # groups of 32, an odd number: the last one's weights in float
        g = K // 32 - 1
        t0 = _tail4(x, q, s, bf16, lut, hi, hb, n, r, g, K)
        t1 = _tail4(x, q, s, bf16, lut, hi, hb, m, r, g, K)
        if two:
            t2 = _tail4(x, q, s, bf16, lut, hi, hb, n, r + 1, g, K)
            t3 = _tail4(x, q, s, bf16, lut, hi, hb, m, r + 1, g, K)
    return hsum(f0) + t0, hsum(f1) + t1, hsum(f2) + t2, hsum(f3) + t3


@njit(inline="always", **_jit)
def _tail4(x, q, s, bf16, lut, hi, hb, n, r, g, K):
    """Group g, the last half block of a 4-bit row n, dotted with x row r in float (its scale's
    part: the bias is _with_biases')."""
    e = f32(0.0)
    for k in range(32 * g, K):
        e += x[r, k] * f32(_integer4(q, lut, hi, hb, n, k))
    return group_value(s, n, g, bf16) * e


@njit(inline="always", **_jit)
def _integer4(q, lut, hi, hb, n, k):
    """Integer k of a 4-bit row n (q its bytes) as the kernels multiply it: its level, or with its
    high bits."""
    return level(lut, (q[n, k >> 1] >> (4 * (k & 1))) & 15) | high_of(hi, n, k, hb) << 4


# ---- int8 activations, where the CPU multiplies bytes ------------------------------------------

@njit(**_jit, **INNER)
def round_int8(x, G, bits, xq, dx, xs):
    """x[K] -> xq int8 [K], each block of 32 rounded to +-127 dx[b] as prefill_int8.quantize_rows
    rounds it (the same integers), and xs[g] the sums of x's groups as rounded.

    For 4 bits, xq is reordered within each block of 64 to match a 32-byte load of the weight's
    nibbles (byte p: weights 2p and 2p + 1): x[2p] at byte p, x[2p + 1] at byte 32 + p; int32
    lane l of a byte dot product sums weights 8l..8l+7 over the low and the high nibbles, lanes 0-3
    the first block, 4-7 the second. A last half block stays in order.
    """
    K = x.shape[0]
    inv = np.empty(K // 32, np.float32)
    halves = np.zeros(K // 16, np.float32)   # each half block's integers (exact: at most 16 * 127)
    for b in range(K // 32):
        top = f32(0.0)
        for k in range(32 * b, 32 * b + 32):
            top = max(top, abs(x[k]))
        dx[b], inv[b] = top / f32(127.0), prefill_int8.inverse_scale(top)
    whole = K // 64 if bits == 4 else 0       # blocks of 64 reordered
    for c in range(whole):
        o = 64 * c
        for h in range(2):
            r = inv[2 * c + h]
            for p in range(16 * h, 16 * h + 16):   # x[o + 2p] to byte p, x[o + 2p + 1] to byte 32 + p
                lo, hi = np.rint(x[o + 2 * p] * r), np.rint(x[o + 2 * p + 1] * r)
                xq[o + p], xq[o + 32 + p] = np.int8(lo), np.int8(hi)
                halves[(o + 2 * p) // 16] += lo + hi
    for b in range(2 * whole, K // 32):
        r = inv[b]
        for k in range(32 * b, 32 * b + 32):
            v = np.rint(x[k] * r)
            xq[k] = np.int8(v)
            halves[k // 16] += v
    if G == 16:
        for g in range(K // 16):
            xs[g] = dx[g // 2] * halves[g]
        return
    per = G // 32
    for g in range(K // G):
        total = f32(0.0)
        for b in range(per * g, per * g + per):
            total += dx[b] * (halves[2 * b] + halves[2 * b + 1])
        xs[g] = total


@njit(parallel=True, **_jit, **INNER)
def _rows_x8(rounded, x, qw, experts, own_x, accumulate, out):
    """_rows on int8 x (rounded: round_rows' and its _lane_scales): each thread a range of
    decode_tasks."""
    tasks = experts.shape[0] * ((out.shape[1] + 1) // 2)   # two weight rows a task
    n = threads()
    for c in prange(n):
        decode_tasks(tasks * c // n, tasks * (c + 1) // n, rounded, x, qw, experts, own_x, accumulate, out)


def decode_tasks(t0, t1, rounded, x, qw, experts, own_x, accumulate, out):
    """Tasks t0..t1-1 of the products of int8 x (rounded: (xq, dx, xs, dxs), round_rows' and
    _lane_scales') with a weight of one of the KINDS, as _rows_of_kind describes; a task is two
    adjacent weight rows (see _tasks_x8). Its bits and groups compile as constants (njit code only)."""


@overload(decode_tasks, inline="always", jit_options=_jit)
def _decode_tasks_typed(t0, t1, rounded, x, qw, experts, own_x, accumulate, out):
    bits, G = qw.instance_class.KIND
    per = 256 // bits   # weights in a unit of 32 bytes: groups in one, and units in a group
    count, upg = max(1, per // G), max(1, G // per)
    alone = bool(qw.instance_class.FIRST)   # a first run's: one x row a pass
    return lambda t0, t1, rounded, x, qw, experts, own_x, accumulate, out: _tasks_x8(
        t0, t1, rounded[0], rounded[1], rounded[3], rounded[2], x, bits, count, upg, accumulate,
        qw.weight.view(np.uint8), qw.scales, qw.biases, qw.bf16, qw.values, qw.high, plane_count(qw.high, x.shape[1]),
        experts, own_x, alone, out)


def _borrowed_any(a):
    """simd.borrowed for an array, None as it is (njit code only)."""


@overload(_borrowed_any, inline="always", jit_options=_jit)
def _borrowed_any_typed(a):
    if isinstance(a, types.NoneType):
        return lambda a: a
    return lambda a: borrowed(a)


@njit(**_jit, **INNER)
def _tasks_x8(t0, t1, xq, dx, dxs, xs, x, bits, count, upg, accumulate, q, s, b, bf16, lut, hi, hb, experts, own_x,
              alone, out):
    """Tasks t0..t1-1 of _rows on int8 x: each weight row dotted with four rows of x a pass while
    four remain (its bytes unpacked once for the four), then with two, then with one (`alone`, a
    first run's: one at a time, a fifth of the code). A unit of 32 weight bytes (64 weights at 4
    bits, 32 at 8) gives 8 int32 lanes, each summing 8 or 4 adjacent products (one block's); each
    lane becomes float and is scaled by its own group's and block's scales, and a lane's float sum
    runs over the units in order: every (weight row, x row) is the same lane arithmetic in a pass
    of four, two or one, whatever the other rows (a batch decodes as each sequence alone), and the
    four rows share no sum (more registers than that spill). `count` groups (a literal) in a unit,
    and `upg` units in a group. A task is two adjacent weight rows, one after the other: a thread's
    range of rows is one stream of each of the weight's arrays (rows h and h + H, as _rows pairs
    them in step, would be two, which the prefetchers serve worse)."""
    # the loop's arrays without their reference counts: the inlined row kernels would take and drop
    # one of each at every row (numba's parallel loops pass theirs so)
    xq, dx, dxs, xs, out = borrowed(xq), borrowed(dx), borrowed(dxs), borrowed(xs), borrowed(out)
    q, s, b, experts = borrowed(q), borrowed(s), borrowed(b), borrowed(experts)
    lut, hi = _borrowed_any(lut), _borrowed_any(hi)
    H = (out.shape[1] + 1) // 2
    for t in range(t0, t1):
        i, h, first, stop, o, pair = _task(t, H, out.shape[1], x.shape[0], experts, own_x)
        # one x row, short rows: the task's two rows in step share x's loads (rows longer than
        # PAIRED read in step are two streams, which the prefetchers serve worse from memory)
        if not alone and pair and stop - first == 1 and q.shape[1] <= PAIRED:
            _put_columns(out, o + first, h, _dots(xq, dx, dxs, xs, q, s, b, bf16, lut, hi, hb, i, first, 1, True, bits,
                                                  count, upg), accumulate)
            continue
        for k in range(2 if pair else 1):   # a loop: the row's kernel inlined once, not twice
            if alone:
                _weight_row_alone(xq, dx, dxs, xs, bits, count, upg, accumulate, q, s, b, bf16, lut, hi, hb, i + k,
                                  h + k, first, stop, o, out)
            else:
                _weight_row(xq, dx, dxs, xs, bits, count, upg, accumulate, q, s, b, bf16, lut, hi, hb, i + k,
                            h + k, first, stop, o, out)


@njit(inline="always", **_jit)
def _task(t, H, N, B, experts, own_x):
    """Task t of _rows_x8's (N weight rows an expert, B rows of x): its first weight row i (of
    expert experts[j], output column h), the x rows first..stop and where their outputs begin (o),
    and whether row i + 1 (column h + 1) is the task's too: H = ceil(N / 2) tasks an expert."""
    j, p = divmod(np.int64(t), H)        # prange's index is unsigned: 2 * p + 1 would type as float
    first, stop, o = (j, j + 1, 0) if own_x else (0, B, j * B)
    h = 2 * p
    return experts[j] * N + h, h, first, stop, o, h + 1 < N


@njit(**_jit, **INNER)
def _lane_scales(dx, bits):
    """x's block scales as decode's lanes meet them: [B, units * 8], lane k of unit u the scale of
    the block its products lie in (4 bits: blocks 2u, lanes 0-3, and 2u + 1; 8 bits: block u)."""
    B, blocks = dx.shape
    out = np.empty((B, blocks // (2 if bits == 4 else 1) * 8), np.float32)
    _lane_scales_into(dx, bits, out)
    return out


@njit(inline="always", **_jit)
def _lane_scales_into(dx, bits, out):
    per = 2 if bits == 4 else 1   # blocks a unit
    for r in range(dx.shape[0]):
        for u in range(out.shape[1] // 8):
            for k in range(8):
                out[r, 8 * u + k] = dx[r, per * u + k * per // 8]


def rounding(x, qw):
    """Room for x[B, K] rounded for qw's kind, as decode_tasks takes it: (xq, dx, xs, dxs) to
    be filled by round_into (njit code only, where INT8)."""


@overload(rounding, inline="always", jit_options=_jit)
def _rounding_typed(x, qw):
    bits, G = qw.instance_class.KIND
    per = 2 if bits == 4 else 1
    return lambda x, qw: (np.empty(x.shape, np.int8), np.empty((x.shape[0], x.shape[1] // 32), np.float32),
                          np.empty((x.shape[0], x.shape[1] // G), np.float32),
                          np.empty((x.shape[0], x.shape[1] // 32 // per * 8), np.float32))


@njit(**_jit, **INNER)
def round_into(x, qw, rounded):
    """x[B, K] rounded for qw's kind into `rounding`'s room: round_rows' and _lane_scales' values."""
    xq, dx, xs, dxs = rounded
    for r in range(x.shape[0]):
        round_int8(x[r], qw.group_size, qw.bits, xq[r], dx[r], xs[r])
    _lane_scales_into(dx, qw.bits, dxs)


def alike(a, b):
    """Whether weights a and b take their input rounded alike (of one kind; njit code only)."""


@overload(alike, inline="always", jit_options=_jit)
def _alike_typed(a, b):
    same = a.instance_class.KIND == b.instance_class.KIND
    return lambda a, b: same


@njit(inline="always", **_jit)
def _weight_row(xq, dx, dxs, xs, bits, count, upg, accumulate, q, s, b, bf16, lut, hi, hb, n, col, first, stop, o, out):
    """Weight row n (output column col) with x rows first..stop into out[o + r, col]: four x rows
    a pass, then two, then one (each pass a copy of _dots that LLVM makes for its constant)."""
    r = first
    while r + 4 <= stop:
        _put(out, o + r, col, 4, _dots(xq, dx, dxs, xs, q, s, b, bf16, lut, hi, hb, n, r, 4, False, bits, count, upg), accumulate)
        r += 4
    if r + 2 <= stop:
        _put(out, o + r, col, 2, _dots(xq, dx, dxs, xs, q, s, b, bf16, lut, hi, hb, n, r, 2, False, bits, count, upg), accumulate)
        r += 2
    if r < stop:
        _put(out, o + r, col, 1, _dots(xq, dx, dxs, xs, q, s, b, bf16, lut, hi, hb, n, r, 1, False, bits, count, upg), accumulate)


@njit(inline="always", **_jit)
def _weight_row_alone(xq, dx, dxs, xs, bits, count, upg, accumulate, q, s, b, bf16, lut, hi, hb, n, col, first, stop,
                      o, out):
    """_weight_row one x row a pass."""
    for r in range(first, stop):
        _put(out, o + r, col, 1, _dots(xq, dx, dxs, xs, q, s, b, bf16, lut, hi, hb, n, r, 1, False, bits, count, upg),
             accumulate)


@njit(inline="always", **_jit)
def _put_columns(out, r, col, v, accumulate):
    """out[r, col], out[r, col + 1] (+)= v[0], v[1]."""
    out[r, col] = out[r, col] + v[0] if accumulate else v[0]
    out[r, col + 1] = out[r, col + 1] + v[1] if accumulate else v[1]


@njit(inline="always", **_jit)
def _put(out, r, col, rows, v, accumulate):
    """out[r + k, col] (+)= v[k] for the first `rows` of the four sums v."""
    for k in range(rows):
        out[r + k, col] = out[r + k, col] + v[k] if accumulate else v[k]


@njit(inline="always", **_jit)
def _unpacked(v, bits, table, hi, h, hb):
    """A unit's 32 weight bytes as the byte products take them: at 4 bits their low and high
    nibbles, as levels in `table` (prefill_int8.levels') or with their high bits from the planes
    of hi at h (simd.plane_at's); at 8 bits the bytes themselves."""
    if bits == 4:
        return (with_high(lookup(table, nibbles(v, False)), hi, h, hb, False),
                with_high(lookup(table, nibbles(v, True)), hi, h, hb, True))
    return v, v


@njit(inline="always", **_jit)
def _step(f, w0, w1, sw, xq, dxs, r, u, bits, small):
    """f + unit u's lanes of x row r times the unit's weights w0, w1 (_unpacked), each lane's
    integer sum scaled by its group's scale sw and its block's (dxs)."""
    j = r * xq.shape[1] + (256 // bits) * u
    if bits == 4:
        a = udot2(zero_i32(), w0, load_u8x32(xq, j), w1, load_u8x32(xq, j + 32), small)
    elif SIGNED8:
        a = sdot(zero_i32(), w0, load_u8x32(xq, j))
    else:
        a = udot(zero_i32(), w0, load_u8x32(xq, j), False)
    return scale_add(f, a, vmul(sw, load_f32x8(dxs, r * dxs.shape[1] + 8 * u)))


@njit(inline="always", **_jit)
def _offset_lanes(f, c, xs, r, g, groups):
    """f + the coefficients c of x row r's group sums g..g+7 (zero past the last) times them."""
    return fma(c, load_first_f32x8(xs, r * groups + g, min(groups - g, 8)), f)


@njit(inline="always", **_jit)
def _dots(xq, dx, dxs, xs, q, s, b, bf16, lut, hi, hb, n, r, rows, pair, bits, count, upg):
    """Row n . x rows r..r + rows - 1 (rows: 1, 2 or 4; the sums past them zero), or where `pair`
    rows n and n + 1 . x row r (rows 1), which share x's loads: its units' lanes, then the biases'
    part in the same lanes (8 groups of biases times x's group sums a step; for 8-bit weights
    whose products took q - 128, SIGNED8, 128 times the scales too), then at 4 bits with an odd
    number of groups of 32 the last one's products. The second sum is row m = n + 1 with x row r
    where `pair`, else row n with x row r + 1: each (weight row, x row) the same arithmetic either way."""
    Kb = q.shape[1]
    table = levels(lut)
    small = nibble_sized(table)
    m, r1 = (n + 1, r) if pair else (n, r + 1)
    second = pair or rows > 1
    f0 = f1 = f2 = f3 = sv = svm = zero_f32()
    for u in range(Kb // 32):
        _ahead1(q, n * Kb, 32 * u)
        w0, w1 = _unpacked(load_u8x32(q, n * Kb + 32 * u), bits, table, hi, plane_at(hi, n, u, hb), hb)
        sw, sv = _unit_scales(s, n, u, sv, bf16, count, upg)
        v0, v1, swm = w0, w1, sw
        if pair:
            _ahead1(q, m * Kb, 32 * u)
            v0, v1 = _unpacked(load_u8x32(q, m * Kb + 32 * u), bits, table, hi, plane_at(hi, m, u, hb), hb)
            swm, svm = _unit_scales(s, m, u, svm, bf16, count, upg)
        f0 = _step(f0, w0, w1, sw, xq, dxs, r, u, bits, small)
        if second:
            f1 = _step(f1, v0, v1, swm, xq, dxs, r1, u, bits, small)
        if rows > 2:
            f2 = _step(f2, w0, w1, sw, xq, dxs, r + 2, u, bits, small)
            f3 = _step(f3, w0, w1, sw, xq, dxs, r + 3, u, bits, small)
        if s.ndim == 3 and (u + 1) % upg == 0:
            sv, svm = next_scales(sv, count), next_scales(svm, count)
    groups = group_count(b)
    for g in range(0, groups, 8):
        c = _offsets(s, b, n, g, bits, bf16)
        cm = _offsets(s, b, m, g, bits, bf16) if pair else c
        f0 = _offset_lanes(f0, c, xs, r, g, groups)
        if second:
            f1 = _offset_lanes(f1, cm, xs, r1, g, groups)
        if rows > 2:
            f2 = _offset_lanes(f2, c, xs, r + 2, g, groups)
            f3 = _offset_lanes(f3, c, xs, r + 3, g, groups)
    K = xq.shape[1]
    if bits == 4 and K % 64:
        g = K // 32 - 1
        return (hsum(f0) + _tail4_x8(xq, dx, q, s, bf16, lut, hi, hb, n, r, g, K),
                hsum(f1) + (_tail4_x8(xq, dx, q, s, bf16, lut, hi, hb, m, r1, g, K) if second else f32(0.0)),
                hsum(f2) + (_tail4_x8(xq, dx, q, s, bf16, lut, hi, hb, n, r + 2, g, K) if rows > 2 else f32(0.0)),
                hsum(f3) + (_tail4_x8(xq, dx, q, s, bf16, lut, hi, hb, n, r + 3, g, K) if rows > 2 else f32(0.0)))
    return hsum(f0), hsum(f1), hsum(f2), hsum(f3)


@njit(inline="always", **_jit)
def _unit_scales(s, n, u, sv, bf16, count, upg):
    """Row n's scales for unit u's lanes, and the 8 groups' values sv carries on (in two levels:
    read and scaled 8 groups at once, then moved down a unit's worth; one level: a unit's own,
    fewer instructions)."""
    g = (u // upg) * count   # the unit's first group
    if s.ndim == 3:
        if u % upg == 0 and g % 8 == 0:
            sv = group_values8(s, n, g, bf16)
        return spread(sv, count), sv
    return unit_scales(s, n, g, count, bf16), sv


@njit(inline="always", **_jit)
def _offsets(s, b, n, g, bits, bf16):
    """Row n's biases of groups g..g+7 (for 8-bit weights whose products took q - 128, SIGNED8,
    plus 128 times their scales): what x's group sums are multiplied by."""
    c = group_values8(b, n, g, bf16)
    if bits == 8 and SIGNED8:
        c = fma(group_values8(s, n, g, bf16), splat_f32(f32(128.0)), c)
    return c


@njit(inline="always", **_jit)
def _ahead1(q, i, k):
    """Prefetch the bytes AHEAD of byte k of the row at i of q, once a cache line (see AHEAD)."""
    if k % 64 == 0:
        prefetch(q, i + k + AHEAD)


@njit(inline="always", **_jit)
def _tail4_x8(xq, dx, q, s, bf16, lut, hi, hb, n, r, g, K):
    """Group g, the last half block of a 4-bit row n, times int8 x row r (in order there)."""
    e = 0
    for k in range(32 * g, K):
        e += np.int32(xq[r, k]) * np.int32(_integer4(q, lut, hi, hb, n, k))
    return group_value(s, n, g, bf16) * dx[r, g] * f32(e)
