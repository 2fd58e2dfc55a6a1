"""LoRA adapters merged into a model's weights, for those who want a model of its own rather than
the base with an adapter beside it: each module an adapter targets becomes float32 W + scale * B @ A
(its quantized or 16-bit weight widened first), every other tensor stays as stored."""
from __future__ import annotations

import dataclasses

import numpy as np

from nibble.formats.errors import FormatError
from nibble.formats.half import HalfTensor
from nibble.formats.lora import LoRA
from nibble.formats.model_dir import ModelDir
from nibble.quant.affine import QuantizedTensor, dequantize
from nibble.quant.convert import read_linear


def merged(model_dir: ModelDir, loras: list[LoRA]) -> ModelDir:
    """`model_dir` with `loras` merged in, in order; FormatError for a module the model does not
    have, or of another shape."""
    loras = [lora.for_model(model_dir.config) for lora in loras]   # a GGUF adapter's q/k rows by the model's heads
    tensors, quantization = dict(model_dir.tensors), model_dir.config.quantization
    modules = {}
    for lora in loras:
        for module in lora.pairs:
            if module not in modules:
                modules[module] = _float(tensors, quantization, module, lora)
            delta = lora.delta(module)
            if delta.shape != modules[module].shape:
                raise FormatError(f"{lora.path}: {module} is {list(modules[module].shape)} in the model, "
                                  f"{list(delta.shape)} in the adapter")
            modules[module] += delta
    for module, w in modules.items():
        for part in ("scales", "biases", "values", "high"):
            tensors.pop(f"{module}.{part}", None)
        tensors[f"{module}.weight"] = w
    config = model_dir.config
    if quantization is not None:   # the merged modules are float now: mlx-lm's per-module false
        config = dataclasses.replace(config, quantization={**quantization, **dict.fromkeys(modules, False)})
    return dataclasses.replace(model_dir, path=None, config=config, tensors=tensors)


def _float(tensors: dict, quantization: dict | None, module: str, lora: LoRA) -> np.ndarray:
    if f"{module}.weight" not in tensors:
        raise FormatError(f"{lora.path}: the adapter changes {module}, which the model does not have "
                          "(an adapter trained on another model?)")
    w = read_linear(tensors, quantization, module)
    w = dequantize(w) if isinstance(w, QuantizedTensor) else w.widen() if isinstance(w, HalfTensor) else w
    return np.array(w, np.float32)   # a copy of its own: the stored one may be a read-only map
