"""Decoder blocks on an NVIDIA GPU with numba-cuda: weights uploaded once and still quantized, the
KV cache and the activations on the device, one host call per layer (the kernels: cuda_kernels.py).

A layer is 8 launches and no host round trip: RMSNorm, the q/k/v product (one stacked weight),
RoPE + KV store, attention, the output product (+ residual), RMSNorm, the gate/up product with
SwiGLU (one interleaved weight), the down product (+ residual). One token takes the matrix-vector
kernels, several the tiled matrix-matrix ones. Same math as layer.decoder_layer on the CPU.

Setup (once):   weights = upload_layer(model.layers[i].weights); kv = allocate_kv(Hkv, ctx, hd)
                cos, sin = cuda.to_device(model.cos), cuda.to_device(model.sin)
                work = Workspace.allocate(weights, max_tokens)
Per pass:       x = cuda.to_device(hidden)               # [T, D], once per device boundary
                decoder_layer(x, weights, kv, pos0, cos, sin, eps, window, work)  # for each layer
                rmsnorm(x[-1:], norm, eps, h); linear(h, head, logits)           # the output head
"""
from typing import NamedTuple

import numpy as np
from numba import cuda

from . import cuda_kernels as kernels
from .cuda_kernels import ADD, STORE, SWIGLU
from .quant_cpu import QuantizedWeight

FLOAT = 32   # DeviceWeight.bits of a float32 weight


class DeviceWeight(NamedTuple):
    """A linear layer's weight [N, K] on the device.

    words: uint32 [N, K*bits/32], MLX's packed words as on disk (a lane loads whole words), or
    float32 [N, K] when bits is FLOAT; scales, biases: float32 [N, K/G] (w = scales * q + biases),
    a [1, 1] placeholder for float weights.
    """
    words: object
    scales: object
    biases: object
    bits: int
    group_size: int

    @property
    def rows(self) -> int:
        return self.words.shape[0]

    @property
    def cols(self) -> int:
        return self.words.shape[1] * 32 // self.bits


def upload(w: np.ndarray | QuantizedWeight) -> DeviceWeight:
    """Copy a float32 [N, K] matrix or a QuantizedWeight to the device, as it is."""
    if isinstance(w, QuantizedWeight):
        words = np.ascontiguousarray(w.q).view(np.uint32)          # the uint8 view back to words
        return DeviceWeight(cuda.to_device(words), cuda.to_device(w.scales),
                            cuda.to_device(w.biases), w.bits, w.group_size)
    unused = cuda.to_device(np.zeros((1, 1), np.float32))
    return DeviceWeight(cuda.to_device(np.ascontiguousarray(w, np.float32)), unused, unused, FLOAT, 0)


class LayerWeights(NamedTuple):
    """One decoder block on the device."""
    input_norm: object        # [D]
    qkv: DeviceWeight         # [(H + 2 Hkv) hd, D]: the rows of wq, wk, wv, one product
    qkv_bias: object          # [(H + 2 Hkv) hd] (zeros for models without biases)
    wo: DeviceWeight          # [D, H hd]
    post_norm: object         # [D]
    gate_up: DeviceWeight     # [2F, D]: row 2f is w_gate's f, row 2f+1 w_up's f
    down: DeviceWeight        # [D, F]


def upload_layer(weights: tuple) -> LayerWeights:
    """Upload a block given as model.Layer.weights: (input_norm, wq, wk, wv, bq, bk, bv, wo,
    post_norm, w_gate, w_up, w_down)."""
    input_norm, wq, wk, wv, bq, bk, bv, wo, post_norm, w_gate, w_up, w_down = weights
    vector = lambda a: cuda.to_device(np.ascontiguousarray(a, np.float32))
    return LayerWeights(vector(input_norm), _stacked([wq, wk, wv], np.concatenate),
                        vector(np.concatenate([bq, bk, bv])), upload(wo), vector(post_norm),
                        _stacked([w_gate, w_up], _interleave), upload(w_down))


def _interleave(arrays):
    """Rows of a and b alternating: [a0, b0, a1, b1, ...]."""
    a, b = arrays
    return np.stack([a, b], axis=1).reshape(2 * a.shape[0], *a.shape[1:])


def _stacked(weights: list, join) -> DeviceWeight:
    """One device weight made of the rows of host weights of one kind, joined by `join`."""
    kinds = {(w.bits, w.group_size) if isinstance(w, QuantizedWeight) else FLOAT for w in weights}
    if len(kinds) > 1:
        raise ValueError(f"the GPU joins q/k/v and gate/up into one product each, which needs one "
                         f"quantization for all of them, got {sorted(map(str, kinds))}: keep this "
                         f"layer on the CPU or quantize the model again")
    w0 = weights[0]
    if isinstance(w0, QuantizedWeight):
        parts = [join([getattr(w, name) for w in weights]) for name in ("q", "scales", "biases")]
        return upload(QuantizedWeight(*parts, w0.bits, w0.group_size))
    return upload(join([np.asarray(w, np.float32) for w in weights]))


