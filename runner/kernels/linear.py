"""out (+)= x @ W.T for any weight: the one place that chooses between the float32 kernels
(cpu.py), the quantized ones (quant_decode.py for up to SMALL tokens) and the 16-bit float ones
(half.py, the same); more tokens through either of the last two go through prefill.py's tiles,
or for a quantized weight prefill_int8.py's integer ones where the CPU multiplies bytes.

Inside njit code the choice is made at compile time from the weight's numba type (the overloads
below), so one jitted decoder layer serves float32, bf16/f16 and quantized models; from Python,
by isinstance.
"""
from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.extending import overload

from nibble.formats import superblocks
from nibble.formats.half import HalfTensor
from nibble.quant.affine import KERNEL_KINDS, QuantizedTensor
from . import cpu, half, prefill, prefill_int8, quant_decode
from .cpu import INNER, SMALL, _jit

class LoRAWeight(NamedTuple):
    """A weight with LoRA adapters beside it, not merged (formats/lora.py): out (+)= x @ base.T +
    ((x @ a.T) * each row's scales) @ b.T, the base as it is stored (quantized, say), the adapters'
    rank-r pairs side by side in float32, so that each row of a pass runs its own adapters at its
    own scales (vLLM's punica, in one pass)."""
    base: np.ndarray | QuantizedTensor | HalfTensor
    a: np.ndarray        # [R, K]: every adapter's A that targets this weight, stacked
    b: np.ndarray        # [N, R]: their B side by side, each times its adapter's own scale
    owner: np.ndarray    # [R] int64: the adapter (its column in scales) of each rank
    scales: np.ndarray   # [rows, adapters]: each row's scale of each adapter, the model's (set each pass)

    @property
    def shape(self) -> tuple[int, int]:
        return self.base.shape

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + self.a.nbytes + self.b.nbytes


# a float32 [N, K] matrix, a prepared quantized one, or 16-bit floats (bf16, f16) by their bits,
# and any of them with a LoRA adapter beside it
Weight = np.ndarray | QuantizedTensor | HalfTensor | LoRAWeight


def int8_activations() -> bool:
    """Whether quantized weights multiply int8 activations here, in decode (quant_decode.py) and
    prefill (prefill_int8.py): where the CPU multiplies bytes, rounding x as llama.cpp's quantized
    runs do; else decode rounds x to int16 (close to float) and prefill runs prefill.py's float tiles."""
    return quant_decode.INT8


