"""The importance matrix for quantization: how strongly each input channel of each projection is
driven, measured by running the model on calibration text (llama.cpp's imatrix)."""
from __future__ import annotations

import numpy as np

from nibble.formats.safetensors import release
from .model import Model
from .stages import CPUStage


def collect_imatrix(model: Model, tokens, ctx: int = 512, progress=None) -> dict[str, np.ndarray]:
    """Mean squared input activation per input channel, keyed by the HF weight name of each
    linear layer (e.g. model.layers.0.mlp.down_proj.weight), over windows of `ctx` tokens.

    Every window goes through a layer before any goes on to the next, and the memory-map pages
    of a layer's weights are given back after it: a model larger than memory is read once, with
    one layer resident at a time. progress(done, total) after each layer.
    """
    c = model.config
    tokens = np.asarray(tokens)
    windows = [tokens[i:i + ctx] for i in range(0, len(tokens) - 1, ctx)]
    xs = [model.embedding(window) for window in windows]     # [T, D] residual stream of each
    sums = np.zeros((c.num_hidden_layers, 4, max(c.hidden_size, c.intermediate_size)))
    for i, weights in enumerate(model.layers):
        layer = CPUStage(model, i, i + 1, head=False)
        kv = layer.new_cache(ctx, np.float32)   # each window starts at position 0, over the last
        for x in xs:
            layer.forward(x, kv, 0, False, sums)   # x in place
        for w in weights:
            release(w)
        if progress:
            progress(i + 1, c.num_hidden_layers)
    widths = (c.hidden_size, c.num_attention_heads * c.head_dim, c.hidden_size, c.intermediate_size)
    inputs = model.family.INPUTS   # the projections each slot's input feeds, by the family's names
    return {f"model.layers.{i}.{name}.weight": sums[i, slot, :widths[slot]] / len(tokens)
            for i in range(c.num_hidden_layers) for slot, names in enumerate(inputs) for name in names}
