"""An encoder block (BERT's) as one jitted function: decoder_layer's attention made bidirectional
by the layer's window (-1), LayerNorms with biases after each residual add, an exact-GELU MLP."""
from typing import NamedTuple

import numpy as np
from numba import njit

from . import cpu
from .layer import self_attention, weight_nbytes
from .linear import Weight, linear, out_features


class EncoderLayerWeights(NamedTuple):
    """One encoder block's weights, as encoder_layer takes them."""
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
    cpu.gelu(f, w.b_in)
    if collect:
        cpu.add_squares(f, act_sq[3])
    linear(f, w.w_out, h, False)                                       # h = gelu(...) @ w_out.T
    cpu.add_layernorm(x, h, w.b_out, w.out_norm, w.out_norm_bias, eps)
