"""GGUF's quantized blocks repacked into MLX's affine layout, without changing a single weight.

Each ggml block type below stores, per run of 32 weights, integers q and numbers that make
w = scale * q + bias (Q4_0, Q5_0 and Q8_0 centre q on zero: their bias is -d times the offset;
Q4_K and Q5_K hold 8 runs of 32 in a super-block of 256, with scale d*sc and bias -dmin*m). MLX's
layout holds the same things in groups of 32: the integers packed into uint32 words (see
packing), scales and biases beside them. So the repacked tensor, dequantized, gives the very
float32 numbers ggml's dequantization gives: the products and sums are the same float32
operations on the same operands (q*d and 8*d are exact in float32). 5-bit integers keep their
fifth bit in a plane beside the 4-bit words (planes), as ggml keeps it beside the nibbles, Q6_K's
6-bit ones two planes; Q2_K's and Q3_K's 2- and 3-bit integers take 4-bit words. A
K-quant's scales and biases stay in its two levels (superblocks): a float16 a super-block and a
small integer a sub-block (of 32, or of 16 for Q2_K, Q3_K and Q6_K; signed for Q3_K and Q6_K). IQ4_NL, IQ4_XS and MXFP4 index 16 values that are not evenly spaced:
their 4-bit integers go through a table of levels (Repacked.values), the signed values plus an
offset that the biases take back (-offset * scale). IQ4_XS's scales and biases are in two levels
too, their integers signed. A level times the scale is exact in float32 (at most 8 bits times an
f16's 11, or a power of two), and so is the sum, the file's weight; IQ4_XS's products take up to
25 bits, exact in the float64 that affine.dequantize computes them in.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from . import mxfp4, planes, superblocks
from .half import HalfTensor
from .packing import pack, unpack

GROUP_SIZE = 32   # weights sharing a scale and bias: a ggml block, or a K-quant sub-block
_STEP = 1 << 22   # weights repacked at a time: bounds the temporaries


class Repacked(NamedTuple):
    """One matrix [N, K] in MLX's affine layout:
    W[n, k] = scales[n, k//G] * q[n, k] + biases[n, k//G], with values[q[n, k]] for q where
    there is a table of levels, q + 16 h[n, k] where there are high planes h; or experts' matrices
    stacked [E, N, K], as MLX's switch_mlp holds them: each array but values with the leading
    expert axis."""
    weight: np.ndarray   # uint32 [(E,) N, K*bits/32], packed integers
    scales: np.ndarray | HalfTensor   # [(E,) N, K/32] float16 where that holds every value exactly,
                         # else bfloat16 (a HalfTensor) where that does, else float32; a K-quant's
                         # in two levels (superblocks), uint8 [(E,) N, K/256, 10]
    biases: np.ndarray | HalfTensor   # [(E,) N, K/32] stored as scales are
    bits: int
    values: np.ndarray | None = None   # uint8 [16], the level of each 4-bit integer; None: q itself
    high: np.ndarray | None = None     # uint8 [(E,) N, planes.width]: the integers' bits above the
                                       # words' 4 (formats.planes); None: none
    group_size: int = GROUP_SIZE       # weights a scale and bias: 32, or Q6_K's 16


class _BlockType(NamedTuple):
    bits: int   # MLX's width for the integers: 4 or 8
    # blocks [n, type_size] uint8 -> q [n, block_size] uint8, scales and biases [n, block_size/32]
    # float32, or a K-quant's [n, 10] uint8 in two levels (superblocks)
    decode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
    two_level: bool = False
    values: np.ndarray | None = None   # uint8 [16]: the level of each integer (Repacked.values)
    # scales and biases in bfloat16 whatever their values (MXFP4's powers of two, as a checkpoint's
    # MXFP4 is held: one set of compiled kernels for both)
    bf16: bool = False
    planes: int = 0   # bits above the 4 of `bits` held in high planes (formats.planes)
    signed: bool = False   # two levels whose integers have a sign (int8, superblocks)
    group_size: int = GROUP_SIZE   # weights a scale and bias: 16 for Q6_K's sub-blocks


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes a row, a little-endian float16 -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes [n, m] -> [n, 2m] integers: each `run` bytes hold `run` weights in their low nibbles,
    then the next `run` weights in their high nibbles."""
    q = qs.reshape(len(qs), -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(len(qs), -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: 4 bytes [n, 4], bit j for weight j -> [n, 32] values 0 or 16."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << np.uint8(4)


def _q4_0(b):   # d f16, 16 bytes of nibbles; w = d * (q - 8)
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:], 16), d, -8 * d


def _q4_1(b):   # d f16, m f16, 16 bytes of nibbles; w = d * q + m
    return _nibbles(b[:, 4:], 16), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5_0(b):   # d f16, 4 bytes of fifth bits, 16 bytes of nibbles; w = d * (q - 16)
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 6:], 16) | _high_bits(b[:, 2:6]), d, -16 * d