def prepare(qt: QuantizedTensor) -> QuantizedTensor:
    """`qt` as the kernels take it, as the class of its bits and groups (quant_decode.KINDS):
    called once at load.

    Nothing is widened or copied: the packed weight stays as it is (a read-only np.memmap stays
    one; the kernels read its uint32 words as little-endian bytes), and so do scales and biases
    stored in 16 bits (float16 or bfloat16: their uint16 bits, `bf16` saying which; half the
    bytes of float32, which decode reads every token), and those in two levels (a GGUF K-quant's,
    formats.superblocks). Other widths become float32. A table of levels (`values`) is kept as it
    is, and so are high planes (formats.planes). Refuses what the kernels would read out of bounds.
    """
    bits, group_size, weight = qt.bits, qt.group_size, qt.weight
    if (bits, group_size) not in KERNEL_KINDS:
        raise ValueError(f"no kernel for {bits}-bit weights in groups of {group_size}: bits and group_size "
                         f"must be one of {', '.join(f'{b} and {g}' for b, g in KERNEL_KINDS)}")
    stacked = weight.ndim == 3   # experts (kernels/moe.py)
    if weight.dtype != np.uint32 or (weight.ndim != 2 and not stacked) or not weight.flags.c_contiguous:
        raise ValueError(f"weight must be a C-contiguous uint32 matrix (or experts' matrices stacked), "
                         f"got {weight.dtype} {weight.shape}")
    if qt.scales.shape != qt.groups_shape or qt.biases.shape != qt.scales.shape:
        N, K = qt.shape
        raise ValueError(f"scales and biases must be {list(qt.groups_shape)} for a {N}x{K} weight in "
                         f"groups of {group_size}, got {qt.scales.shape} and {qt.biases.shape}")
    if group_size == 16 and not superblocks.is_two_level(qt.scales):   # as GGUF's Q6_K holds them
        raise ValueError("4-bit weights in groups of 16 need their scales and biases in two levels")
    values = qt.values
    if values is not None:
        if bits != 4 or group_size != 32 or values.dtype != np.uint8 or values.shape != (16,):
            raise ValueError(f"a table of levels must be 16 uint8 values for 4-bit weights in groups of 32 "
                             f"(as MXFP4's and IQ4_NL's), got {values.dtype} {values.shape} for {bits}-bit "
                             f"weights in groups of {group_size}")
        values, = _read_only(np.ascontiguousarray(values))
    problem = qt.planes_problem()
    if problem:
        raise ValueError(problem)
    high = None if qt.high is None else _read_only(np.ascontiguousarray(qt.high))[0]
    kind = quant_decode.KINDS[bits, group_size]
    if superblocks.is_two_level(qt.scales):
        if group_size > 32 or qt.biases.dtype != qt.scales.dtype:
            raise ValueError(f"scales and biases in two levels must be bytes of one dtype (uint8, or int8 "
                             f"with a sign), in groups of 32 or 16; got {qt.scales.dtype} and {qt.biases.dtype} "
                             f"in groups of {group_size}")
        return kind(*_read_only(weight, *(np.ascontiguousarray(a) for a in (qt.scales, qt.biases))),
                    bits, group_size, False, values, high)
    s, b = _half_bits(qt.scales), _half_bits(qt.biases)
    if s and b and s[1] == b[1]:
        return kind(*_read_only(weight, s[0], b[0]), bits, group_size, s[1], values, high)
    as32 = lambda a: np.ascontiguousarray(np.asarray(a), dtype=np.float32)   # a HalfTensor widens
    return kind(*_read_only(weight, as32(qt.scales), as32(qt.biases)), bits, group_size, False, values, high)


def read_only(weights):
    """`weights` (an array, or named tuples of them as the kernels take a block's) with every
    writable array in it a read-only view: numba compiles each kernel once per array type, and
    a block's type holds its norms', biases' and float weights' too (_read_only)."""
    if isinstance(weights, np.ndarray):
        return _read_only(weights)[0] if weights.flags.writeable else weights
    if isinstance(weights, tuple):
        parts = [read_only(w) for w in weights]
        return type(weights)(*parts) if hasattr(weights, "_fields") else tuple(parts)
    return weights


def _read_only(*arrays: np.ndarray) -> list[np.ndarray]:
    """Read-only views: the kernels never write a weight, and numba compiles a kernel once for each
    array type, writable or not. A memory-mapped file's weights are read-only; as views, weights
    made in memory (quantized at load, or by a test) run the same compiled code."""
    views = [a.view() for a in arrays]
    for v in views:
        v.flags.writeable = False
    return views


def _half_bits(a: np.ndarray | HalfTensor) -> tuple[np.ndarray, bool] | None:
    """(uint16 bits in C order, bf16) of 16-bit float scales or biases; None for other widths."""
    if isinstance(a, HalfTensor):
        return np.ascontiguousarray(a.bits), a.bf16
    if a.dtype == np.float16:
        return np.ascontiguousarray(a).view(np.uint16), False
    return None


def row_block(w: Weight, start: int, stop: int) -> Weight:
    """Rows start..stop-1 of a float32, 16-bit or quantized weight, as a view (no copy): a block
    of rows of a C-contiguous matrix is C-contiguous, so the kernels take it as a whole matrix."""
    if isinstance(w, QuantizedTensor):
        return w._replace(weight=w.weight[start:stop], scales=w.scales[start:stop],
                          biases=w.biases[start:stop], high=None if w.high is None else w.high[start:stop])
    if isinstance(w, HalfTensor):
        return w._replace(bits=w.bits[start:stop])
    return w[start:stop]


