"""Qwen2.5-VL's vision (Qwen2_5_VLForConditionalGeneration): an image resized to whole merged
patches (smart_resize: each side a multiple of patch_size x spatial_merge_size, its pixels
between the processor's bounds, PIL's bicubic), scaled by CLIP's mean and std, cut into patches
(each twice: a still image is two frames of a video), merge x merge patches after one another;
a tower of RMSNorm blocks whose patches turn by 2D RoPE over their row and column and attend in
windows of window_size pixels, but over the whole image in fullatt_block_indexes' blocks; the
patch merger (an RMSNorm, merge x merge patches one row, a GELU MLP) into the text model's width.

In the prompt an image is `<|image_pad|>` made one a merged patch, between the template's
<|vision_start|> and <|vision_end|>. The decoder is Qwen2's, with multimodal RoPE: each rotated
pair turns by the position of one of three axes (mrope_section: time, rows, columns). A text
token's three are its place in the sequence less what the images before it saved; an image's
tokens all share the time of the image's start and add their row and column to it, and the
image moves the text after it on by its longer side, not by its tokens.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from PIL import Image

from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.image import Picture
from ..kernels import compiling, cpu
from ..kernels.encoder import EncoderLayerWeights, vision_layer
from ..kernels.linear import Weight, linear, read_only, row_block
from ..kv.cache import Rows
from ..model import TensorGetter
from ..text.image_ids import key_of, split_ids
from ..threads import ThreadChooser
from .base import Vision, count_field

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
EPS = np.float32(1e-6)   # the tower's RMSNorms' (fixed in transformers' code)
GRIDS = 1 << 16   # images whose grids are remembered, for the RoPE of the text after them
# An image's tokens at most, as ollama bounds them (transformers lets Qwen2.5-VL's processor make
# 16384, llama.cpp 4096): a photo in a few hundred, within the default context, its tower in
# seconds on a CPU rather than minutes. A larger image is resized down, as smart_resize does.
MAX_TOKENS = 1280


class Qwen25VLVision(Vision):
    interleaved = False   # whether the decoder's rotated pairs take the three axes in turn (Qwen3-VL's)
    windowed = True       # whether blocks outside fullatt_block_indexes attend in windows
    def __init__(self, config: dict, tensors: dict, quantization: dict | None, token_text, preprocessor: dict):
        super().__init__()
        v = config.get("vision_config")
        if not isinstance(v, dict):
            raise FormatError("config.json: a qwen2_5_vl checkpoint needs its vision_config")
        self.width = D = count_field(v, "hidden_size")
        self.heads, F = count_field(v, "num_heads"), count_field(v, "intermediate_size")
        self.patch, self.merge = count_field(v, "patch_size", 14), count_field(v, "spatial_merge_size", 2)
        self.frames, C = count_field(v, "temporal_patch_size", 2), count_field(v, "in_channels", 3)
        # merged patches a window's side; 0: none, every block over whole images
        self.window = count_field(v, "window_size", 112) // (self.patch * self.merge) if self.windowed else 0
        hd = D // self.heads
        if D % self.heads or hd % 4 or (self.windowed and not self.window):
            raise FormatError(f"config.json: vision_config's hidden_size {D} over {self.heads} heads must be "
                              f"heads of a multiple of 4, and window_size at least one merged patch")
        self.full = set(v.get("fullatt_block_indexes", (7, 15, 23, 31))) if self.windowed else set()
        theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.inv_freq = 1.0 / theta ** (np.arange(0, hd // 2, 2, dtype=np.float64) / (hd // 2))   # [hd / 4]
        text = config.get("text_config") or config
        self.hidden = count_field(text, "hidden_size")
        self.axes = _axes(text, text.get("head_dim") or self.hidden // count_field(text, "num_attention_heads"),
                          self.interleaved)
        get = TensorGetter({k.removeprefix("vision_tower."): t for k, t in tensors.items()}, quantization)
        K = C * self.frames * self.patch ** 2
        conv = get("patch_embed.proj.weight", (D, C, self.frames, self.patch, self.patch))
        self.patch_weight = None if conv is None else read_only(np.ascontiguousarray(conv.reshape(D, K)))
        self.patch_bias = self._patch_bias(get, D)
        self.depth = count_field(v, "depth")
        self.layers = [read_only(self._layer(get, f"blocks.{i}.", D, F)) for i in range(self.depth)]
        self.merger = self._merger(get, v)
        # the blocks whose output is merged apart and added to the first decoder layers' image
        # rows (Qwen3-VL's deepstack), with their mergers
        self.deep_blocks, self.deep_mergers = self._deepstack(get, v)
        get.raise_if_missing()
        self._threads = ThreadChooser()
        self.marker = token_text(config.get("image_token_id", 151655))
        p = preprocessor
        size = p.get("size") or {}
        self.min_pixels = p.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        f = self.patch * self.merge
        self.max_pixels = min(p.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280, MAX_TOKENS * f * f)
        self.resample = Image.Resampling(p.get("resample", Image.Resampling.BICUBIC))
        self.rescale = np.float32(p.get("rescale_factor", 1 / 255))
        self.mean = np.float32(p.get("image_mean", CLIP_MEAN)).reshape(3, 1, 1)
        self.std = np.float32(p.get("image_std", CLIP_STD)).reshape(3, 1, 1)
        self._grids: OrderedDict[int, tuple[int, int]] = OrderedDict()

    @property
    def threads(self) -> ThreadChooser:
        return self._threads

    def _patch_bias(self, get, D: int) -> np.ndarray | None:
        return None

    def _merger(self, get, v: dict) -> Merger:
        D, m2 = self.width, self.merge ** 2
        return Merger(get("merger.ln_q.weight", (D,)), None, get.linear("merger.mlp.0", (D * m2, D * m2)),
                      get("merger.mlp.0.bias", (D * m2,)), get.linear("merger.mlp.2", (self.hidden, D * m2)),
                      get("merger.mlp.2.bias", (self.hidden,)))

    def _deepstack(self, get, v: dict) -> tuple[list[int], list[Merger]]:
        return [], []

    def _layer(self, get, p: str, D: int, F: int) -> EncoderLayerWeights:
        none = np.zeros(0, np.float32)   # RMSNorms: no biases
        return EncoderLayerWeights(
            **self._attention(get, p, D), attention_norm_bias=none, out_norm_bias=none,
            w_in=get.linear(p + "mlp.up_proj", (F, D)), b_in=get(p + "mlp.up_proj.bias", (F,)),
            w_gate=get.linear(p + "mlp.gate_proj", (F, D)), b_gate=get(p + "mlp.gate_proj.bias", (F,)),
            w_out=get.linear(p + "mlp.down_proj", (D, F)), b_out=get(p + "mlp.down_proj.bias", (D,)))

    def _attention(self, get, p: str, D: int) -> dict:
        """A block's attention and its norms' weights: q, k and v as views of the rows of its
        one qkv matrix."""
        qkv, bias = get.linear(p + "attn.qkv", (3 * D, D)), get(p + "attn.qkv.bias", (3 * D,))
        wq, wk, wv = (None if qkv is None else row_block(qkv, i * D, (i + 1) * D) for i in range(3))
        bq, bk, bv = (None if bias is None else bias[i * D:(i + 1) * D] for i in range(3))
        return dict(wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv,
                    wo=get.linear(p + "attn.proj", (D, D)), bo=get(p + "attn.proj.bias", (D,)),
                    attention_scale=np.float32(1 / math.sqrt(D // self.heads)),
                    attention_norm=get(p + "norm1.weight", (D,)), out_norm=get(p + "norm2.weight", (D,)))

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for layer in self.layers for w in layer if not isinstance(w, np.float32)) + \
            self.patch_weight.nbytes

    def _size(self, picture: Picture) -> tuple[int, int]:
        """(height, width) the processor resizes the image to (Qwen2VLImageProcessor's smart_resize)."""
        height, width = picture.pixels.shape[:2]
        if max(height, width) / min(height, width) > 200:
            raise NibbleError(f"{picture.name}: {width} x {height} pixels is too long and thin for this model "
                              f"(its sides may differ 200 times at most)")
        f = self.patch * self.merge
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def grid(self, picture: Picture) -> tuple[int, int]:
        """Its merged patches: (rows, columns)."""
        h, w = self._size(picture)
        f = self.patch * self.merge
        return h // f, w // f

    def count(self, picture: Picture) -> int:
        rows, cols = self.grid(picture)
        key = key_of(picture.digest)
        self._grids[key] = rows, cols
        self._grids.move_to_end(key)
        while len(self._grids) > GRIDS:
            self._grids.popitem(last=False)
        return rows * cols

    def pixels(self, picture: Picture) -> np.ndarray:
        """[rows, columns, merge^2, C x frames x patch^2] float32: each merged patch's patches
        (transformers' pixel_values, [patches, C x frames x patch^2], in that order)."""
        h, w = self._size(picture)
        image = np.asarray(Image.fromarray(picture.pixels).resize((w, h), self.resample), np.float32)
        x = (image.transpose(2, 0, 1) * self.rescale - self.mean) / self.std   # [C, h, w]
        p, m, C = self.patch, self.merge, x.shape[0]
        x = x.reshape(C, h // (p * m), m, p, w // (p * m), m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], self.frames, p, p))
        return np.ascontiguousarray(x.reshape(h // (p * m), w // (p * m), m * m, -1))

    def embed(self, pixels: list[np.ndarray]) -> list[np.ndarray]:
        """Each image's rows [tokens, hidden] (with deepstack, [tokens, hidden x (1 + its blocks)]:
        the merger's, then each deepstack merger's)."""
        m2 = self.merge ** 2
        units, windows, images, angles = [], [0], [0], []   # the merged patches in window order
        first = 0
        for grid in pixels:
            rows, cols = grid.shape[:2]
            index = first + np.arange(rows * cols).reshape(rows, cols)
            w = self.window or max(rows, cols)   # none: the whole image
            for r in range(0, rows, w):
                for c in range(0, cols, w):
                    units.append(index[r:r + w, c:c + w].ravel())
                    windows.append(windows[-1] + units[-1].size * m2)
            first += rows * cols
            images.append(images[-1] + rows * cols * m2)
            row, col = _places(rows, cols, self.merge)
            angles.append(np.concatenate([np.outer(row, self.inv_freq), np.outer(col, self.inv_freq)], 1))
        order = np.concatenate(units)
        patches = (order[:, None] * m2 + np.arange(m2)).ravel()   # the patches in window order
        angle = np.concatenate(angles)[patches]
        cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
        windows, images = np.array(windows, np.int64), np.array(images, np.int64)
        flat = np.ascontiguousarray(np.concatenate([g.reshape(-1, g.shape[-1]) for g in pixels]), np.float32)
        with self.threads.pass_of(len(flat)):
            x = np.empty((len(flat), self.width), np.float32)
            linear(flat, self.patch_weight, x, False)
            if self.patch_bias is not None:
                x += self.patch_bias
            self._add_positions(x, pixels)
            x = x[patches]
            deep = []
            for i, layer in enumerate(self.layers):
                vision_layer(x, layer, images if i in self.full else windows, self.heads, EPS, cos, sin)
                if i in self.deep_blocks:
                    deep.append(self._merged(x, self.deep_mergers[self.deep_blocks.index(i)]))
            out = np.concatenate([self._merged(x, self.merger), *deep], axis=1)
        compiling.finish()
        tokens = np.empty_like(out)
        tokens[order] = out   # back in each image's order
        return np.split(tokens, np.cumsum([g.shape[0] * g.shape[1] for g in pixels])[:-1])

    def _add_positions(self, x: np.ndarray, pixels: list[np.ndarray]):
        """Learned positions of the patches (none here: RoPE alone places them)."""

    def _merged(self, x: np.ndarray, m: Merger) -> np.ndarray:
        """A merger's rows [patches / merge^2, hidden]: merge^2 patches one row, normed before or
        after (m.after), then a GELU MLP."""
        wide = self.width * self.merge ** 2
        h = np.empty_like(x)
        if m.after:   # normed in merged rows
            _normed(x.reshape(-1, wide), m.norm, m.norm_bias, h.reshape(-1, wide))
        else:
            _normed(x, m.norm, m.norm_bias, h)
        h = h.reshape(-1, wide)
        mid = np.empty_like(h)
        linear(h, m.w_in, mid, False)
        cpu.gelu(mid, m.b_in, False)
        out = np.empty((len(mid), self.hidden), np.float32)
        linear(mid, m.w_out, out, False)
        out += m.b_out
        return out

    def deep(self, tokens: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """What the first decoder layers add to a pass's image rows: for each of them (indexes
        of those rows, the rows to add)."""
        image = np.flatnonzero(tokens < 0)
        if not self.deep_blocks or not len(image):
            return []
        held, D = self.rows(tokens[image]), self.hidden
        return [(image, np.ascontiguousarray(held[:, (i + 1) * D:(i + 2) * D])) for i in range(len(self.deep_blocks))]

    def placed(self, tokens: np.ndarray, rows: Rows, ids: Sequence[Sequence[int]] | None) -> Rows:
        """Rows.turns: each rotated pair of each row turned by its axis' position (_positions);
        as they were (each row by its position) where no sequence of the pass holds an image."""
        seqs = []
        for s in np.unique(rows.seq):
            mine = np.flatnonzero(rows.seq == s)
            first = int(rows.positions[mine].min())
            seq = np.zeros(int(rows.positions[mine].max()) + 1, np.int64)
            if ids is not None:
                seq[:first] = ids[s][:first]
            seq[rows.positions[mine]] = tokens[mine]
            seqs.append((mine, seq))
        if all(seq.min() >= 0 for _, seq in seqs):
            return rows
        turns = np.empty((len(tokens), len(self.axes)), np.int64)
        for mine, seq in seqs:
            turns[mine] = self._positions(seq)[:, rows.positions[mine]].T[:, self.axes]
        return rows._replace(turns=turns)

    def _positions(self, seq: np.ndarray) -> np.ndarray:
        """[3, len(seq)]: the time, row and column positions of a sequence's tokens, as
        transformers' get_rope_index makes them for an image's tokens."""
        n = len(seq)
        where = np.empty((3, n), np.int64)
        image = np.flatnonzero(seq < 0)
        keys, index = split_ids(seq[image])
        done, shift = 0, 0   # shift: what the images so far saved
        for start, key in zip(image[index == 0], keys[index == 0]):
            where[:, done:start] = np.arange(done, start) + shift
            rows, cols = self._grid_of(int(key))
            k = np.arange(min(rows * cols, n - start))
            at = start + shift
            where[0, start:start + len(k)] = at
            where[1, start:start + len(k)] = at + k // cols
            where[2, start:start + len(k)] = at + k % cols
            shift += max(rows, cols) - rows * cols
            done = start + len(k)
        where[:, done:] = np.arange(done, n) + shift
        return where

    def _grid_of(self, key: int) -> tuple[int, int]:
        grid = self._grids.get(key)
        if grid is None:
            raise NibbleError("an image of this conversation is no longer known: send it again")
        return grid


class Merger(NamedTuple):
    """A patch merger's weights: its norm (an RMSNorm without a bias, else a LayerNorm; over each
    patch, or with `after`, over merge^2 patches' row) and its MLP."""
    norm: np.ndarray
    norm_bias: np.ndarray | None
    w_in: Weight
    b_in: np.ndarray
    w_out: Weight
    b_out: np.ndarray
    after: bool = False


def _normed(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out: np.ndarray):
    if bias is None:
        cpu.rmsnorm(x, weight, EPS, out)
    else:
        cpu.layernorm(x, weight, bias, EPS, out)


def _places(rows: int, cols: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The row and column of each patch of an image of rows x cols merged patches, in the
    processor's order (merge block after merge block, each block's patches by rows)."""
    r = np.arange(rows)[:, None, None, None] * m + np.arange(m)[None, None, :, None]
    c = np.arange(cols)[None, :, None, None] * m + np.arange(m)[None, None, None, :]
    shape = (rows, cols, m, m)
    return np.broadcast_to(r, shape).ravel(), np.broadcast_to(c, shape).ravel()


def _axes(text: dict, head_dim: int, interleaved: bool) -> np.ndarray:
    """The axis (0 time, 1 rows, 2 columns) each rotated pair of a head turns by: mrope_section's
    pairs of each, one section after another, or `interleaved`, rows and columns in turn among the
    first pairs (time, rows, columns, time, ...) and time for the rest."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if (not isinstance(section, list) or len(section) != 3 or not all(isinstance(n, int) and n >= 0 for n in section)
            or sum(section) != head_dim // 2):
        raise FormatError(f"config.json: rope_parameters.mrope_section must be three counts of the {head_dim // 2} "
                          f"rotated pairs of a head, not {section!r}")
    if not interleaved:
        return np.repeat(np.arange(3), section)
    axes = np.zeros(head_dim // 2, np.int64)
    for axis in (1, 2):
        axes[axis:3 * section[axis]:3] = axis
    return axes
