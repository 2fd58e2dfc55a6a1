"""The decoder block as one jitted function, for float32, 16-bit float and quantized weights alike.

Numba compiles it once per combination of weight types; `linear`, `project_qkv` and `gated_mlp`
choose their kernels at compile time from those types (float32: cpu's fused kernels; quantized
and 16-bit: quant_decode's, half's and prefill's, through linear.py).
"""
from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.extending import overload

from . import cpu
from .linear import Weight, gated_mlp, linear, out_features, project_qkv
from .moe import MoEWeights, moe_mlp
from .team import decoded_in_one_region


class LayerWeights(NamedTuple):
    """One decoder block's weights, as decoder_layer takes them (numba takes named tuples; at
    module level, so that the cached kernels can name the type when they are loaded again)."""
    input_norm: np.ndarray   # [D]
    wq: Weight               # [H*hd, D]
    wk: Weight               # [Hkv*hd, D]
    wv: Weight               # [Hkv*hd, D]
    bq: np.ndarray           # [H*hd] (qwen2; zeros for models without biases)
    bk: np.ndarray           # [Hkv*hd]
    bv: np.ndarray           # [Hkv*hd]
    q_norm: np.ndarray       # [hd] (qwen3: RMSNorm of each query head), [H*hd] (olmoe: of each
    k_norm: np.ndarray       # row's whole width); [hd] or [Hkv*hd] for keys; shape (0,): none
    wo: Weight               # [D, H*hd]
    bo: np.ndarray           # [D] (gpt-oss; shape (0,) for the others)
    sinks: np.ndarray        # [H]: each head's attention sink logit (gpt-oss; shape (0,) for the others)
    post_norm: np.ndarray    # [D]
    attention_scale: np.float32   # the scores are q . k times this: 1/sqrt(hd), or Granite's
    residual_scale: np.float32    # the attention's and the MLP's outputs times this, added to x (Granite's)
    w_gate: Weight           # [F, D]
    w_up: Weight             # [F, D]
    w_down: Weight           # [D, F]

    @property
    def nbytes(self) -> int:
        """Bytes of all the block's weights: what a decoded token reads of it."""
        return weight_nbytes(self)


class MoELayerWeights(NamedTuple):
    """A decoder block whose MLP is a mixture of experts: LayerWeights' attention, moe's MLP."""
    input_norm: np.ndarray
    wq: Weight
    wk: Weight
    wv: Weight
    bq: np.ndarray
    bk: np.ndarray
    bv: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    wo: Weight
    bo: np.ndarray
    sinks: np.ndarray
    post_norm: np.ndarray
    attention_scale: np.float32
    residual_scale: np.float32
    moe: MoEWeights

    @property
    def nbytes(self) -> int:
        """Bytes of the block's weights a decoded token reads: the routed experts' (moe.nbytes)."""
        return weight_nbytes(self)


def weights_of(block: tuple) -> list:
    """A block's weights (its arrays, matrices and experts), without its scalars."""
    return [w for w in block if not isinstance(w, np.float32)]


def weight_nbytes(block: tuple) -> int:
    return sum(w.nbytes for w in weights_of(block))


