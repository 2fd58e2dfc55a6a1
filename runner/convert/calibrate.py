"""The importance matrix for quantization: how strongly each input channel of each projection is
driven, measured by running the model on calibration text (llama.cpp's imatrix)."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from nibble.formats.half import HalfTensor
from nibble.formats.safetensors import release
from ..model import Model
from ..stages import CPUStage


def layer_importances(model: Model, tokens, ctx: int = 512) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(i, block i's entries of the importance matrix), block by block: the mean squared input
    activation per input channel of each linear, keyed by the HF weight name (e.g.
    model.layers.0.mlp.down_proj.weight), over windows of `ctx` tokens.

    Every window goes through a layer before any goes on to the next, and the memory-map pages
    of a layer's weights are given back after it (once the caller is done with block i): a model
    larger than memory is read once, with one layer resident at a time.
    """
    c = model.config
    tokens = np.asarray(tokens)
    windows = [tokens[i:i + ctx] for i in range(0, len(tokens) - 1, ctx)]
    xs = [model.embedding(window) for window in windows]     # [T, D] residual stream of each
    for i, weights in enumerate(model.layers):
        layer = CPUStage(model, i, i + 1, head=False)
        kv = layer.new_cache(ctx, np.float32)   # each window starts at position 0, over the last
        sums = np.zeros(model.family.act_shape(c, i))   # the family's rows for this block
        for x in xs:
            layer.forward(x, kv, 0, False, {i: sums})   # x in place
        yield i, model.family.importances(c, i, sums, len(tokens))
        _release(weights)


def _release(weights: tuple) -> None:
    """Give back the pages of a block's weights: its arrays and those in its tuples (a mixture's
    experts and router)."""
    for w in weights:
        if isinstance(w, tuple):
            _release(w)
        elif isinstance(w, (np.ndarray, HalfTensor)):
            release(w)
