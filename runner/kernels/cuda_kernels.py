"""numba-cuda kernels of the decoder block; the host side (upload, launches, the layer) is cuda.py.

Everything also runs in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1), which has no warp
shuffles: reductions go through shared memory. The kernels and the device functions they call
stay in this one module: while a kernel runs, the simulator swaps its module's `cuda` global, and
a device function in another module would race with that swap.

Shared arrays are declared at the top of a kernel, before its first barrier: the simulator
creates one when the first thread reaches it, and two threads arriving together could each make
their own.

Positions arrive as pos, an int32 [1] device array, never as a kernel argument: a recorded CUDA
graph replays its arguments as they were (cuda.Replay).

Types: every constant is float32(...) and every integer is cast with float32() before it meets a
float, or numba would compute in float64 (slow on most GPUs).
"""
import math

from numba import config, cuda, float32, uint32

# What a matrix product does with its result: out = acc, out += acc (a residual), or SwiGLU of
# row pairs, out[:, f] = silu(acc[:, 2f]) * acc[:, 2f + 1] (gate and up rows interleaved).
STORE, ADD, SWIGLU = 0, 1, 2

WORDS = 4   # uint32 words a lane reads from a row per step: a 16-byte chunk of it
# In the simulator (the tests on a machine without a GPU) each CUDA thread is a Python thread,
# slow to start: there blocks are as small and a row's threads as few as the kernels allow (their
# code does not depend on these sizes), so that the tests run the same code on fewer threads.
SIMULATED = config.ENABLE_CUDASIM


