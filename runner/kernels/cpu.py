"""Numba CPU kernels for the float path. Each has a plain numpy twin in tests/reference.py.

All kernels write into preallocated outputs, release the GIL (the chat app runs generation in a
thread) and are cached on disk so a second start does not compile again.
"""
import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .simd import f32_from_bits, fma, hmax, hsum, load_f32x8, splat_f32, store_f32x8, vmax, zero_f32

# error_model="numpy": a division by zero gives inf or NaN (as numpy does) instead of raising
# ZeroDivisionError from inside a kernel; non-finite values are caught on the logits (model.py).
_jit = dict(fastmath=True, cache=True, nogil=True, error_model="numpy")

# Most rows that go through the decode kernels (here, quant_decode's, half's), which read each
# weight once for all rows and compute each row as they would alone; more rows go through the
# tiles. Model.forward_batch decodes sequences in groups of SMALL. Where the tiles catch up
# (tests/bench_batch.py, int4, 2 threads): SmolLM2's matrices at 12-16 rows, Llama-2-7B's past 16.
SMALL = 16


@njit(parallel=True, **_jit)
def matmul(x, w, out, accumulate):
    """out[T, N] (+)= x[T, K] @ w[N, K].T -- by far the most time is spent here.

    Decode (T <= SMALL) is bound by reading w: rows split across threads, each row read once and
    dotted with every row of x (_dot: the same sum for a row of x whatever T). Prefill is bound by
    arithmetic: w is packed into panels of PANEL rows, transposed (wp[p, k]: the PANEL weights of
    column k of panel p, one cache line), then each task multiplies BLOCK_ROWS rows of x by one
    panel (_tile_6x16). Up to PACKED floats of panels at a time: a bounded copy of a large w (an
    output head's), kept in L3 while every block of x passes over it. Each output is one chain of
    FMAs along k, so a row's result is the same whatever T (past SMALL) and whatever rows beside it.
    """
    T, K = x.shape
    N = w.shape[0]
    if T <= SMALL:
        for n in prange(N):
            for t in range(T):
                acc = _dot(x, t, w, n)
                out[t, n] = out[t, n] + acc if accumulate else acc
        return
    panels = (N + PANEL - 1) // PANEL
    step = max(1, PACKED // (K * PANEL))
    wp = np.empty((min(step, panels), K, PANEL), np.float32)
    blocks = (T + BLOCK_ROWS - 1) // BLOCK_ROWS
    for p0 in range(0, panels, step):
        n_panels = min(step, panels - p0)
        for p in prange(n_panels):
            for c in range(PANEL):
                n = (p0 + p) * PANEL + c
                for k in range(K):
                    wp[p, k, c] = w[n, k] if n < N else 0
        for task in prange(blocks * n_panels):
            # consecutive tasks share a block of x (kept in L2): each thread runs a contiguous range
            b, p = np.int64(task) // n_panels, np.int64(task) % n_panels
            t0, t1 = b * BLOCK_ROWS, min(T, b * BLOCK_ROWS + BLOCK_ROWS)
            tile = np.empty((BLOCK_ROWS, PANEL), np.float32)
            for t in range(t0, t1, 6):
                _tile_6x16(x, t, t1 - 1, wp[p], tile, t - t0)
            n0 = (p0 + p) * PANEL
            for t in range(t0, t1):
                for c in range(min(PANEL, N - n0)):
                    out[t, n0 + c] = out[t, n0 + c] + tile[t - t0, c] if accumulate else tile[t - t0, c]


PANEL, BLOCK_ROWS = 16, 48   # prefill: columns (two vectors) and rows (8 micro-tiles) a task
PACKED = 1 << 20             # floats of w packed at a time (4 MB)


@njit(inline="always", **_jit)
def _tile_6x16(x, t, last, wp, tile, r):
    """tile[r:r+6] = x[t:t+6] @ wp [K, 16], rows past `last` repeating it (unused): 12 vector
    accumulators, each step 2 loads of wp and 6 of x (broadcast) for 12 FMAs."""
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = zero_f32()
    t1, t2, t3, t4, t5 = min(t + 1, last), min(t + 2, last), min(t + 3, last), min(t + 4, last), min(t + 5, last)
    for k in range(x.shape[1]):
        w0, w1 = load_f32x8(wp, k * PANEL), load_f32x8(wp, k * PANEL + 8)
        u = splat_f32(np.float32(x[t, k]))
        a00, a01 = fma(u, w0, a00), fma(u, w1, a01)
        u = splat_f32(np.float32(x[t1, k]))
        a10, a11 = fma(u, w0, a10), fma(u, w1, a11)
        u = splat_f32(np.float32(x[t2, k]))
        a20, a21 = fma(u, w0, a20), fma(u, w1, a21)
        u = splat_f32(np.float32(x[t3, k]))
        a30, a31 = fma(u, w0, a30), fma(u, w1, a31)
        u = splat_f32(np.float32(x[t4, k]))
        a40, a41 = fma(u, w0, a40), fma(u, w1, a41)
        u = splat_f32(np.float32(x[t5, k]))
        a50, a51 = fma(u, w0, a50), fma(u, w1, a51)
    at = r * PANEL
    store_f32x8(tile, at, a00)
    store_f32x8(tile, at + 8, a01)
    store_f32x8(tile, at + PANEL, a10)
    store_f32x8(tile, at + PANEL + 8, a11)
    store_f32x8(tile, at + 2 * PANEL, a20)
    store_f32x8(tile, at + 2 * PANEL + 8, a21)
    store_f32x8(tile, at + 3 * PANEL, a30)
    store_f32x8(tile, at + 3 * PANEL + 8, a31)
    store_f32x8(tile, at + 4 * PANEL, a40)
    store_f32x8(tile, at + 4 * PANEL + 8, a41)
    store_f32x8(tile, at + 5 * PANEL, a50)
    store_f32x8(tile, at + 5 * PANEL + 8, a51)


def _dot(x, t, w, n):
    """x[t] . w[n] in float32, summed in the same order whatever the other rows (njit code only)."""


@overload(_dot, jit_options=_jit)
def _dot_typed(x, t, w, n):
    if all(a.dtype == types.float32 and a.layout == "C" for a in (x, w)):
        return _dot_vectors
    return _dot_any   # other dtypes or layouts (tests' float64 weights, views): one by one


def _dot_vectors(x, t, w, n):
    """Rows of K float32 in C order: two accumulators of 8 lanes, K % 16 one by one."""
    K = x.shape[1]
    K16 = K - K % 16
    xt, wn = t * K, n * K   # flat indexes of the rows
    a0, a1 = zero_f32(), zero_f32()
    for k in range(0, K16, 16):
        a0 = fma(load_f32x8(x, xt + k), load_f32x8(w, wn + k), a0)
        a1 = fma(load_f32x8(x, xt + k + 8), load_f32x8(w, wn + k + 8), a1)
    s = hsum(a0) + hsum(a1)
    for k in range(K16, K):
        s += x[t, k] * w[n, k]
    return s


def _dot_any(x, t, w, n):
    s = np.float32(0.0)
    for k in range(x.shape[1]):
        s += x[t, k] * w[n, k]
    return s


# exp's own flags: fast, but no reassociation, which could fold its ln2 in two parts (below) into one
_EXACT = dict(_jit, fastmath={"nnan", "ninf", "nsz", "arcp", "contract", "afn"})


@njit(**_EXACT)
def exp(x):
    """e ** x for a float32 x in [-87, 88] (clamped to it: e ** -87 stands for less, e ** 88 for
    more), within about 1 ulp: arithmetic only, so that a loop of it vectorizes (np.exp calls libm
    for one value at a time: silu took 4x longer). Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2
    (ln2 in two parts, the first exact in n ln2), e ** r by polynomial, times 2 ** n built in the
    exponent bits."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.rint(x * np.float32(1.44269504088896341))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * r * r + r + np.float32(1.0)) * f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(parallel=True, **_jit)
def silu_mul(g, up):
    """g[T, F] = silu(g) * up, in place"""
    for t in prange(g.shape[0]):
        for f in range(g.shape[1]):
            g[t, f] = g[t, f] / (np.float32(1.0) + exp(-g[t, f])) * up[t, f]


@njit(parallel=True, **_jit)
def gelu_tanh_mul(g, up):
    """g[T, F] = gelu(g) * up, in place, with GELU's tanh approximation (gelu_pytorch_tanh)"""
    c = np.float32(math.sqrt(2 / math.pi))
    for t in prange(g.shape[0]):
        for f in range(g.shape[1]):
            x = g[t, f]
            inner = c * (x + np.float32(0.044715) * x * x * x)
            g[t, f] = np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner)) * up[t, f]


