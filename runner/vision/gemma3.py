"""Gemma 3's vision (Gemma3ForConditionalGeneration): an image resized to the tower's square
(PIL's bilinear, as its image processor), scaled to [-1, 1], through SigLIP; the patch grid
average-pooled to mm_tokens_per_image tokens, Gemma's RMSNorm (x (1 + w)), a projection into the
text model's width. In the prompt an image is `\\n\\n<start_of_image>`, its tokens,
`<end_of_image>\\n\\n`, as Gemma3Processor writes it; in the decoder an image's tokens see each
other (transformers' bidirectional mask over an image's block)."""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from nibble.formats.errors import FormatError
from nibble.formats.image import Picture
from ..model import TensorGetter
from ..text.image_ids import tag
from .base import Vision
from .siglip import tower_of


class Gemma3Vision(Vision):
    bidirectional = True

    def __init__(self, config: dict, tensors: dict, quantization: dict | None, token_text):
        """config: the checkpoint's config.json (Gemma3Config's); tensors under vision_tower.* and
        multi_modal_projector.*; token_text(id): the tokenizer's text of a token id."""
        super().__init__()
        self.tower = tower_of(config, tensors, quantization)
        self.tokens = config.get("mm_tokens_per_image", 256)
        side, pooled = self.tower.size // self.tower.patch, math.isqrt(self.tokens)
        if pooled * pooled != self.tokens or side % pooled:
            raise FormatError(f"config.json: mm_tokens_per_image {self.tokens} is not a square that "
                              f"divides the tower's {side} x {side} patches")
        self.pool = side // pooled
        hidden = config.get("text_config", {}).get("hidden_size")
        projector = TensorGetter({k.removeprefix("multi_modal_projector."): t for k, t in tensors.items()}, None)
        self.norm = projector("mm_soft_emb_norm.weight", (self.tower.width,))
        self.projection = projector("mm_input_projection_weight", (self.tower.width, hidden))
        projector.raise_if_missing()
        self.norm = 1 + self.norm
        self.marker = token_text(config.get("boi_token_index", 255999))
        self.end = token_text(config.get("eoi_token_index", 256000))

    def count(self, picture: Picture) -> int:
        return self.tokens

    def text(self, picture: Picture) -> str:
        return f"\n\n{self.marker}{tag(picture.digest, self.tokens)}{self.end}\n\n"

    def pixels(self, picture: Picture) -> np.ndarray:
        """[3, size, size] float32, as Gemma3ImageProcessor makes them."""
        size = self.tower.size
        resized = np.asarray(Image.fromarray(picture.pixels).resize((size, size), Image.Resampling.BILINEAR), np.float32)
        return ((resized * np.float32(1 / 255) - np.float32(0.5)) / np.float32(0.5)).transpose(2, 0, 1)

    def embed(self, pixels: list[np.ndarray]) -> list[np.ndarray]:
        hidden = self.tower.run(np.stack(pixels))   # [n, patches, D]
        n, _, D = hidden.shape
        side, k = self.tower.size // self.tower.patch, self.pool
        pooled = hidden.reshape(n, side // k, k, side // k, k, D).mean(axis=(2, 4), dtype=np.float32)
        pooled = pooled.reshape(n, self.tokens, D)
        scale = 1 / np.sqrt(np.mean(pooled * pooled, axis=-1, keepdims=True) + np.float32(self.tower.eps))
        return list((pooled * scale * self.norm) @ self.projection)
