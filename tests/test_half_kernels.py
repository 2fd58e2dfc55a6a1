"""The 16-bit float kernels (bf16, f16 widened on the fly) against numpy on the widened weights.

Widening is exact, so only the order of the float32 sums differs from numpy's float64 product:
they agree to 1e-5 of the magnitude bound |x| @ |W|.T.
"""
import numpy as np
import pytest

from nibble.formats.half import HalfTensor
from nibble.runner.kernels.linear import linear, qmatmul
from nibble.runner.kernels.prefill import dequantize, dequantize_rows

rng = np.random.default_rng(0)


def half_weight(N, K, bf16):
    """A random HalfTensor [N, K] and its values as float32, widened independently of the kernels."""
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    if bf16:   # truncate: the bf16 value is the float32 with its low 16 bits cleared
        return HalfTensor((w.view(np.uint32) >> 16).astype(np.uint16), True), \
            (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    h = w.astype(np.float16)
    return HalfTensor.of_float16(h), h.astype(np.float32)


def check(out, x, W, before, accumulate):
    want = x.astype(np.float64) @ W.T.astype(np.float64) + (before if accumulate else 0)
    bound = np.abs(x) @ np.abs(W).T + np.abs(before)
    assert np.all(np.abs(out - want) <= 1e-5 * bound), np.abs(out - want).max()


# K: whole 16-value steps, whole 8-lane vectors and leftovers; N odd and even
SHAPES = [(37, 128), (16, 200), (5, 7), (24, 203), (49, 576)]


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("T", [1, 3, 70])
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul(bf16, N, K, T, accumulate):
    w, W = half_weight(N, K, bf16)
    x = rng.standard_normal((T, K)).astype(np.float32)
    out = rng.standard_normal((T, N)).astype(np.float32)
    before = out.copy()
    qmatmul(x, w, out, accumulate)
    check(out, x, W, before, accumulate)


@pytest.mark.parametrize("bf16", [True, False])
def test_linear_dispatches_16_bit_weights(bf16):
    w, W = half_weight(24, 64, bf16)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    out = np.zeros((2, 24), np.float32)
    linear(x, w, out, False)
    check(out, x, W, out * 0, False)


@pytest.mark.parametrize("bf16", [True, False])
def test_widening_is_exact(bf16):
    w, W = half_weight(13, 45, bf16)
    np.testing.assert_array_equal(dequantize(w), W)
    np.testing.assert_array_equal(np.asarray(w), W)   # HalfTensor.widen
    ids = np.array([12, 0, 5, 5])
    np.testing.assert_array_equal(dequantize_rows(w, ids), W[ids])


def test_special_values_widen():
    # exact in both formats; 2**-24 is a float16 subnormal
    f = np.array([1.0, -2.0, np.inf, -np.inf, 0.0, -0.0, 0.375, -2.0**15, 2.0**-24], np.float32)
    bf = HalfTensor((f.view(np.uint32) >> 16).astype(np.uint16)[None], True)
    f16 = HalfTensor.of_float16(f.astype(np.float16)[None])
    for w in (bf, f16):
        got = dequantize(w)[0]
        np.testing.assert_array_equal(got, f)
        assert np.signbit(got[5])
    np.testing.assert_array_equal(dequantize(HalfTensor(np.array([[0x7FC0]], np.uint16), True)), [[np.nan]])


def test_shapes_are_checked():
    w, _ = half_weight(4, 16, True)
    with pytest.raises(ValueError, match="x must be"):
        qmatmul(np.zeros((1, 15), np.float32), w, np.zeros((1, 4), np.float32), False)