@njit(**cpu._jit)
def decoder_layer(x, weights, kv, rows, cos, sin, eps, window, act_sq):
    """One transformer block on the residual stream x[T, D], in place; row t is position
    rows.positions[t] of sequence rows.seq[t] (cache.Rows), its k/v written into that sequence's
    blocks of the layer's cache kv = (k [blocks, Hkv, hd, BLOCK], v [blocks, Hkv, BLOCK, hd],
    k_scale, v_scale [blocks, Hkv, BLOCK]). One call per layer keeps Python out of the token loop's inner steps.

    weights: LayerWeights or MoELayerWeights. act_sq: float64 sums of the squared inputs of
    the q/k/v, o, gate/up and down projections, a row each (for the importance matrix of
    quantization; a mixture's experts have rows of their own: moe.moe_mlp), or shape (0, 0)
    when not collecting.
    """
    if decoded_in_one_region(x, weights, kv, rows, cos, sin, eps, window, act_sq):   # decode: the team's
        return
    w = weights
    h = np.empty_like(x)                                     # [T, D]
    # attention block
    cpu.rmsnorm(x, w.input_norm, eps, h)
    collect = act_sq.shape[0] > 0
    if collect:
        cpu.add_squares(h, act_sq[0])
    attn = self_attention(h, w.wq, w.wk, w.wv, w.bq, w.bk, w.bv, w.q_norm, w.k_norm,
                          kv, rows, cos, sin, eps, window, w.attention_scale, w.sinks)  # [T, H*hd]
    if collect:
        cpu.add_squares(attn, act_sq[1])
    scaled = w.residual_scale != 1
    if scaled:   # x += s * (attn @ wo.T + bo)
        linear(attn, w.wo, h, False)
        if w.bo.shape[0]:
            h += w.bo
        x += w.residual_scale * h
    else:
        linear(attn, w.wo, x, True)                         # residual: x += attn @ wo.T
        if w.bo.shape[0]:
            x += w.bo
    # feed-forward block
    cpu.rmsnorm(x, w.post_norm, eps, h)
    if collect:
        cpu.add_squares(h, act_sq[2])
    # residual: x += mlp(h), or through y for a scale (one call: its code is inlined here)
    y = np.zeros_like(x) if scaled else x
    feed_forward(h, w, y, act_sq)
    if scaled:
        x += w.residual_scale * y


def feed_forward(h, w, x, act_sq):
    """x += the block's MLP of h: SwiGLU (LayerWeights) or a mixture of experts
    (MoELayerWeights), chosen by w's type (njit code only)."""


@overload(feed_forward, inline="always", jit_options=cpu._jit)
def _feed_forward_typed(h, w, x, act_sq):
    if isinstance(w, types.BaseNamedTuple) and w.instance_class is MoELayerWeights:
        def mixture(h, w, x, act_sq):
            out = np.empty_like(h)
            moe_mlp(h, w.moe, out, act_sq)
            x += out
        return mixture

    def dense(h, w, x, act_sq):
        mlp = np.empty((h.shape[0], out_features(w.w_gate)), np.float32)   # [T, F]
        gated_mlp(h, w.w_gate, w.w_up, mlp, False)         # SwiGLU
        if act_sq.shape[0] > 0:
            cpu.add_squares(mlp, act_sq[3])
        linear(mlp, w.w_down, x, True)                      # x += mlp @ w_down.T
    return dense


@njit(inline="always", **cpu._jit)
def self_attention(h, wq, wk, wv, bq, bk, bv, q_norm, k_norm, kv, rows, cos, sin, eps, window, scale, sinks):
    """-> [T, H*hd]: causal attention of the normed input h[T, D] (before the output projection),
    the rows' k and v stored first in the layer's cache kv (see decoder_layer), so that the rows
    of one prompt chunk see each other. Biases of shape (0,) are skipped, and so are q/k norms
    (RMSNorm of each head or of the whole row, before RoPE)."""
    k_cache, v_cache, k_scale, v_scale = kv
    T = h.shape[0]
    Hkv, hd = v_cache.shape[1], v_cache.shape[3]
    H = out_features(wq) // hd
    q = np.empty((T, H * hd), np.float32)
    k = np.empty((T, Hkv * hd), np.float32)
    v = np.empty((T, Hkv * hd), np.float32)
    project_qkv(h, wq, wk, wv, q, k, v)
    q = q.reshape(T, H, hd)
    cpu.place_qkv(q, k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd), bq, bk, bv, q_norm, k_norm, kv, rows, cos, sin, eps)
    attn = np.empty((T, H * hd), np.float32)                # [T, H*hd]
    cpu.attention(q, k_cache, v_cache, k_scale, v_scale, rows, window, scale, sinks, attn.reshape(T, H, hd))
    return attn
