"""MLX's affine scheme: w = scales * q + biases per group of `group_size` consecutive inputs.

A linear `P` is stored as `P.weight` (uint32 [out, in*bits/32], see packing), `P.scales` and
`P.biases` (float16 [out, in/group_size]). Scales and biases are rounded to float16 before the
integers are chosen, so the integers fit the values a reader will actually see.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from nibble.formats import planes, superblocks
from nibble.formats.errors import NibbleError
from nibble.formats.half import HalfTensor
from nibble.formats.packing import pack, unpack

from .search import search_affine

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)   # what nibble quantizes to
# what the kernels read: those, and GGUF's Q6_K's 4-bit words (and high planes) in groups of 16
KERNEL_KINDS = tuple((bits, G) for bits in BITS for G in GROUP_SIZES) + ((4, 16),)
METHODS = ("rtn", "search")
_BLOCK = 1 << 18  # weights per block: keeps the search's temporaries in cache
# numpy and the search kernel (nogil) release the GIL, so blocks quantize in parallel on threads.
_WORKERS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count() or 1)


@dataclass(frozen=True)
class AffineScheme:
    """How a matrix is quantized: `bits` per weight, one scale and bias per `group_size` inputs;
    integer_zeros: each bias -scale times an integer in [0, nmax] (a zero point, as vLLM's
    asymmetric integers hold it), scales and biases then float32 (float16 scales' values: the
    biases are not float16 numbers)."""
    bits: int
    group_size: int
    integer_zeros: bool = False

    def __post_init__(self):
        if self.bits not in BITS:
            raise NibbleError(f"bits must be 4 or 8, got {self.bits!r}")
        if (self.bits, self.group_size) not in KERNEL_KINDS:
            raise NibbleError(f"group size must be 32, 64 or 128 (or 16 at 4 bits), got {self.group_size!r}")

    @property
    def nmax(self) -> int:
        """The largest quantized integer."""
        return (1 << self.bits) - 1


class QuantizedTensor(NamedTuple):
    """One quantized matrix W [N, K], laid out as MLX stores it: W[n, k] = scales[n, k//G] *
    q[n, k] + biases[n, k//G], or where `values` is given (a table of 16 levels for 4-bit
    integers) scales[n, k//G] * values[q[n, k]] + biases[n, k//G]: the non-uniform 4-bit
    formats (MXFP4's E2M1 values, IQ4_NL's), held exactly at their size; where `high` is given,
    the integers of 4-bit words have 1 or 2 bits more, q + 16 * h[n, k] (GGUF's 5- and 6-bit
    types at their size, formats.planes). The one type of a
    quantized weight, from the file to the kernels:
    a named tuple of arrays, so numba takes it as it is (runner.kernels: host arrays, scales and
    biases as runner.kernels.linear.prepare keeps them; runner.kernels.cuda: device arrays)."""
    weight: np.ndarray  # uint32 [N, K*bits/32], packed integers (see packing)
    scales: np.ndarray  # [N, K/G] as stored: float16, bf16 (a HalfTensor), float32; prepared:
                        # 16-bit floats as their uint16 bits (see bf16), anything else float32;
                        # or in two levels, a GGUF K-quant's: uint8 (int8 with a sign) [N, K/256, 10]
                        # (formats.superblocks), kept as stored
    biases: np.ndarray  # [N, K/G] like scales
    bits: int           # one of BITS
    group_size: int     # G: one of GROUP_SIZES, or 16 (KERNEL_KINDS)
    bf16: bool = False  # prepared uint16 scales and biases: bfloat16 bits if True, else float16
    values: np.ndarray | None = None   # uint8 [16], the level of each 4-bit integer; None: q itself
    high: np.ndarray | None = None     # uint8 [N, planes.width]: the bits above the words' 4
                                       # (formats.planes); None: none

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), as a float matrix's shape; of each expert's matrix where the arrays are
        stacked experts' (a leading expert axis on each: a mixture of experts' weights)."""
        *_, n, words = tuple(self.weight.shape)   # a tuple: numba's CUDA simulator indexes no shape from the end
        return n, words * 32 // self.bits

    @property
    def groups_shape(self) -> tuple[int, ...]:
        """The shape scales and biases must have, after the expert axis if stacked: (N, K/G), or
        in two levels (superblocks) (N, K/256, 2 + 256/G)."""
        N, K = self.shape
        *experts, _, _ = tuple(self.weight.shape)
        if superblocks.is_two_level(self.scales):
            return *experts, *superblocks.shape(N, K, self.group_size)
        return *experts, N, K // self.group_size

    @property
    def nbytes(self) -> int:
        """Bytes held (and read by a product with it), as a float matrix's nbytes."""
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes + sum(
            0 if a is None else a.nbytes for a in (self.values, self.high))

    @property
    def integer_bits(self) -> int:
        """Bits an integer takes: the words', and the high planes' (formats.planes)."""
        return self.bits if self.high is None else self.bits + planes.count(self.high, self.shape[1])

    def planes_problem(self) -> str | None:
        """What keeps `high` from being read as this weight's high planes (formats.planes), or None:
        1 or 2 planes of uint8, a row each weight row has, beside 4-bit words in groups of 32 or 16
        without a table."""
        if self.high is None:
            return None
        *rows, _ = tuple(self.weight.shape)
        K = self.shape[1]
        if (self.high.dtype != np.uint8 or self.bits != 4 or self.group_size > 32 or self.values is not None
                or planes.count(self.high, K) not in (1, 2)
                or tuple(self.high.shape) != (*rows, planes.width(K, planes.count(self.high, K)))):
            return (f"high planes should be uint8 [{', '.join(map(str, rows))}, {planes.width(K, 1)} or "
                    f"{planes.width(K, 2)}] beside 4-bit weights in groups of 32 or 16 without a table of levels, got "
                    f"{self.high.dtype} of shape {tuple(self.high.shape)} beside {self.bits}-bit weights in "
                    f"groups of {self.group_size}")
        return None

    @property
    def scheme(self) -> AffineScheme:
        return AffineScheme(self.bits, self.group_size)


def quantize(w: np.ndarray, scheme: AffineScheme, imatrix: np.ndarray | None = None,
             method: str = "search") -> QuantizedTensor:
    """Quantize a float matrix w [out, in] under `scheme`.

    imatrix (f32 [in], the mean squared input activation per input channel) weighs the error of
    each column; None weighs all alike. method "rtn" is min/max round-to-nearest per group;
    "search" (the default) searches scales and biases (see quant.search) and, group by group,
    keeps whichever of the two reconstructs w better, so it is never worse than "rtn".
    """
    if method not in METHODS:
        raise NibbleError(f"unknown quantization method {method!r}: "
                          f"use one of {', '.join(METHODS)}")
    w = _check_matrix(w, scheme)
    imp = _check_imatrix(imatrix, w.shape[1])
    rows, n = w.shape
    g = scheme.group_size
    q = np.empty((rows, n), dtype=np.uint8)                      # [out, in]
    dtype = np.float32 if scheme.integer_zeros else np.float16
    scales = np.empty((rows, n // g), dtype=dtype)               # [out, in/g]
    biases = np.empty((rows, n // g), dtype=dtype)               # [out, in/g]
    imp_groups = None if imp is None else imp.reshape(n // g, g)  # [in/g, g]
    step = max(1, _BLOCK // n)

    def block(r: int) -> None:
        x = w[r:r + step].astype(np.float32).reshape(-1, n // g, g)  # [step, in/g, g]
        lq, ls, lb = _quantize_block(x, scheme.nmax, imp_groups, method, scheme.integer_zeros)
        q[r:r + step], scales[r:r + step], biases[r:r + step] = lq.reshape(-1, n), ls, lb

    with ThreadPoolExecutor(_WORKERS) as pool:
        list(pool.map(block, range(0, rows, step)))  # list(): re-raise any error here
    return QuantizedTensor(pack(q, scheme.bits), scales, biases, scheme.bits, scheme.group_size)


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """The float32 matrix [out, in] that `qt` stands for."""
    rows, n = qt.shape
    g = qt.group_size
    w = np.empty((rows, n), dtype=np.float32)                        # [out, in]
    step = max(1, _BLOCK // n)  # in blocks, so the temporaries stay in cache
    for r in range(0, rows, step):
        q = unpack(qt.weight[r:r + step], qt.bits)
        if qt.high is not None:
            q |= planes.unpack(qt.high[r:r + step], n) << np.uint8(4)
        q = q.reshape(-1, n // g, g)                                   # [step, in/g, g]
        # in float64: a level times a two-level scale (IQ4_XS's) can take 25 bits, and their sum is
        # the file's weight exactly only when neither is rounded (widen first: mixed-dtype
        # broadcasts are slow)
        block = (q if qt.values is None else qt.values[q]).astype(np.float64)
        block *= group_values(_rows(qt.scales, r, r + step)).astype(np.float64)[..., None]
        block += group_values(_rows(qt.biases, r, r + step)).astype(np.float64)[..., None]
        w[r:r + step] = block.reshape(-1, n)
    return w


def _rows(a: np.ndarray | HalfTensor, start: int, stop: int) -> np.ndarray | HalfTensor:
    """Rows start:stop of scales or biases as stored (a bfloat16 HalfTensor's by its bits)."""
    return a._replace(bits=a.bits[start:stop]) if isinstance(a, HalfTensor) else a[start:stop]


def group_values(a: np.ndarray) -> np.ndarray:
    """Scales or biases as stored (float, or in two levels), float32 [N, K/G]."""
    return superblocks.expand(a) if superblocks.is_two_level(a) else np.asarray(a, np.float32)


def reconstruction_error(w: np.ndarray, qt: QuantizedTensor,
                         imatrix: np.ndarray | None = None) -> float:
    """Relative RMS error |w - dequantize(qt)| / |w|, each column weighted by imatrix if given."""
    n = w.shape[1]
    imp = _check_imatrix(imatrix, n)
    err = np.zeros(n, dtype=np.float64)                              # [in] squared error
    ref = np.zeros(n, dtype=np.float64)                              # [in] squared weight
    step = max(1, _BLOCK // n)
    for r in range(0, w.shape[0], step):
        part = qt._replace(weight=qt.weight[r:r + step], scales=_rows(qt.scales, r, r + step),
                           biases=_rows(qt.biases, r, r + step),
                           high=None if qt.high is None else qt.high[r:r + step])
        x = np.asarray(w[r:r + step], dtype=np.float32)
        d = x - dequantize(part)
        err += np.einsum("ij,ij->j", d, d)
        ref += np.einsum("ij,ij->j", x, x)
    weights = np.ones(n) if imp is None else imp
    err, ref = err @ weights, ref @ weights
    return float(np.sqrt(err / ref)) if ref > 0 else float(np.sqrt(err))


def _quantize_block(x: np.ndarray, nmax: int, imp: np.ndarray | None, method: str, integer_zeros: bool = False):
    """Integers uint8, scales and biases float16 (integer_zeros: float32, see AffineScheme) for
    groups x [rows, in/g, g]."""
    lo, hi = x.min(axis=-1), x.max(axis=-1)                    # [rows, in/g]
    with np.errstate(over="ignore"):   # weights near float32's limit: an infinite scale, refused in _snap
        span = hi - lo
    snap = _snap_integer_zeros if integer_zeros else _snap
    q, s, b = snap(x, span / nmax, lo, nmax)
    if method == "search":
        fit = _search_integer_zeros(x, lo, span, imp, nmax) if integer_zeros else search_affine(x, lo, hi, imp, nmax)
        q2, s2, b2 = snap(x, *fit, nmax)
        # Compare on the float16 values a reader will see; ties keep min/max rounding.
        better = _group_error(x, q2, s2, b2, imp) < _group_error(x, q, s, b, imp)
        np.copyto(q, q2, where=better[..., None])
        s, b = np.where(better, s2, s), np.where(better, b2, b)
    return q.astype(np.uint8), s, b


def _snap(x: np.ndarray, s: np.ndarray, b: np.ndarray, nmax: int):
    """Round scale and bias to float16, then pick each group's nearest levels (as float32)."""
    with np.errstate(over="ignore"):   # beyond float16: refused below, in one line
        s16, b16 = s.astype(np.float16), b.astype(np.float16)
    if not (np.isfinite(s16).all() and np.isfinite(b16).all()):
        raise NibbleError("weights that are not finite, or too large for float16 scales and "
                          "biases, cannot be stored in MLX's affine format")
    s32 = s16.astype(np.float32)
    # A zero scale (constant group) gets inverse 0, so all its integers are 0.
    inv = np.divide(1, s32, out=np.zeros_like(s32), where=s32 != 0)[..., None]
    q = x - b16.astype(np.float32)[..., None]
    q *= inv
    np.rint(q, out=q)
    return np.clip(q, 0, nmax, out=q), s16, b16


def _search_integer_zeros(x: np.ndarray, lo: np.ndarray, span: np.ndarray, imp: np.ndarray | None, nmax: int,
                          steps: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """search_affine's grid of scales with the zero point an integer: for each inverse scale
    (nmax - 1 + 0.1 i) / span, the zero point z nearest -lo / s and the levels round(x / s) + z,
    then the scale that fits those levels best (weighted least squares, z held); the (scale, bias)
    of least weighted error, for _snap_integer_zeros."""
    w = np.ones_like(x) if imp is None else np.broadcast_to(imp, x.shape)
    best_s, best_b = span / nmax, lo
    best_e = np.full(span.shape, np.inf, np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(steps + 1):
            s = span / np.float32(nmax - 1 + 0.1 * i)
            z = np.clip(np.rint(-lo / s), 0, nmax)
            level = np.clip(np.rint(x / s[..., None]) + z[..., None], 0, nmax) - z[..., None]   # q - z
            fit = np.einsum("...k,...k,...k->...", w, x, level) / np.einsum("...k,...k,...k->...", w, level, level)
            s = np.where(np.isfinite(fit) & (fit > 0), fit, s).astype(np.float16).astype(np.float32)
            z = np.clip(np.rint(-lo / s), 0, nmax)
            level = np.clip(np.rint(x / s[..., None]) + z[..., None], 0, nmax) - z[..., None]
            d = level * s[..., None] - x
            e = np.einsum("...k,...k,...k->...", w, d, d)
            better = e < best_e
            best_s, best_b, best_e = np.where(better, s, best_s), np.where(better, -s * z, best_b), np.where(better, e, best_e)
    return best_s, best_b


def _snap_integer_zeros(x: np.ndarray, s: np.ndarray, b: np.ndarray, nmax: int):
    """_snap with each bias -s z for the integer z in [0, nmax] nearest -b / s (s rounded to
    float16 first), float32; a constant group's one value at the top or bottom level."""
    top = np.abs(x).max(axis=-1) / np.float32(nmax)
    flat = s == 0
    s, b = np.where(flat, top, s), np.where(flat, np.minimum(x[..., 0], 0), b)
    with np.errstate(over="ignore"):
        s16 = s.astype(np.float16)
    if not (np.isfinite(s16).all() and np.isfinite(b).all()):
        raise NibbleError("weights that are not finite, or too large for float16 scales, cannot be "
                          "quantized")
    s32 = s16.astype(np.float32)
    inv = np.divide(1, s32, out=np.zeros_like(s32), where=s32 != 0)
    zeros = np.clip(np.rint(-b * inv), 0, nmax)
    biases = -s32 * zeros   # exact: an 11-bit scale times an integer of at most 8 bits
    q = (x - biases[..., None]) * inv[..., None]
    np.rint(q, out=q)
    return np.clip(q, 0, nmax, out=q), s32, biases


def _group_error(x, q, s16, b16, imp) -> np.ndarray:
    """sum imp (s q + b - x)^2 per group: [rows, in/g]."""
    d = q * s16.astype(np.float32)[..., None]
    d += b16.astype(np.float32)[..., None]
    d -= x
    if imp is None:
        return np.einsum("rgk,rgk->rg", d, d)
    d *= d
    return np.einsum("rgk,gk->rg", d, imp)


def _check_matrix(w: np.ndarray, scheme: AffineScheme) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2:
        raise NibbleError(f"can only quantize matrices, got shape {w.shape}")
    if w.shape[1] % scheme.group_size:
        raise NibbleError(f"row length {w.shape[1]} is not a multiple of the group size "
                          f"{scheme.group_size}")
    if not np.issubdtype(w.dtype, np.floating):
        raise NibbleError(f"can only quantize float matrices, got {w.dtype}")
    return w


def _check_imatrix(imatrix: np.ndarray | None, n: int) -> np.ndarray | None:
    if imatrix is None:
        return None
    imp = np.asarray(imatrix, dtype=np.float32)
    if imp.shape != (n,):
        raise NibbleError(f"importance matrix has shape {imp.shape}, expected ({n},): "
                          f"one value per input channel")
    if not np.isfinite(imp).all() or (imp < 0).any():
        raise NibbleError("importance matrix must be finite and non-negative")
    return imp