@njit(**_jit)
def qmatmul(x, w, out, accumulate):
    """out[T, N] (+)= x[T, K] @ W.T for a prepared QuantizedTensor or a HalfTensor W; x, out
    float32. Callable from Python and from inside other njit functions.

    T <= SMALL takes the decode path (qmatvec), bound by memory bandwidth, each weight read once
    for all rows (quantized: integer dot products on x rounded to int8 per block where the CPU
    multiplies bytes (int8_activations), else to int16 per group; 16-bit: widened on the fly);
    more rows prefill (qprefill): a quantized W on x rounded to int8 per block where the CPU
    multiplies bytes, else float tiles.
    """
    if x.shape[0] <= SMALL:
        qmatvec(x, w, out, accumulate)
    else:
        qprefill(x, w, out, accumulate)


@njit(**_jit)
def qmatvec(x, w, out, accumulate):
    """qmatmul for at most SMALL rows."""
    _check(x, w, out)
    _matvec(x, w, out, accumulate)


@njit(**_jit)
def qprefill(x, w, out, accumulate):
    """qmatmul for more than SMALL rows."""
    _check(x, w, out)
    prefill_int8.matmul(x, w, out, accumulate)


@njit(inline="always", **_jit)
def _check(x, w, out):
    T, K = x.shape
    N, Kw = prefill.dims(w)
    if Kw != K or out.shape[0] != T or out.shape[1] != N:
        raise ValueError("qmatmul: x must be [T, K] and out [T, N] for a weight of N rows of K")


def _matvec(x, w, out, accumulate):
    """out[T, N] (+)= x[T, K] @ W.T for a few rows (njit code only)."""


@overload(_matvec)
def _matvec_typed(x, w, out, accumulate):
    if issubclass(w.instance_class, QuantizedTensor):
        return lambda x, w, out, accumulate: quant_decode.matvec_rows(x, w, out, accumulate)
    if w.instance_class is HalfTensor:
        return lambda x, w, out, accumulate: half.matvec_rows(x, w, out, accumulate)


def linear(x, w, out, accumulate):
    """out (+)= x @ w.T for a float32 [N, K] weight, a QuantizedTensor or a HalfTensor.

    Inside njit code the choice is made at compile time from w's numba type (the overload below),
    so one jitted decoder layer serves float32, 16-bit and quantized models. From Python (the
    output head), so is the choice between decode and prefill: a run that never multiplies more
    than SMALL rows by the head never compiles its prefill kernel.
    """
    if isinstance(w, LoRAWeight):
        _lora_linear(x, w, out, accumulate)
    elif isinstance(w, (QuantizedTensor, HalfTensor)):
        (qmatvec if x.shape[0] <= SMALL or getattr(w, "FIRST", False) else qprefill)(x, w, out, accumulate)
    else:
        cpu.matmul(x, w, out, accumulate)


@overload(linear)
def _linear_typed(x, w, out, accumulate):
    if isinstance(w, types.Array):
        return lambda x, w, out, accumulate: cpu.matmul(x, w, out, accumulate)
    if isinstance(w, types.BaseNamedTuple) and w.instance_class is LoRAWeight:
        return lambda x, w, out, accumulate: _lora_linear(x, w, out, accumulate)
    if quant_decode.is_first(w):   # a first run's: the decode kernels whatever the rows
        return lambda x, w, out, accumulate: qmatvec(x, w, out, accumulate)
    if isinstance(w, types.BaseNamedTuple) and issubclass(w.instance_class, (QuantizedTensor, HalfTensor)):
        return lambda x, w, out, accumulate: qmatmul(x, w, out, accumulate)