def allocate_kv(n_kv_heads: int, ctx: int, head_dim: int) -> tuple:
    """One layer's KV cache on the device: k, v float32 [Hkv, ctx, hd]. Not zeroed: attention
    reads only the positions decoder_layer has written."""
    if head_dim % 2 or head_dim > kernels.MAX_HEAD_DIM:
        raise ValueError(f"the GPU kernels take an even head_dim of at most "
                         f"{kernels.MAX_HEAD_DIM}, the model has {head_dim}: run it on the CPU")
    shape = (n_kv_heads, ctx, head_dim)
    return cuda.device_array(shape, np.float32), cuda.device_array(shape, np.float32)


class Workspace(NamedTuple):
    """A block's activations for up to `tokens` positions, allocated once and shared by all
    layers (a device allocation synchronizes with the GPU)."""
    h: object       # [tokens, D] a normalized residual
    qkv: object     # [tokens, (H + 2 Hkv) hd]
    attn: object    # [tokens, H hd]
    mlp: object     # [tokens, F]

    @classmethod
    def allocate(cls, layer: LayerWeights, tokens: int) -> "Workspace":
        widths = (layer.input_norm.shape[0], layer.qkv.rows, layer.wo.cols, layer.down.cols)
        return cls(*(cuda.device_array((tokens, n), np.float32) for n in widths))

    def first(self, T: int) -> "Workspace":
        return Workspace(*(a[:T] for a in self))


def decoder_layer(x, weights: LayerWeights, kv: tuple, pos0: int, cos, sin, eps: float,
                  window: int, work: Workspace | None = None):
    """One transformer block on the residual stream x [T, D] (a device array), in place; k and v
    of positions pos0.. go into kv = (k, v) [Hkv, ctx, hd]. cos, sin: [ctx, hd/2] device tables;
    window > 0: sliding-window attention. work: buffers for at least T tokens (else allocated)."""
    T = x.shape[0]
    k_cache, v_cache = kv
    if work is None or work.h.shape[0] < T:
        work = Workspace.allocate(weights, T)
    w = work.first(T)
    # attention block
    rmsnorm(x, weights.input_norm, eps, w.h)
    _product(w.h, weights.qkv, w.qkv, STORE)
    _rope_store(w.qkv, weights.qkv_bias, cos, sin, pos0, k_cache, v_cache)
    _attention(w.qkv, k_cache, v_cache, pos0, window, w.attn)
    _product(w.attn, weights.wo, x, ADD)                    # residual: x += attn @ wo.T
    # feed-forward block
    rmsnorm(x, weights.post_norm, eps, w.h)
    _product(w.h, weights.gate_up, w.mlp, SWIGLU)           # mlp = silu(h @ w_gate.T) * (h @ w_up.T)
    _product(w.mlp, weights.down, x, ADD)                   # residual: x += mlp @ w_down.T


def linear(x, w: DeviceWeight, out, accumulate: bool = False):
    """out[T, N] (+)= x[T, K] @ W.T on the device (the output head: N = vocabulary)."""
    if x.shape[1] != w.cols or tuple(out.shape) != (x.shape[0], w.rows):
        raise ValueError(f"linear: x must be [T, {w.cols}] and out [T, {w.rows}], "
                         f"got {tuple(x.shape)} and {tuple(out.shape)}")
    _product(x, w, out, ADD if accumulate else STORE)


def rmsnorm(x, weight, eps: float, out):
    """out[T, D] = x / sqrt(mean(x^2) + eps) * weight on the device; out may be x."""
    kernels.rmsnorm[x.shape[0], kernels.NORM_THREADS](x, weight, eps, out)


def _product(x, w: DeviceWeight, out, mode: int):
    """out (op)= x @ W.T with the epilogue `mode` (STORE, ADD or SWIGLU)."""
    T, N = x.shape[0], w.rows
    args = (x, w.words, w.scales, w.biases, w.group_size, out, mode)
    if T == 1:
        blocks = -(-N // (kernels.MV_ROWS * kernels.MV_WARPS))
        kernels.MATVEC[w.bits][blocks, (32, kernels.MV_WARPS)](*args)
    else:
        grid = (-(-N // kernels.MM_N), -(-T // kernels.MM_T))
        kernels.MATMUL[w.bits][grid, (kernels.MM_THREADS, kernels.MM_THREADS)](*args)


def _rope_store(qkv, bias, cos, sin, pos0, k_cache, v_cache):
    threads = qkv.shape[0] * qkv.shape[1] // 2
    blocks = -(-threads // kernels.ROPE_THREADS)
    kernels.rope_store[blocks, kernels.ROPE_THREADS](qkv, bias, cos, sin, pos0, k_cache, v_cache)


def _attention(qkv, k_cache, v_cache, pos0, window, out):
    H = out.shape[1] // k_cache.shape[2]
    kernels.attention[(H, qkv.shape[0]), kernels.ATT_THREADS](qkv, k_cache, v_cache, pos0, window, out)
