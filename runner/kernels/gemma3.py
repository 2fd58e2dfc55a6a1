"""Gemma 3's decoder block as one jitted function, for float32, 16-bit float and quantized weights.

It differs from Llama's (layer.py) in its norms and its MLP: the attention output and the MLP's
output are each normalized before they join the residual stream (four RMSNorms a block), every
head's q and k are normalized before RoPE, and the MLP gates with GELU (tanh approximation)
instead of SiLU. The attention itself is layer.py's.
"""
from typing import NamedTuple

import numpy as np
from numba import njit

from . import cpu
from .layer import self_attention, weight_nbytes
from .linear import Weight, gated_mlp, linear, out_features


class Gemma3Weights(NamedTuple):
    """One Gemma 3 block's weights. Every norm weight is what RMSNorm multiplies by: Gemma's
    (1 + w), made at load (runner/models/gemma3.py)."""
    input_norm: np.ndarray             # [D]
    wq: Weight                         # [H*hd, D]
    wk: Weight                         # [Hkv*hd, D]
    wv: Weight                         # [Hkv*hd, D]
    q_norm: np.ndarray                 # [hd]
    k_norm: np.ndarray                 # [hd]
    attention_scale: np.float32        # scores times query_pre_attn_scalar^-0.5
    wo: Weight                         # [D, H*hd]
    post_attention_norm: np.ndarray    # [D]
    pre_feedforward_norm: np.ndarray   # [D]
    w_gate: Weight                     # [F, D]
    w_up: Weight                       # [F, D]
    w_down: Weight                     # [D, F]
    post_feedforward_norm: np.ndarray  # [D]

    @property
    def nbytes(self) -> int:
        """Bytes of all the block's weights: what a decoded token reads of it."""
        return weight_nbytes(self)


@njit(**cpu._jit)
def gemma3_layer(x, weights, kv, rows, cos, sin, eps, window, act_sq):
    """One Gemma 3 block on the residual stream x[T, D], in place; arguments as layer.decoder_layer's
    (weights: Gemma3Weights)."""
    w = weights
    T = x.shape[0]
    h = np.empty_like(x)                                     # [T, D]
    no_bias = np.empty(0, np.float32)
    # attention block: x += norm(attention(norm(x)) @ wo.T)
    cpu.rmsnorm(x, w.input_norm, eps, h)
    collect = act_sq.shape[0] > 0
    if collect:
        cpu.add_squares(h, act_sq[0])
    attn = self_attention(h, w.wq, w.wk, w.wv, no_bias, no_bias, no_bias, w.q_norm, w.k_norm,
                          kv, rows, cos, sin, eps, window, w.attention_scale, no_bias)  # [T, H*hd]
    if collect:
        cpu.add_squares(attn, act_sq[1])
    linear(attn, w.wo, h, False)                            # h = attn @ wo.T
    cpu.rmsnorm(h, w.post_attention_norm, eps, h)
    x += h
    # feed-forward block: x += norm((gelu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T), h = norm(x)
    cpu.rmsnorm(x, w.pre_feedforward_norm, eps, h)
    mlp = np.empty((T, out_features(w.w_gate)), np.float32)         # [T, F]
    gated_mlp(h, w.w_gate, w.w_up, mlp, True)               # GELU-gated
    if collect:
        cpu.add_squares(h, act_sq[2])
        cpu.add_squares(mlp, act_sq[3])
    linear(mlp, w.w_down, h, False)                         # h = mlp @ w_down.T
    cpu.rmsnorm(h, w.post_feedforward_norm, eps, h)
    x += h
