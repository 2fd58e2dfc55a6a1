"""The importance matrix for quantization: how strongly each input channel of each projection is
driven, measured by running the model on calibration text (llama.cpp's imatrix)."""
from __future__ import annotations

import numpy as np

from .model import Model


def collect_imatrix(model: Model, tokens, ctx: int = 512, progress=None) -> dict[str, np.ndarray]:
    """Mean squared input activation per input channel, keyed by the HF weight name of each
    linear layer (e.g. model.layers.0.mlp.down_proj.weight), over windows of `ctx` tokens."""
    c = model.config
    tokens = np.asarray(tokens)
    windows = [tokens[i:i + ctx] for i in range(0, len(tokens) - 1, ctx)]
    sums = np.zeros((c.num_hidden_layers, 4, max(c.hidden_size, c.intermediate_size)))
    for w, window in enumerate(windows):
        model.forward(window, model.new_cache(len(window)), act_sq=sums)
        if progress:
            progress(w + 1, len(windows))
    widths = (c.hidden_size, c.num_attention_heads * c.head_dim, c.hidden_size, c.intermediate_size)
    inputs = model.family.INPUTS   # the projections each slot's input feeds, by the family's names
    return {f"model.layers.{i}.{name}.weight": sums[i, slot, :widths[slot]] / len(tokens)
            for i in range(c.num_hidden_layers) for slot, names in enumerate(inputs) for name in names}
