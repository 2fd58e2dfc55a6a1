"""Numba CPU kernels for the float path. Each has a plain numpy twin in tests/reference.py.

All kernels write into preallocated outputs, release the GIL (the chat app runs generation in a
thread) and are cached on disk so a second start does not compile again.
"""
import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .simd import (LANES, f32_from_bits, fma, hsum, load_f32w, load_f32x8, prefetch, splat_f32, splat_f32w,
                   store_f32w, store_f32x8, zero_f32, zero_f32w)

# error_model="numpy": a division by zero gives inf or NaN (as numpy does) instead of raising
# ZeroDivisionError from inside a kernel; non-finite values are caught on the logits (model.py).
_jit = dict(fastmath=True, cache=True, nogil=True, error_model="numpy")
# for kernels only other kernels call: no wrappers for Python to call them through (a wrapper
# unboxes every argument, seconds of compile for a long list of arrays and named tuples)
INNER = dict(no_cpython_wrapper=True, no_cfunc_wrapper=True)

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
    column k of panel p), then multiplied by the rows of x (panel_matmul). Up to PACKED floats of
    panels at a time: a bounded copy of a large w (an output head's), kept in L3 while every block
    of x passes over it.
    """
    T, K = x.shape
    N = w.shape[0]
    if T <= SMALL:
        for n in prange(N):
            for t in range(T):
                acc = _dot(x, t, w, n)
                out[t, n] = out[t, n] + acc if accumulate else acc
        return
    panel_matmul(x, w, out, accumulate)


def weight_row(w, n, row):
    """row[:K] = W[n] as float32 (njit code only): a float32 array's here, a quantized or 16-bit
    weight's in prefill.py (overloads of it, chosen from w's numba type)."""


@overload(weight_row, jit_options=_jit)
def _float_weight_row(w, n, row):
    if isinstance(w, types.Array):
        def copy(w, n, row):
            for k in range(row.shape[0]):
                row[k] = w[n, k]
        return copy


@njit(parallel=True, **_jit)
def panel_matmul(x, w, out, accumulate):
    """out[T, N] (+)= x[T, K] @ W.T for more than SMALL rows, W any weight weight_row reads: its
    rows made float32 into panels (PACKED floats of them at a time), then times_panels."""
    K, N = x.shape[1], out.shape[1]
    panels = (N + PANEL - 1) // PANEL
    step = max(1, PACKED // (K * PANEL))
    wp = np.empty((min(step, panels), K, PANEL), np.float32)
    for p0 in range(0, panels, step):
        n_panels = min(step, panels - p0)
        for p in prange(n_panels):
            row = np.empty(K, np.float32)
            for c in range(PANEL):
                n = (p0 + p) * PANEL + c
                if n < N:
                    weight_row(w, n, row)
                else:
                    row[:] = 0
                for k in range(K):
                    wp[p, k, c] = row[k]
        times_panels(x, wp[:n_panels], p0 * PANEL, out, accumulate)


# prefill: columns (two vectors) and rows (8 micro-tiles) a task
PANEL, BLOCK_ROWS = 2 * LANES, 48
PACKED = 1 << 20             # floats of w packed at a time (4 MB)


@njit(parallel=True, **_jit)
def times_panels(x, wp, n0, out, accumulate):
    """out[:, n0 + p PANEL + c] (+)= x @ wp[p, :, c] for the packed panels wp [panels, K, PANEL]
    (columns past out's width are padding): each task BLOCK_ROWS rows of x by one panel
    (_tile_6). Each output is one chain of FMAs along k, so a row's result is the same whatever T
    (past SMALL), whatever rows beside it, and whatever the vectors' width."""
    T, N = x.shape[0], out.shape[1]
    n_panels = wp.shape[0]
    blocks = (T + BLOCK_ROWS - 1) // BLOCK_ROWS
    for task in prange(blocks * n_panels):
        # consecutive tasks share a block of x (kept in L2): each thread runs a contiguous range
        b, p = np.int64(task) // n_panels, np.int64(task) % n_panels
        t0, t1 = b * BLOCK_ROWS, min(T, b * BLOCK_ROWS + BLOCK_ROWS)
        tile = np.empty((BLOCK_ROWS, PANEL), np.float32)
        for t in range(t0, t1, 6):
            _tile_6(x, t, t1 - 1, wp[p], tile, t - t0)
        first = n0 + p * PANEL
        for t in range(t0, t1):
            for c in range(min(PANEL, N - first)):
                out[t, first + c] = out[t, first + c] + tile[t - t0, c] if accumulate else tile[t - t0, c]


@njit(inline="always", **_jit)
def _tile_6(x, t, last, wp, tile, r):
    """tile[r:r+6] = x[t:t+6] @ wp [K, PANEL], rows past `last` repeating it (unused): 12 vector
    accumulators (of LANES lanes), each step 2 loads of wp and 6 of x (broadcast) for 12 FMAs."""
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = zero_f32w()
    t1, t2, t3, t4, t5 = min(t + 1, last), min(t + 2, last), min(t + 3, last), min(t + 4, last), min(t + 5, last)
    for k in range(x.shape[1]):
        w0, w1 = load_f32w(wp, k * PANEL), load_f32w(wp, k * PANEL + LANES)
        u = splat_f32w(np.float32(x[t, k]))
        a00, a01 = fma(u, w0, a00), fma(u, w1, a01)
        u = splat_f32w(np.float32(x[t1, k]))
        a10, a11 = fma(u, w0, a10), fma(u, w1, a11)
        u = splat_f32w(np.float32(x[t2, k]))
        a20, a21 = fma(u, w0, a20), fma(u, w1, a21)
        u = splat_f32w(np.float32(x[t3, k]))
        a30, a31 = fma(u, w0, a30), fma(u, w1, a31)
        u = splat_f32w(np.float32(x[t4, k]))
        a40, a41 = fma(u, w0, a40), fma(u, w1, a41)
        u = splat_f32w(np.float32(x[t5, k]))
        a50, a51 = fma(u, w0, a50), fma(u, w1, a51)
    at = r * PANEL
    store_f32w(tile, at, a00)
    store_f32w(tile, at + LANES, a01)
    store_f32w(tile, at + PANEL, a10)
    store_f32w(tile, at + PANEL + LANES, a11)
    store_f32w(tile, at + 2 * PANEL, a20)
    store_f32w(tile, at + 2 * PANEL + LANES, a21)
    store_f32w(tile, at + 3 * PANEL, a30)
    store_f32w(tile, at + 3 * PANEL + LANES, a31)
    store_f32w(tile, at + 4 * PANEL, a40)
    store_f32w(tile, at + 4 * PANEL + LANES, a41)
    store_f32w(tile, at + 5 * PANEL, a50)
    store_f32w(tile, at + 5 * PANEL + LANES, a51)


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


# no approximate reciprocal or regrouping: an activation is the same value computed in a vector
# loop or in its scalar remainder, wherever a loop's range starts (team.py's chunks cut rows anywhere)
ACTIVATION = dict(_jit, fastmath={"nnan", "ninf", "nsz", "contract"})


@njit(parallel=True, **ACTIVATION)
def silu_mul(g, up):
    """g[T, F] = silu(g) * up, in place"""
    for t in prange(g.shape[0]):
        for f in range(g.shape[1]):
            g[t, f] = silu_times(g[t, f], up[t, f])


@njit(inline="always", **ACTIVATION)
def silu_times(g, u):
    return g / (np.float32(1.0) + exp(-g)) * u


@njit(parallel=True, **_jit)
def gelu_tanh_mul(g, up):
    """g[T, F] = gelu(g) * up, in place, with GELU's tanh approximation (gelu_pytorch_tanh)"""
    for t in prange(g.shape[0]):
        for f in range(g.shape[1]):
            g[t, f] = gelu_tanh(g[t, f]) * up[t, f]


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
def gelu(x, bias, approximate):
    """x[T, F] = gelu(x + bias) in place (bias [F]): GELU with erf, as BERT's hidden_act "gelu", or
    (`approximate`) with tanh's approximation, as SigLIP's "gelu_pytorch_tanh"."""
    r = np.float32(1 / math.sqrt(2))
    for t in prange(x.shape[0]):
        for f in range(x.shape[1]):
            v = x[t, f] + bias[f]
            x[t, f] = gelu_tanh(v) if approximate else np.float32(0.5) * v * (np.float32(1.0) + erf(v * r))


@njit(inline="always", **_jit)
def gelu_tanh(v):
    """GELU's tanh approximation as x sigmoid(2 c (x + 0.044715 x^3)), the same function: `exp`
    vectorizes where libm's tanh is a call a value (five times the time over a tower's MLP)."""
    c = np.float32(2 * math.sqrt(2 / math.pi))
    return v / (np.float32(1.0) + exp(-c * (v + np.float32(0.044715) * v * v * v)))


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
def rope(x, cos, sin, turns):
    """Rotate x[T, H, hd] in place (the rotate-half layout of HF models), row t's pair i by the
    position turns[t, 0] (turns [T, 1]), or turns[t, i] (turns [T, r/2]: multimodal RoPE, each
    pair turned by the position of its own axis).

    cos, sin: [max_ctx, r/2] tables built once at load, rotating the first r dims of each head
    (r = hd but for partial rotary; r = 0: a layer without RoPE).
    """
    T, H, hd = x.shape
    half = cos.shape[1]
    if half == 0:
        return
    c, s = np.empty(half, np.float32), np.empty(half, np.float32)
    for t in range(T):
        if turns.shape[1] > 1:
            for i in range(half):
                c[i] = cos[turns[t, i], i]
                s[i] = sin[turns[t, i], i]
        else:
            c[:] = cos[turns[t, 0]]
            s[:] = sin[turns[t, 0]]
        for h in range(H):
            for i in range(half):
                x1 = x[t, h, i]
                x2 = x[t, h, i + half]
                x[t, h, i] = x1 * c[i] - x2 * s[i]
                x[t, h, i + half] = x2 * c[i] + x1 * s[i]


QROWS = 4     # rows of queries a tile (_times)
SPLIT = 256   # positions of keys a split takes: a decoded row's tasks, where every row's sums merge
QPOS = 32     # positions of one sequence's rows a prompt's task takes
_NONE = np.float32(-1e30)   # the maximum of no score (finite: fast math assumes no infinities)
# a row's sums in one order wherever it is computed: no regrouping, no fusing that the context decides
_PRECISE = dict(_jit, fastmath={"nnan", "ninf", "nsz", "arcp", "afn"})


@njit(parallel=True, **_jit)
def attention(q, k_cache, v_cache, k_scale, v_scale, rows, window, scale, sinks, out):
    """Grouped-query attention of new queries against the cache, read through block tables:
    causal, sliding, or bidirectional where window < 0 (an encoder's).

    q: [T, H, hd], row t the query of position p = rows.positions[t] of sequence rows.seq[t];
    k_cache [blocks, Hkv, hd, BLOCK] (a block's keys transposed) and v_cache [blocks, Hkv, BLOCK,
    hd], float32, or int8 times k_scale, v_scale [blocks, Hkv, BLOCK], already holding that
    sequence's positions 0..p in the blocks its table rows.tables[rows.seq[t]] names, in order;
    out: [T, H, hd]. Row t sees positions 0..p, or up to rows.sees[t] - 1 (an image's tokens,
    which see each other); window > 0 not those before p - window + 1 (Mistral's sliding window);
    window < 0 every position of its sequence this pass stores, later ones too (an encoder's
    sequences come whole). The scores are q . k times `scale` (1/sqrt(hd)
    but for Gemma's and Granite's). sinks [H] (gpt-oss's; shape (0,): none): a logit per head that
    joins every row's softmax with no value to weigh.

    Flash attention's tiles: the rows of a sequence that share a KV head (its query heads at each
    of its positions) go QROWS at a time through each block of keys, Q K^T and P V as
    register-blocked products (_times) on the cache's own layout, the softmax online (a running
    maximum, sum and weighted sum of values, rescaled once a block). The keys come in splits of
    SPLIT positions whose sums merge in order: a decoded row (its sequence's only row in the pass)
    runs its splits on every thread at once; a prompt's rows, in tasks of QPOS positions, merge
    them as they go. A row's arithmetic is the same either way and whatever else the pass holds:
    decoded alone, in a batch or prefilled, the same bits.
    """
    T, H, hd = q.shape
    Hkv = v_cache.shape[1]
    check_cache(k_cache, v_cache, hd)
    order, lo, hi, first, count, kv_of, split, lone, head_task, head_splits, merged, pm, pl, pacc = plan(
        rows, Hkv, H // Hkv, hd, window)
    tasks = first.shape[0]
    for i in prange(tasks):
        attend(from_both_ends(i, tasks), first, count, kv_of, split, lone, order, lo, hi, q, scale, rows, k_cache,
               v_cache, k_scale, v_scale, sinks, pm, pl, pacc, out)
    if merged.shape[0]:   # (a parallel region costs a few microseconds, some 200 a token)
        for j in prange(merged.shape[0]):
            i0 = head_task[merged[j]]
            finish(out, order[first[i0]], kv_of[i0], sinks, pm, pl, pacc, i0, head_splits[merged[j]])


@njit(inline="always", **_jit)
def check_cache(k_cache, v_cache, hd):
    if k_cache.shape[2] != hd or k_cache.shape[3] != v_cache.shape[2]:   # else attention reads and writes past them
        raise ValueError("attention: keys [blocks, Hkv, hd, BLOCK] and values [blocks, Hkv, BLOCK, hd] expected")


@njit(inline="always", **_jit)
def from_both_ends(i, tasks):
    """attention's i-th task taken from both ends in turn: a prompt's later rows see more keys, and
    each thread runs a contiguous range of tasks."""
    return i // 2 if i % 2 == 0 else tasks - 1 - i // 2


@njit(**_jit, **INNER)
def plan(rows, Hkv, group, hd, window):
    """attention's tasks (see there), and the sums of its split tasks: the parallel loops apart
    from the rest (numba compiles a parallel function's code twice over)."""
    T = rows.positions.shape[0]
    order = _by_sequence(rows)
    lo, hi = np.empty(T, np.int64), np.empty(T, np.int64)   # each row sees positions lo..hi-1
    for t in range(T):
        hi[t] = rows.sees[t]
        lo[t] = max(0, rows.positions[t] + 1 - window) if window > 0 else 0
    tasks = heads = 0
    a = 0
    while a < T:   # the rows of one sequence, order[a:b], by position
        b = _run_end(order, rows.seq, a)
        if window < 0:
            end = hi[order[b - 1]]
            for i in range(a, b):
                hi[order[i]] = end
        if b - a == 1:
            tasks += Hkv * ((hi[order[a]] - 1) // SPLIT - lo[order[a]] // SPLIT + 1)
            heads += Hkv
        else:
            tasks += Hkv * ((b - a + QPOS - 1) // QPOS)
        a = b
    first, count = np.empty(tasks, np.int64), np.empty(tasks, np.int64)
    kv_of, split = np.empty(tasks, np.int64), np.empty(tasks, np.int64)
    head_task, head_splits = np.empty(heads, np.int64), np.empty(heads, np.int64)
    i = j = a = 0
    while a < T:
        b = _run_end(order, rows.seq, a)
        for kv in range(Hkv):
            if b - a == 1:   # decoded: a task a split
                s0 = lo[order[a]] // SPLIT
                head_task[j], head_splits[j] = i, (hi[order[a]] - 1) // SPLIT - s0 + 1
                for s in range(s0, s0 + head_splits[j]):
                    first[i], count[i], kv_of[i], split[i] = a, 1, kv, s
                    i += 1
                j += 1
            else:            # a prompt's: a task QPOS positions
                for c in range(a, b, QPOS):
                    first[i], count[i], kv_of[i], split[i] = c, min(QPOS, b - c), kv, -1
                    i += 1
        a = b
    pm, pl = np.empty((tasks, group), np.float32), np.empty((tasks, group), np.float32)
    pacc = np.empty((tasks, group, hd), np.float32)   # a split task's sums
    lone = np.zeros(tasks, np.bool_)   # a decoded row's only split: its task finishes the row
    merged = np.empty(heads, np.int64)   # the decoded rows of more splits, merged once all are done
    n_merged = 0
    for j in range(heads):
        if head_splits[j] == 1:
            lone[head_task[j]] = True
        else:
            merged[n_merged] = j
            n_merged += 1
    return order, lo, hi, first, count, kv_of, split, lone, head_task, head_splits, merged[:n_merged], pm, pl, pacc


@njit(**_jit, **INNER)
def attend(task, first, count, kv_of, split, lone, order, lo, hi, q, scale, rows, k_cache, v_cache, k_scale, v_scale,
            sinks, pm, pl, pacc, out):
    """Task `task` of attention's (see there): a function of its own, so that the parallel loop's
    body is a call (numba compiles a parallel loop's body twice over)."""
    group, hd = pacc.shape[1], pacc.shape[2]
    c, kv = first[task], kv_of[task]
    R = count[task] * group   # row r: position order[c + r // group], head kv * group + r % group
    qs = np.zeros((R + QROWS, hd), np.float32)
    rlo, rhi = np.empty(R, np.int64), np.empty(R, np.int64)
    for r in range(R):
        t = order[c + r // group]
        rlo[r], rhi[r] = lo[t], hi[t]
        for d in range(hd):
            qs[r, d] = q[t, kv * group + r % group, d] * np.float32(scale)
    table = rows.tables[rows.seq[order[c]]]
    m, l, acc = np.full(R, _NONE), np.zeros(R, np.float32), np.zeros((R, hd), np.float32)
    if split[task] >= 0:
        _split(qs, rlo, rhi, split[task], k_cache, v_cache, k_scale, v_scale, table, kv, m, l, acc)
        _copy(pm[task], m)
        _copy(pl[task], l)
        _copy(pacc[task], acc)
        if lone[task]:
            finish(out, order[c], kv, sinks, pm, pl, pacc, task, 1)
        return
    tm, tl, tacc = np.empty(R, np.float32), np.empty(R, np.float32), np.zeros((R, hd), np.float32)
    for r in range(R):
        tm[r], tl[r] = _sink(sinks, kv * group + r % group)
    for s in range(rlo.min() // SPLIT, (rhi.max() - 1) // SPLIT + 1):
        m[:] = _NONE
        l[:] = 0
        acc[:] = 0
        _split(qs, rlo, rhi, s, k_cache, v_cache, k_scale, v_scale, table, kv, m, l, acc)
        for r in range(R):
            tm[r], tl[r] = _merge(tm[r], tl[r], tacc[r], m[r], l[r], acc[r])
    for r in range(R):
        inverse = np.float32(1.0) / tl[r]   # as the decoded rows' (fast math would choose)
        for d in range(hd):
            out[order[c + r // group], kv * group + r % group, d] = tacc[r, d] * inverse


@njit(inline="always", **_jit)
def _by_sequence(rows):
    """The rows' indices in order of sequence, then position: an insertion sort, which a pass's
    rows (a sequence's consecutive positions, sequences in order) keep at one comparison a row
    (numba's argsort takes a second of a first run to compile)."""
    T = rows.seq.shape[0]
    order = np.arange(T)
    for i in range(1, T):
        t = order[i]
        j = i
        while j > 0 and (rows.seq[order[j - 1]], rows.positions[order[j - 1]]) > (rows.seq[t], rows.positions[t]):
            order[j] = order[j - 1]
            j -= 1
        order[j] = t
    return order


@njit(inline="always", **_jit)
def _copy(dst, src):
    """dst[...] = src, src's shape: numba's own array copy compiles a message formatting both
    shapes for a mismatch (seconds of a first run, in unicode's and repr's code)."""
    for i in np.ndindex(src.shape):
        dst[i] = src[i]


@njit(**_jit, **INNER)
def finish(out, t, kv, sinks, pm, pl, pacc, i0, n):
    """Row t's query heads of KV head kv: the sums of its splits i0..i0+n-1 merged in order."""
    group, hd = pacc.shape[1], pacc.shape[2]
    acc = np.zeros(hd, np.float32)
    for g in range(group):
        m, l = _sink(sinks, kv * group + g)
        acc[:] = 0
        for i in range(i0, i0 + n):
            m, l = _merge(m, l, acc, pm[i, g], pl[i, g], pacc[i, g])
        inverse = np.float32(1.0) / l
        for d in range(hd):
            out[t, kv * group + g, d] = acc[d] * inverse


@njit(inline="always", **_jit)
def _run_end(order, seq, a):
    """One past the last of order[a:]'s rows of sequence seq[order[a]]."""
    b = a + 1
    while b < order.shape[0] and seq[order[b]] == seq[order[a]]:
        b += 1
    return b


@njit(inline="always", **_jit)
def _sink(sinks, h):
    """A row's sums before its first key: the sink's term (exp(sink - max), the max the sink), or none."""
    if sinks.shape[0]:
        return sinks[h], np.float32(1.0)
    return _NONE, np.float32(0.0)


@njit(**_PRECISE)
def _merge(m, l, acc, sm, sl, sacc):
    """-> the maximum and sum of a row's sums (m, l, acc) and a split's (sm, sl, sacc), acc
    updated in place."""
    if sl == 0:   # the split held none of the row's keys
        return m, l
    best = max(m, sm)
    a, b = exp(m - best), exp(sm - best)
    for d in range(acc.shape[0]):
        acc[d] = acc[d] * a + sacc[d] * b
    return best, l * a + sl * b


@njit(**_PRECISE, **INNER)
def _split(qs, lo, hi, s, k_cache, v_cache, k_scale, v_scale, table, kv, m, l, acc):
    """The keys of split s through rows' sums m, l, acc [R, hd] (see attention): row r's query
    qs[r] (times the score scale), its keys lo[r]..hi[r]-1. Rows that see the same keys of a
    block share a tile."""
    R, hd = acc.shape
    B = v_cache.shape[2]
    j_lo, j_hi = max(lo.min(), s * SPLIT), min(hi.max(), (s + 1) * SPLIT)
    p = np.empty((QROWS, B), np.float32)
    width = (hd + 15) // 16 * 16   # P V's width: whole steps of 16
    o = np.empty((QROWS, width), np.float32)
    c = np.empty(QROWS, np.float32)
    keys, values = np.empty((hd, B), np.float32), np.empty((B, width), np.float32)
    last = (j_hi - 1) // B
    for jb in range(j_lo // B, last + 1):
        b0 = jb * B
        if jb < last:   # the next block's keys and values, asked for while this one is worked on
            _ahead(k_cache, table[jb + 1], kv)
            _ahead(v_cache, table[jb + 1], kv)
        kb = _floats(k_cache, k_scale, table[jb], kv, True, keys)
        vb = _floats(v_cache, v_scale, table[jb], kv, False, values)
        r = 0
        while r < R:
            j0, j1 = min(max(lo[r] - b0, 0), B), min(max(hi[r] - b0, 0), B)
            e = r + 1
            while e < min(R, r + QROWS) and lo[e] == lo[r] and hi[e] == hi[r]:
                e += 1
            if j0 < j1:
                _times(qs[r:r + QROWS], kb, 0, hd, p)
                for i in range(e - r):
                    row = p[i, j0:j1]   # indexes from 0: loops that vectorize
                    top = _NONE
                    for j in range(row.shape[0]):
                        top = max(top, row[j])
                    best = max(m[r + i], top)
                    c[i] = exp(m[r + i] - best)
                    for j in range(row.shape[0]):   # apart from the sum, which would keep it from vectorizing
                        row[j] = exp(row[j] - best)
                    total = np.float32(0.0)
                    for j in range(row.shape[0]):
                        total += row[j]
                    m[r + i], l[r + i] = best, l[r + i] * c[i] + total
                _times(p, vb, j0, j1, o)
                for i in range(e - r):
                    for d in range(hd):
                        acc[r + i, d] = acc[r + i, d] * c[i] + o[i, d]
            r = e


@njit(inline="always", **_jit)
def _ahead(cache, blk, kv):
    """Prefetch block blk of KV head kv, a cache line at a time: blocks lie apart in the pool, and
    the hardware prefetchers start over at each."""
    x = cache[blk, kv]
    for i in range(0, x.size, 64 // x.itemsize):
        prefetch(x, i)


def _floats(cache, scales, blk, kv, keys, scratch):
    """Block blk of KV head kv as float32: keys [hd, BLOCK] or values [BLOCK, width], the cache's
    own where it is so (float32, as wide as scratch), else times its scales into scratch."""


@overload(_floats, jit_options=_PRECISE)
def _floats_typed(cache, scales, blk, kv, keys, scratch):
    if cache.dtype == types.float32:
        def as_is(cache, scales, blk, kv, keys, scratch):
            x = cache[blk, kv]
            if x.shape[1] == scratch.shape[1]:
                return x
            for i in range(x.shape[0]):
                for j in range(scratch.shape[1]):
                    scratch[i, j] = x[i, j] if j < x.shape[1] else 0
            return scratch
        return as_is

    def times_scales(cache, scales, blk, kv, keys, scratch):
        x, s = cache[blk, kv], scales[blk, kv]
        for i in range(x.shape[0]):
            for j in range(x.shape[1]):
                scratch[i, j] = x[i, j] * s[j if keys else i]
        scratch[:, x.shape[1]:] = 0
        return scratch
    return times_scales


@njit(inline="always", **_jit)
def _times(a, b, k0, k1, out):
    """out[:QROWS, :N] = a[:QROWS, k0:k1] @ b[k0:k1, :N], N = b's and out's width (a multiple of
    16): 16 columns at a time, 8 accumulators, each output one chain of FMAs along k. Q K^T (b a
    block's keys, transposed) and P V (b its values)."""
    N = b.shape[1]
    for c in range(0, N, 16):
        a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = zero_f32()
        for k in range(k0, k1):
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


@njit(**_jit, **INNER)
def place_qkv(q, k, v, bq, bk, bv, q_norm, k_norm, kv, rows, cos, sin, eps):
    """The projections q [T, H, hd], k and v [T, Hkv, hd] made ready for attention, in place: the
    biases added (zeros, or shape (0,): none), q and k RMSNormed (each head on its own, or each
    row's whole width; shape (0,): not), RoPE'd, and k and v stored in the layer's cache kv (as
    decoder_layer's)."""
    T, H, hd = q.shape
    Hkv = k.shape[1]
    if bq.shape[0]:
        for t in range(T):
            _add(q[t], bq)
            _add(k[t], bk)
            _add(v[t], bv)
    if q_norm.shape[0]:   # before RoPE, in place: each head on its own, or each row's whole width
        n, m = q_norm.shape[0], k_norm.shape[0]
        rmsnorm(q.reshape(T * H * hd // n, n), q_norm, eps, q.reshape(T * H * hd // n, n))
        rmsnorm(k.reshape(T * Hkv * hd // m, m), k_norm, eps, k.reshape(T * Hkv * hd // m, m))
    rope(q, cos, sin, rows.turns)
    rope(k, cos, sin, rows.turns)
    k_cache, v_cache, k_scale, v_scale = kv
    for t in range(T):
        store_kv(k_cache, k_scale, k[t], rows, t, True)
        store_kv(v_cache, v_scale, v[t], rows, t, False)


@njit(inline="always", **_jit)
def _add(x, b):
    """x[H, hd] += b[H * hd]: a bias of each head's row (numba's broadcasting of b.reshape costs
    microseconds here)."""
    H, hd = x.shape
    for h in range(H):
        for i in range(hd):
            x[h, i] += b[h * hd + i]


@njit(**_jit)
def store_kv(cache, scales, x, rows, t, keys):
    """Row t's keys (keys=True: into a block's columns, the cache [blocks, Hkv, hd, BLOCK]) or
    values (its rows, [blocks, Hkv, BLOCK, hd]) x [Hkv, hd] at its position in its sequence's
    blocks (see attention). An int8 cache keeps each head's row as round(x / s) with s = max|x| /
    127 in scales [blocks, Hkv, BLOCK]; a float32 cache keeps x as it is (its scales stay 1)."""
    B = scales.shape[2]
    pos = rows.positions[t]
    blk, j = rows.tables[rows.seq[t], pos // B], pos % B
    for h in range(x.shape[0]):
        s = np.float32(1.0)
        if cache.itemsize == 1:
            s = np.abs(x[h]).max() / np.float32(127.0)
            if s == 0:
                s = np.float32(1.0)
            scales[blk, h, j] = s
        for i in range(x.shape[1]):
            y = np.rint(x[h, i] / s) if cache.itemsize == 1 else x[h, i]
            if keys:
                cache[blk, h, i, j] = y
            else:
                cache[blk, h, j, i] = y


@njit(**_jit)
def add_squares(x, acc):
    """acc[:K] += sum over tokens of x[T, K]^2"""
    for t in range(x.shape[0]):
        for k in range(x.shape[1]):
            acc[k] += np.float64(x[t, k]) * x[t, k]