def out_features(w) -> int:
    """Output size of a float [N, K], quantized or 16-bit weight."""
    return w.shape[0]


@overload(out_features)
def _out_features(w):
    if isinstance(w, types.Array):
        return lambda w: w.shape[0]
    if isinstance(w, types.BaseNamedTuple) and w.instance_class is LoRAWeight:
        return lambda w: w.b.shape[0]
    return lambda w: prefill.dims(w)[0]   # numba sees a named tuple's fields, not its properties


@njit(**_jit)   # called from Python too (linear's isinstance): with its wrapper
def _lora_linear(x, w, out, accumulate):
    """out (+)= x @ base.T, then += ((x @ a.T) * the rows' scales) @ b.T: the adapters beside the
    weight, unmerged. A pass whose rows all have scale 0 (no adapter asked for) skips them, and a row
    with none gets exactly the base's output."""
    linear(x, w.base, out, accumulate)
    T, R = x.shape[0], w.a.shape[0]
    s = np.empty((T, R), np.float32)
    used = False
    for i in range(T):
        for r in range(R):
            s[i, r] = w.scales[i, w.owner[r]]
            used |= s[i, r] != 0
    if not used:
        return
    t = np.empty((T, R), np.float32)
    cpu.matmul(x, w.a, t, False)
    for i in range(T):
        for r in range(R):
            t[i, r] = t[i, r] * s[i, r] if s[i, r] != 0 else 0   # a row's unused adapter adds 0, not NaN
    cpu.matmul(t, w.b, out, True)


def project_qkv(x, wq, wk, wv, q, k, v):
    """q, k, v = x @ wq.T, x @ wk.T, x @ wv.T"""
    for w, out in ((wq, q), (wk, k), (wv, v)):
        linear(x, w, out, False)


@overload(project_qkv)
def _project_qkv(x, wq, wk, wv, q, k, v):
    if all(isinstance(w, types.Array) for w in (wq, wk, wv)):
        return lambda x, wq, wk, wv, q, k, v: cpu.project_qkv(x, wq, wk, wv, q, k, v)
    if _rounded_alike(wq, wk, wv):
        if quant_decode.is_first(wq):
            return lambda x, wq, wk, wv, q, k, v: _qkv_decoded(x, wq, wk, wv, q, k, v)
        return lambda x, wq, wk, wv, q, k, v: _qkv_rounded_once(x, wq, wk, wv, q, k, v)
    return lambda x, wq, wk, wv, q, k, v: _qkv_each(x, wq, wk, wv, q, k, v)


def _rounded_alike(*weights) -> bool:
    """Whether these weights' types multiply int8 activations (int8_activations) rounded alike: of
    one kind (the same bits and groups), they share x rounded once for them all (a fifth of
    SmolLM2's prefill matmul time went to rounding x)."""
    kinds = {w.instance_class if isinstance(w, types.BaseNamedTuple) else None for w in weights}
    return quant_decode.INT8 and len(kinds) == 1 and getattr(kinds.pop(), "KIND", None) is not None


@njit(**_jit, **INNER)
def _qkv_each(x, wq, wk, wv, q, k, v):
    linear(x, wq, q, False)
    linear(x, wk, k, False)
    linear(x, wv, v, False)


@njit(**_jit, **INNER)
def _qkv_rounded_once(x, wq, wk, wv, q, k, v):
    if x.shape[0] <= SMALL:
        _qkv_decoded(x, wq, wk, wv, q, k, v)
    else:
        rounded = prefill_int8.round_rows(x, wq.group_size, wq.bits)
        _prefill_rounded(rounded, x, wq, q)
        _prefill_rounded(rounded, x, wk, k)
        _prefill_rounded(rounded, x, wv, v)


