"""A model reference opened as it is stored: what the commands that read a model start from."""
from __future__ import annotations

import dataclasses

from nibble.formats.hub import resolve
from nibble.formats.model_dir import ModelDir, read_model_dir


def open_model(ref: str) -> ModelDir:
    """A directory, .safetensors or .gguf file, hub id or alias -> its ModelDir. A GGUF file
    keeps its quantization (see quant.gguf_import), and reads images with the vision projector
    beside it (formats/gguf_mmproj.py) if there is one."""
    path = resolve(ref)
    if path.suffix != ".gguf":
        return read_model_dir(path)
    from nibble.formats.gguf_mmproj import find_mmproj, read_mmproj   # the gguf package: only for a .gguf
    from .gguf_import import import_gguf_model
    model = import_gguf_model(path).model
    mmproj = find_mmproj(path)
    if mmproj is None:
        return model
    config, tensors, preprocessor = read_mmproj(mmproj, model.config, model.tokenizer.token_to_id)
    return dataclasses.replace(model, vision_config=config, vision_tensors=tensors, preprocessor_config=preprocessor)
