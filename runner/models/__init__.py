"""One module per model family, in the style of mlx-lm's models/: each is the one home of its
family. It describes itself to the file readers in a `formats.families.Family` (FAMILY: its model
types and their config defaults and rules, its GGUF names), which importing this package adds to
their table, and says how its checkpoints' tensors become its blocks' weights. runner/model.py
runs any of them. A family module has:

    FAMILY: its formats.families.Family, named after the module
    layer(get, config, i) -> the weights of block i (a NamedTuple the block kernel takes), read
        with get(name, shape) for vectors and get.linear(path, shape) for matrices
    block() -> the jitted kernel of one block, (x, weights, kv, rows, cos, sin, eps, window,
        act_sq) (numba imported there, when a model is built: reading a config does not need it)
    ropes(config, ctx) -> [(cos, sin)] for each layer, [ctx, rotated dims / 2] each
    norm(get, name, shape) -> an RMSNorm's weight as the kernels multiply by it (the final norm's too)
    embed_scale(config, embed) -> the factor on the embedded rows (embed: the embedding as loaded)
    logits_scale(config) -> the factor on the logits (made part of the final norm's weight)
    block_shapes(config, i) -> block i's tensors by Hugging Face name and shape (llama's and
        qwen3_moe's: the random models of runner/measure/synthetic.py)
    act_shape(config, i) -> the shape of block i's act_sq, the sums of its projections' squared
        inputs that the block kernel adds to when calibrating (runner/convert/calibrate.py)
    importances(config, i, act_sq, tokens) -> block i's entries of the importance matrix, by the
        weight names quantize writes
    stacks(config, tensors) -> {weight name: quant.convert.ExpertStack}: a mixture's experts,
        which quantize writes stacked (none for the dense families)

An encoder's module (FAMILY.encoder: runner/embedding/encoder.py runs it) has Embeddings(get, config), its
words', positions' and token types' rows and their norm, in place of norm, embed_scale and
logits_scale. switch_layers.py is no family: the machinery every mixture of experts shares (mlx-lm's
switch_layers.py); FAMILIES names the families.
"""
import importlib
from types import ModuleType

from nibble.formats import families
from nibble.formats.config import ModelConfig

# the family modules; switch_layers.py, the machinery the mixtures share, is none
FAMILIES = ("bert", "gemma3", "gpt_oss", "granitemoe", "llama", "mixtral", "olmoe", "phi3", "qwen3_moe")
for _name in FAMILIES:
    families.add(importlib.import_module(f".{_name}", __name__).FAMILY)


def family(config: ModelConfig) -> ModuleType:
    """The family module that runs `config`'s model_type."""
    return importlib.import_module(f".{families.of(config.model_type).name}", __name__)
