"""Qwen3-VL's vision (Qwen3VLForConditionalGeneration): Qwen2.5-VL's processor, prompt and
multimodal RoPE (qwen2_5_vl.py), with a tower of LayerNorm blocks and a tanh-GELU MLP, SigLIP's,
whose patches turn by 2D RoPE and all see each other (no windows), learned positions added after
the patch convolution (a square table bilinearly resized to each image's patches), the patch
merger's norm a LayerNorm; and deepstack: the outputs of deepstack_visual_indexes' blocks merged
apart (their norm after the merge) and added to the image rows of the first decoder layers'
outputs. The decoder is Qwen3's, its rotated pairs taking time, rows and columns in turn."""
from __future__ import annotations

import math

import numpy as np

from nibble.formats.errors import FormatError
from ..kernels.encoder import EncoderLayerWeights
from .qwen2_5_vl import Merger, Qwen25VLVision, _places


class Qwen3VLVision(Qwen25VLVision):
    interleaved = True
    windowed = False

    def _patch_bias(self, get, D: int) -> np.ndarray | None:
        return get("patch_embed.proj.bias", (D,))

    def _layer(self, get, p: str, D: int, F: int) -> EncoderLayerWeights:
        return EncoderLayerWeights(
            **self._attention(get, p, D),
            attention_norm_bias=get(p + "norm1.bias", (D,)), out_norm_bias=get(p + "norm2.bias", (D,)),
            w_in=get.linear(p + "mlp.linear_fc1", (F, D)), b_in=get(p + "mlp.linear_fc1.bias", (F,)),
            w_out=get.linear(p + "mlp.linear_fc2", (D, F)), b_out=get(p + "mlp.linear_fc2.bias", (D,)))

    def _merger(self, get, v: dict, name: str = "merger", after: bool = False) -> Merger:
        D, m2 = self.width, self.merge ** 2
        norm = D * m2 if after else D
        return Merger(get(f"{name}.norm.weight", (norm,)), get(f"{name}.norm.bias", (norm,)),
                      get.linear(f"{name}.linear_fc1", (D * m2, D * m2)), get(f"{name}.linear_fc1.bias", (D * m2,)),
                      get.linear(f"{name}.linear_fc2", (self.hidden, D * m2)), get(f"{name}.linear_fc2.bias", (self.hidden,)),
                      after)

    def _deepstack(self, get, v: dict) -> tuple[list[int], list[Merger]]:
        blocks = v.get("deepstack_visual_indexes", [8, 16, 24])
        if not isinstance(blocks, list) or not all(isinstance(i, int) and 0 <= i < self.depth for i in blocks):
            raise FormatError(f"config.json: vision_config.deepstack_visual_indexes must be blocks of the tower's "
                              f"{self.depth}, not {blocks!r}")
        self.table = get("pos_embed.weight", (v.get("num_position_embeddings", 2304), self.width))
        self.side = math.isqrt(len(self.table)) if self.table is not None else 0
        if self.table is not None and self.side ** 2 != len(self.table):
            raise FormatError(f"config.json: vision_config.num_position_embeddings {len(self.table)} is not a square")
        return blocks, [self._merger(get, v, f"deepstack_merger_list.{j}", True) for j in range(len(blocks))]

    def _add_positions(self, x: np.ndarray, pixels: list[np.ndarray]):
        """The table resized to each image's patches (bilinear, corners on corners), in the
        processor's order of its patches."""
        first, n = 0, self.side
        for grid in pixels:
            rows, cols = grid.shape[:2]
            row, col = _places(rows, cols, self.merge)
            (r0, r1, wr), (c0, c1, wc) = _taps(row, rows * self.merge, n), _taps(col, cols * self.merge, n)
            t = self.table
            x[first:first + len(row)] += ((1 - wr) * (1 - wc))[:, None] * t[r0 * n + c0] + \
                ((1 - wr) * wc)[:, None] * t[r0 * n + c1] + (wr * (1 - wc))[:, None] * t[r1 * n + c0] + \
                (wr * wc)[:, None] * t[r1 * n + c1]
            first += len(row)


def _taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear taps into `side` table entries for places `index` of `size` (align_corners): the
    lower and upper entries and the upper one's weight."""
    at = (index * (side - 1) / max(size - 1, 1)).astype(np.float32)
    low = np.floor(at)
    weight = at - low
    return low.astype(np.int64), np.minimum(low.astype(np.int64) + 1, side - 1), weight
