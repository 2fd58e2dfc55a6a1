"""One module per model family, in the style of mlx-lm's models/: each says how a checkpoint's
tensors become its blocks' weights, which kernel runs a block, and each layer's RoPE tables.
runner/model.py runs any of them. Which model_type belongs to which family is formats/config.py's
ARCHITECTURES; a family module has:

    layer(get, config, i) -> the weights of block i (a NamedTuple the block kernel takes), read
        with get(name, shape) for vectors and get.linear(path, shape) for matrices
    block(x, weights, kv, rows, cos, sin, eps, window, act_sq): the jitted kernel of one block
    ropes(config, ctx) -> [(cos, sin)] for each layer, [ctx, rotated dims / 2] each
    norm(get, name, shape) -> an RMSNorm's weight as the kernels multiply by it (the final norm's too)
    embed_scale(config, embed) -> the factor on the embedded rows (embed: the embedding as loaded)
    INPUTS: the weight names (after model.layers.<i>.) whose input each of the block's four act_sq
        rows collects: the q/k/v, o, gate/up and down projections (runner/calibrate.py)
"""
import importlib
from types import ModuleType

from nibble.formats.config import ARCHITECTURES, ModelConfig


def family(config: ModelConfig) -> ModuleType:
    """The family module of `config`'s model_type, imported on first use: each defines its
    block's kernels, which a model of another family does not need."""
    return importlib.import_module(f".{ARCHITECTURES[config.model_type]}", __name__)
