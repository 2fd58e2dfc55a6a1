"""GPU offload: the last N decoder layers of a Model on an NVIDIA GPU (runner.kernels.cuda).

The last layers, not the first: the hidden state then crosses to the device once per forward pass
and, when every layer is offloaded, the output head runs there too and only the logits come back.
Weights are uploaded once, still quantized; the offloaded layers' KV cache lives on the device
(KVCache.device) while the host KVCache keeps the positions and tokens, so truncating it works
as on the CPU: later passes overwrite the device positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from formats.errors import NibbleError

CHUNK = 256           # most tokens sent through the device at once: bounds the workspace
HEADROOM = 0.9        # share of the free GPU memory to plan for (the rest: CUDA's own needs)


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
    per_layer = kv + sum(_nbytes(w) for w in model.layers[-1].weights)
    work = CHUNK * 4 * (2 * c.hidden_size + (c.num_attention_heads + 2 * c.num_key_value_heads)
                        * c.head_dim + c.intermediate_size)                     # Workspace
    fixed = model.cos.nbytes + model.sin.nbytes + work
    head = _nbytes(model.lm_head) + model.norm.nbytes + CHUNK * c.vocab_size * 4
    budget = int(free * HEADROOM) - fixed
    if n == L and budget >= n * per_layer + head:
        return Plan(n, True)
    fit = max(0, min(n, budget // per_layer))
    if fit == n:
        return Plan(n, False)
    return Plan(fit, False, f"offloading {fit} of {n} layers: the others do not fit in "
                            f"{free / 1e6:.0f} MB of free GPU memory")


def _nbytes(w) -> int:
    return w.nbytes if isinstance(w, np.ndarray) else w.q.nbytes + w.scales.nbytes + w.biases.nbytes


class Offload:
    """The device side of a Model: layers [first, L) and, if `head`, the output head."""

    def __init__(self, model, p: Plan):
        from .kernels import cuda as gpu
        self.gpu, self.cuda = gpu, cuda_api()
        c = model.config
        self.eps, self.window = c.rms_norm_eps, c.sliding_window or 0
        self.first = len(model.layers) - p.layers
        self.kv_shape = (c.num_key_value_heads, c.head_dim)
        gpu.allocate_kv(c.num_key_value_heads, 1, c.head_dim)   # refuses a head_dim it cannot take: now
        self.layers = [gpu.upload_layer(l.weights) for l in model.layers[self.first:]]
        self.cos, self.sin = self.cuda.to_device(model.cos), self.cuda.to_device(model.sin)   # [ctx, hd/2]
        self.norm = self.cuda.to_device(model.norm) if p.head else None                   # [D]
        self.head = gpu.upload(model.lm_head) if p.head else None                          # [V, D]
        self.work = gpu.Workspace.allocate(self.layers[0], CHUNK)
        self.normed = self.cuda.device_array((CHUNK, c.hidden_size), np.float32) if p.head else None
        self.logits = self.cuda.device_array((CHUNK, c.vocab_size), np.float32) if p.head else None
        self.events: list | None = None   # (start, end) CUDA events per pass, when timing (bench)

    def allocate_kv(self, ctx: int) -> list[tuple]:
        """k, v [Hkv, ctx, hd] on the device for each offloaded layer."""
        Hkv, hd = self.kv_shape
        from numba.cuda.cudadrv.driver import CudaAPIError
        try:
            return [self.gpu.allocate_kv(Hkv, ctx, hd) for _ in self.layers]
        except CudaAPIError as e:
            raise NibbleError(f"the GPU has no room for a KV cache of {ctx} positions ({e}): "
                              f"lower --ctx-size or --gpu-layers") from None

    def forward(self, x: np.ndarray, kv: list[tuple], pos0: int, all_logits: bool) -> np.ndarray:
        """Run x [T, D] (host) through the offloaded layers at positions pos0..; -> logits
        [T or 1, V] when the head is here, else the hidden state [T or 1, D] for the host's head."""
        out = []
        for s in range(0, len(x), CHUNK):
            last = s + CHUNK >= len(x)
            if all_logits or last:
                out.append(self._chunk(x[s:s + CHUNK], kv, pos0 + s, keep_all=all_logits))
            else:
                self._chunk(x[s:s + CHUNK], kv, pos0 + s, keep_all=False)
        return np.concatenate(out)

    def _chunk(self, x: np.ndarray, kv, pos0: int, keep_all: bool) -> np.ndarray:
        h = self.cuda.to_device(np.ascontiguousarray(x))                    # [T, D] crosses once
        start = self._event()   # after the copy: the events time the kernels only
        for weights, layer_kv in zip(self.layers, kv):
            self.gpu.decoder_layer(h, weights, layer_kv, pos0, self.cos, self.sin, self.eps,
                                   self.window, self.work)
        rows = h if keep_all else h[-1:]
        if self.head is not None:
            T = rows.shape[0]
            self.gpu.rmsnorm(rows, self.norm, self.eps, self.normed[:T])
            self.gpu.linear(self.normed[:T], self.head, self.logits[:T])           # [T or 1, V]
            rows = self.logits[:T]
        self._record(start)
        return rows.copy_to_host()

    def _event(self):
        if self.events is None:
            return None
        e = self.cuda.event()
        e.record()
        return e

    def _record(self, start):
        if start is not None:
            end = self.cuda.event()
            end.record()
            self.events.append((start, end))

    def kernel_seconds(self) -> float:
        """GPU seconds between the recorded events, summed (waits for the last)."""
        if self.events:
            self.events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self.events or ()) / 1000


def setup(model, gpu_layers: int, ctx: int | None, require_gpu: bool) -> tuple[Offload | None, str]:
    """Offload `gpu_layers` of `model` (-1: all) -> (Offload or None, one line for the user or "").

    No usable GPU: run on the CPU and say why, or raise NoGPU when `require_gpu`."""
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
    except (NoGPU, ValueError) as e:   # ValueError: a model the kernels cannot take (their message)
        if require_gpu:
            raise NoGPU(f"no GPU: {e}") from None
        return None, f"no GPU: running on the CPU ({e})"


def _build(model, p: Plan) -> Offload:
    from numba.cuda.cudadrv.driver import CudaAPIError
    try:
        return Offload(model, p)
    except CudaAPIError as e:   # the memory figure was off (or unknown): one line, no traceback
        raise NibbleError(f"the GPU ran out of memory for {p.layers} layers ({e}): "
                          f"lower --gpu-layers") from None
