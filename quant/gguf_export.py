"""A model's tensors as GGUF types, for formats.gguf_export: exact where a type holds nibble's
values, else rounded again.

4-bit weights in groups of 32, 64 or 128 with float16 scales and biases are Q4_1 (Q4_0, Q8_0
where the biases are the types' offsets), the very weights (gguf_blocks.as_blocks). Anything else
quantized (8-bit affine weights, whose biases Q8_0 has no room for; other groups; levels, high
planes or two-level scales) is dequantized and rounded again to Q8_0, the GGUF type of most bits
llama.cpp runs fast; float tensors stay as stored.
"""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from nibble.formats.gguf_blocks import as_blocks
from nibble.formats.gguf_export import Tensor
from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import ModelDir

from .affine import QuantizedTensor, dequantize, group_values
from .convert import read_linear

_PARTS = ("scales", "biases", "values", "high")   # a quantized module's arrays beside its weight
AGAIN = QType.Q8_0


def gguf_tensors(model: ModelDir) -> tuple[list[Tensor], dict[str, str]]:
    """Every tensor of `model` as GGUF holds it, and for each matrix rounded again what it was
    (its name -> "int8 g64")."""
    tensors, again = [], {}
    quantization = model.config.quantization
    for name, t in model.tensors.items():
        path, kind = name.rsplit(".", 1)
        if kind in _PARTS and f"{path}.weight" in model.tensors:
            continue
        w = read_linear(model.tensors, quantization, path) if kind == "weight" else t
        if isinstance(w, QuantizedTensor):
            exact = _exact(w)
            if exact is None:
                again[name] = f"int{w.integer_bits} g{w.group_size}"
                exact = AGAIN, gguf.quants.quantize(dequantize(w), AGAIN)
            tensors.append(Tensor(name, exact[1], exact[0]))
        else:
            tensors.append(_float(name, w))
    return tensors, again


def _exact(w: QuantizedTensor) -> tuple[QType, np.ndarray] | None:
    if w.values is not None or w.high is not None:
        return None
    return as_blocks(w.weight, group_values(w.scales), group_values(w.biases), w.bits, w.group_size)


def _float(name: str, w) -> Tensor:
    """A float tensor as stored: float32, float16, or bfloat16 (its bytes)."""
    if isinstance(w, HalfTensor):
        return Tensor(name, np.ascontiguousarray(w.bits).view(np.uint8),
                      QType.BF16 if w.bf16 else QType.F16)
    w = np.asarray(w)
    if w.dtype == np.float16:
        return Tensor(name, w, QType.F16)
    return Tensor(name, w.astype(np.float32, copy=False), QType.F32)