@njit(parallel=True, **_jit)
def project_qkv(x, wq, wk, wv, q, k, v):
    """q, k, v = x @ wq.T, x @ wk.T, x @ wv.T; for decode all rows in one parallel region."""
    if x.shape[0] > SMALL:
        matmul(x, wq, q, False)
        matmul(x, wk, k, False)
        matmul(x, wv, v, False)
        return
    nq, nk = wq.shape[0], wk.shape[0]
    for task in prange(nq + nk + wv.shape[0]):
        n = np.int64(task)   # prange's index is unsigned: n - nq would type as float
        if n < nq:
            w, out, row = wq, q, n
        elif n < nq + nk:
            w, out, row = wk, k, n - nq
        else:
            w, out, row = wv, v, n - nq - nk
        for t in range(x.shape[0]):
            out[t, row] = _dot(x, t, w, row)


@njit(parallel=True, **_jit)
def swiglu(x, w_gate, w_up, out):
    """out[T, F] = silu(x @ w_gate.T) * (x @ w_up.T); for decode both matrices in one pass."""
    T, K = x.shape
    if T > SMALL:
        up = np.empty_like(out)
        matmul(x, w_gate, out, False)
        matmul(x, w_up, up, False)
        silu_mul(out, up)
        return
    for f in prange(w_gate.shape[0]):
        for t in range(T):
            g, u = _dot(x, t, w_gate, f), _dot(x, t, w_up, f)
            out[t, f] = g / (np.float32(1.0) + np.exp(-g)) * u


