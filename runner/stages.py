"""A model runs as a list of stages, each a run of consecutive layers on one device that owns
those layers' weights and its part of the KV cache; the last stage also runs the output head.

Every stage has the same face, so Model runs them in order without asking where they run:

    new_cache(ctx, dtype) -> its part of a KVPool of ceil(ctx / BLOCK) blocks (None when it has
        no layers)
    run(x, kv, rows, logit_rows, act_sq, check) -> the hidden state [T, D] of every row for the
        next stage, or, from the stage with the head, the logits [len(logit_rows), V] of the rows
        logit_rows; rows (cache.Rows) place each row in its sequence's blocks; check(i, out), if
        given, is called with each layer's output (i: the layer's index) and the logits (i: the
        number of layers), on the host: Model.forward's search for a layer that made NaN/Inf
    weight_nbytes -> bytes of the weights a decoded token reads there

CPUStage is here; offload.GPUStage is the same on an NVIDIA GPU (`-ngl`).
"""
from __future__ import annotations

import numpy as np
from numba._dispatcher import compute_fingerprint

from .cache import HostKV, Rows, blocks_for, identity_table
from .kernels import ahead, cpu, linear
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
        self._blocks: dict[tuple, list] = {}   # see blocks()

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
            act_sq: np.ndarray | None = None, check=None) -> np.ndarray:
        """act_sq, if given: each layer's sums of its projections' squared inputs by layer index
        (float64, as the family's act_shape; see decoder_layer), accumulated."""
        m, c = self.model, self.model.config
        acts = [_NOT_COLLECTING] * len(m.layers) if act_sq is None else act_sq
        blocks = self.blocks(x, kv, rows, acts[self.first]) if self.last > self.first else []
        for i, block in zip(range(self.first, self.last), blocks):
            block(x, m.layers[i], kv.layer(i - self.first), rows, *m.ropes[i], c.rms_norm_eps, c.windows[i], acts[i])
            if check:
                check(i, x)
        if not self.head:
            return x
        if not len(logit_rows):   # a group of rows only stored (Model.forward_batch)
            return np.empty((0, c.vocab_size), np.float32)
        x = x[logit_rows]   # a copy: generation needs only the next token's distribution
        cpu.rmsnorm(x, m.norm, c.rms_norm_eps, x)
        logits = np.empty((x.shape[0], c.vocab_size), np.float32)   # [len(logit_rows), V]
        linear.linear(x, m.lm_head, logits, False)
        if check:
            check(len(m.layers), logits)
        return logits

    def blocks(self, x, kv, rows, act) -> list:
        """Each layer's family.block() compiled for its arguments' types (act: the first layer's
        act_sq): numba's dispatcher works them out again at each call, ~8 us for a layer's named
        tuples (0.25 ms of a SmolLM2 token, 5%), but a layer's weights and rotations keep theirs:
        only those of x, rows, the cache (f32 or int8) and act_sq are looked at each pass, by
        numba's fingerprint of a value's type (0.1 us; typing rows costs 20)."""
        block = self.model.family.block()
        key = tuple(map(compute_fingerprint, (x, rows, kv.layer(0), act)))
        if key not in self._blocks:
            m, c = self.model, self.model.config
            sigs = [tuple(map(block.typeof_pyval, (x, m.layers[i], kv.layer(i - self.first), rows,
                                                   *m.ropes[i], c.rms_norm_eps, c.windows[i], act)))
                    for i in range(self.first, self.last)]
            compile_layers = lambda: [block.compile(sig) for sig in sigs]
            if ahead.is_cached(block, sigs[0]):
                self._blocks[key] = compile_layers()
            else:   # a first run: the kernels compile on two cores
                self._blocks[key] = ahead.first_pass(m.layers[self.first:self.last], m.lm_head if self.head else None,
                                                     compile_layers)
        return self._blocks[key]