@njit(inline="always", **_jit)
def _qkv_decoded(x, wq, wk, wv, q, k, v):
    """_qkv_rounded_once through the decode kernels."""
    rounded = quant_decode.round_rows(x, wq.group_size, wq.bits)
    _decode_rounded(rounded, x, wq, q)
    _decode_rounded(rounded, x, wk, k)
    _decode_rounded(rounded, x, wv, v)


@njit(inline="always", **_jit)
def _decode_rounded(rounded, x, w, out):
    """out = x @ w.T for a few rows, x as quant_decode.round_rows gave it for w's bits and groups."""
    _check(x, w, out)
    # bool(): a plain bool, as qmatmul passes it; a literal False would compile the kernel again
    quant_decode.products(rounded, x, w, out, bool(False))


@njit(inline="always", **_jit)
def _prefill_rounded(rounded, x, w, out):
    """out = x @ w.T, x as prefill_int8.round_rows gave it for w's bits and groups."""
    _check(x, w, out)
    prefill_int8.matmul_rounded(rounded, w, out, bool(False))   # a plain bool, as above


def gated_mlp(x, w_gate, w_up, out, gelu):
    """out = act(x @ w_gate.T) * (x @ w_up.T): act SiLU (SwiGLU), or GELU's tanh approximation if
    `gelu` (GeGLU), a constant of the caller's (only its activation compiles); x rounded once for
    both where their weights take it rounded alike (njit code only)."""


@overload(gated_mlp, prefer_literal=True)
def _gated_mlp(x, w_gate, w_up, out, gelu):
    if not isinstance(gelu, types.BooleanLiteral):
        return None
    if isinstance(w_gate, types.Array) and isinstance(w_up, types.Array) and not gelu.literal_value:
        return lambda x, w_gate, w_up, out, gelu: cpu.swiglu(x, w_gate, w_up, out)   # decode: one pass
    # gelu goes on as a constant: numba compiles a function once for each constant's value
    if _rounded_alike(w_gate, w_up):
        if quant_decode.is_first(w_gate):
            return lambda x, w_gate, w_up, out, gelu: _gated_decoded(x, w_gate, w_up, out, gelu)
        return lambda x, w_gate, w_up, out, gelu: _gated_rounded_once(x, w_gate, w_up, out, gelu)
    return lambda x, w_gate, w_up, out, gelu: _gated_each(x, w_gate, w_up, out, gelu)


def _activate(g, up, gelu):
    """g = act(g) * up, act as gated_mlp's constant `gelu` says (njit code only)."""


@overload(_activate, prefer_literal=True)
def _activate_typed(g, up, gelu):
    if not isinstance(gelu, types.BooleanLiteral):
        return None
    if gelu.literal_value:
        return lambda g, up, gelu: cpu.gelu_tanh_mul(g, up)
    return lambda g, up, gelu: cpu.silu_mul(g, up)


@njit(**_jit, **INNER)
def _gated_each(x, w_gate, w_up, out, gelu):
    up = np.empty_like(out)
    linear(x, w_gate, out, False)
    linear(x, w_up, up, False)
    _activate(out, up, gelu)


@njit(**_jit, **INNER)
def _gated_rounded_once(x, w_gate, w_up, out, gelu):
    if x.shape[0] <= SMALL:
        _gated_decoded(x, w_gate, w_up, out, gelu)
        return
    up = np.empty_like(out)
    rounded = prefill_int8.round_rows(x, w_gate.group_size, w_gate.bits)
    _prefill_rounded(rounded, x, w_gate, out)
    _prefill_rounded(rounded, x, w_up, up)
    _activate(out, up, gelu)


@njit(inline="always", **_jit)
def _gated_decoded(x, w_gate, w_up, out, gelu):
    """_gated_rounded_once through the decode kernels."""
    up = np.empty_like(out)
    rounded = quant_decode.round_rows(x, w_gate.group_size, w_gate.bits)
    _decode_rounded(rounded, x, w_gate, out)
    _decode_rounded(rounded, x, w_up, up)
    _activate(out, up, gelu)