def _q5_1(b):   # d f16, m f16, 4 bytes of fifth bits, 16 bytes of nibbles; w = d * q + m
    return _nibbles(b[:, 8:], 16) | _high_bits(b[:, 4:8]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b):   # d f16, 32 int8; w = d * q: q + 128 is the int8's byte with its top bit flipped
    d = _f16(b[:, 0:2])
    return b[:, 2:] ^ np.uint8(0x80), d, -128 * d


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's 8 sub-block scales d*sc and biases (-dmin)*m in two levels
    (superblocks), uint8 [n, 10]: -dmin is dmin with its sign bit flipped, exactly."""
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])   # 6-bit integers, packed in 12 bytes
    d, dmin = b[:, 0:2].copy().view("<f2"), b[:, 2:4].copy().view("<u2") ^ np.uint16(0x8000)
    return (superblocks.pack(d, sc.astype(np.uint8)).reshape(len(b), -1),
            superblocks.pack(dmin.view("<f2"), m.astype(np.uint8)).reshape(len(b), -1))


def _q4_k(b):   # d, dmin, 12 bytes of 6-bit sc and m, 128 bytes of nibbles (32-byte runs)
    return _nibbles(b[:, 16:], 32), *_k_scales(b)


def _q5_k(b):   # as Q4_K, with 32 bytes of fifth bits before the nibbles: bit s of byte e for
    # weight e of sub-block s
    high = np.unpackbits(b[:, 16:48, None], axis=-1, bitorder="little")   # [n, 32, 8]
    high = high.transpose(0, 2, 1).reshape(len(b), -1) << np.uint8(4)      # [n, 256]
    return _nibbles(b[:, 48:], 32) | high, *_k_scales(b)


# ggml-common.h's kvalues_iq4nl plus 128: unsigned levels, whose 128 the biases take back
_IQ4_NL_LEVELS = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
                  + 128).astype(np.uint8)


def _iq4_nl(b):   # d f16, 16 bytes of nibbles; w = d * kvalues_iq4nl[q]
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:], 16), d, -128 * d


def _iq4_xs(b):   # d f16, 16 bits of the scales' high 2 bits, 4 bytes of their low 4, 128 bytes of
    # nibbles (16-byte runs); w = d * (ls - 32) * kvalues_iq4nl[q] for sub-block scales ls (6 bits):
    # in two levels, d and ls - 32 (int8), and -128 d with the same integers for the biases
    high = b[:, 2:4].copy().view("<u2") >> (2 * np.arange(8, dtype=np.uint16))           # [n, 8]
    low = b[:, 4:8, None] >> np.array([0, 4], np.uint8)                                   # [n, 4, 2]
    ls = (low.reshape(len(b), 8) & np.uint8(0x0F)) | ((high & np.uint16(3)).astype(np.uint8) << np.uint8(4))
    signed = (ls.astype(np.int16) - 32).astype(np.int8)
    d = b[:, 0:2].copy().view("<f2")
    with np.errstate(over="ignore"):   # past float16: the caller's finite check refuses the repack
        bias = (d.astype(np.float32) * -128).astype(np.float16)
    return (_nibbles(b[:, 8:], 16), superblocks.pack(d, signed).reshape(len(b), -1),
            superblocks.pack(bias, signed).reshape(len(b), -1))


_CRUMBS = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)   # the shifts of four 2-bit fields a byte


def _q2_k(b):   # 16 bytes of 4-bit sc (low) and m (high) a sub-block of 16, 64 bytes of 2-bit q, d,
    # dmin; w = d * sc * q - dmin * m: in two levels (d, sc) and (-dmin, m), -dmin exactly
    n = len(b)
    q = (b[:, 16:80].reshape(n, 2, 1, 32) >> _CRUMBS) & np.uint8(3)
    dmin = b[:, 82:84].copy().view("<u2") ^ np.uint16(0x8000)
    return (q.reshape(n, 256), superblocks.pack(b[:, 80:82].copy().view("<f2"), b[:, :16] & np.uint8(15)).reshape(n, -1),
            superblocks.pack(dmin.view("<f2"), b[:, :16] >> np.uint8(4)).reshape(n, -1))


def _q3_k(b):   # 32 bytes of third bits, 64 of 2-bit low parts, 12 of 6-bit sub-block scales sc, d;
    # w = d * (sc - 32) * (q - 4) for q = low + 4 * third (ggml subtracts 4 where the bit is clear):
    # in two levels (d, sc - 32) and (-4 d, sc - 32), signed
    n = len(b)
    low = (b[:, 32:96].reshape(n, 2, 1, 32) >> _CRUMBS) & np.uint8(3)
    third = (b[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    q = low.reshape(n, 256) | (third.reshape(n, 256) << np.uint8(2))
    lo = (b[:, 96:104].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16) & np.uint8(15)
    hi = (b[:, 104:108].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16) & np.uint8(3)
    signed = ((lo | (hi << np.uint8(4))).astype(np.int16) - 32).astype(np.int8)
    d = b[:, 108:110].copy().view("<f2")
    with np.errstate(over="ignore"):   # past float16: the caller's finite check refuses the repack
        bias = (d.astype(np.float32) * -4).astype(np.float16)
    return q, superblocks.pack(d, signed).reshape(n, -1), superblocks.pack(bias, signed).reshape(n, -1)


def _q6_k(b):   # 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 sub-block scales sc, d
    # f16; w = d * sc * (q - 32) a sub-block of 16: in two levels d and sc, and -32 d with the
    # same sc for the biases (-32 d * sc: exact, a power of two times the scale)
    n = len(b)
    lo = b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    hi = b[:, 128:192].reshape(n, 2, 1, 32) >> _CRUMBS
    q = (lo & np.uint8(0x0F)).reshape(n, 256) | ((hi & np.uint8(3)).reshape(n, 256) << np.uint8(4))
    sc, d = b[:, 192:208].view(np.int8), b[:, 208:210].copy().view("<f2")
    with np.errstate(over="ignore"):   # past float16: the caller's finite check refuses the repack
        bias = (d.astype(np.float32) * -32).astype(np.float16)
    return q, superblocks.pack(d, sc).reshape(n, -1), superblocks.pack(bias, sc).reshape(n, -1)


def _mxfp4(b):   # an E8M0 exponent e, 16 bytes of nibbles; w = 2^(e-128) * kvalues_mxfp4[q], E2M1's
    # values doubled: mxfp4.LEVELS less its offset 12
    d = gguf.quants.MXFP4.e8m0_to_fp32_half(b[:, 0:1])   # ggml's own power of two, subnormals too
    return _nibbles(b[:, 1:], 16), d, -mxfp4.OFFSET * d


BLOCK_TYPES = {QType.Q4_0: _BlockType(4, _q4_0), QType.Q4_1: _BlockType(4, _q4_1),
               QType.Q4_K: _BlockType(4, _q4_k, True), QType.Q5_0: _BlockType(4, _q5_0, planes=1),
               QType.Q5_1: _BlockType(4, _q5_1, planes=1), QType.Q5_K: _BlockType(4, _q5_k, True, planes=1),
               QType.Q8_0: _BlockType(8, _q8_0),
               QType.IQ4_NL: _BlockType(4, _iq4_nl, values=_IQ4_NL_LEVELS),
               QType.Q2_K: _BlockType(4, _q2_k, True, group_size=16),
               QType.Q3_K: _BlockType(4, _q3_k, True, signed=True, group_size=16),
               QType.Q6_K: _BlockType(4, _q6_k, True, planes=2, signed=True, group_size=16),
               QType.IQ4_XS: _BlockType(4, _iq4_xs, True, values=_IQ4_NL_LEVELS, signed=True),
               QType.MXFP4: _BlockType(4, _mxfp4, values=mxfp4.LEVELS, bf16=True)}


def repack(data: np.ndarray, qtype: QType) -> Repacked | None:
    """A GGUF matrix of one of BLOCK_TYPES (its bytes, [N, bytes per row]), or experts' matrices
    stacked ([E, N, bytes per row]), in MLX's layout. None where a table's top level times a
    scale is no finite float32, so that the levels would not give the file's weights (an MXFP4
    exponent above 251: weights of 2^124 and more; a damaged IQ4_NL scale): the caller
    dequantizes such a matrix instead."""
    *stacked, n, row_bytes = data.shape
    kind = BLOCK_TYPES[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = data.reshape(-1, row_bytes)   # every row is repacked alone: the experts' rows as one matrix's
    rows, cols = len(data), row_bytes // type_size * block_size   # N (all experts'), K
    weight = np.empty((rows, cols * kind.bits // 32), np.uint32)  # [N, K*bits/32]
    high = np.empty((rows, planes.width(cols, kind.planes)), np.uint8) if kind.planes else None
    scales = (np.empty(superblocks.shape(rows, cols, kind.group_size), np.int8 if kind.signed else np.uint8)
              if kind.two_level else np.empty((rows, cols // GROUP_SIZE), np.float32))   # [N, K/32]
    biases = np.empty_like(scales)
    step = max(1, _STEP // cols)
    for r in range(0, rows, step):
        part = data[r:r + step]
        m = len(part)
        with np.errstate(invalid="ignore", over="ignore"):   # a damaged f16 scale: the caller
            q, s, b = kind.decode(part.reshape(-1, type_size))   # checks scales and biases
            if (kind.values is not None or kind.signed) and not _finite(s, b, kind):
                return None
        q = q.reshape(m, cols)
        weight[r:r + m] = pack(q & np.uint8(15) if kind.planes else q, kind.bits)
        if kind.planes:
            high[r:r + m] = planes.pack(q >> np.uint8(4), kind.planes)
        scales[r:r + m], biases[r:r + m] = s.reshape(scales[r:r + m].shape), b.reshape(scales[r:r + m].shape)
    weight, scales, biases = (a.reshape(*stacked, n, *a.shape[1:]) for a in (weight, scales, biases))
    if high is not None:
        high = high.reshape(*stacked, n, high.shape[1])
    if not kind.two_level:
        scales, biases = _narrowed(scales, biases, kind.bf16)
    return Repacked(weight, scales, biases, kind.bits, kind.values, high, kind.group_size)


def _finite(s: np.ndarray, b: np.ndarray, kind: _BlockType) -> bool:
    """Whether the largest integer (a table's top level) times every scale, and every bias, is a
    finite float32 (else the repack would not give the file's weights: a bias's float16 overflowed,
    or a level past float32)."""
    if kind.two_level:
        s, b = (superblocks.expand(a.reshape(len(a), 1, -1)) for a in (s, b))
    top = (1 << (kind.bits + kind.planes)) - 1 if kind.values is None else kind.values.max()
    return bool(np.isfinite(s * np.float32(top)).all() and np.isfinite(b).all())


def _narrowed(scales: np.ndarray, biases: np.ndarray, bf16: bool) -> tuple:
    """float32 scales and biases as float16 where that keeps every value (half the bytes) and bf16
    is not asked for, else as bfloat16 HalfTensors where that does (MXFP4's powers of two, past
    float16's range too), else as they are."""
    with np.errstate(over="ignore"):   # a value too large for float16 is caught below
        half = scales.astype(np.float16), biases.astype(np.float16)
    if not bf16 and all(np.array_equal(h.astype(np.float32), x) for h, x in zip(half, (scales, biases))):
        return half
    bits = [x.view(np.uint32) for x in (scales, biases)]   # a bfloat16 is a float32's top half
    if not any((b & np.uint32(0xFFFF)).any() for b in bits):
        return tuple(HalfTensor((b >> 16).astype(np.uint16), bf16=True) for b in bits)
    return scales, biases


def as_blocks(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
              group_size: int, exact: bool = True) -> tuple[QType, np.ndarray] | None:
    """A matrix in MLX's affine layout, its scales and biases as float32 values [(E,) N, K/G],
    as the blocks of the GGUF type that holds it exactly ([(E,) N, bytes per row]), or None where
    none does. 4-bit integers in groups of a whole number of blocks of 32, their scales and biases
    float16 values: Q4_0 where every bias is -8 times its scale, else Q4_1 (a group of 64 is two
    blocks of the same scale and bias); 8-bit integers whose biases are -128 times their scales,
    likewise: Q8_0. The inverse of `repack` for those types. exact=False: scales and biases that
    are not float16 values rounded to the nearest ones (finite), the integers as they are."""
    *stacked, n, words = weight.shape
    K = words * 32 // bits
    if bits not in (4, 8) or group_size % GROUP_SIZE or K % group_size:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        d, m = (np.repeat(a, group_size // GROUP_SIZE, axis=-1).astype(np.float16) for a in (scales, biases))
    if not all(np.array_equal(h.astype(np.float32), a.repeat(group_size // GROUP_SIZE, axis=-1))
               if exact else np.isfinite(h).all() for h, a in ((d, scales), (m, biases))):
        return None
    offset = np.float32(1 << (bits - 1))
    centred = np.array_equal(m.astype(np.float32), -offset * d.astype(np.float32))
    if bits == 8 and not centred:
        return None
    q = unpack(weight.reshape(-1, words), bits).reshape(-1, K // GROUP_SIZE, GROUP_SIZE)
    head = [d.reshape(-1, K // GROUP_SIZE, 1).view(np.uint8)]
    if bits == 8:
        qtype, body = QType.Q8_0, q ^ np.uint8(0x80)   # q - 128 as an int8's byte
    else:
        qtype, body = QType.Q4_0 if centred else QType.Q4_1, q[..., :16] | (q[..., 16:] << np.uint8(4))
        if qtype == QType.Q4_1:
            head.append(m.reshape(-1, K // GROUP_SIZE, 1).view(np.uint8))
    blocks = np.concatenate([*head, body], axis=-1)
    return qtype, blocks.reshape(*stacked, n, -1)


def as_k_blocks(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, high: np.ndarray | None,
                group_size: int) -> tuple[QType, np.ndarray] | None:
    """A matrix `repack` made of a K-quant (4-bit words, scales and biases in two levels, high
    planes) as that type's blocks again, byte for byte ([N, bytes per row]): Q4_K (groups of 32),
    Q5_K (and one plane), Q6_K (groups of 16, signed, two planes, biases -32 times the scales);
    None for anything else."""
    n, words = weight.shape
    K = words * 8
    count = 0 if high is None else planes.count(high, K)
    kind = {(32, 0, np.uint8): QType.Q4_K, (32, 1, np.uint8): QType.Q5_K, (16, 2, np.int8): QType.Q6_K}.get(
        (group_size, count, scales.dtype.type))
    if kind is None or K % superblocks.SUPER or biases.dtype != scales.dtype:
        return None
    q = unpack(weight, 4)
    if count:
        q |= planes.unpack(high, K) << np.uint8(4)
    q = q.reshape(-1, superblocks.SUPER)                                   # a super-block a row
    s, b = (a.reshape(len(q), -1).view(np.uint8) for a in (scales, biases))
    d, sc, bias_super, m = s[:, :2], s[:, 2:], b[:, :2], b[:, 2:]
    if kind == QType.Q6_K:
        if not (np.array_equal(sc, m) and np.array_equal(
                bias_super.view("<f2"), (d.view("<f2").astype(np.float32) * -32).astype(np.float16))):
            return None
        lo, hi = q & np.uint8(15), q >> np.uint8(4)
        low = lo.reshape(-1, 2, 2, 64)
        crumbs = hi.reshape(-1, 2, 4, 32) << _CRUMBS.reshape(1, 1, 4, 1)
        blocks = np.concatenate([(low[:, :, 0] | (low[:, :, 1] << np.uint8(4))).reshape(-1, 128),
                                 np.bitwise_or.reduce(crumbs, axis=2).reshape(-1, 64), sc, d], axis=1)
    else:
        if (sc > 63).any() or (m > 63).any():
            return None
        dmin = (bias_super.copy().view("<u2") ^ np.uint16(0x8000)).view(np.uint8)   # -(-dmin), exactly
        packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> np.uint8(4)) << np.uint8(6)),
                                 m[:, :4] | ((m[:, 4:] >> np.uint8(4)) << np.uint8(6)),
                                 (sc[:, 4:] & np.uint8(15)) | ((m[:, 4:] & np.uint8(15)) << np.uint8(4))], axis=1)
        runs = (q & np.uint8(15)).reshape(-1, 4, 2, 32)
        nibbles = (runs[:, :, 0] | (runs[:, :, 1] << np.uint8(4))).reshape(-1, 128)
        fifth = [np.packbits((q >> np.uint8(4)).reshape(-1, 8, 32).transpose(0, 2, 1), axis=-1,
                             bitorder="little").reshape(-1, 32)] if kind == QType.Q5_K else []
        blocks = np.concatenate([d, dmin, packed, *fifth, nibbles], axis=1)
    return kind, np.ascontiguousarray(blocks).reshape(n, -1)
