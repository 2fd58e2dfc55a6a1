"""A model runs as a list of stages, each a run of consecutive layers on one device that owns
those layers' weights and its part of the KV cache; the last stage also runs the output head.

Every stage has the same face, so Model runs them in order without asking where they run:

    new_cache(ctx, dtype) -> its part of a KVPool of ceil(ctx / BLOCK) blocks (None when it has
        no layers)
    run(x, kv, rows, logit_rows, act_sq, check, adds) -> the hidden state [T, D] of every row for
        the next stage, or, from the stage with the head, the logits [len(logit_rows), V] of the
        rows logit_rows; rows (cache.Rows) place each row in its sequence's blocks; check(i, out),
        if given, is called with each layer's output (i: the layer's index) and the logits (i: the
        number of layers), on the host: Model.forward's search for a layer that made NaN/Inf;
        adds[i] = (indexes, values): x[indexes] += values after layer i (Qwen3-VL's deepstack)
    weight_nbytes -> bytes of the weights a decoded token reads there

CPUStage is here; offload.GPUStage is the same on an NVIDIA GPU (`-ngl`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba._dispatcher import compute_fingerprint

from nibble.quant.affine import QuantizedTensor
from .kv.cache import HostKV, Rows, blocks_for, identity_table, kv_type
from .kernels import ahead, compiling, cpu, linear, quant_decode
from .kernels.layer import weights_of

_NOT_COLLECTING = np.zeros((0, 0))


def weight_nbytes(model, first: int, last: int, head: bool, nbytes=lambda w: w.nbytes) -> int:
    """Bytes of layers [first, last) of `model`, and of its head if `head`, `nbytes` a weight
    (the GPU counts what it holds: see offload.device_nbytes)."""
    weights = [w for layer in model.layers[first:last] for w in weights_of(layer)]
    return sum(map(nbytes, weights + ([model.norm, model.lm_head] if head else [])))


class CPUStage:
    """Layers [first, last) of `model` on the CPU (Numba kernels), then the head if `head`."""
    on_gpu = False

    def __init__(self, model, first: int, last: int, head: bool):
        self.model, self.first, self.last, self.head = model, first, last, head
        self.weight_nbytes = weight_nbytes(model, first, last, head)
        self._kernels: dict[tuple, Kernels] = {}   # see kernels()

    def new_cache(self, ctx: int, dtype) -> HostKV | None:
        c = self.model.config
        if self.last == self.first:
            return None
        return HostKV.allocate(self.last - self.first, c.num_key_value_heads, blocks_for(ctx),
                               c.head_dim, dtype)

    def forward(self, x: np.ndarray, kv: HostKV | None, pos0: int, all_logits: bool,
                act_sq: np.ndarray | None = None) -> np.ndarray:
        """run() for one sequence at positions pos0.. on its own part (calibration's way), the
        logits of every row (all_logits) or of the last."""
        T = len(x)
        rows = Rows.single(pos0, T, identity_table(kv.k.shape[1] if kv else blocks_for(pos0 + T)))
        return self.run(x, kv, rows, np.arange(T) if all_logits else np.array([T - 1]), act_sq)

    def run(self, x: np.ndarray, kv: HostKV | None, rows: Rows, logit_rows: np.ndarray,
            act_sq: np.ndarray | None = None, check=None, adds=()) -> np.ndarray:
        """act_sq, if given: each layer's sums of its projections' squared inputs by layer index
        (float64, as the family's act_shape; see decoder_layer), accumulated."""
        m, c = self.model, self.model.config
        acts = [_NOT_COLLECTING] * len(m.layers) if act_sq is None else act_sq
        kernels = self.kernels(x, kv, rows, acts[self.first] if self.last > self.first else None)
        for i, block, layer in zip(range(self.first, self.last), kernels.blocks, kernels.layers):
            block(x, layer, kv.layer(i - self.first), rows, *m.ropes[i], c.rms_norm_eps, c.windows[i], acts[i])
            if i < len(adds):
                x[adds[i][0]] += adds[i][1]
            if check:
                check(i, x)
        if not self.head:
            return x
        if not len(logit_rows):   # a group of rows only stored (Model.forward_batch)
            return np.empty((0, c.vocab_size), np.float32)
        x = x[logit_rows]   # a copy: generation needs only the next token's distribution
        cpu.rmsnorm(x, m.norm, c.rms_norm_eps, x)
        logits = np.empty((x.shape[0], c.vocab_size), np.float32)   # [len(logit_rows), V]
        linear.linear(x, kernels.head, logits, False)
        if check:
            check(len(m.layers), logits)
        return logits

    def kernels(self, x, kv, rows, act) -> Kernels:
        """Each layer's family.kernel() compiled for its arguments' types (act: the first layer's
        act_sq), with the weights it takes: numba's dispatcher would type a layer's named tuples
        again at each call (a few percent of a small model's token), but a layer's weights and
        rotations keep theirs: only those of x, rows, the cache (f32 or int8) and act_sq are looked
        at each pass, by numba's fingerprint of a value's type, far cheaper than typing them.
        Kernels on a first run's weights give way to the full ones once the background has
        compiled them."""
        key = tuple(map(compute_fingerprint, (x, rows, kv.layer(0) if kv else None, act)))
        kernels = self._kernels.get(key)
        if kernels is None or (kernels.first and self.model.background.finished()):
            kernels = self._kernels[key] = self._compiled(x, kv, rows, act, kernels)
        return kernels

    def _compiled(self, x, kv, rows, act, first: Kernels | None) -> Kernels:
        """The kernels, loaded from numba's cache or compiled on two cores (kernels/ahead.py). On
        a first run (not cached) where the model's background allows it, those of the weights as
        a first run's kinds (quant_decode.FIRST_KINDS, a fraction of the compile), while the
        background compiles the full ones. `first`: the kernels of a first run whose background
        has ended, kept where it did not leave the full ones cached."""
        m = self.model
        layers, head = m.layers[self.first:self.last], m.lm_head if self.head else None
        if self.last == self.first:
            return Kernels([], layers, head)
        block = m.family.kernel()
        sigs = self._signatures(block, layers, x, kv, rows, act)
        if ahead.is_cached(block, sigs[0]):
            return Kernels([block.compile(sig) for sig in sigs], layers, head)
        if first is not None:
            return Kernels(first.blocks, first.layers, first.head)
        # a float model's first run would compile the same kernels twice: where nothing is quantized
        background = m.background.wanted() and any(isinstance(w, QuantizedTensor) for w in weights_of(layers[0]))
        if background:
            m.background.start(kv_type(kv.k.dtype))
            layers, head = [first_kinds(layer) for layer in layers], first_kinds(head)
            sigs = self._signatures(block, layers, x, kv, rows, act)
        compile_layers = lambda: [block.compile(sig) for sig in sigs]
        if ahead.is_cached(block, sigs[0]):
            return Kernels(compile_layers(), layers, head, first=background)
        if background:
            compiling.rest_in_background()
        window = m.config.windows[self.first]
        attention = (cpu.attention, self._attention_signature(layers[0], kv.layer(0), rows, window))
        return Kernels(ahead.first_pass(layers, head, compile_layers, [attention]), layers, head, first=background)

    @staticmethod
    def _attention_signature(layer, kv, rows, window) -> tuple:
        """The types a layer's block calls cpu.attention with (q and out new [T, H, hd] arrays, the
        layer's sinks or, for a family without them, a new empty array): compiled beside the
        matrix kernels on a first run."""
        q = np.empty((1, 1, 1), np.float32)
        sinks = getattr(layer, "sinks", np.empty(0, np.float32))
        return tuple(map(cpu.attention.typeof_pyval, (q, *kv, rows, window, layer.attention_scale, sinks, q)))

    def _signatures(self, block, layers, x, kv, rows, act) -> list[tuple]:
        m, c = self.model, self.model.config
        return [tuple(map(block.typeof_pyval, (x, layer, kv.layer(i - self.first), rows, *m.ropes[i],
                                               c.rms_norm_eps, c.windows[i], act)))
                for i, layer in zip(range(self.first, self.last), layers)]


@dataclass
class Kernels:
    """A stage's compiled layers, the weights they take (the model's, or as a first run's kinds)
    and the head's weight; `first`: a first run's, while the full ones compile in the background."""
    blocks: list
    layers: list
    head: object
    first: bool = False


def first_kinds(weights):
    """A layer's weights (a named tuple of them) or the head's, each quantized one as its first
    run's kind (quant_decode.first_kind): the same arrays, the kernels that compile quickly."""
    if isinstance(weights, QuantizedTensor):
        return quant_decode.first_kind(weights)
    if isinstance(weights, tuple) and hasattr(weights, "_fields"):
        return type(weights)(*(first_kinds(w) if isinstance(w, QuantizedTensor) else w for w in weights))
    return weights
