"""Decoder blocks on an NVIDIA GPU with numba-cuda: weights uploaded once and still quantized, the
KV cache and the activations on the device, no host round trip inside a pass (the kernels:
cuda_kernels.py).

One token (decode) is 5 launches a layer: RMSNorm + the q/k/v product (one stacked weight), RoPE
+ KV store + attention, the output product (+ residual), RMSNorm + the gate/up product with
SwiGLU (one interleaved weight), the down product (+ residual). Several tokens (prefill) take the
tiled matrix-matrix kernels and 8 launches: the norms, RoPE and the KV store on their own. Same
math as layer.decoder_layer on the CPU. The position comes from device memory, so one decode
pass can be recorded once and replayed for every token (Replay: a CUDA graph).

Setup (once):   weights = upload_layer(model.layers[i]); kv = allocate_kv(Hkv, ctx, hd)
                cos, sin = map(cuda.to_device, model.ropes[i])
                work = Workspace.allocate(weights, max_tokens); pos = cuda.to_device(int32 [1])
Per pass:       x = cuda.to_device(hidden)               # [T, D], once per device boundary
                decoder_layer(x, weights, kv, pos, cos, sin, eps, window, work)  # for each layer
                linear(x[-1:], head, logits, norm=norm, eps=eps)               # the output head
"""
import functools
import warnings
from typing import Callable, NamedTuple

import numpy as np
from numba import cuda

from . import cuda_kernels as kernels
from .cuda_kernels import ADD, STORE, SWIGLU
from .layer import LayerWeights
from nibble.formats import superblocks
from nibble.formats.errors import UnsupportedModel
from nibble.formats.half import HalfTensor
from nibble.quant.affine import QuantizedTensor

# numba-cuda warns about every launch of fewer than 128 blocks; a model's small matrices and its
# attention heads make such grids, by design, and the warning would land in the user's terminal
warnings.filterwarnings("ignore", message=r"Grid size \d+ will likely result in GPU under-utilization")


# A weight [N, K] on the device (for annotations): a float32 device array, or a QuantizedTensor
# of device arrays (MLX's uint32 words as on disk, a lane loads whole words; scales and biases
# widened to float32). Both have .shape (N, K).
DeviceWeight = object


def upload(w: np.ndarray | QuantizedTensor) -> DeviceWeight:
    """Copy a float32 [N, K] matrix or a prepared QuantizedTensor to the device, its words as
    they are, its scales and biases widened to float32 (the kernels' one kind)."""
    if isinstance(w, QuantizedTensor):
        _check_integers(w)
        return w._replace(weight=cuda.to_device(w.weight), scales=cuda.to_device(_wide(w.scales, w.bf16)),
                          biases=cuda.to_device(_wide(w.biases, w.bf16)), bf16=False)
    return cuda.to_device(np.ascontiguousarray(w, np.float32))


def _check_integers(w: QuantizedTensor) -> None:
    if w.values is not None:
        raise UnsupportedModel("the GPU kernels do not read 4-bit weights through a table of levels "
                               "(MXFP4, IQ4_NL): run the model on the CPU")
    if w.high is not None or w.group_size < 32:
        raise UnsupportedModel("the GPU kernels do not read weights with high bits or in groups of 16 "
                               "(GGUF's Q5 types, Q2_K, Q3_K and Q6_K): run the model on the CPU")


def _wide(a: np.ndarray, bf16: bool) -> np.ndarray:
    """Prepared scales or biases (float32, the uint16 bits of bf16 or f16, or in two levels) as
    float32 [N, K/G]."""
    if superblocks.is_two_level(a):
        return superblocks.expand(a)
    return HalfTensor(a, bf16).widen() if a.dtype == np.uint16 else a


class DeviceLayer(NamedTuple):
    """One decoder block on the device."""
    input_norm: object        # [D]
    qkv: DeviceWeight         # [(H + 2 Hkv) hd, D]: the rows of wq, wk, wv, one product
    qkv_bias: object          # [(H + 2 Hkv) hd] (zeros for models without biases)
    wo: DeviceWeight          # [D, H hd]
    post_norm: object         # [D]
    gate_up: DeviceWeight     # [2F, D]: row 2f is w_gate's f, row 2f+1 w_up's f
    down: DeviceWeight        # [D, F]


def upload_layer(w: LayerWeights) -> DeviceLayer:
    """Upload a block of the model, joining q/k/v and gate/up into one product each."""
    if not isinstance(w, LayerWeights):
        raise UnsupportedModel(f"the GPU kernels run Llama's block, not {type(w).__name__}: "
                               f"run the model on the CPU")
    if w.q_norm.size:
        raise UnsupportedModel("the GPU kernels do not run qwen3's per-head q/k norms: run it on the CPU")
    vector = lambda a: cuda.to_device(np.ascontiguousarray(a, np.float32))
    return DeviceLayer(vector(w.input_norm), _stacked([w.wq, w.wk, w.wv], np.concatenate),
                       vector(np.concatenate([w.bq, w.bk, w.bv])), upload(w.wo), vector(w.post_norm),
                       _stacked([w.w_gate, w.w_up], _interleave), upload(w.w_down))


