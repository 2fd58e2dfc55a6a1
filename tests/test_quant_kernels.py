"""The quantized CPU kernels against a numpy twin that dequantizes MLX's affine layout from the spec.

The twin unpacks the uint32 words with numpy shifts (element k of a row: word k*bits//32, bit offset
(k*bits) % 32) and computes in float64; it shares no code with the kernels, which read bytes.
Where the CPU multiplies bytes (linear.int8_activations) decode (T <= SMALL) and prefill round the
activations to int8 per block of 32: both are compared with the integer twin (tests/reference.py),
exact but for float32 sums (1e-6 of the magnitude bound |x| @ |W|.T). Elsewhere decode rounds them
to int16 per group (matvec_rows16, tested on every CPU) and prefill stays in float32: both are
compared with the float product at 1e-4 of the bound.
"""
import numpy as np
import pytest
from numba import njit

from nibble.formats import planes, superblocks
from nibble.formats.half import HalfTensor
from nibble.runner.kernels import linear
from nibble.quant import affine
from nibble.quant.affine import QuantizedTensor
from nibble.runner.kernels.cpu import SMALL
from nibble.runner.kernels.quant_decode import matvec_rows, matvec_rows16
from nibble.runner.kernels.linear import prepare, qmatmul
from nibble.runner.kernels.prefill import dequantize, dequantize_rows
from tests import reference

rng = np.random.default_rng(0)


