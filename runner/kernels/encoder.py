"""Encoder blocks as jitted functions: BERT's (decoder_layer's attention made bidirectional by the
layer's window, -1; LayerNorms after each residual add, an exact-GELU MLP) and a vision tower's
(SigLIP's: LayerNorms before each sublayer, dense attention over each image's patches, a
tanh-GELU MLP; Qwen2.5-VL's: RMSNorms, 2D RoPE, attention in windows, a SwiGLU MLP)."""
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from . import cpu
from .layer import self_attention, weight_nbytes
from .linear import Weight, linear, out_features


_NO_MATRIX = np.zeros((0, 0), np.float32)
_NO_VECTOR = np.zeros(0, np.float32)


class EncoderLayerWeights(NamedTuple):
    """One encoder block's weights, as encoder_layer and vision_layer take them (vision_layer's
    norms come before the attention and the MLP: attention_norm and out_norm are SigLIP's
    layer_norm1 and layer_norm2; without biases, RMSNorms)."""
    wq: Weight               # [D, D]
    wk: Weight
    wv: Weight
    bq: np.ndarray           # [D]
    bk: np.ndarray
    bv: np.ndarray
    wo: Weight               # [D, D]
    bo: np.ndarray
    attention_norm: np.ndarray        # [D]: LayerNorm after the attention's residual add
    attention_norm_bias: np.ndarray
    attention_scale: np.float32       # 1/sqrt(hd)
    w_in: Weight             # [F, D]
    b_in: np.ndarray         # [F]
    w_out: Weight            # [D, F]
    b_out: np.ndarray        # [D]
    out_norm: np.ndarray     # [D]: LayerNorm after the MLP's residual add
    out_norm_bias: np.ndarray
    w_gate: Weight = _NO_MATRIX   # [F, D]: a gated MLP's (vision_layer: silu(w_gate x) * w_in x)
    b_gate: np.ndarray = _NO_VECTOR

    @property
    def nbytes(self) -> int:
        return weight_nbytes(self)


@njit(**cpu._jit)
def encoder_layer(x, weights, kv, rows, cos, sin, eps, window, act_sq):
    """One post-norm encoder block on x[T, D], in place, decoder_layer's arguments (window -1: each
    row attends to every row of its sequence; cos and sin zero-width, no RoPE). act_sq's rows:
    the inputs of q/k/v, of the output projection, of the MLP's first and second matrices."""
    w = weights
    T = x.shape[0]
    collect = act_sq.shape[0] > 0
    if collect:
        cpu.add_squares(x, act_sq[0])
    none = np.zeros(0, np.float32)
    attn = self_attention(x, w.wq, w.wk, w.wv, w.bq, w.bk, w.bv, none, none, kv, rows, cos, sin, eps,
                          window, w.attention_scale, none)             # [T, D]
    if collect:
        cpu.add_squares(attn, act_sq[1])
    h = np.empty_like(x)
    linear(attn, w.wo, h, False)                                       # h = attn @ wo.T
    cpu.add_layernorm(x, h, w.bo, w.attention_norm, w.attention_norm_bias, eps)
    if collect:
        cpu.add_squares(x, act_sq[2])
    f = np.empty((T, out_features(w.w_in)), np.float32)                # [T, F]
    linear(x, w.w_in, f, False)
    cpu.gelu(f, w.b_in, False)
    if collect:
        cpu.add_squares(f, act_sq[3])
    linear(f, w.w_out, h, False)                                       # h = gelu(...) @ w_out.T
    cpu.add_layernorm(x, h, w.b_out, w.out_norm, w.out_norm_bias, eps)


