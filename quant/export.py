"""A model's tensors for another engine's format: exact where the format holds nibble's values,
else rounded again (and said).

GGUF (formats.gguf_export):
4-bit weights in groups of 32, 64 or 128 with float16 scales and biases are Q4_1 (Q4_0, Q8_0
where the biases are the types' offsets), the very weights (gguf_blocks.as_blocks), and a
K-quant `nibble import` made (Q4_K, Q5_K, Q6_K) its own blocks again (as_k_blocks); with float32
ones (nibble quantize --for vllm), the same with those rounded to float16. Anything else
quantized (8-bit affine weights, whose biases Q8_0 has no room for; the other imports: Q2_K,
Q3_K, Q5_0, Q5_1, the types with a table of levels) is dequantized and rounded again to Q8_0, the
GGUF type of most bits llama.cpp runs fast; float tensors stay as stored.

compressed-tensors (formats.compressed_tensors): a block's linears in asymmetric integers of their
bits and groups, exactly where each bias is -scale times an integer (nibble quantize --for vllm),
else their integers and zero points rounded again under the same scales; the embedding and head
as the float32 values nibble runs.
"""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from nibble.formats import compressed_tensors as ct
from nibble.formats.errors import NibbleError
from nibble.formats import superblocks
from nibble.formats.gguf_blocks import as_blocks, as_k_blocks
from nibble.formats.gguf_export import Tensor
from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import ModelDir
from nibble.formats.packing import pack

from .affine import QuantizedTensor, dequantize, group_values
from .convert import read_linear

_PARTS = ("scales", "biases", "values", "high")   # a quantized module's arrays beside its weight
AGAIN = QType.Q8_0


def gguf_tensors(model: ModelDir) -> tuple[list[Tensor], dict[str, str]]:
    """Every tensor of `model` as GGUF holds it, and for each matrix rounded again what became of
    it (its name -> "int8 g64 -> Q8_0")."""
    tensors, again = [], {}
    quantization = model.config.quantization
    for name, t in model.tensors.items():
        path, kind = name.rsplit(".", 1)
        if kind in _PARTS and f"{path}.weight" in model.tensors:
            continue
        w = read_linear(model.tensors, quantization, path) if kind == "weight" else t
        if isinstance(w, QuantizedTensor):
            was = f"int{w.integer_bits} g{w.group_size}"
            blocks = _blocks(w)
            if blocks is None and (blocks := _blocks(w, exact=False)) is not None:   # its integers kept
                again[name] = f"{was} -> {blocks[0].name} (scales and biases to float16)"
            elif blocks is None:
                blocks = AGAIN, gguf.quants.quantize(dequantize(w), AGAIN)
                again[name] = f"{was} -> {AGAIN.name}"
            tensors.append(Tensor(name, blocks[1], blocks[0]))
        else:
            tensors.append(_float(name, w))
    return tensors, again


def _blocks(w: QuantizedTensor, exact: bool = True) -> tuple[QType, np.ndarray] | None:
    """w as a GGUF type's blocks (gguf_blocks.as_blocks; a K-quant's two levels: as_k_blocks), or None."""
    if w.values is not None or w.weight.ndim != 2:
        return None
    if superblocks.is_two_level(w.scales):
        return as_k_blocks(w.weight, w.scales, w.biases, w.high, w.group_size) if exact else None
    if w.high is not None:
        return None
    return as_blocks(w.weight, group_values(w.scales), group_values(w.biases), w.bits, w.group_size, exact)


def _float(name: str, w) -> Tensor:
    """A float tensor as stored: float32, float16, or bfloat16 (its bytes)."""
    if isinstance(w, HalfTensor):
        return Tensor(name, np.ascontiguousarray(w.bits).view(np.uint8),
                      QType.BF16 if w.bf16 else QType.F16)
    w = np.asarray(w)
    if w.dtype == np.float16:
        return Tensor(name, w, QType.F16)
    return Tensor(name, w.astype(np.float32, copy=False), QType.F32)


def compressed_tensors(model: ModelDir) -> tuple[dict[str, np.ndarray], dict, dict[str, str], dict]:
    """`model`'s tensors in compressed-tensors' pack-quantized layout, its quantization_config,
    what was rounded again (name -> what became of it), and those matrices as nibble holds them
    (weight, scales and biases: -scale times the zero point, float32) to measure them by.

    A block's quantized linears go as they are where each bias is -scale times an integer (nibble
    quantize --for vllm makes them so), else with their integers and zero points rounded again
    under the same scales. The embedding and the head, which vLLM runs in float, go as the float32
    values nibble runs; float tensors as stored."""
    quantization = model.config.quantization or {}
    tensors, again, schemes, ignore, as_run = {}, {}, set(), [], {}
    for name, t in model.tensors.items():
        path, kind = name.rsplit(".", 1)
        if kind in _PARTS and f"{path}.weight" in model.tensors:
            continue
        w = read_linear(model.tensors, quantization, path) if kind == "weight" else t
        if not isinstance(w, QuantizedTensor):
            tensors[name] = w
            if kind == "weight" and np.ndim(w) == 2 and ".layers." in name:
                ignore.append(path)
        elif ".layers." not in name:   # the embedding and the head
            tensors[name] = dequantize(w)
        else:
            weight, scales, zeros = _integer_zeros(w)
            if zeros is None:
                again[name] = f"int{w.integer_bits} g{w.group_size} -> integer zero points"
                weight, zeros = _rounded_again(w, scales)
                s = scales.astype(np.float32)
                as_run |= {name: weight, f"{path}.scales": s, f"{path}.biases": -s * zeros}
            schemes.add((w.bits, w.group_size))
            tensors |= ct.module_tensors(path, weight, scales, zeros, w.bits)
    if len(schemes) > 1:
        raise NibbleError(f"its layers' matrices are quantized in {len(schemes)} ways; compressed-tensors "
                          "is written with one (nibble quantize makes them so)")
    if not schemes:
        raise NibbleError("it has no quantized matrices in its layers: quantize it first (nibble quantize "
                          "--for vllm), or hand vLLM the float model itself")
    (bits, group_size), = schemes
    ignore.append("lm_head")   # vLLM runs the head in float (tied or not)
    return tensors, ct.quantization_config(bits, group_size, ignore), again, as_run


def _integer_zeros(w: QuantizedTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """w's words, its scales (float16 where that holds them, else float32) and its zero points,
    None where its biases are not -scale times an integer (or it has levels, planes or two-level
    scales, which the layout has no room for)."""
    s, b = group_values(w.scales), group_values(w.biases)
    half = s.astype(np.float16)
    scales = half if np.array_equal(half.astype(np.float32), s) else s
    plain = w.values is None and w.high is None
    return w.weight, scales, ct.zero_points(s, b, w.bits) if plain else None


def _rounded_again(w: QuantizedTensor, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w's values as integers and integer zero points under its own scales (w's integers too,
    were its biases integers of them): z = round(-b / s), q = round(w / s) + z, both clipped."""
    top = (1 << w.integer_bits) - 1
    s = group_values(w.scales)
    zeros = np.clip(np.rint(np.divide(-group_values(w.biases), s, out=np.zeros_like(s), where=s != 0)), 0, top)
    values = dequantize(w).reshape(*s.shape, -1)
    q = np.rint(np.divide(values, s[..., None], out=np.zeros_like(values), where=s[..., None] != 0))
    q = np.clip(q + zeros[..., None], 0, min(top, (1 << w.bits) - 1)).astype(np.uint8)
    return pack(q.reshape(len(q), -1), w.bits), zeros.astype(np.uint8)
