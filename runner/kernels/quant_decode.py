"""Quantized decode (a few tokens): out[B, N] (+)= x[B, K] @ W.T for a prepared QuantizedTensor W.

Decode reads each weight once and is bound by memory bandwidth. Each activation row is quantized
to int16 per group (dx: its scale) and the dot products run on integers, 16 multiply-adds an
instruction (x86 vpmaddwd), 8 lanes wide (simd.py). Per row,

    out[r, n] = sum_g scales[n, g] * dx[r, g] * sum_k xq[r, k] q[n, k]  +  sum_g biases[n, g] * xs[r, g]

where q are the weight's integers, read as the little-endian bytes of MLX's uint32 words, and
xs[r, g] the sums of x's groups. Several rows of x (the decoded tokens of several sequences)
share each weight read from memory: a task unpacks two weight rows and dots them with two rows
of x at a time, from L1 again for the next two. Each output is summed in the same order whatever
B and whichever x rows it is paired with (the integer sums are exact): a row's result does not
depend on the other rows, which makes a batch of sequences decode as each would alone.

Projections of one input (q/k/v, gate/up) run as one parallel region (matvec_group): each region
costs a fork and a join, and waits for its slowest thread (a busy core makes that thread late).
"""
import numpy as np
from numba import njit, prange

from .cpu import _jit
from .simd import group_scale_bias, hsum, load_16x16, load_u8x16, madd, nibble, scale_add, vadd, zero_f32, zero_i32

f32 = np.float32
# no reassociation or contraction: LLVM may not regroup or fuse a row's float sums differently for one
# x row than for two (the SLP vectorizer packs some rows' scalar sums into vectors)
_jit = dict(_jit, fastmath={"nnan", "ninf", "nsz", "arcp", "afn"})


@njit(**_jit)
def matvec_rows(x, qw, out, accumulate):
    """out[B, N] (+)= x[B, K] @ W.T, shapes checked by the caller (linear.qmatmul)."""
    _group(x, (qw, qw, qw), (out, out, out), 1, accumulate)


@njit(**_jit)
def matvec_group(x, ws, outs, count):
    """outs[i][B, N_i] = x[B, K] @ ws[i].T for the first `count` (2 or 3) of ws, weights of one
    bits and group size: a decoded token's q/k/v or gate/up. x is quantized once and all of them
    run in one parallel region, not one each (every region waits for its slowest thread)."""
    if not (_fits(x, ws[0], outs[0], ws[0]) and _fits(x, ws[1], outs[1], ws[0])
            and _fits(x, ws[2], outs[2], ws[0])):   # (the tuples may hold several types: no loop)
        raise ValueError("matvec_group: weights of one kind, x [B, K] and each out [B, N]")
    _group(x, ws, outs, count, False)


@njit(inline="always", **_jit)
def _fits(x, qw, out, first):
    """Whether out = x @ qw.T has the right shapes, qw the bits and group size of `first`."""
    N, K = qw.weight.shape[0], qw.weight.shape[1] * 32 // qw.bits
    return (qw.bits == first.bits and qw.group_size == first.group_size and K == x.shape[1]
            and out.shape[0] == x.shape[0] and out.shape[1] == N)