@njit(parallel=True, **_jit)
def layernorm(x, weight, bias, eps, out):
    """out[T, D] = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias (BERT's LayerNorm; out may
    be x)."""
    for t in prange(x.shape[0]):
        _normalize(x, t, weight, bias, eps, out)


@njit(parallel=True, **_jit)
def add_layernorm(x, y, add, weight, bias, eps):
    """x[T, D] = layernorm(x + y + add) in place: BERT's norm after a residual add, x the residual
    stream, y [T, D] a block's output before its bias `add` [D]; one pass over the rows."""
    for t in prange(x.shape[0]):
        for d in range(x.shape[1]):
            x[t, d] = x[t, d] + y[t, d] + add[d]
        _normalize(x, t, weight, bias, eps, x)


@njit(inline="always", **_jit)
def _normalize(x, t, weight, bias, eps, out):
    D = x.shape[1]
    mean = np.float32(0.0)
    for d in range(D):
        mean += x[t, d]
    mean /= D
    var = np.float32(0.0)
    for d in range(D):
        var += (x[t, d] - mean) * (x[t, d] - mean)
    scale = np.float32(1.0) / np.sqrt(var / D + np.float32(eps))
    for d in range(D):
        out[t, d] = (x[t, d] - mean) * scale * weight[d] + bias[d]


@njit(parallel=True, **_jit)
def gelu(x, bias):
    """x[T, F] = gelu(x + bias) in place (bias [F]), GELU with erf (not tanh's approximation), as
    BERT's hidden_act "gelu"."""
    r = np.float32(1 / math.sqrt(2))
    for t in prange(x.shape[0]):
        for f in range(x.shape[1]):
            v = x[t, f] + bias[f]
            x[t, f] = np.float32(0.5) * v * (np.float32(1.0) + erf(v * r))


@njit(inline="always", **_jit)
def erf(x):
    """erf of a float32 within 1.5e-7 (Abramowitz and Stegun 7.1.26): arithmetic and `exp` only,
    so that a loop of it vectorizes (math.erf, a libm call a value in float64, took 30 ns)."""
    a = abs(x)
    t = np.float32(1.0) / (np.float32(1.0) + np.float32(0.3275911) * a)
    p = np.float32(1.061405429)
    p = p * t - np.float32(1.453152027)
    p = p * t + np.float32(1.421413741)
    p = p * t - np.float32(0.284496736)
    p = p * t + np.float32(0.254829592)
    y = np.float32(1.0) - p * t * exp(-a * a)
    return y if x >= 0 else -y