def mlx_weight(N, K, bits, G):
    """Random MLX tensors: uint32 words [N, K*bits/32], float16 scales and biases [N, K/G]."""
    w = rng.integers(0, 2**32, size=(N, K * bits // 32), dtype=np.uint32)
    scales = (rng.random((N, K // G)) * 0.02 + 1e-3).astype(np.float16)
    biases = (rng.standard_normal((N, K // G)) * 0.05).astype(np.float16)
    return w, scales, biases


def as_kind(a, kind):
    """float16 values a as stored in a file of `kind`: float16, bfloat16 (a HalfTensor of the top
    halves of their float32 bits: other values, as exact) or float32 (a GGUF K-quant's d * sc)."""
    if kind == "bfloat16":
        return HalfTensor((a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16), True)
    return a.astype(kind)


def twin_integers(w, bits):
    """uint32 [N, K]: the integers q[n, k] of MLX's words, per the spec."""
    N, per_word = w.shape[0], 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * bits           # bit offset of each element
    q = (w[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)      # [N, K/per_word, per_word]
    return q.reshape(N, -1)                                         # element k = word k//per_word


def twin_dequantize(w, scales, biases, bits, G):
    """float64 [N, K]: w[n, k] = scales[n, k//G] * q[n, k] + biases[n, k//G], per the MLX spec."""
    q = twin_integers(w, bits).astype(np.float64)
    groups = np.arange(q.shape[1]) // G
    return np.asarray(scales, np.float64)[:, groups] * q + np.asarray(biases, np.float64)[:, groups]


def check(out, x, W, before, accumulate, rel=1e-4):
    want = x.astype(np.float64) @ W.T + (before if accumulate else 0)
    bound = np.abs(x) @ np.abs(W).T + np.abs(before)
    assert np.all(np.abs(out - want) <= rel * bound + 1e-6), np.abs(out - want).max()


def check_product(out, x, w, s, b, bits, G, before, accumulate, int8):
    """out against x @ W.T (+ before): on int8 x (int8) the integer twin's, else the float one's."""
    if not int8:
        check(out, x, twin_dequantize(w, s, b, bits, G), before, accumulate)
        return
    s64, b64 = np.asarray(s, np.float64), np.asarray(b, np.float64)
    want = reference.int8_product(x, twin_integers(w, bits).astype(np.int64), s64, b64, G) + (before if accumulate else 0)
    bound = np.abs(x) @ np.abs(twin_dequantize(w, s, b, bits, G)).T + np.abs(before)
    assert np.all(np.abs(out - want) <= 1e-6 * bound + 1e-6), np.abs(out - want).max()


# the decode kernels this CPU runs: matvec_rows16 everywhere, matvec_rows on int8 x where it multiplies bytes
DECODE = [matvec_rows16] + ([matvec_rows] if linear.int8_activations() else [])


def k_for(bits, G):
    # 4-bit, G = 32: an odd number of groups leaves a last half block (the float tail)
    return 7 * 32 if (bits, G) == (4, 32) else 3 * G


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("T", [1, 2, 3, 8, 70])   # decode rows: pairs and a remainder; tiles
@pytest.mark.parametrize("accumulate", [False, True])
def test_qmatmul(bits, G, T, accumulate):
    N, K = 37, k_for(bits, G)          # N odd: rows pair up as (i, i + 19), the last one alone
    w, s, b = mlx_weight(N, K, bits, G)
    x = rng.standard_normal((T, K)).astype(np.float32)
    out = rng.standard_normal((T, N)).astype(np.float32)
    before = out.copy()
    qmatmul(x, prepare(QuantizedTensor(w, s, b, bits, G)), out, accumulate)
    check_product(out, x, w, s, b, bits, G, before, accumulate, linear.int8_activations())


@pytest.mark.parametrize("kernel", DECODE)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("G,K", [(128, 1536), (32, 6176), (64, 6144)])
def test_decode_on_larger_rows(kernel, bits, G, K):
    """Several blocks per group and many rows, the decode path's steady state, and long rows of x
    (Llama-2-7B's down projection); the last rows prefetch past the end of the weight."""
    N = 301
    w, s, b = mlx_weight(N, K, bits, G)
    x = rng.standard_normal((1, K)).astype(np.float32)
    x[0, 5] = 40.0                                   # an outlier channel, as LLM activations have
    out = np.empty((1, N), np.float32)
    kernel(x, prepare(QuantizedTensor(w, s, b, bits, G)), out, False)
    check_product(out, x, w, s, b, bits, G, out * 0, False, kernel is matvec_rows)


@pytest.mark.parametrize("kernel", DECODE)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("B", [2, 3, 5, SMALL])
def test_decode_rows_are_each_as_alone(kernel, bits, G, B):
    """Every row of x bit-identical to the same row through the kernel alone (B = 1, which is
    decode): batched sequences decode as they would one by one."""
    N, K = 37, k_for(bits, G)
    w, s, b = mlx_weight(N, K, bits, G)
    qw = prepare(QuantizedTensor(w, s, b, bits, G))
    x = rng.standard_normal((B, K)).astype(np.float32)
    x[1, 3] = 30.0                                   # rows of other magnitudes beside each other
    out = np.empty((B, N), np.float32)
    kernel(x, qw, out, False)
    check_product(out, x, w, s, b, bits, G, out * 0, False, kernel is matvec_rows)
    for r in range(B):
        alone = np.empty((1, N), np.float32)
        kernel(x[r:r + 1], qw, alone, False)
        np.testing.assert_array_equal(out[r], alone[0])


# Each group size with the 16-bit kinds, float32 with one: the kernels read a scale by its dtype
# whatever the group size, and each kind of weight compiles them anew (about 20 s).
@pytest.mark.parametrize("kind, G", [(k, G) for k in ("float16", "bfloat16") for G in (32, 64, 128)] + [("float32", 32)])
@pytest.mark.parametrize("bits", [4, 8])
def test_scales_and_biases_are_read_as_stored(kind, bits, G):
    """16-bit scales and biases stay 16-bit (their bits, no copy: decode reads the file's bytes),
    float32 ones float32; decode (each row as alone) and prefill both read them right."""
    N, K = 37, k_for(bits, G)
    w, s, b = mlx_weight(N, K, bits, G)
    s, b = as_kind(s, kind), as_kind(b, kind)
    qw = prepare(QuantizedTensor(w, s, b, bits, G))
    assert qw.nbytes == w.nbytes + s.nbytes + b.nbytes
    if kind != "float32":
        assert qw.scales.dtype == np.uint16 and qw.bf16 == (kind == "bfloat16")
        assert np.shares_memory(qw.scales, s.bits if kind == "bfloat16" else s)
    W = twin_dequantize(w, s, b, bits, G)
    for T in (5, 70):                                # decode rows, prefill tiles
        x = rng.standard_normal((T, K)).astype(np.float32)
        out = np.empty((T, N), np.float32)
        qmatmul(x, qw, out, False)
        check_product(out, x, w, s, b, bits, G, out * 0, False, linear.int8_activations())
        if T <= SMALL:
            for r in range(T):
                alone = np.empty((1, N), np.float32)
                qmatmul(x[r:r + 1], qw, alone, False)
                np.testing.assert_array_equal(out[r], alone[0])
    np.testing.assert_allclose(dequantize(linear.row_block(qw, 3, 9)), W[3:9], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("K", [64, 70])          # whole steps of 16, and leftovers
def test_16_bit_decode_rows_are_each_as_alone(bf16, K):
    w32 = rng.standard_normal((29, K)).astype(np.float32)
    w = HalfTensor((w32.view(np.uint32) >> 16).astype(np.uint16) if bf16 else w32.astype(np.float16).view(np.uint16), bf16)
    x = rng.standard_normal((5, K)).astype(np.float32)
    out = np.empty((5, 29), np.float32)
    qmatmul(x, w, out, False)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.widen().T, rtol=1e-5, atol=1e-5)
    for r in range(5):
        alone = np.empty((1, 29), np.float32)
        qmatmul(x[r:r + 1], w, alone, False)
        np.testing.assert_array_equal(out[r], alone[0])


def test_zero_activations():
    w, s, b = mlx_weight(8, 64, 8, 64)
    out = np.ones((1, 8), np.float32)
    qmatmul(np.zeros((1, 64), np.float32), prepare(QuantizedTensor(w, s, b, 8, 64)), out, True)
    np.testing.assert_array_equal(out, 1)


@pytest.mark.parametrize("bits", [4, 8])
def test_memmapped_weights_are_not_copied(tmp_path, bits):
    N, K, G = 19, 128, 64
    w, s, b = mlx_weight(N, K, bits, G)
    w.tofile(tmp_path / "w.bin")
    mapped = np.memmap(tmp_path / "w.bin", np.uint32, "r", shape=w.shape)
    qw = prepare(QuantizedTensor(mapped, s, b, bits, G))
    assert np.shares_memory(qw.weight, mapped) and not qw.weight.flags.writeable
    W = twin_dequantize(w, s, b, bits, G)
    for T in (1, 5):
        x = rng.standard_normal((T, K)).astype(np.float32)
        out = np.zeros((T, N), np.float32)
        qmatmul(x, qw, out, False)
        check_product(out, x, w, s, b, bits, G, out * 0, False, linear.int8_activations())
    np.testing.assert_allclose(dequantize(qw), W, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("G", [32, 128])
def test_dequantize(bits, G):
    w, s, b = mlx_weight(23, 2 * G, bits, G)
    qw, W = prepare(QuantizedTensor(w, s, b, bits, G)), twin_dequantize(w, s, b, bits, G)
    np.testing.assert_allclose(dequantize(qw), W, rtol=1e-6, atol=1e-6)
    ids = np.array([3, 0, 22, 3])
    np.testing.assert_allclose(dequantize_rows(qw, ids), W[ids], rtol=1e-6, atol=1e-6)
    with pytest.raises(IndexError):
        dequantize_rows(qw, np.array([23]))


def test_prepare_rejects_what_no_kernel_reads():
    w, s, b = mlx_weight(4, 64, 4, 64)
    with pytest.raises(ValueError, match="groups of 32"):
        prepare(QuantizedTensor(w, s, b, 4, 64, values=LEVELS[0]))
    w, s, b = mlx_weight(4, 64, 8, 32)
    with pytest.raises(ValueError, match="no kernel for 3-bit weights"):
        prepare(QuantizedTensor(w, s, b, 3, 32))
    with pytest.raises(ValueError, match="no kernel for 8-bit weights in groups of 16"):
        prepare(QuantizedTensor(w, s, b, 8, 16))
    with pytest.raises(ValueError, match="scales and biases must be"):
        prepare(QuantizedTensor(w, s, b, 8, 64))
    with pytest.raises(ValueError, match="uint32"):
        prepare(QuantizedTensor(w.view(np.int32), s, b, 8, 32))
    with pytest.raises(ValueError, match="out"):
        qmatmul(np.zeros((1, 64), np.float32), prepare(QuantizedTensor(w, s, b, 8, 32)), np.zeros((1, 5), np.float32), False)


@njit(cache=True)
def _block(x, w_in, w_out, h, out):
    """A toy layer, as the jitted decoder calls its projections: float or quantized alike."""
    linear.linear(x, w_in, h, False)
    linear.linear(h, w_out, out, True)


@pytest.mark.parametrize("T", [1, 4])
def test_linear_inside_njit_dispatches_on_the_weight_type(T):
    K, F = 64, 96
    w, s, b = mlx_weight(F, K, 4, 32)
    w_in = prepare(QuantizedTensor(w, s, b, 4, 32))                                  # quantized [F, K]
    w_out = rng.standard_normal((K, F)).astype(np.float32)          # float32 [K, F]
    x = rng.standard_normal((T, K)).astype(np.float32)
    h, out = np.empty((T, F), np.float32), np.ones((T, K), np.float32)
    _block(x, w_in, w_out, h, out)
    check_product(h, x, w, s, b, 4, 32, h * 0, False, linear.int8_activations())
    np.testing.assert_allclose(out, 1 + h.astype(np.float64) @ w_out.T, rtol=1e-4, atol=1e-4)
    assert isinstance(w_in, QuantizedTensor)
    linear.linear(x, w_in, h, False)                                # and from Python
    check_product(h, x, w, s, b, 4, 32, h * 0, False, linear.int8_activations())



def two_level(N, K, rng):
    """Scales or biases in two levels (formats.superblocks) for groups of 32: random float16
    super-scales of either sign, 6-bit integers."""
    supers = (rng.choice([-1, 1], (N, K // 256)) * 10 ** rng.uniform(-4, -1, (N, K // 256))).astype(np.float16)
    return superblocks.pack(supers, rng.integers(0, 64, (N, K // 32), dtype=np.uint8))


def test_two_level_scales_run_as_their_float32_values():
    """A GGUF K-quant's scales and biases, read in their two levels as stored (no copy, 10 bytes a
    super-block), give the kernels' results bit for bit as the same values stored as float32:
    decode (each row as alone), prefill, the embedding's rows; the int16 decode (CPUs without byte
    products) against the twin (bit for bit too would compile it for float32 scales as well).
    4-bit integers, as every K-quant holds them (formats/gguf_blocks.BLOCK_TYPES): 8-bit ones in
    two levels would compile every kernel once more for weights no file has, and the kernels read
    8-bit integers alike whatever their scales (the tests above)."""
    N, K, bits = 37, 768, 4
    w = rng.integers(0, 2**32, size=(N, K * bits // 32), dtype=np.uint32)
    s, b = two_level(N, K, rng), two_level(N, K, rng)
    qw = prepare(QuantizedTensor(w, s, b, bits, 32))
    assert np.shares_memory(qw.scales, s) and qw.nbytes == w.nbytes + 2 * N * 3 * 10
    flat = prepare(QuantizedTensor(w, superblocks.expand(s), superblocks.expand(b), bits, 32))
    assert flat.scales.dtype == np.float32
    for T in (1, 2, 5, 70):
        x = rng.standard_normal((T, K)).astype(np.float32)
        got, want = np.empty((T, N), np.float32), np.empty((T, N), np.float32)
        qmatmul(x, qw, got, False)
        qmatmul(x, flat, want, False)
        np.testing.assert_array_equal(got, want)
        if T <= SMALL:
            matvec_rows16(x, qw, got, False)
            check_product(got, x, w, superblocks.expand(s), superblocks.expand(b), bits, 32, got * 0, False, False)
    np.testing.assert_array_equal(dequantize(linear.row_block(qw, 3, 9)), dequantize(linear.row_block(flat, 3, 9)))
    ids = np.array([0, 36, 5])
    np.testing.assert_array_equal(dequantize_rows(qw, ids), dequantize_rows(flat, ids))


# levels of the 4-bit formats that are not evenly spaced, as nibble holds them (plus an offset that
# the biases take back): MXFP4's E2M1 values times 2 plus 12, IQ4_NL's kvalues plus 128; and any
LEVELS = [np.array([12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], np.uint8),
          np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]).astype(np.uint8) + 128,
          np.random.default_rng(1).integers(0, 256, 16).astype(np.uint8)]


def check_every_kernel(qw, q, scales, biases):
    """Every kernel on the prepared 4-bit qw in groups of G against the twin of its integers q
    [N, K] as they stand for (levels, high bits) and float64 scales and biases [N, K/G]: qmatmul
    (decode and prefill), each decode kernel this CPU runs, dequantized rows. Returns the twin's W."""
    N, K = q.shape
    G = qw.group_size
    W = scales.repeat(G, 1) * q + biases.repeat(G, 1)
    for T in (1, 2, 3, 70):
        x = rng.standard_normal((T, K)).astype(np.float32)
        bound = np.abs(x) @ np.abs(W).T
        int8 = reference.int8_product(x, q.astype(np.int64), scales, biases, G)
        got = np.empty((T, N), np.float32)
        for kernel in [qmatmul] + (DECODE if T <= SMALL else []):
            kernel(x, qw, got, False)
            if linear.int8_activations() and kernel is not matvec_rows16:
                assert np.all(np.abs(got - int8) <= 1e-6 * bound + 1e-6), (kernel, T)
            else:
                check(got, x, W, 0, False)
    np.testing.assert_allclose(dequantize_rows(qw, np.array([N - 1, 0])), W[[N - 1, 0]], rtol=1e-6, atol=1e-7)
    return W


@pytest.mark.parametrize("values", LEVELS)
def test_a_table_of_levels_reads_each_integer_as_its_level(values):
    """4-bit integers read through a table of levels (QuantizedTensor.values: MXFP4, IQ4_NL): every
    kernel computes W = scales * values[q] + biases, against the twin of the same integers mapped
    by the table; K with an odd number of groups, so the last half block's tail reads them too."""
    N, K = 37, 7 * 32
    w, s, b = mlx_weight(N, K, 4, 32)
    qw = prepare(QuantizedTensor(w, s, b, 4, 32, values=values))
    W = check_every_kernel(qw, values[twin_integers(w, 4)].astype(np.float64), s.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(dequantize(qw), W, rtol=1e-6, atol=1e-7)


def test_signed_two_level_scales_with_levels_run_as_iq4_xs_is_read():
    """IQ4_XS's layout: 4-bit integers through IQ4_NL's table of levels, scales and biases in two
    levels whose integers have a sign (int8, ls - 32): every kernel computes W = scales *
    values[q] + biases against the twin, the scales read with their signs."""
    N, K = 37, 768
    w = rng.integers(0, 2**32, size=(N, K // 8), dtype=np.uint32)
    signed = rng.integers(-32, 32, (N, K // 32)).astype(np.int8)
    supers = (10 ** rng.uniform(-4, -2, (N, K // 256))).astype(np.float16)
    s, b = superblocks.pack(supers, signed), superblocks.pack((supers.astype(np.float32) * -128).astype(np.float16), signed)
    values = LEVELS[1]
    qw = prepare(QuantizedTensor(w, s, b, 4, 32, values=values))
    assert qw.scales.dtype == np.int8 and np.shares_memory(qw.scales, s)
    scales, biases = superblocks.expand(s).astype(np.float64), superblocks.expand(b).astype(np.float64)
    assert (scales < 0).any() and (scales > 0).any()
    W = check_every_kernel(qw, values[twin_integers(w, 4)].astype(np.float64), scales, biases)
    np.testing.assert_array_equal(affine.dequantize(QuantizedTensor(w, s, b, 4, 32, values=values)), W.astype(np.float32))


@pytest.mark.parametrize("hb", [1, 2])
def test_high_planes_add_their_bits_above_the_nibbles(hb):
    """5- and 6-bit integers, 4-bit words and 1 or 2 high planes (QuantizedTensor.high: GGUF's Q5
    types): every kernel computes W = scales * (q + 16 h) + biases against the twin, on K of a
    whole super-block and a rest with an odd number of groups (prefill's superblock and its
    scalar rest, decode's blocks and its last half block)."""
    N, K = 37, 13 * 32
    w, s, b = mlx_weight(N, K, 4, 32)
    top = rng.integers(0, 2**hb, (N, K), dtype=np.uint8)
    qt = QuantizedTensor(w, s, b, 4, 32, high=planes.pack(top, hb))
    qw = prepare(qt)
    assert qw.integer_bits == 4 + hb and qw.nbytes == w.nbytes + s.nbytes + b.nbytes + N * hb * 2 * 32
    W = check_every_kernel(qw, twin_integers(w, 4) + (top.astype(np.float64) * 16), s.astype(np.float64),
                           b.astype(np.float64))
    np.testing.assert_allclose(dequantize(qw), W, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(affine.dequantize(qt), W, rtol=1e-6, atol=1e-7)


def test_six_bit_integers_in_groups_of_16_run_as_q6_k_is_read():
    """Q6_K's layout: 4-bit words and two high planes (integers 0..63), in groups of 16 whose
    scales and biases are in two levels of 16 signed integers a super-block: every kernel computes
    W = scales * (q + 16 h) + biases against the twin (int8 x: two groups to each of x's blocks,
    prefill's lane sums made float each half superblock)."""
    N, K = 37, 768
    w = rng.integers(0, 2**32, size=(N, K // 8), dtype=np.uint32)
    top = rng.integers(0, 4, (N, K), dtype=np.uint8)
    sc = rng.integers(-128, 128, (N, K // 16)).astype(np.int8)
    d = (10 ** rng.uniform(-5, -3, (N, K // 256))).astype(np.float16)
    s, b = superblocks.pack(d, sc), superblocks.pack((d.astype(np.float32) * -32).astype(np.float16), sc)
    qt = QuantizedTensor(w, s, b, 4, 16, high=planes.pack(top, 2))
    qw = prepare(qt)
    assert qw.scales.shape == (N, 3, 18) and qw.integer_bits == 6
    assert 8 * qw.nbytes / (N * K) == 4 + 2 + 2 * 18 * 8 / 256   # the file's 6.5625, and 16 bits of biases
    W = check_every_kernel(qw, twin_integers(w, 4) + top.astype(np.float64) * 16,
                           superblocks.expand(s).astype(np.float64), superblocks.expand(b).astype(np.float64))
    np.testing.assert_array_equal(affine.dequantize(qt), W.astype(np.float32))
    with pytest.raises(ValueError, match="two levels"):
        prepare(QuantizedTensor(w, superblocks.expand(s), superblocks.expand(b), 4, 16))


def test_two_level_scales_expand_as_ggml_multiplies():
    """superblocks.expand: float32(f16 super) * float32(integer), ggml's product, bit for bit."""
    s = two_level(5, 512, rng)
    supers = s[:, :, :2].copy().view(np.float16).astype(np.float32)              # [5, 2, 1]
    want = (supers * s[:, :, 2:].astype(np.float32)).reshape(5, 16)
    np.testing.assert_array_equal(superblocks.expand(s), want)