def _interleave(arrays):
    """Rows of a and b alternating: [a0, b0, a1, b1, ...]."""
    a, b = arrays
    return np.stack([a, b], axis=1).reshape(2 * a.shape[0], *a.shape[1:])


def _stacked(weights: list, join) -> DeviceWeight:
    """One device weight made of the rows of host weights of one kind, joined by `join`."""
    kinds = {(w.bits, w.group_size) if isinstance(w, QuantizedTensor) else "float32" for w in weights}
    if len(kinds) > 1:
        raise UnsupportedModel(f"the GPU joins q/k/v and gate/up into one product each, which needs one "
                         f"quantization for all of them, got {sorted(map(str, kinds))}: keep this "
                         f"layer on the CPU or quantize the model again")
    w0 = weights[0]
    if isinstance(w0, QuantizedTensor):
        for w in weights:
            _check_integers(w)
        parts = [join([w.weight for w in weights])] + [join([_wide(getattr(w, name), w.bf16) for w in weights])
                                                       for name in ("scales", "biases")]
        return upload(QuantizedTensor(*parts, w0.bits, w0.group_size))
    return upload(join([np.asarray(w, np.float32) for w in weights]))


def allocate_kv(n_kv_heads: int, ctx: int, head_dim: int) -> tuple:
    """One layer's KV cache on the device: k, v float32 [Hkv, ctx, hd]. Not zeroed: attention
    reads only the positions decoder_layer has written."""
    if head_dim % 2 or head_dim > kernels.MAX_HEAD_DIM:
        raise UnsupportedModel(f"the GPU kernels take an even head_dim of at most "
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
    def allocate(cls, layer: DeviceLayer, tokens: int) -> "Workspace":
        widths = (layer.input_norm.shape[0], layer.qkv.shape[0], layer.wo.shape[1], layer.down.shape[1])
        return cls(*(cuda.device_array((tokens, n), np.float32) for n in widths))

    def first(self, T: int) -> "Workspace":
        return Workspace(*(a[:T] for a in self))


class Launcher:
    """Issues kernel launches on one stream, in order. When `events` is a list, each launch is
    bracketed by a pair of CUDA events appended to it: the GPU time of every kernel, without the
    gaps while the host prepares the next launch (nibble bench's kernel utilization)."""

    def __init__(self, stream=0):
        self.stream = stream
        self.events: list | None = None

    def __call__(self, kernel, grid, block, *args):
        if self.events is None:
            kernel[grid, block, self.stream](*args)
            return
        start, end = cuda.event(), cuda.event()
        start.record(self.stream)
        kernel[grid, block, self.stream](*args)
        end.record(self.stream)
        self.events.append((start, end))


DEFAULT = Launcher()   # the default stream


class Replay:
    """The launches `issue(launcher)` makes, recorded once on `stream` as a CUDA graph and replayed
    with one launch per call: decode is ~5 small kernels a layer, and a launch from Python costs
    more than most of them take to run. Every launch must read its changing inputs (the hidden
    state, the position) from device memory: the graph keeps the argument values it recorded.

    Needs cuda.core (a dependency of numba-cuda) and a real GPU; raises whatever the capture
    raises otherwise (the caller then launches one by one). Make the same launches once before
    recording, so that no kernel is compiled or loaded while the stream records."""

    def __init__(self, issue: Callable[[Launcher], None], stream):
        from cuda.core import Stream
        self.stream = Stream.from_handle(int(stream.handle))
        builder = self.stream.create_graph_builder().begin_building()
        try:
            issue(Launcher(stream))   # the same stream: its launches go into the graph
        finally:
            builder.end_building()
        self.graph = builder.complete()
        self.graph.upload(self.stream)

    def __call__(self):
        self.graph.launch(self.stream)


def decoder_layer(x, weights: DeviceLayer, kv: tuple, pos, cos, sin, eps: float, window: int,
                  work: Workspace, launch: Launcher = DEFAULT):
    """One transformer block on the residual stream x [T, D] (a device array), in place; k and v
    of positions pos[0].. (pos: int32 [1] on the device) go into kv = (k, v) [Hkv, ctx, hd].
    cos, sin: [ctx, hd/2] device tables; window > 0: sliding-window attention; work: buffers for
    at least T tokens."""
    T = x.shape[0]
    if work.h.shape[0] < T:
        raise ValueError(f"the workspace holds {work.h.shape[0]} tokens, the pass has {T}")
    w = work.first(T)
    # attention block
    _product(launch, x, weights.qkv, w.qkv, STORE, weights.input_norm, eps, w.h)
    if T == 1:
        decode_attention(w.qkv, weights.qkv_bias, cos, sin, pos, kv, window, w.attn, launch)
    else:
        rope_store(w.qkv, weights.qkv_bias, cos, sin, pos, kv, launch)
        attention(w.qkv, kv, pos, window, w.attn, launch)
    _product(launch, w.attn, weights.wo, x, ADD)                      # residual: x += attn @ wo.T
    # feed-forward block: mlp = silu(h @ w_gate.T) * (h @ w_up.T), h = rmsnorm(x)
    _product(launch, x, weights.gate_up, w.mlp, SWIGLU, weights.post_norm, eps, w.h)
    _product(launch, w.mlp, weights.down, x, ADD)                     # residual: x += mlp @ w_down.T


def linear(x, w: DeviceWeight, out, accumulate: bool = False, *, norm=None, eps: float = 0.0,
           scratch=None, launch: Launcher = DEFAULT):
    """out[T, N] (+)= x[T, K] @ W.T on the device, or rmsnorm(x) @ W.T with the norm's weight
    `norm` [K] (the output head: N = vocabulary); scratch [T, K]: the normalized x when T > 1."""
    N, K = w.shape
    if x.shape[1] != K or tuple(out.shape) != (x.shape[0], N):
        raise ValueError(f"linear: x must be [T, {K}] and out [T, {N}], "
                         f"got {tuple(x.shape)} and {tuple(out.shape)}")
    _product(launch, x, w, out, ADD if accumulate else STORE, norm, eps, scratch)


def rmsnorm(x, weight, eps: float, out, launch: Launcher = DEFAULT):
    """out[T, D] = x / sqrt(mean(x^2) + eps) * weight on the device; out may be x."""
    launch(kernels.rmsnorm, x.shape[0], kernels.NORM_THREADS, x, weight, eps, out)


def rope_store(qkv, bias, cos, sin, pos, kv: tuple, launch: Launcher = DEFAULT):
    """qkv [T, (H + 2 Hkv) hd] += bias; q rotated in place, k rotated and v stored in kv at
    positions pos[0].. (see cuda_kernels.rope_store)."""
    threads = qkv.shape[0] * qkv.shape[1] // 2
    launch(kernels.rope_store, -(-threads // kernels.ROPE_THREADS), kernels.ROPE_THREADS,
           qkv, bias, cos, sin, pos, *kv)


def attention(qkv, kv: tuple, pos, window: int, out, launch: Launcher = DEFAULT):
    """out [T, H hd] = causal attention of qkv's (rotated) queries over kv, tokens at pos[0].."""
    H = out.shape[1] // kv[0].shape[2]
    launch(kernels.attention, (H, qkv.shape[0]), kernels.ATT_THREADS, qkv, *kv, pos, window, out)


def decode_attention(qkv, bias, cos, sin, pos, kv: tuple, window: int, out, launch: Launcher = DEFAULT):
    """rope_store then attention for one token, in one launch."""
    H = out.shape[1] // kv[0].shape[2]
    launch(kernels.decode_attention, H, kernels.ATT_THREADS, qkv, bias, cos, sin, pos, *kv, window, out)


def _product(launch, x, w: DeviceWeight, out, mode: int, norm=None, eps: float = 0.0, scratch=None):
    """out (op)= x @ W.T with the epilogue `mode` (STORE, ADD or SWIGLU), of rmsnorm(x) when a
    norm weight is given: inside the matrix-vector kernel for one token, else into scratch first."""
    T, N = x.shape[0], w.shape[0]
    # the kernels take a float weight as words of FLOAT bits with unused scales and biases
    words, scales, biases, bits, G = (w[:5] if isinstance(w, QuantizedTensor)
                                      else (w, *_no_groups(), kernels.FLOAT, 0))
    if T == 1:
        blocks = -(-N // (kernels.MV_ROWS * kernels.MV_WARPS))
        launch(kernels.MATVEC[bits], blocks, (32, kernels.MV_WARPS),
               x, _no_norm() if norm is None else norm, eps, words, scales, biases, G, out, mode)
        return
    if norm is not None:
        rmsnorm(x, norm, eps, scratch, launch)
        x = scratch
    grid = (-(-N // kernels.MM_N), -(-T // kernels.MM_T))
    launch(kernels.MATMUL[bits], grid, (kernels.MM_THREADS, kernels.MM_THREADS),
           x, words, scales, biases, G, out, mode)


@functools.cache
def _no_groups() -> tuple:
    """The scales and biases the kernels are given with a float weight: [1, 1], never read."""
    unused = cuda.to_device(np.zeros((1, 1), np.float32))
    return unused, unused


@functools.cache
def _no_norm():
    """The empty norm weight: the matrix-vector kernel takes x as it is."""
    return cuda.device_array(0, np.float32)
