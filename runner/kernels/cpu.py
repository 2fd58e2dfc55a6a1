"""Numba CPU kernels for the float path. Each has a plain numpy twin in tests/reference.py.

All kernels write into preallocated outputs, release the GIL (the chat app runs generation in a
thread) and are cached on disk so a second start does not compile again.
"""
import math

import numba
import numpy as np
from numba import njit, prange

# `workqueue` costs ~0.1 ms per parallel region (~20 ms a token): prefer OpenMP, then TBB.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

_jit = dict(fastmath=True, cache=True, nogil=True)


@njit(parallel=True, **_jit)
def matmul(x, w, out, accumulate):
    """out[T, N] (+)= x[T, K] @ w[N, K].T -- by far the most time is spent here.

    Rows of w are split across threads; each w row is read once and, for prefill, reused for
    every token while it sits in L1.
    """
    T, K = x.shape
    for n in prange(w.shape[0]):
        for t in range(T):
            acc = np.float32(0.0)
            for k in range(K):
                acc += x[t, k] * w[n, k]
            if accumulate:
                out[t, n] += acc
            else:
                out[t, n] = acc


@njit(parallel=True, **_jit)
def swiglu(x, w_gate, w_up, out):
    """out[T, F] = silu(x @ w_gate.T) * (x @ w_up.T), both matrices read in one pass."""
    T, K = x.shape
    for f in prange(w_gate.shape[0]):
        for t in range(T):
            g = np.float32(0.0)
            u = np.float32(0.0)
            for k in range(K):
                g += x[t, k] * w_gate[f, k]
                u += x[t, k] * w_up[f, k]
            out[t, f] = g / (np.float32(1.0) + np.exp(-g)) * u


@njit(parallel=True, **_jit)
def rmsnorm(x, weight, eps, out):
    """out[T, D] = x / sqrt(mean(x^2) + eps) * weight"""
    T, D = x.shape
    for t in prange(T):
        ss = np.float32(0.0)
        for d in range(D):
            ss += x[t, d] * x[t, d]
        scale = np.float32(1.0) / np.sqrt(ss / D + np.float32(eps))
        for d in range(D):
            out[t, d] = x[t, d] * scale * weight[d]


@njit(parallel=True, **_jit)
def rope(x, cos, sin, pos0):
    """Rotate x[T, H, hd] in place for positions pos0.. (the rotate-half layout of HF models).

    cos, sin: [max_ctx, hd/2] tables built once at load.
    """
    T, H, hd = x.shape
    half = hd // 2
    for t in prange(T):
        c = cos[pos0 + t]
        s = sin[pos0 + t]
        for h in range(H):
            for i in range(half):
                x1 = x[t, h, i]
                x2 = x[t, h, i + half]
                x[t, h, i] = x1 * c[i] - x2 * s[i]
                x[t, h, i + half] = x2 * c[i] + x1 * s[i]


@njit(parallel=True, **_jit)
def attention(q, k_cache, v_cache, pos0, window, out):
    """Causal grouped-query attention of new queries against the cache.

    q: [T, H, hd] for positions pos0..pos0+T-1; k_cache, v_cache: [Hkv, ctx, hd] already holding
    positions 0..pos0+T-1; out: [T, H, hd]. window > 0 limits each query to its last `window`
    positions (Mistral's sliding window). One (token, head) pair per task, with a softmax over a
    scratch row as long as the context: no T x T matrix is held.
    """
    T, H, hd = q.shape
    group = H // k_cache.shape[0]
    scale = np.float32(1.0 / math.sqrt(hd))
    for task in prange(T * H):
        t = task // H
        h = task % H
        kv = h // group
        end = pos0 + t + 1
        start = max(0, end - window) if window > 0 else 0
        scores = np.empty(end - start, dtype=np.float32)
        best = np.float32(-np.inf)
        for j in range(start, end):
            s = np.float32(0.0)
            for i in range(hd):
                s += q[t, h, i] * k_cache[kv, j, i]
            s *= scale
            scores[j - start] = s
            best = max(best, s)
        total = np.float32(0.0)
        for j in range(end - start):
            scores[j] = np.exp(scores[j] - best)
            total += scores[j]
        for i in range(hd):
            out[t, h, i] = 0.0
        for j in range(start, end):
            p = scores[j - start] / total
            for i in range(hd):
                out[t, h, i] += p * v_cache[kv, j, i]

