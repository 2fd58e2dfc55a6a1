"""Encoder blocks as jitted functions, decoder_layer's attention made bidirectional by the layer's
window (-1): BERT's (LayerNorms after each residual add, an exact-GELU MLP) and a vision tower's
(SigLIP's: LayerNorms before each sublayer, a tanh-GELU MLP)."""
from typing import NamedTuple

import numpy as np
from numba import njit

from . import cpu
from .layer import self_attention, weight_nbytes
from .linear import Weight, linear, out_features


class EncoderLayerWeights(NamedTuple):
    """One encoder block's weights, as encoder_layer and vision_layer take them (vision_layer's
    norms come before the attention and the MLP: attention_norm and out_norm are SigLIP's
    layer_norm1 and layer_norm2)."""
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
def vision_layer(x, weights, kv, rows, eps):
    """One pre-norm encoder block (a SigLIP vision tower's) on x[T, D], in place: x += attention
    of LayerNorm(x), then x += MLP of LayerNorm(x), each row attending to every row of its
    sequence (an image's patches), with no RoPE."""
    w = weights
    T = x.shape[0]
    none = np.zeros(0, np.float32)
    flat = np.zeros((1, 0), np.float32)
    h = np.empty_like(x)
    cpu.layernorm(x, w.attention_norm, w.attention_norm_bias, eps, h)
    attn = self_attention(h, w.wq, w.wk, w.wv, w.bq, w.bk, w.bv, none, none, kv, rows, flat, flat, eps,
                          -1, w.attention_scale, none)                  # [T, D]
    linear(attn, w.wo, x, True)                                         # x += attn @ wo.T
    x += w.bo
    cpu.layernorm(x, w.out_norm, w.out_norm_bias, eps, h)
    f = np.empty((T, out_features(w.w_in)), np.float32)                 # [T, F]
    linear(h, w.w_in, f, False)
    cpu.gelu(f, w.b_in, True)
    linear(f, w.w_out, x, True)                                         # x += gelu(...) @ w_out.T
    x += w.b_out
