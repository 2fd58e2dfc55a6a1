"""GPU offload: the last N decoder layers of a Model as a stage on an NVIDIA GPU (runner.kernels.cuda).

The last layers, not the first: the hidden state then crosses to the device once per forward pass
and, when every layer is offloaded, the output head runs there too and only the logits come back.
Weights are uploaded once, still quantized; the stage's part of a KVPool lives on the device
while the KVCache keeps the positions and ids, so truncating it works as on the CPU: later
passes overwrite the device positions. The device cache is contiguous, not in blocks: the GPU
runs one sequence whose blocks are in order (Model.new_cache's), and refuses other passes.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from nibble.formats.errors import NibbleError, UnsupportedModel
from nibble.formats.half import HalfTensor
from nibble.quant.affine import QuantizedTensor
from .kv.cache import blocks_for
from .stages import weight_nbytes

CHUNK = 256           # most tokens sent through the device at once: bounds the workspace
HEADROOM = 0.9        # share of the free GPU memory to plan for (the rest: CUDA's own needs)


def device_nbytes(w) -> int:
    """Bytes of a weight on the device: bf16/f16 go up widened to float32 (kernels.cuda.upload),
    a quantized weight's 16-bit or two-level scales and biases too."""
    if isinstance(w, QuantizedTensor) and w.scales.dtype != np.float32:
        N, K = w.shape
        return w.weight.nbytes + 2 * 4 * N * (K // w.group_size)
    return 2 * w.nbytes if isinstance(w, HalfTensor) else w.nbytes


class NoGPU(NibbleError):
    """No usable GPU; the message says why."""


def cuda_api():
    """numba.cuda when a GPU (or numba's simulator) is usable, else NoGPU with the reason."""
    try:
        from numba import cuda
    except Exception as e:   # numba-cuda missing or broken: any import failure means no GPU
        raise NoGPU(f"numba.cuda cannot be imported: {e}") from None
    if not cuda.is_available():
        raise NoGPU("no CUDA GPU or driver found")
    return cuda


def free_memory(cuda) -> int | None:
    """Free bytes on the current GPU, or None when unknown (numba's simulator says infinity)."""
    try:
        free = cuda.current_context().get_memory_info()[0]
    except Exception:   # no such call in some simulator versions: plan as if everything fits
        return None
    return int(free) if math.isfinite(free) else None


@dataclass
class Plan:
    """How many layers go to the GPU and why not more."""
    layers: int        # offloaded: the last `layers` of the model
    head: bool         # the final norm and lm_head on the GPU too
    note: str = ""     # one line for the user when fewer layers fit than were asked for


def plan(model, requested: int, ctx: int, free: int | None) -> Plan:
    """Offload `requested` layers (-1: all), or as many of them as `free` bytes hold."""
    L = len(model.layers)
    n = L if requested < 0 else min(requested, L)
    if free is None:
        return Plan(n, n == L)
    c = model.config
    kv = 2 * c.num_key_value_heads * ctx * c.head_dim * 4                        # k, v float32
    per_layer = kv + weight_nbytes(model, L - 1, L, False, device_nbytes)
    work = CHUNK * 4 * (3 * c.hidden_size + (c.num_attention_heads + 2 * c.num_key_value_heads)
                        * c.head_dim + c.intermediate_size)                     # Workspace and x
    cos, sin = model.ropes[-1]
    fixed = cos.nbytes + sin.nbytes + work
    head = weight_nbytes(model, L, L, True, device_nbytes) + CHUNK * c.vocab_size * 4
    budget = int(free * HEADROOM) - fixed
    if n == L and budget >= n * per_layer + head:
        return Plan(n, True)
    fit = max(0, min(n, budget // per_layer))
    if fit == n:
        return Plan(n, False)
    return Plan(fit, False, f"offloading {fit} of {n} layers: the others do not fit in "
                            f"{free / 1e6:.0f} MB of free GPU memory")


class GPUStage:
    """Layers [first, L) of a Model on the GPU and, if `head`, the output head: a stage (see
    stages.py) whose part of a KVPool is a list of device (k, v) [Hkv, ctx, hd], one per layer.

    Decode (one token) reads its hidden state and position from fixed device buffers, so after
    one pass launched kernel by kernel the pass is recorded as a CUDA graph (kernels.cuda.Replay)
    and each later token is one graph launch; per KV cache, since the graph holds its addresses.
    Where recording fails (numba's simulator, an old numba-cuda, NIBBLE_CUDA_GRAPHS=0) kernels
    are launched one by one and `graph_error` says why."""

    on_gpu = True

    def __init__(self, model, p: Plan):
        from .kernels import cuda as gpu
        self.gpu, self.cuda = gpu, cuda_api()
        c = model.config
        self.eps = c.rms_norm_eps
        self.first = len(model.layers) - p.layers
        self.windows = c.windows[self.first:]   # each offloaded layer's sliding window (0: none)
        self.weight_nbytes = weight_nbytes(model, self.first, len(model.layers), p.head, device_nbytes)
        self.kv_shape = (c.num_key_value_heads, c.head_dim)
        gpu.allocate_kv(c.num_key_value_heads, 1, c.head_dim)   # refuses a head_dim it cannot take: now
        self.layers = [gpu.upload_layer(l) for l in model.layers[self.first:]]
        cos, sin = _one_rope(model, self.first)
        self.cos, self.sin = self.cuda.to_device(cos), self.cuda.to_device(sin)   # [ctx, hd/2]
        self.norm = self.cuda.to_device(model.norm) if p.head else None                   # [D]
        self.head = gpu.upload(model.lm_head) if p.head else None                          # [V, D]
        self.work = gpu.Workspace.allocate(self.layers[0], CHUNK)
        self.x = self.cuda.device_array((CHUNK, c.hidden_size), np.float32)   # the hidden state in
        self.normed = self.cuda.device_array((CHUNK, c.hidden_size), np.float32) if p.head else None
        self.logits = self.cuda.device_array((CHUNK, c.vocab_size), np.float32) if p.head else None
        self.pos = self.cuda.device_array(1, np.int32)                        # the first position
        self.stream = self.cuda.stream()
        self.launch = gpu.Launcher(self.stream)
        # one token's way in and out: page-locked, so the copies are plain DMA on the stream
        self.x1 = self.x[:1]
        self.out1 = self.logits[:1] if p.head else self.x1
        self.x1_host = self.cuda.pinned_array((1, c.hidden_size), np.float32)
        self.out1_host = self.cuda.pinned_array(self.out1.shape, np.float32)
        self.pos_host = self.cuda.pinned_array(1, np.int32)
        self.replay, self.replay_kv = None, None
        self.graph_error = _graphs_off()   # "" while CUDA graphs may be used
        self.events: list | None = None    # (start, end) CUDA events around kernels, when timing (bench)

    def new_cache(self, ctx: int, dtype=None) -> list[tuple]:
        """k, v float32 [Hkv, ctx, hd] on the device for each offloaded layer (whatever the host
        cache's dtype)."""
        Hkv, hd = self.kv_shape
        from numba.cuda.cudadrv.driver import CudaAPIError
        try:
            return [self.gpu.allocate_kv(Hkv, ctx, hd) for _ in self.layers]
        except CudaAPIError as e:
            raise NibbleError(f"the GPU has no room for a KV cache of {ctx} positions ({e}): "
                              f"lower --ctx-size or --gpu-layers") from None

    def run(self, x: np.ndarray, kv: list[tuple], rows, logit_rows: np.ndarray,
            act_sq: np.ndarray | None = None, check=None, adds=()) -> np.ndarray:
        """The stage's face (stages.py): forward() for rows of one sequence at consecutive
        positions in blocks 0, 1, 2, ... of the pool, which the contiguous device cache is."""
        T, pos0 = len(x), int(rows.positions[0])
        blocks = blocks_for(pos0 + T)
        if (np.any(rows.seq != rows.seq[0]) or not np.array_equal(rows.positions, np.arange(pos0, pos0 + T))
                or not np.array_equal(rows.tables[rows.seq[0], :blocks], np.arange(blocks))):
            raise NibbleError("the GPU runs one sequence whose KV blocks are in order (Model.new_cache): "
                              "load the model without --gpu-layers to share a KV pool")
        if not rows.plain or adds:
            raise NibbleError("the GPU's attention is causal and turns each row by its position, and an image's "
                              "tokens see each other or turn by their place in the image: load the model "
                              "without --gpu-layers to ask about images")
        last_only = len(logit_rows) == 1 and logit_rows[0] == T - 1
        if self.head is None:   # every row's hidden state, for the head on the host
            return self.forward(x, kv, pos0, True, act_sq, check)
        out = self.forward(x, kv, pos0, not last_only, act_sq, check)
        return out if last_only else out[logit_rows]

    def forward(self, x: np.ndarray, kv: list[tuple], pos0: int, all_logits: bool,
                act_sq: np.ndarray | None = None, check=None) -> np.ndarray:
        """Run x [T, D] (host) through the offloaded layers at positions pos0..; -> logits
        [T or 1, V] when the head is here, else the hidden state [T or 1, D] for the host's head.
        With `check` (see stages.py), kernel by kernel, each layer's output copied back."""
        if act_sq is not None:
            raise NibbleError("measuring activations (calibration) runs every layer on the CPU: "
                              "load the model without --gpu-layers")
        if len(x) == 1 and check is None:
            return self._decode(x, kv, pos0)
        out = []
        for s in range(0, len(x), CHUNK):
            want = all_logits or s + CHUNK >= len(x)   # the rows asked for, or the last one
            rows = self._chunk(x[s:s + CHUNK], kv, pos0 + s, all_logits, head=want, check=check)
            if want:
                out.append(rows.copy_to_host(stream=self.stream))
        self.stream.synchronize()
        return np.concatenate(out)

    def _decode(self, x: np.ndarray, kv, pos0: int) -> np.ndarray:
        self.x1_host[:] = x
        self.pos_host[0] = pos0
        self.x1.copy_to_device(self.x1_host, stream=self.stream)   # the hidden state crosses once
        self.pos.copy_to_device(self.pos_host, stream=self.stream)
        recorded = self.replay is not None and self.replay_kv is kv
        if recorded:
            start = self._event()
            self.replay()
            self._record(start)
        else:
            self.launch.events = self.events
            self._decode_pass(kv, self.launch)
            self.launch.events = None
        self.out1.copy_to_host(self.out1_host, stream=self.stream)
        self.stream.synchronize()
        if not recorded:
            self._record_replay(kv)    # for the next tokens: the kernels are loaded now
        return self.out1_host.copy()

    def _decode_pass(self, kv, launch):
        for weights, layer_kv, window in zip(self.layers, kv, self.windows):
            self.gpu.decoder_layer(self.x1, weights, layer_kv, self.pos, self.cos, self.sin,
                                   self.eps, window, self.work, launch)
        if self.head is not None:
            self.gpu.linear(self.x1, self.head, self.out1, norm=self.norm, eps=self.eps, launch=launch)

    def _record_replay(self, kv):
        if self.graph_error:
            return
        try:
            self.replay, self.replay_kv = self.gpu.Replay(lambda launch: self._decode_pass(kv, launch),
                                                          self.stream), kv
        except Exception as e:   # cuda.core missing or too old, a driver that refuses: launch one by one
            self.replay, self.replay_kv = None, None
            self.graph_error = f"CUDA graphs unavailable ({type(e).__name__}: {e})"
            self.stream = self.cuda.stream()   # a failed capture can leave the stream unusable
            self.launch = self.gpu.Launcher(self.stream)

    def _chunk(self, x: np.ndarray, kv, pos0: int, keep_all: bool, head: bool, check=None):
        """Queue up to CHUNK tokens through the layers, and the head if `head` -> the device rows
        of the result: every token's (keep_all) or the last one's. With `check`, each layer's
        output and the logits are copied back and checked (see stages.py)."""
        T = len(x)
        h = self.x[:T]
        # pageable host memory: the copies take the values before they return
        h.copy_to_device(np.ascontiguousarray(x), stream=self.stream)
        self.pos.copy_to_device(np.array([pos0], np.int32), stream=self.stream)
        for i, (weights, layer_kv, window) in enumerate(zip(self.layers, kv, self.windows)):
            self.gpu.decoder_layer(h, weights, layer_kv, self.pos, self.cos, self.sin, self.eps,
                                   window, self.work, self.launch)
            if check:
                check(self.first + i, self._to_host(h))
        rows = h if keep_all else h[-1:]
        if self.head is None or not head:
            return rows
        T = rows.shape[0]
        self.gpu.linear(rows, self.head, self.logits[:T], norm=self.norm, eps=self.eps,
                        scratch=self.normed[:T], launch=self.launch)          # [T or 1, V]
        if check:
            check(self.first + len(self.layers), self._to_host(self.logits[:T]))
        return self.logits[:T]

    def _to_host(self, a) -> np.ndarray:
        out = a.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return out

    def _event(self):
        if self.events is None:
            return None
        e = self.cuda.event()
        e.record(self.stream)
        return e

    def _record(self, start):
        if start is not None:
            end = self.cuda.event()
            end.record(self.stream)
            self.events.append((start, end))

    def kernel_seconds(self) -> float:
        """GPU seconds between the recorded events, summed (waits for the last): each kernel
        launched one by one, or each replayed graph (its kernels and the GPU's gaps between them)."""
        if self.events:
            self.events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self.events or ()) / 1000


def _graphs_off() -> str:
    """Why decode passes cannot be replayed as CUDA graphs here, or ""."""
    from numba import config
    if config.ENABLE_CUDASIM:
        return "numba's CUDA simulator has no graphs"
    if os.environ.get("NIBBLE_CUDA_GRAPHS") == "0":
        return "NIBBLE_CUDA_GRAPHS=0"
    return ""


def _one_rope(model, first: int) -> tuple[np.ndarray, np.ndarray]:
    """The RoPE table of layers [first, L): the GPU kernels rotate whole heads with one table."""
    cos, sin = model.ropes[first]
    if any(r[0] is not cos for r in model.ropes[first:]) or 2 * cos.shape[1] != model.config.head_dim:
        raise UnsupportedModel(f"the GPU kernels rotate whole heads with one RoPE table, and "
                               f"{model.config.model_type}'s layers differ: run it on the CPU")
    return cos, sin


def setup(model, gpu_layers: int, ctx: int | None, require_gpu: bool) -> tuple[GPUStage | None, str]:
    """Offload `gpu_layers` of `model` (-1: all) -> (GPUStage or None, one line for the user or "").

    No usable GPU, or a model its kernels cannot run: run on the CPU and say why, or raise NoGPU
    when `require_gpu`."""
    if gpu_layers == 0 and not require_gpu:
        return None, ""
    try:
        cuda = cuda_api()
        if gpu_layers == 0:
            return None, ""
        p = plan(model, gpu_layers, ctx or model.config.max_position_embeddings, free_memory(cuda))
        if p.layers == 0:
            raise NoGPU(p.note)
        return _build(model, p), p.note
    except (NoGPU, UnsupportedModel) as e:
        if require_gpu:
            raise NoGPU(f"no GPU: {e}") from None
        return None, f"no GPU: running on the CPU ({e})"


def _build(model, p: Plan) -> GPUStage:
    from numba.cuda.cudadrv.driver import CudaAPIError
    try:
        return GPUStage(model, p)
    except CudaAPIError as e:   # the memory figure was off (or unknown): one line, no traceback
        raise NibbleError(f"the GPU ran out of memory for {p.layers} layers ({e}): "
                          f"lower --gpu-layers") from None
