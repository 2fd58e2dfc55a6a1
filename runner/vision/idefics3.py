"""Idefics3's vision (SmolVLM-256M/500M-Instruct's; SmolVLM's, model_type smolvlm): an image's
longest edge resized to the processor's `size` (up or down, PIL's Lanczos), then to whole tiles
of the tower's square, cut into those tiles, the whole image resized to one tile after them; each
tile through SigLIP, its patches pixel-shuffled (`scale_factor` x `scale_factor` patches a row)
and projected into the text model's width. In the prompt, Idefics3Processor's layout: each tile
`<fake_token_around_image><row_R_col_C>` and its tokens, a line a row of tiles, then
`<fake_token_around_image><global-img>`, the whole image's tokens, `<fake_token_around_image>`.
Its decoder (Llama) attends causally."""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from nibble.formats.errors import FormatError
from nibble.formats.image import Picture
from ..kernels.linear import linear, read_only
from ..model import TensorGetter
from ..text.image_ids import tag
from .base import Vision
from .siglip import tower_of

FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"
MAX_SIDE = 4096   # the processor's bound on the resized image


class Idefics3Vision(Vision):
    parts = True   # SmolVLM's template reads message['content'][0]['type']

    def __init__(self, config: dict, tensors: dict, quantization: dict | None, token_text, preprocessor: dict):
        super().__init__()
        self.tower = tower_of(config, tensors, quantization)
        get = TensorGetter(tensors, quantization)
        self.scale = config.get("scale_factor", 2)
        side = self.tower.size // self.tower.patch
        if not isinstance(self.scale, int) or self.scale < 1 or side % self.scale:
            raise FormatError(f"config.json: scale_factor {self.scale!r} does not divide the tower's {side} patches a side")
        self.tokens = (side // self.scale) ** 2   # a tile's
        width = self.tower.width * self.scale ** 2
        hidden = config.get("text_config", {}).get("hidden_size")
        self.projection = read_only(get.linear("connector.modality_projection.proj", (hidden, width)))
        get.raise_if_missing()
        self.hidden = hidden
        self.marker = token_text(config.get("image_token_id", 128257))
        p = preprocessor
        self.tile = (p.get("max_image_size") or {}).get("longest_edge", self.tower.size)
        self.longest = (p.get("size") or {}).get("longest_edge", 4 * self.tile)
        if self.tile != self.tower.size or not p.get("do_image_splitting", True):
            raise FormatError(f"preprocessor_config.json: nibble cuts images into tiles of the tower's "
                              f"{self.tower.size} pixels (max_image_size {self.tile}, do_image_splitting "
                              f"{p.get('do_image_splitting', True)})")
        self.resample = Image.Resampling(p.get("resample", Image.Resampling.LANCZOS))
        self.rescale = np.float32(p.get("rescale_factor", 1 / 255))
        self.mean = np.float32(p.get("image_mean", [0.5] * 3)).reshape(3, 1, 1)
        self.std = np.float32(p.get("image_std", [0.5] * 3)).reshape(3, 1, 1)

    def _sizes(self, picture: Picture) -> tuple[tuple[int, int], tuple[int, int]]:
        """(height, width) after the longest edge is resized, then after it is made whole tiles."""
        height, width = picture.pixels.shape[:2]
        aspect = width / height
        if width >= height:   # Idefics3ImageProcessor's rounding, step by step
            width, height = self.longest, int(self.longest / aspect)
            height += height % 2
        else:
            height, width = self.longest, int(self.longest * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        aspect = width / height
        if width >= height and width > MAX_SIDE:
            width, height = MAX_SIDE, max(int(MAX_SIDE / aspect), 1)
        elif height > width and height > MAX_SIDE:
            height, width = MAX_SIDE, max(int(MAX_SIDE * aspect), 1)
        t, aspect = self.tile, width / height
        if width >= height:
            tiled_w = math.ceil(width / t) * t
            tiled_h = math.ceil(int(tiled_w / aspect) / t) * t
        else:
            tiled_h = math.ceil(height / t) * t
            tiled_w = math.ceil(int(tiled_h * aspect) / t) * t
        return (height, width), (tiled_h, tiled_w)

    def _grid(self, picture: Picture) -> tuple[int, int]:
        """Rows and columns of tiles (0, 0: the image is one tile, with no global one)."""
        _, (h, w) = self._sizes(picture)
        return (h // self.tile, w // self.tile) if h > self.tile or w > self.tile else (0, 0)

    def count(self, picture: Picture) -> int:
        rows, cols = self._grid(picture)
        return (rows * cols + 1) * self.tokens

    def text(self, picture: Picture) -> str:
        rows, cols = self._grid(picture)
        T, d = self.tokens, picture.digest
        out = ""
        for r in range(rows):
            for c in range(cols):
                out += f"{FAKE}<row_{r + 1}_col_{c + 1}>{tag(d, T, (r * cols + c) * T)}"
            out += "\n"
        return out + ("\n" if rows else "") + f"{FAKE}{GLOBAL}{tag(d, T, rows * cols * T)}{FAKE}"

    def pixels(self, picture: Picture) -> np.ndarray:
        """[tiles, 3, tile, tile] float32: the tiles by rows, then the whole image."""
        (h, w), (th, tw) = self._sizes(picture)
        image = Image.fromarray(picture.pixels).resize((w, h), self.resample)
        image = image.resize((tw, th), self.resample)
        t = self.tile
        if th > t or tw > t:
            tiles = [image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(th // t) for c in range(tw // t)]
            tiles.append(image.resize((t, t), self.resample))
        else:
            tiles = [image]
        frames = np.stack([np.asarray(tile, np.float32).transpose(2, 0, 1) for tile in tiles])
        return (frames * self.rescale - self.mean) / self.std

    def embed(self, pixels: list[np.ndarray]) -> list[np.ndarray]:
        hidden = self.tower.run(np.concatenate(pixels))   # [frames, patches, D]
        n, N, D = hidden.shape
        side, r = int(math.isqrt(N)), self.scale
        # Idefics3Connector.pixel_shuffle: each r x r square of patches one row, D r^2 wide
        x = hidden.reshape(n, side, side // r, D * r).transpose(0, 2, 1, 3)
        x = x.reshape(n, side // r, side // r, D * r * r).transpose(0, 2, 1, 3)
        x = np.ascontiguousarray(x.reshape(n * self.tokens, D * r * r))
        out = np.empty((len(x), self.hidden), np.float32)
        linear(x, self.projection, out, False)
        return np.split(out, np.cumsum([len(p) * self.tokens for p in pixels])[:-1])
