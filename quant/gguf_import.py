"""A GGUF file made ready to run: the exact repacks of formats/gguf.py, the rest quantized here.

formats/ repacks the block types MLX's layout holds as they are (a K-quant's scales in their two
levels, the Q5 types' and Q6_K's high bits in planes, IQ4_NL's, IQ4_XS's and MXFP4's values
through a table of levels); a matrix in any other quantized type (Q2_K, Q3_K, the IQ types of 1
to 3 bits, ...) arrives dequantized to float32 and is quantized again to 8 bits in groups of 32
by rounding to nearest: at least as many bits as any of those types had, so the error it adds
is small next to theirs (a mixture of experts' stacked experts too, each expert's matrix alike).
F32, F16 and BF16 tensors stay as the file holds them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from nibble.formats.errors import NibbleError
from nibble.formats.gguf import FLOAT_TYPES, import_gguf
from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import ModelDir

from .affine import AffineScheme
from .convert import count_params, quantize_linears, read_linear

REQUANTIZE = AffineScheme(8, 32)


@dataclass(frozen=True)
class TypeOutcome:
    """What the tensors of one GGUF type became."""
    gguf_type: str   # "Q4_1"
    became: str      # "int4 g32 (exact)", "int5 g32 (exact)" (with a high plane), "int6 g16
                     # (exact)" (Q6_K's two planes and sub-blocks of 16), "int4 g32
                     # levels (exact)" (through a table of levels), "int8 g32 (requantized)",
                     # "float16", "float32 (dequantized)"
    tensors: int
    bits_before: float   # bits per weight in the file
    bits_after: float    # and as imported: integers, scales and biases

    def __str__(self) -> str:
        plural = "s" * (self.tensors != 1)
        return (f"{self.gguf_type}: {self.tensors} tensor{plural} -> {self.became}, "
                f"{self.bits_after:.2f} bits per weight (the file's {self.bits_before:.2f})")


@dataclass
class ImportReport:
    """A GGUF import: the model, and what became of each tensor type."""
    model: ModelDir
    outcomes: list[TypeOutcome]   # in the order the file first has each type
    kept_float: dict[str, str]    # weight name of a matrix left in float though it was to be
                                  # quantized -> why
    params: int                   # weights in the model

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.model.tensors.values())

    @property
    def bits_per_weight(self) -> float:
        """Of the whole model, norms included, as QuantizeReport counts them."""
        return self.nbytes * 8 / self.params


def import_gguf_model(path: str | Path, keep_float: bool = False) -> ImportReport:
    """Read a GGUF file into a ModelDir that keeps its quantization: repacked exactly where
    formats/ can, else requantized to REQUANTIZE. keep_float: every quantized type dequantized
    to float32 instead. Raises FormatError (see import_gguf)."""
    imported = import_gguf(path, repack_blocks=not keep_float)
    model, kept_float, requantized = imported.model, {}, set()
    if imported.dequantized and not keep_float:
        try:
            model, kept_float = _requantized(model, imported.dequantized)
        except NibbleError as e:   # weights too large to requantize: the file's, by name
            raise type(e)(f"{path}: {e}") from None
        requantized = {p for p in imported.dequantized if f"{p}.weight" not in kept_float}
    tally = {}   # (type, became) -> [tensors, weights, bytes in the file, bytes as imported]
    for name, qtype in imported.types.items():
        weights, nbytes = _size(model, name)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        counts = tally.setdefault((qtype.name, _became(model, name, qtype, requantized)), [0, 0, 0, 0])
        for i, n in enumerate((1, weights, weights * type_size // block_size, nbytes)):
            counts[i] += n
    outcomes = [TypeOutcome(t, became, n, 8 * before / weights, 8 * after / weights)
                for (t, became), (n, weights, before, after) in tally.items()]
    return ImportReport(model, outcomes, kept_float, count_params(model.tensors, model.config.quantization))


def _requantized(model: ModelDir, paths: list[str]) -> tuple[ModelDir, dict[str, str]]:
    """quantize_linears' model and kept_float for the matrices at `paths`, REQUANTIZE'd. Stacked
    experts [E, N, K] are quantized as the matrix [E*N, K] of their rows (a group never spans two
    rows, so each expert's matrix comes out as it would alone) and stacked back."""
    weights = {p: model.tensors[f"{p}.weight"] for p in paths}
    stacked = {p: w.shape[:-1] for p, w in weights.items() if w.ndim == 3}
    rows = {f"{p}.weight": weights[p].reshape(-1, weights[p].shape[-1]) for p in stacked}
    report = quantize_linears(dataclasses.replace(model, tensors=model.tensors | rows), paths, REQUANTIZE)
    tensors = dict(report.model.tensors)
    for p, lead in stacked.items():
        for name in (f"{p}.weight", f"{p}.scales", f"{p}.biases"):
            if name in tensors:   # a matrix left float has its weight only
                tensors[name] = tensors[name].reshape(*lead, tensors[name].shape[-1])
    return dataclasses.replace(report.model, tensors=tensors), report.kept_float


def _size(model: ModelDir, name: str) -> tuple[int, int]:
    """(weights, bytes) of the tensor `name` in `model`, a quantized one's scales and biases
    included."""
    path = name.removesuffix(".weight")
    if f"{path}.scales" in model.tensors:
        qt = read_linear(model.tensors, model.config.quantization, path)
        return math.prod(qt.weight.shape[:-1]) * qt.shape[1], qt.nbytes   # stacked experts': all
    t = model.tensors[name]
    return t.size, t.nbytes


def _became(model: ModelDir, name: str, qtype: QType, requantized: set[str]) -> str:
    """What the tensor `name` is in `model`: "int8 g32 (requantized)", "float16", ..."""
    path = name.removesuffix(".weight")
    if f"{path}.scales" in model.tensors:
        qt = read_linear(model.tensors, model.config.quantization, path)
        how = "requantized" if path in requantized else "exact"
        levels = "" if qt.values is None else " levels"
        return f"int{qt.integer_bits} g{qt.group_size}{levels} ({how})"
    t = model.tensors[name]
    dtype = ("bfloat16" if t.bf16 else "float16") if isinstance(t, HalfTensor) else str(t.dtype)
    return dtype if qtype in FLOAT_TYPES else f"{dtype} (dequantized)"