@njit(**_jit)
def rmsnorm(x, weight, eps, out):
    """out[T, D] = x / sqrt(mean(x^2) + eps) * weight

    Serial, as is rope: too little work to pay for a parallel region (~5 us each here).
    """
    T, D = x.shape
    for t in range(T):
        ss = np.float32(0.0)
        for d in range(D):
            ss += x[t, d] * x[t, d]
        scale = np.float32(1.0) / np.sqrt(ss / D + np.float32(eps))
        for d in range(D):
            out[t, d] = x[t, d] * scale * weight[d]


@njit(**_jit)
def rope(x, cos, sin, positions):
    """Rotate x[T, H, hd] in place, row t for position positions[t] (the rotate-half layout of HF
    models).

    cos, sin: [max_ctx, r/2] tables built once at load, rotating the first r dims of each head
    (r = hd but for partial rotary; r = 0: a layer without RoPE).
    """
    T, H, hd = x.shape
    half = cos.shape[1]
    for t in range(T):
        c = cos[positions[t]]
        s = sin[positions[t]]
        for h in range(H):
            for i in range(half):
                x1 = x[t, h, i]
                x2 = x[t, h, i + half]
                x[t, h, i] = x1 * c[i] - x2 * s[i]
                x[t, h, i + half] = x2 * c[i] + x1 * s[i]


