"""SigLIP's vision tower (Gemma 3's, Idefics3's): an image cut into square patches, each patch a
row (the patch convolution as one matrix product), learned positions added, pre-norm encoder
blocks whose patches all see each other (kernels/encoder.py's vision_layer), a final LayerNorm."""
from __future__ import annotations

import math

import numpy as np

from nibble.formats.errors import FormatError
from ..kernels import compiling, cpu
from ..kernels.encoder import EncoderLayerWeights, vision_layer
from ..kernels.linear import linear, read_only
from ..model import TensorGetter
from ..threads import ThreadChooser
from .base import count_field


class SigLIP:
    """The tower of a `vision_config` (SiglipVisionConfig's fields), its tensors named as
    SiglipVisionModel's without `vision_model.` (embeddings.*, encoder.layers.*, post_layernorm.*)."""

    def __init__(self, config: dict, get: TensorGetter):
        self.width = D = count_field(config, "hidden_size")
        F, self.heads = count_field(config, "intermediate_size"), count_field(config, "num_attention_heads")
        self.patch, self.size, C = count_field(config, "patch_size"), count_field(config, "image_size"), count_field(config, "num_channels", 3)
        self.eps = float(config.get("layer_norm_eps", 1e-6))
        if D % self.heads or self.size % self.patch:
            raise FormatError(f"config.json: vision_config's hidden_size {D} and heads {self.heads}, or its "
                              f"image_size {self.size} and patch_size {self.patch}, do not divide")
        side = self.size // self.patch
        conv = get("embeddings.patch_embedding.weight", (D, C, self.patch, self.patch))
        self.patch_weight = None if conv is None else read_only(np.ascontiguousarray(conv.reshape(D, -1)))
        self.patch_bias = get("embeddings.patch_embedding.bias", (D,))
        self.positions = get("embeddings.position_embedding.weight", (side * side, D))
        self.layers = [read_only(self._layer(get, f"encoder.layers.{i}.", D, F))
                       for i in range(count_field(config, "num_hidden_layers"))]
        self.norm = get("post_layernorm.weight", (D,))
        self.norm_bias = get("post_layernorm.bias", (D,))
        self.threads = ThreadChooser()

    def _layer(self, get, p: str, D: int, F: int) -> EncoderLayerWeights:
        return EncoderLayerWeights(
            wq=get.linear(p + "self_attn.q_proj", (D, D)), wk=get.linear(p + "self_attn.k_proj", (D, D)),
            wv=get.linear(p + "self_attn.v_proj", (D, D)),
            bq=get(p + "self_attn.q_proj.bias", (D,)), bk=get(p + "self_attn.k_proj.bias", (D,)),
            bv=get(p + "self_attn.v_proj.bias", (D,)),
            wo=get.linear(p + "self_attn.out_proj", (D, D)), bo=get(p + "self_attn.out_proj.bias", (D,)),
            attention_norm=get(p + "layer_norm1.weight", (D,)), attention_norm_bias=get(p + "layer_norm1.bias", (D,)),
            attention_scale=np.float32(1 / math.sqrt(D // self.heads)),
            w_in=get.linear(p + "mlp.fc1", (F, D)), b_in=get(p + "mlp.fc1.bias", (F,)),
            w_out=get.linear(p + "mlp.fc2", (D, F)), b_out=get(p + "mlp.fc2.bias", (D,)),
            out_norm=get(p + "layer_norm2.weight", (D,)), out_norm_bias=get(p + "layer_norm2.bias", (D,)))

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for layer in self.layers for w in layer if not isinstance(w, np.float32)) + \
            self.patch_weight.nbytes + self.positions.nbytes

    def run(self, pixels: np.ndarray) -> np.ndarray:
        """Images' pixels [n, C, size, size] (float32, as the processor makes them) -> the tower's
        last hidden states [n, patches, D], all the images in one pass."""
        n, C, H, W = pixels.shape
        p, side = self.patch, self.size // self.patch
        if H != self.size or W != self.size:
            raise ValueError(f"the tower takes {self.size} x {self.size} pixels, not {H} x {W}")
        patches = (pixels.reshape(n, C, side, p, side, p).transpose(0, 2, 4, 1, 3, 5)
                   .reshape(n * side * side, C * p * p).astype(np.float32))
        starts = np.arange(n + 1, dtype=np.int64) * side * side   # each image's patches
        no_rope = np.zeros((0, 0), np.float32)
        with self.threads.pass_of(len(patches)):
            x = np.empty((len(patches), self.width), np.float32)
            linear(patches, self.patch_weight, x, False)
            x += self.patch_bias
            x += np.tile(self.positions, (n, 1))
            for layer in self.layers:
                vision_layer(x, layer, starts, self.heads, np.float32(self.eps), no_rope, no_rope)
            cpu.layernorm(x, self.norm, self.norm_bias, np.float32(self.eps), x)
        compiling.finish()
        return x.reshape(n, side * side, self.width)


def tower_of(config: dict, tensors: dict, quantization: dict | None) -> SigLIP:
    """The SigLIP tower of a wrapper's config.json and its vision tensors (vision_tower.*)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise FormatError(f"config.json: a {config.get('model_type')} checkpoint needs its vision_config")
    get = TensorGetter({k.removeprefix("vision_tower."): t for k, t in tensors.items()}, quantization)
    tower = SigLIP(vision, get)
    get.raise_if_missing()
    return tower