@njit(**_jit)
def _group(x, ws, outs, count, accumulate):
    B, K = x.shape
    G, bits = ws[0].group_size, ws[0].bits
    xq = np.empty((B, K), np.int16)
    dx = np.empty((B, K // G), np.float32)
    xs = np.empty((B, K // G), np.float32)
    for r in range(B):
        quantize_activation(x[r], G, bits, xq[r], dx[r], xs[r])
    e0 = _tasks(ws[0])
    e1 = e0 + (_tasks(ws[1]) if count > 1 else 0)
    e2 = e1 + (_tasks(ws[2]) if count > 2 else 0)
    _rows(xq, dx, xs, x, ws[0], ws[1], ws[2], outs[0], outs[1], outs[2], e0, e1, e2, bits, G, accumulate)


@njit(inline="always", **_jit)
def _tasks(qw):
    """Tasks of a weight: two rows each (its rows pair up as i, i + half)."""
    return (qw.weight.shape[0] + 1) // 2


@njit(parallel=True, **_jit)
def _rows(xq, dx, xs, x, w0, w1, w2, o0, o1, o2, e0, e1, e2, bits, G, accumulate):
    """Every row of w0, w1, w2 dotted with the rows of x into o0, o1, o2: tasks 0..e0-1 are
    w0's, e0..e1-1 w1's, e1..e2-1 w2's (the three may be one; then e1 = e2 = e0)."""
    for t in prange(e2):       # each thread: a range of tasks
        j = np.int64(t)        # prange's index is unsigned: j - e0 would type as float
        if j < e0:
            _task(xq, dx, xs, x, w0, j, bits, G, o0, accumulate)
        elif j < e1:
            _task(xq, dx, xs, x, w1, j - e0, bits, G, o1, accumulate)
        else:
            _task(xq, dx, xs, x, w2, j - e1, bits, G, o2, accumulate)


@njit(**_jit)
def _task(xq, dx, xs, x, qw, i, bits, G, out, accumulate):
    """Rows i and i + H of qw (H: half its rows, rounded up) dotted with every row of x: two rows
    far apart are two sequential streams, a range of tasks two ranges of rows."""
    q = qw.weight.view(np.uint8)
    N, B = q.shape[0], x.shape[0]
    H = (N + 1) // 2
    m = i + H if i + H < N else i
    for r in range(0, B, 2):
        two = r + 1 < B
        v0, v1, v2, v3 = _pair(xq, dx, xs, x, q, qw, i, m, r, two, bits, G)
        _put(out, r, i, m, v0, v1, accumulate)
        if two:
            _put(out, r + 1, i, m, v2, v3, accumulate)


@njit(inline="always", **_jit)
def _put(out, r, n, m, v0, v1, accumulate):
    out[r, n] = out[r, n] + v0 if accumulate else v0
    if m != n:
        out[r, m] = out[r, m] + v1 if accumulate else v1


@njit(inline="always", **_jit)
def _pair(xq, dx, xs, x, q, qw, n, m, r, two, bits, G):
    """(rows n, m) . (x rows r, and r + 1 if `two`), with G and `two` passed on as constants:
    each inner loop gets fixed bounds, and one x row no code for a second."""
    if two:
        return _pair_g(xq, dx, xs, x, q, qw, n, m, r, True, bits, G)
    return _pair_g(xq, dx, xs, x, q, qw, n, m, r, False, bits, G)


@njit(inline="always", **_jit)
def _pair_g(xq, dx, xs, x, q, qw, n, m, r, two, bits, G):
    if bits == 8:
        if G == 64:
            return _pair8(xq, dx, xs, q, qw, n, m, r, two, 64)
        if G == 32:
            return _pair8(xq, dx, xs, q, qw, n, m, r, two, 32)
        return _pair8(xq, dx, xs, q, qw, n, m, r, two, 128)
    if G == 64:
        return _pair4(xq, dx, xs, x, q, qw, n, m, r, two, 64)
    if G == 32:
        return _pair4(xq, dx, xs, x, q, qw, n, m, r, two, 32)
    return _pair4(xq, dx, xs, x, q, qw, n, m, r, two, 128)


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
def _pair8(xq, dx, xs, q, qw, n, m, r, two, G):
    """(rows n, m) . (x rows r, r + 1) for 8 bits: two rows far apart are two sequential streams
    (two adjacent rows read in step defeat the hardware prefetcher: 2-3x slower from DRAM)."""
    Kb = q.shape[1]
    j0, j1 = r * Kb, (r + 1) * Kb
    f0, f1, f2, f3 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    t0, t1, t2, t3 = f32(0.0), f32(0.0), f32(0.0), f32(0.0)
    for g in range(Kb // G):
        a0, a1, a2, a3 = zero_i32(), zero_i32(), zero_i32(), zero_i32()
        for k in range(g * G, g * G + G, 16):
            a0, a1, a2, a3 = _madd4(a0, a1, a2, a3, load_u8x16(q, n * Kb + k), load_u8x16(q, m * Kb + k),
                                    xq, j0 + k, j1 + k, two)
        sn, bn = group_scale_bias(qw, n, g)
        sm, bm = group_scale_bias(qw, m, g)
        f0 = scale_add(f0, a0, sn * dx[r, g], sn * dx[r, g])
        f1 = scale_add(f1, a1, sm * dx[r, g], sm * dx[r, g])
        t0 += bn * xs[r, g]
        t1 += bm * xs[r, g]
        if two:
            f2 = scale_add(f2, a2, sn * dx[r + 1, g], sn * dx[r + 1, g])
            f3 = scale_add(f3, a3, sm * dx[r + 1, g], sm * dx[r + 1, g])
            t2 += bn * xs[r + 1, g]
            t3 += bm * xs[r + 1, g]
    return hsum(f0) + t0, hsum(f1) + t1, hsum(f2) + t2, hsum(f3) + t3


@njit(inline="always", **_jit)
def _block4(a0, a1, a2, a3, q, i0, i1, xq, j0, j1, c, two):
    """Add block c (64 weights) of the 4-bit rows starting at bytes i0, i1 of q, times the x rows
    starting at j0 (and j1) of xq: 32 bytes = 16 lanes of 4 nibbles; xq is in the matching order."""
    v0, v1 = load_16x16(q, i0 + 32 * c), load_16x16(q, i1 + 32 * c)
    k = 64 * c
    a0, a1, a2, a3 = _madd4(a0, a1, a2, a3, nibble(v0, 0), nibble(v1, 0), xq, j0 + k, j1 + k, two)
    a0, a1, a2, a3 = _madd4(a0, a1, a2, a3, nibble(v0, 1), nibble(v1, 1), xq, j0 + k + 16, j1 + k + 16, two)
    a0, a1, a2, a3 = _madd4(a0, a1, a2, a3, nibble(v0, 2), nibble(v1, 2), xq, j0 + k + 32, j1 + k + 32, two)
    return _madd4(a0, a1, a2, a3, nibble(v0, 3), nibble(v1, 3), xq, j0 + k + 48, j1 + k + 48, two)


@njit(inline="always", **_jit)
def _pair4(xq, dx, xs, x, q, qw, n, m, r, two, G):
    """(rows n, m) . (x rows r, r + 1) for 4 bits. A block of 64 holds one group, half of one, or
    (G = 32) two: int32 lanes 0-3 then sum its first 32 weights, lanes 4-7 the next 32."""
    Kb = q.shape[1]
    K = 2 * Kb
    j0, j1 = r * K, (r + 1) * K
    f0, f1, f2, f3 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    t0, t1, t2, t3 = f32(0.0), f32(0.0), f32(0.0), f32(0.0)
    per = 2 if G == 32 else 1      # groups a block holds
    for c in range(K // 64 if G == 32 else K // G):
        a0, a1, a2, a3 = zero_i32(), zero_i32(), zero_i32(), zero_i32()
        if G == 32:
            a0, a1, a2, a3 = _block4(a0, a1, a2, a3, q, n * Kb, m * Kb, xq, j0, j1, c, two)
            g, h = 2 * c, 2 * c + 1
        else:
            for cc in range(c * (G // 64), (c + 1) * (G // 64)):
                a0, a1, a2, a3 = _block4(a0, a1, a2, a3, q, n * Kb, m * Kb, xq, j0, j1, cc, two)
            g, h = c, c
        sng, bng = group_scale_bias(qw, n, g)
        snh, bnh = group_scale_bias(qw, n, h)
        smg, bmg = group_scale_bias(qw, m, g)
        smh, bmh = group_scale_bias(qw, m, h)
        f0 = scale_add(f0, a0, sng * dx[r, g], snh * dx[r, h])
        f1 = scale_add(f1, a1, smg * dx[r, g], smh * dx[r, h])
        t0 += _bias(bng, bnh, xs, r, g, h, per)
        t1 += _bias(bmg, bmh, xs, r, g, h, per)
        if two:
            f2 = scale_add(f2, a2, sng * dx[r + 1, g], snh * dx[r + 1, h])
            f3 = scale_add(f3, a3, smg * dx[r + 1, g], smh * dx[r + 1, h])
            t2 += _bias(bng, bnh, xs, r + 1, g, h, per)
            t3 += _bias(bmg, bmh, xs, r + 1, g, h, per)
    if K % 64:   # G = 32 and an odd number of groups: the last one in float
        g = K // 32 - 1
        t0 += _tail4(x, q, qw, xs, n, r, g, K)
        t1 += _tail4(x, q, qw, xs, m, r, g, K)
        if two:
            t2 += _tail4(x, q, qw, xs, n, r + 1, g, K)
            t3 += _tail4(x, q, qw, xs, m, r + 1, g, K)
    return hsum(f0) + t0, hsum(f1) + t1, hsum(f2) + t2, hsum(f3) + t3


@njit(inline="always", **_jit)
def _bias(bg, bh, xs, r, g, h, per):
    """The biases' part of a block: a row's biases bg, bh of each group it holds (g, and h if
    per = 2) times x row r's sums there."""
    if per == 2:
        return bg * xs[r, g] + bh * xs[r, h]
    return bg * xs[r, g]


@njit(inline="always", **_jit)
def _tail4(x, q, qw, xs, n, r, g, K):
    """Group g, the last half block of a 4-bit row n, dotted with x row r in float."""
    e = f32(0.0)
    for k in range(32 * g, K):
        e += x[r, k] * f32((q[n, k >> 1] >> (4 * (k & 1))) & 15)
    s, b = group_scale_bias(qw, n, g)
    return s * e + b * xs[r, g]