@cuda.jit(device=True)
def _emit(out, t, n, value, following, N, mode):
    """Write row n's result for token t; `following` is row n+1's (read only by SwiGLU)."""
    if mode == SWIGLU:
        if n % 2 == 0 and n + 1 < N:
            out[t, n // 2] = value / (float32(1.0) + math.exp(-value)) * following
    elif n < N:
        if mode == ADD:
            out[t, n] += value
        else:
            out[t, n] = value


# ---- decode (T = 1): matrix-vector, bound by reading the weights once ----------------------------
# A warp owns MV_ROWS rows and a lane a 16-byte chunk of each per step (4 words: 32 int4, 16 int8
# or 4 float32 weights, inside one quantization group since G is a multiple of 32), so a warp
# streams 512 contiguous bytes of a row per step, each lane issues 4 x MV_ROWS independent loads
# (128 bytes) before using them, and a chunk needs one scale and one bias. The 4-byte loads of a
# chunk coalesce into whole 32-byte sectors; numba cannot express a 16-byte vector load portably.
# x is staged in shared memory per slab, transposed (element e of chunk c at e * pitch + c, pitch
# = chunks + 1) so that 32 lanes reading element e of 32 consecutive chunks hit 32 banks.
MV_WARPS = 2                  # warps per block: 16 rows, N/16 blocks (256 for a 4096-row matrix)
MV_ROWS = 16 if SIMULATED else 8   # rows per warp: each x value read from shared memory serves 8 rows
# (ptxas for sm_90: 128 registers and 18.5 KB of shared memory, so 16 warps per SM with 64 KB of
# weight loads in flight; a first guess, to be tuned on a GPU)
SLAB = 256 if SIMULATED else 4096   # x elements staged at a time (16 KB)
_XS_SIZE = SLAB + 32          # + the padding column: one element per element of a chunk
_SUMS_SHAPE = (MV_ROWS, MV_WARPS, 32)
_MV_THREADS = 32 * MV_WARPS
_WORDS_SHAPE = (WORDS, MV_ROWS)


@cuda.jit(device=True)
def _stage_transposed(x, norm, s0, per_chunk, pitch, xs):
    """xs[e * pitch + c] = x[0, k] (times norm[k] when norm is not empty) for k = s0 + c * per_chunk
    + e in the slab starting at s0; -> this thread's share of the sum of x[0, k]^2 over the slab."""
    tid = cuda.threadIdx.y * 32 + cuda.threadIdx.x
    squares = float32(0.0)
    for i in range(tid, min(SLAB, x.shape[1] - s0), 32 * MV_WARPS):
        v = x[0, s0 + i]
        squares += v * v
        if norm.shape[0] > 0:
            v *= norm[s0 + i]
        xs[(i % per_chunk) * pitch + i // per_chunk] = v
    cuda.syncthreads()
    return squares


def _quantized_chunk(bits):
    """Device function: acc[j] += W[r0 + j] . x over chunk gc, for MLX affine `bits`-bit rows:
    per group, scale * sum(q x) + bias * sum(x)."""
    per_word, mask = 32 // bits, (1 << bits) - 1

    @cuda.jit(device=True)
    def chunk(w, scales, biases, G, r0, gc, xs, c, pitch, acc):
        last = w.shape[0] - 1
        words = cuda.local.array(_WORDS_SHAPE, uint32)
        for u in range(WORDS):                  # all loads first: 32 in flight per lane
            for j in range(MV_ROWS):
                words[u, j] = w[min(r0 + j, last), WORDS * gc + u]
        dots = cuda.local.array(MV_ROWS, float32)
        for j in range(MV_ROWS):
            dots[j] = float32(0.0)
        x_sum = float32(0.0)
        for u in range(WORDS):
            for e in range(per_word):
                xv = xs[(u * per_word + e) * pitch + c]
                x_sum += xv
                for j in range(MV_ROWS):
                    dots[j] += float32((words[u, j] >> (bits * e)) & mask) * xv
        g = gc * WORDS * per_word // G
        for j in range(MV_ROWS):
            n = min(r0 + j, last)
            acc[j] += scales[n, g] * dots[j] + biases[n, g] * x_sum
    return chunk


@cuda.jit(device=True)
def _float_chunk(w, scales, biases, G, r0, gc, xs, c, pitch, acc):
    """acc[j] += W[r0 + j] . x over chunk gc (4 float32 weights; K need not be a multiple of 4)."""
    last, K = w.shape[0] - 1, w.shape[1]
    for e in range(WORDS):
        k = WORDS * gc + e
        if k < K:
            xv = xs[e * pitch + c]
            for j in range(MV_ROWS):
                acc[j] += w[min(r0 + j, last), k] * xv


def _matvec(chunk, per_chunk):
    """Kernel out[0] (op)= rmsnorm(x[0]) @ W.T, or x[0] @ W.T when norm is empty; grid:
    ceil(N / (MV_ROWS * MV_WARPS)) blocks of (32, MV_WARPS).

    The RMSNorm costs no launch of its own: staging x, a block multiplies it by the norm's weight
    and sums its squares, and since the product is linear in x, the 1 / rms factor multiplies
    each row's total at the end."""
    chunks = SLAB // per_chunk
    pitch = chunks + 1

    @cuda.jit
    def matvec(x, norm, eps, w, scales, biases, G, out, mode):
        lane, warp = cuda.threadIdx.x, cuda.threadIdx.y
        N, K = w.shape[0], x.shape[1]
        r0 = (cuda.blockIdx.x * MV_WARPS + warp) * MV_ROWS    # past N: loads clamp, writes skip
        xs = cuda.shared.array(_XS_SIZE, float32)
        sums = cuda.shared.array(_SUMS_SHAPE, float32)
        squares = cuda.shared.array(_MV_THREADS, float32)
        acc = cuda.local.array(MV_ROWS, float32)
        for j in range(MV_ROWS):
            acc[j] = float32(0.0)
        my_squares = float32(0.0)
        for s0 in range(0, K, SLAB):
            my_squares += _stage_transposed(x, norm, s0, per_chunk, pitch, xs)
            for c in range(lane, min(chunks, (K - s0 + per_chunk - 1) // per_chunk), 32):
                chunk(w, scales, biases, G, r0, s0 // per_chunk + c, xs, c, pitch, acc)
            if s0 + SLAB < K:
                cuda.syncthreads()                            # the slab is read before the next
        # the 32 lanes' partial sums: one barrier, then lane j adds up row j (32 broadcast reads)
        for j in range(MV_ROWS):
            sums[j, warp, lane] = acc[j]
        squares[warp * 32 + lane] = my_squares
        cuda.syncthreads()
        if lane < MV_ROWS:
            scale = float32(1.0)
            if norm.shape[0] > 0:
                total = float32(0.0)
                for i in range(_MV_THREADS):
                    total += squares[i]
                scale = float32(1.0) / math.sqrt(total / float32(K) + float32(eps))
            value = _lane_total(sums, lane, warp) * scale
            following = float32(0.0)
            if mode == SWIGLU and lane % 2 == 0:
                following = _lane_total(sums, lane + 1, warp) * scale
            _emit(out, 0, r0 + lane, value, following, N, mode)
    return matvec


@cuda.jit(device=True)
def _lane_total(sums, j, warp):
    total = float32(0.0)
    for i in range(32):
        total += sums[j, warp, i]
    return total


# ---- prefill (T > 1): matrix-matrix, tiled through shared memory ---------------------------------
# A block computes MM_T tokens x MM_N rows: per k-slab it stages x and the weights, dequantized
# once into float32, k-major (padded rows: the staging writes do not collide in one bank), then
# each thread accumulates a 4 x 4 micro-tile of adjacent tokens and rows (adjacent rows: a thread
# holds both rows of each SwiGLU pair). Small tiles keep the simulator fast; larger ones (64 x 64,
# 256 threads) should do better on a GPU: to be measured there.
MM_THREADS = 8                        # (8, 8) threads
MM_T = MM_N = 4 * MM_THREADS          # 32 tokens x 32 rows
MM_K = 32                             # k-slab: G is a multiple of it, so no group straddles one
_MM_BLOCK = MM_THREADS * MM_THREADS
_X_TILE = (MM_K, MM_T + 1)
_W_TILE = (MM_K, MM_N + 1)
_MICRO = (4, 4)


@cuda.jit(device=True)
def _stage_x_tile(x, t0, k0, xs, tid):
    """xs[kk, tt] = x[t0 + tt, k0 + kk]; zero past K, the last token repeated past T."""
    T, K = x.shape
    for i in range(tid, MM_T * MM_K, _MM_BLOCK):
        tt, kk = i // MM_K, i % MM_K
        xs[kk, tt] = x[min(t0 + tt, T - 1), k0 + kk] if k0 + kk < K else float32(0.0)


def _quantized_tile(bits):
    """Device function: ws[kk, r] = dequantized W[n0 + r, k0 + kk], one word per step per thread."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    words_per_row = MM_K // per_word

    @cuda.jit(device=True)
    def tile(w, scales, biases, G, n0, k0, ws, tid):
        last = w.shape[0] - 1
        for i in range(tid, MM_N * words_per_row, _MM_BLOCK):
            r, u = i // words_per_row, i % words_per_row
            n, k = min(n0 + r, last), k0 + u * per_word
            word = w[n, k // per_word]
            s, b = scales[n, k // G], biases[n, k // G]
            for e in range(per_word):
                ws[u * per_word + e, r] = s * float32((word >> (bits * e)) & mask) + b
    return tile


@cuda.jit(device=True)
def _float_tile(w, scales, biases, G, n0, k0, ws, tid):
    """ws[kk, r] = W[n0 + r, k0 + kk]; zero past K."""
    last, K = w.shape[0] - 1, w.shape[1]
    for i in range(tid, MM_N * MM_K, _MM_BLOCK):
        r, kk = i // MM_K, i % MM_K
        ws[kk, r] = w[min(n0 + r, last), k0 + kk] if k0 + kk < K else float32(0.0)


def _matmul(stage_weights):
    """Kernel out (op)= x @ W.T; grid (ceil(N / MM_N), ceil(T / MM_T)) of (MM_THREADS, MM_THREADS)."""

    @cuda.jit
    def matmul(x, w, scales, biases, G, out, mode):
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        tid = ty * MM_THREADS + tx
        T, K, N = x.shape[0], x.shape[1], w.shape[0]
        n0, t0 = cuda.blockIdx.x * MM_N, cuda.blockIdx.y * MM_T
        xs = cuda.shared.array(_X_TILE, float32)
        ws = cuda.shared.array(_W_TILE, float32)
        acc = cuda.local.array(_MICRO, float32)
        for i in range(4):
            for j in range(4):
                acc[i, j] = float32(0.0)
        wv = cuda.local.array(4, float32)
        for k0 in range(0, K, MM_K):
            _stage_x_tile(x, t0, k0, xs, tid)
            stage_weights(w, scales, biases, G, n0, k0, ws, tid)
            cuda.syncthreads()
            for kk in range(MM_K):
                for j in range(4):
                    wv[j] = ws[kk, 4 * tx + j]
                for i in range(4):
                    xv = xs[kk, 4 * ty + i]
                    for j in range(4):
                        acc[i, j] += xv * wv[j]
            cuda.syncthreads()
        for i in range(4):
            t = t0 + 4 * ty + i
            if t < T:
                for j in range(4):
                    _emit(out, t, n0 + 4 * tx + j, acc[i, j], acc[i, (j + 1) % 4], N, mode)
    return matmul


# Kernels by a QuantizedTensor's bits, or FLOAT for a float32 weight. numba compiles each on its
# first launch.
FLOAT = 32
MATVEC = {4: _matvec(_quantized_chunk(4), 32), 8: _matvec(_quantized_chunk(8), 16),
          FLOAT: _matvec(_float_chunk, WORDS)}
MATMUL = {4: _matmul(_quantized_tile(4)), 8: _matmul(_quantized_tile(8)), FLOAT: _matmul(_float_tile)}


# ---- the rest of the block -----------------------------------------------------------------------
NORM_THREADS = 32 if SIMULATED else 128


@cuda.jit
def rmsnorm(x, weight, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight; one block of NORM_THREADS per token.
    out may be x."""
    t, tid = cuda.blockIdx.x, cuda.threadIdx.x
    D = x.shape[1]
    partial = cuda.shared.array(NORM_THREADS, float32)
    ss = float32(0.0)
    for d in range(tid, D, NORM_THREADS):
        ss += x[t, d] * x[t, d]
    partial[tid] = ss
    cuda.syncthreads()
    total = float32(0.0)
    for i in range(NORM_THREADS):     # every thread adds the partials: one barrier, not a tree
        total += partial[i]
    scale = float32(1.0) / math.sqrt(total / float32(D) + float32(eps))
    for d in range(tid, D, NORM_THREADS):
        out[t, d] = x[t, d] * scale * weight[d]


ROPE_THREADS = 32 if SIMULATED else 128


@cuda.jit(device=True)
def _rotated(qkv, bias, t, col, half, c, s):
    """The pair (col, col + half) of token t's projections plus biases, rotated by (c, s)."""
    x1 = qkv[t, col] + bias[col]
    x2 = qkv[t, col + half] + bias[col + half]
    return x1 * c - x2 * s, x2 * c + x1 * s


@cuda.jit
def rope_store(qkv, bias, cos, sin, pos, k_cache, v_cache):
    """Add the biases to qkv [T, (H + 2 Hkv) hd] (q, k, v heads side by side), rotate q in place
    and k (rotate-half RoPE at positions pos[0]..; cos, sin [ctx, hd/2]), and write k and v into
    the caches [Hkv, ctx, hd]. One thread per (token, head, i < hd/2); 1-D grid of ROPE_THREADS."""
    Hkv, _, hd = k_cache.shape
    half, slots = hd // 2, qkv.shape[1] // hd
    H = slots - 2 * Hkv
    idx = cuda.grid(1)
    if idx >= qkv.shape[0] * slots * half:
        return
    t, slot, i = idx // (slots * half), idx // half % slots, idx % half
    col, p = slot * hd + i, pos[0] + t
    if slot >= H + Hkv:                                       # v: stored as it is
        v_cache[slot - H - Hkv, p, i] = qkv[t, col] + bias[col]
        v_cache[slot - H - Hkv, p, i + half] = qkv[t, col + half] + bias[col + half]
        return
    r1, r2 = _rotated(qkv, bias, t, col, half, cos[p, i], sin[p, i])
    if slot < H:
        qkv[t, col] = r1
        qkv[t, col + half] = r2
    else:
        k_cache[slot - H, p, i] = r1
        k_cache[slot - H, p, i + half] = r2


# Attention: one block per (head, token), with an online softmax over chunks of ATT_THREADS keys:
# the chunk's keys are staged in shared memory with coalesced loads (rows padded by one: thread j
# reading row j hits its own bank), thread j scores key j, then every thread reads all the scores
# (broadcast) and updates the running maximum, sum and its head dims' weighted sum of values.
# Three barriers a chunk, no T x T matrix. Query heads of one KV group read the same keys through
# L2 (one block per KV group would read them once: later, with the decode split over the context).
ATT_THREADS = 32 if SIMULATED else 64
MAX_HEAD_DIM = 128
_KEYS_SIZE = ATT_THREADS * (MAX_HEAD_DIM + 1)
_DIMS = MAX_HEAD_DIM // ATT_THREADS          # head dims per thread


@cuda.jit
def attention(qkv, k_cache, v_cache, pos, window, out):
    """out[t, h hd:(h+1) hd] = causal attention of query head h of token t (at position pos[0] + t,
    read from qkv) over the cache [Hkv, ctx, hd] holding positions 0..pos[0]+T-1; window > 0 keeps
    the last `window` positions. Grid (H, T) of ATT_THREADS."""
    h, t, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    hd = k_cache.shape[2]
    q = cuda.shared.array(MAX_HEAD_DIM, float32)
    keys = cuda.shared.array(_KEYS_SIZE, float32)
    scores = cuda.shared.array(ATT_THREADS, float32)
    scale = float32(1.0 / math.sqrt(hd))
    for i in range(tid, hd, ATT_THREADS):
        q[i] = qkv[t, h * hd + i] * scale
    _attend(q, keys, scores, k_cache, v_cache, pos[0] + t, window, out, t, h)


@cuda.jit
def decode_attention(qkv, bias, cos, sin, pos, k_cache, v_cache, window, out):
    """rope_store and attention in one launch for one token (T = 1) at position pos[0]: add the
    biases, rotate q of head h and k of its KV group, store k and v in the caches, then attend.
    Grid (H,) of ATT_THREADS. Every block of a KV group writes the same k and v (identical
    values, so the overlapping writes agree) and reads them back after a barrier."""
    h, tid = cuda.blockIdx.x, cuda.threadIdx.x
    Hkv, _, hd = k_cache.shape
    H, half, p = out.shape[1] // hd, hd // 2, pos[0]
    kv = h // (H // Hkv)
    q = cuda.shared.array(MAX_HEAD_DIM, float32)
    keys = cuda.shared.array(_KEYS_SIZE, float32)
    scores = cuda.shared.array(ATT_THREADS, float32)
    scale = float32(1.0 / math.sqrt(hd))
    for i in range(tid, half, ATT_THREADS):
        c, s = cos[p, i], sin[p, i]
        r1, r2 = _rotated(qkv, bias, 0, h * hd + i, half, c, s)
        q[i], q[i + half] = r1 * scale, r2 * scale
        r1, r2 = _rotated(qkv, bias, 0, (H + kv) * hd + i, half, c, s)
        k_cache[kv, p, i], k_cache[kv, p, i + half] = r1, r2
        col = (H + Hkv + kv) * hd + i
        v_cache[kv, p, i] = qkv[0, col] + bias[col]
        v_cache[kv, p, i + half] = qkv[0, col + half] + bias[col + half]
    cuda.syncthreads()                          # a barrier also makes the block's global writes visible
    _attend(q, keys, scores, k_cache, v_cache, p, window, out, 0, h)


@cuda.jit(device=True)
def _attend(q, keys, scores, k_cache, v_cache, position, window, out, t, h):
    """out[t, h hd:(h+1) hd] = softmax(q . keys) @ values over the cache positions up to
    `position` (the last `window` of them when window > 0); q: the scaled query, in shared memory."""
    tid = cuda.threadIdx.x
    Hkv, _, hd = k_cache.shape
    kv = h // (out.shape[1] // hd // Hkv)
    end = position + 1
    start = max(0, end - window) if window > 0 else 0
    acc = cuda.local.array(_DIMS, float32)
    for a in range(_DIMS):
        acc[a] = float32(0.0)
    best, total = float32(-math.inf), float32(0.0)
    for c0 in range(start, end, ATT_THREADS):
        n = min(ATT_THREADS, end - c0)
        for i in range(tid, n * hd, ATT_THREADS):
            keys[i // hd * (hd + 1) + i % hd] = k_cache[kv, c0 + i // hd, i % hd]
        cuda.syncthreads()                      # also orders q's staging before its first read
        if tid < n:
            s = float32(0.0)
            for i in range(hd):
                s += q[i] * keys[tid * (hd + 1) + i]
            scores[tid] = s
        cuda.syncthreads()
        top = best
        for j in range(n):
            top = max(top, scores[j])
        rescale = math.exp(best - top)          # a new maximum: shrink what was summed so far
        total *= rescale
        for a in range(_DIMS):
            acc[a] *= rescale
        for j in range(n):
            p = math.exp(scores[j] - top)
            total += p
            for a in range(_DIMS):
                i = tid + a * ATT_THREADS
                if i < hd:
                    acc[a] += p * v_cache[kv, c0 + j, i]
        best = top
        if c0 + ATT_THREADS < end:
            cuda.syncthreads()                  # keys and scores are overwritten next
    for a in range(_DIMS):
        i = tid + a * ATT_THREADS
        if i < hd:
            out[t, h * hd + i] = acc[a] / total