@njit(**cpu._jit)
def vision_layer(x, weights, starts, heads, eps, cos, sin):
    """One pre-norm encoder block of a vision tower on x[T, D], in place: x += attention of
    norm(x) over `heads` heads, then x += MLP of norm(x). The norms are LayerNorms (SigLIP's), or
    RMSNorms where they have no bias (Qwen2.5-VL's); q and k turn by RoPE where cos and sin [T,
    hd/2] are not zero-width, each row by its own angles (the Qwens' 2D RoPE over a patch's row
    and column); rows starts[s]..starts[s + 1] - 1 all see each other (dense_attention): an
    image's patches, or a window of them. The MLP is tanh-GELU(w_in x), or with w_gate
    silu(w_gate x) * w_in x (Qwen2.5-VL's), each with its biases."""
    w = weights
    T, D = x.shape
    h = np.empty_like(x)
    _norm(x, w.attention_norm, w.attention_norm_bias, eps, h)
    q, k, v = np.empty((T, D), np.float32), np.empty((T, D), np.float32), np.empty((T, D), np.float32)
    linear(h, w.wq, q, False)
    linear(h, w.wk, k, False)
    linear(h, w.wv, v, False)
    q += w.bq
    k += w.bk
    v += w.bv
    if cos.shape[1]:
        own = np.arange(T).reshape((T, 1))   # row t's angles: cos[t], sin[t]
        cpu.rope(q.reshape((T, heads, D // heads)), cos, sin, own)
        cpu.rope(k.reshape((T, heads, D // heads)), cos, sin, own)
    attn = np.empty((T, D), np.float32)
    dense_attention(q, k, v, starts, heads, w.attention_scale, attn)
    linear(attn, w.wo, x, True)                                         # x += attn @ wo.T
    x += w.bo
    _norm(x, w.out_norm, w.out_norm_bias, eps, h)
    f = np.empty((T, out_features(w.w_in)), np.float32)                 # [T, F]
    linear(h, w.w_in, f, False)
    if w.b_gate.shape[0]:
        g = np.empty_like(f)
        linear(h, w.w_gate, g, False)
        _gate(f, w.b_in, g, w.b_gate)
    else:
        cpu.gelu(f, w.b_in, True)
    linear(f, w.w_out, x, True)                                         # x += mlp(...) @ w_out.T
    x += w.b_out


@njit(**cpu._jit)
def _norm(x, weight, bias, eps, out):
    if bias.shape[0]:
        cpu.layernorm(x, weight, bias, eps, out)
    else:
        cpu.rmsnorm(x, weight, eps, out)


@njit(parallel=True, **cpu.ACTIVATION)
def _gate(f, b_in, g, b_gate):
    """f[T, F] = silu(g + b_gate) * (f + b_in), in place."""
    for t in prange(f.shape[0]):
        for i in range(f.shape[1]):
            f[t, i] = cpu.silu_times(g[t, i] + b_gate[i], f[t, i] + b_in[i])


@njit(parallel=True, **cpu._jit)
def dense_attention(q, k, v, starts, heads, scale, out):
    """out[T, H hd] = softmax(q k^T scale) v, head by head, each row over every row of its
    sequence (rows starts[s]..starts[s + 1] - 1): an encoder's whole sequences, no cache, no mask.

    The products run on cpu.matmul's tiles (times_panels' _tile_6): a sequence's keys and values
    packed once a head into panels, then a task per head and block of BLOCK_ROWS queries, its
    scores [BLOCK_ROWS, n] (in L2), their softmax, and their product with the values. Each
    output is one chain of FMAs along the keys."""
    T, width = q.shape
    hd = width // heads
    P, R = cpu.PANEL, cpu.BLOCK_ROWS
    vpanels = (hd + P - 1) // P
    for s in range(len(starts) - 1):
        a, n = starts[s], starts[s + 1] - starts[s]
        kpanels = (n + P - 1) // P
        kp = np.zeros((heads, kpanels, hd, P), np.float32)    # kp[h, p, d, c] = k[a + p P + c, h hd + d]
        vp = np.zeros((heads, vpanels, n, P), np.float32)     # vp[h, p, j, c] = v[a + j, h hd + p P + c]
        for h in prange(heads):
            for j in range(n):
                for d in range(hd):
                    kp[h, j // P, d, j % P] = k[a + j, h * hd + d]
                    vp[h, d // P, j, d % P] = v[a + j, h * hd + d]
        blocks = (n + R - 1) // R
        for task in prange(heads * blocks):
            h, b = np.int64(task) // blocks, np.int64(task) % blocks
            t0, t1 = a + b * R, min(a + n, a + b * R + R)
            rows = t1 - t0
            qs = np.empty((rows, hd), np.float32)
            for t in range(rows):
                for d in range(hd):
                    qs[t, d] = q[t0 + t, h * hd + d] * scale
            scores = np.empty((rows, kpanels * P), np.float32)
            tile = np.empty((R, P), np.float32)
            for p in range(kpanels):
                for t in range(0, rows, 6):
                    cpu._tile_6(qs, t, rows - 1, kp[h, p], tile, t)
                for t in range(rows):
                    for c in range(P):
                        scores[t, p * P + c] = tile[t, c]
            total = np.empty(rows, np.float32)
            for t in range(rows):
                top = scores[t, 0]
                for j in range(1, n):
                    top = max(top, scores[t, j])
                for j in range(n):
                    scores[t, j] = cpu.exp(scores[t, j] - top)
                acc = np.float32(0.0)
                for j in range(n):
                    acc += scores[t, j]
                total[t] = acc
                for j in range(n, kpanels * P):
                    scores[t, j] = 0
            for p in range(vpanels):
                for t in range(0, rows, 6):
                    cpu._tile_6(scores[:, :n], t, rows - 1, vp[h, p], tile, t)
                for t in range(rows):
                    inverse = np.float32(1.0) / total[t]
                    for c in range(min(P, hd - p * P)):
                        out[t0 + t, h * hd + p * P + c] = tile[t, c] * inverse