@njit(parallel=True, **_jit)
def attention(q, k_cache, v_cache, k_scale, v_scale, rows, window, scale, sinks, out):
    """Grouped-query attention of new queries against the cache, read through block tables: causal,
    or bidirectional where window < 0 (an encoder's).

    q: [T, H, hd], row t the query of position p = rows.positions[t] of sequence rows.seq[t];
    k_cache, v_cache: [blocks, Hkv, BLOCK, hd] (float32, or int8 rows times k_scale, v_scale
    [blocks, Hkv, BLOCK]), already holding that sequence's positions 0..p in the blocks its table
    rows.tables[rows.seq[t]] names, in order; out: [T, H, hd]. window > 0 limits each query to
    its last `window` positions (Mistral's sliding window); window < 0 lets it see every position
    of its sequence that this pass stores, later ones too (an encoder's sequences come whole:
    _bidirectional). The scores are q . k times `scale` (1/sqrt(hd) but for Gemma's and
    Granite's). sinks [H] (gpt-oss's; shape (0,): none): a logit per head that joins every row's
    softmax with no value to weigh. A row's result depends on its own sequence only: the same
    whatever else is in the pass.

    Causal: one (row, head) pair per task, with an online softmax: one pass over the keys and
    values, keeping a running maximum, sum and weighted sum of values, the scores of one block of
    positions at a time (their dot products independent of each other, the sums rescaled once a
    block); no T x T matrix, no whole row.
    """
    if window < 0:
        _bidirectional(q, k_cache, v_cache, k_scale, v_scale, rows, scale, sinks, out)
        return
    T, H, hd = q.shape
    B = k_cache.shape[2]
    group = H // k_cache.shape[1]
    scale = np.float32(scale)
    for task in prange(T * H):
        # the rows from both ends taken in turn: a prompt's later rows attend to more positions,
        # and each thread runs a contiguous range of tasks
        i, h = np.int64(task) // H, np.int64(task) % H
        t = i // 2 if i % 2 == 0 else T - 1 - i // 2
        kv = h // group
        table = rows.tables[rows.seq[t]]
        end = rows.positions[t] + 1
        start = max(0, end - window) if window > 0 else 0
        acc = np.zeros(hd, np.float32)
        scores = np.empty(B, np.float32)
        best, total = np.float32(-np.inf), np.float32(0.0)
        if sinks.shape[0]:   # the sink's term, exp(sink - best) with best the sink so far
            best, total = sinks[h], np.float32(1.0)
        for jb in range(start // B, (end + B - 1) // B):   # one table lookup a block
            blk = table[jb]
            j0, j1 = max(start, jb * B) - jb * B, min(end, jb * B + B) - jb * B
            top = best
            for j in range(j0, j1):   # the block's scores first: independent of each other
                s = np.float32(0.0)
                for i in range(hd):
                    s += q[t, h, i] * k_cache[blk, kv, j, i]
                scores[j] = s * scale * k_scale[blk, kv, j]
                top = max(top, scores[j])
            if top > best:   # a new maximum: rescale what was summed against the old one, once a block
                c = np.exp(best - top)
                total *= c
                for i in range(hd):
                    acc[i] *= c
                best = top
            for j in range(j0, j1):
                p = np.exp(scores[j] - best)
                total += p
                p *= v_scale[blk, kv, j]
                for i in range(hd):
                    acc[i] += p * v_cache[blk, kv, j, i]
        for i in range(hd):
            out[t, h, i] = acc[i] / total


QROWS, QCHUNK = 4, 256   # bidirectional attention: query rows a tile, and a task


@njit(parallel=True, **_jit)
def _bidirectional(q, k_cache, v_cache, k_scale, v_scale, rows, scale, sinks, out):
    """attention for window < 0. All the rows of a sequence see the same keys, its positions
    0..L-1 (L one past the last this pass stores), so a tile of QROWS of its rows shares each key
    and value loaded: the scores Q K^T and the sum P V as small matrix products in registers, 16
    keys or 16 dims at a time, and each row's softmax taken whole (all its L scores are at hand).

    A task is one head of up to QCHUNK rows of one sequence (an encoder's whole text, mostly): it
    first gathers the sequence's keys (transposed) and values from their blocks as float32 times
    their scales, a few % of its work. Each row's sums run in one order whatever rows share its
    tile (missing ones are zeros) and whatever else the pass holds.
    """
    T, H, hd = q.shape
    S = rows.tables.shape[0]
    group = H // k_cache.shape[1]
    scale = np.float32(scale)
    count = np.zeros(S, np.int64)   # each sequence's rows in this pass, and its length L
    ends = np.zeros(S, np.int64)
    for t in range(T):
        s = rows.seq[t]
        count[s] += 1
        ends[s] = max(ends[s], rows.positions[t] + 1)
    first = np.zeros(S + 1, np.int64)   # order[first[s]:first[s + 1]]: sequence s's rows
    chunks = 0
    for s in range(S):
        first[s + 1] = first[s] + count[s]
        chunks += (count[s] + QCHUNK - 1) // QCHUNK
    order = np.empty(T, np.int64)
    filled = first[:S].copy()
    for t in range(T):
        order[filled[rows.seq[t]]] = t
        filled[rows.seq[t]] += 1
    chunk_seq, chunk_at = np.empty(chunks, np.int64), np.empty(chunks, np.int64)
    c = 0
    for s in range(S):
        for at in range(first[s], first[s + 1], QCHUNK):
            chunk_seq[c], chunk_at[c] = s, at
            c += 1
    for task in prange(chunks * H):
        c, h = np.int64(task) // H, np.int64(task) % H
        s = chunk_seq[c]
        i0, i1 = chunk_at[c], min(chunk_at[c] + QCHUNK, first[s + 1])
        L = ends[s]
        kt = np.empty((hd, (L + 15) // 16 * 16), np.float32)      # keys [hd, L] and values [L, hd],
        vs = np.empty((kt.shape[1], (hd + 15) // 16 * 16), np.float32)   # zeros up to whole steps
        _gather(k_cache, k_scale, rows.tables[s], h // group, L, kt, True)
        _gather(v_cache, v_scale, rows.tables[s], h // group, L, vs, False)
        kt[:, L:] = 0
        vs[L:] = 0
        vs[:L, hd:] = 0
        qt = np.zeros((QROWS, hd), np.float32)
        p = np.empty((QROWS, kt.shape[1]), np.float32)
        o = np.empty((QROWS, vs.shape[1]), np.float32)
        inverse = np.empty(QROWS, np.float32)   # 1 / each row's softmax divisor
        for r0 in range(i0, i1, QROWS):
            n = min(QROWS, i1 - r0)
            for r in range(n):
                for i in range(hd):
                    qt[r, i] = q[order[r0 + r], h, i] * scale
            qt[n:] = 0
            _times(qt, kt, hd, p)
            for r in range(QROWS):
                inverse[r] = np.float32(1.0) / _softmax(p[r], L, sinks, h)
            _times(p, vs, L, o)
            for r in range(n):
                for i in range(hd):
                    out[order[r0 + r], h, i] = o[r, i] * inverse[r]


@njit(inline="always", **_jit)
def _gather(cache, scales, table, kv, L, to, transpose):
    """Positions 0..L-1 of kv head `kv` of a sequence's blocks, times their scales, into to[:L,
    :hd], or to[:hd, :L] if transpose."""
    B = cache.shape[2]
    for j in range(L):
        blk, b = table[j // B], j % B
        sj = scales[blk, kv, b]
        for i in range(cache.shape[3]):
            if transpose:
                to[i, j] = cache[blk, kv, b, i] * sj
            else:
                to[j, i] = cache[blk, kv, b, i] * sj


@njit(inline="always", **_jit)
def _times(a, b, K, out):
    """out[:QROWS, :N] = a[:QROWS, :K] @ b[:K, :N], N = b's and out's width (a multiple of 16): 16
    columns at a time, 8 accumulators. Q K^T (b the keys transposed) and P V (b the values)."""
    N = b.shape[1]
    for c in range(0, N, 16):
        a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = zero_f32()
        for k in range(K):
            b0, b1 = load_f32x8(b, k * N + c), load_f32x8(b, k * N + c + 8)
            u = splat_f32(a[0, k])
            a00, a01 = fma(u, b0, a00), fma(u, b1, a01)
            u = splat_f32(a[1, k])
            a10, a11 = fma(u, b0, a10), fma(u, b1, a11)
            u = splat_f32(a[2, k])
            a20, a21 = fma(u, b0, a20), fma(u, b1, a21)
            u = splat_f32(a[3, k])
            a30, a31 = fma(u, b0, a30), fma(u, b1, a31)
        store_f32x8(out, c, a00)
        store_f32x8(out, c + 8, a01)
        store_f32x8(out, N + c, a10)
        store_f32x8(out, N + c + 8, a11)
        store_f32x8(out, 2 * N + c, a20)
        store_f32x8(out, 2 * N + c + 8, a21)
        store_f32x8(out, 3 * N + c, a30)
        store_f32x8(out, 3 * N + c + 8, a31)


@njit(inline="always", **_jit)
def _softmax(s, L, sinks, h):
    """s[:L] = exp(s - max) and -> their sum, the sink's term with them (the softmax's divisor)."""
    L8 = L - L % 8
    best = s[0]
    if L8:   # 8 lanes at a time: LLVM does not vectorize a scalar loop of max
        m = load_f32x8(s, 0)
        for j in range(8, L8, 8):
            m = vmax(m, load_f32x8(s, j))
        best = hmax(m)
    for j in range(L8, L):
        best = max(best, s[j])
    total = np.float32(0.0)
    if sinks.shape[0]:
        best = max(best, sinks[h])
        total = exp(sinks[h] - best)
    for j in range(L):
        s[j] = exp(s[j] - best)
        total += s[j]
    return total


@njit(**_jit)
def store_kv(cache, scales, x, rows, t):
    """Row t's keys or values x [Hkv, hd] into the cache [blocks, Hkv, BLOCK, hd] at its position
    in its sequence's blocks (see attention). An int8 cache keeps each head's row as round(x / s)
    with s = max|x| / 127 in scales [blocks, Hkv, BLOCK]; a float32 cache keeps x as it is (its
    scales stay 1)."""
    B = cache.shape[2]
    pos = rows.positions[t]
    blk, j = rows.tables[rows.seq[t], pos // B], pos % B
    for h in range(x.shape[0]):
        if cache.itemsize == 1:
            s = np.abs(x[h]).max() / np.float32(127.0)
            if s == 0:
                s = np.float32(1.0)
            scales[blk, h, j] = s
            for i in range(x.shape[1]):
                cache[blk, h, j, i] = np.int8(np.rint(x[h, i] / s))
        else:
            for i in range(x.shape[1]):
                cache[blk, h, j, i] = x[h, i]


@njit(**_jit)
def add_squares(x, acc):
    """acc[:K] += sum over tokens of x[T, K]^2"""
    for t in range(x.shape[0]):
        for k in range(x.shape[1]):
            acc[k] += np.float64(x[t, k]) * x[t, k]
