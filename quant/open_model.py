"""A model reference opened as it is stored: what the commands that read a model start from."""
from __future__ import annotations

from nibble.formats.hub import resolve
from nibble.formats.model_dir import ModelDir, read_model_dir


def open_model(ref: str) -> ModelDir:
    """A directory, .safetensors or .gguf file, hub id or alias -> its ModelDir. A GGUF file
    keeps its quantization (see quant.gguf_import)."""
    path = resolve(ref)
    if path.suffix != ".gguf":
        return read_model_dir(path)
    from .gguf_import import import_gguf_model   # the gguf package: only for a .gguf
    return import_gguf_model(path).model
