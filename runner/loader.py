"""From a model reference to a runnable model and its tokenizer."""
from nibble.formats import progress
from nibble.formats.errors import NibbleError
from nibble.formats.hub import resolve
from nibble.formats.model_dir import ModelDir, read_model_dir
from nibble.quant.convert import is_quantized, quantize_model
from .model import Model
from .tokenizer import Tokenizer

QUANT_BITS = {"int8": 8, "int4": 4}


def open_model(ref: str) -> ModelDir:
    """A directory, .safetensors or .gguf file, hub id or alias -> its ModelDir. A GGUF file
    keeps its quantization (see quant.gguf_import)."""
    path = resolve(ref)
    if path.suffix != ".gguf":
        return read_model_dir(path)
    from nibble.quant.gguf_import import import_gguf_model   # the gguf package: only for a .gguf
    model = import_gguf_model(path).model
    progress.clear()   # the import's progress line
    return model


def load(ref: str, quant: str | None = None, gpu_layers: int = 0, require_gpu: bool = False,
         ctx_size: int | None = None) -> tuple[Model, Tokenizer]:
    """The model at `ref`; `quant` ("int8" or "int4") quantizes a float model in memory first
    (round to nearest in groups of 64, embedding at 8 bits: `nibble quantize` does better).

    gpu_layers: run the last N layers on the GPU (-1: all; see Model.offload_layers, which plans
    for a KV cache of `ctx_size` positions). The line to show the user (no GPU, or only some layers
    fit) is in model.offload_note; require_gpu raises NoGPU instead of running on the CPU."""
    model_dir = open_model(ref)
    if quant:
        if quant not in QUANT_BITS:
            raise NibbleError(f"unknown quantization {quant!r}: choose int8 or int4")
        if is_quantized(model_dir.config):
            raise NibbleError(f"{ref} is already quantized: drop --quant")
        model_dir = quantize_model(model_dir, QUANT_BITS[quant], 64, embed_bits=8, method="rtn").model
    model, tokenizer = from_model_dir(model_dir)
    model.offload_layers(gpu_layers, ctx_size, require_gpu)
    return model, tokenizer


def from_model_dir(model_dir: ModelDir) -> tuple[Model, Tokenizer]:
    return Model(model_dir.config, model_dir.tensors), Tokenizer(model_dir)
