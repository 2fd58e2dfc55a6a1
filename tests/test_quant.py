"""Affine quantization: bit packing, error bounds, and the scale search against min/max rounding."""
import numpy as np
import pytest

from nibble.formats.errors import NibbleError
from nibble.quant.affine import AffineScheme, dequantize, quantize, reconstruction_error
from nibble.formats.packing import pack, unpack
from nibble.quant.search import search_affine
from tests import reference

SCHEMES = [AffineScheme(b, g) for b in (4, 8) for g in (32, 64, 128)]


def gaussian(rows=256, cols=512, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def test_pack_puts_element_zero_in_the_lowest_bits():
    q4 = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 15, 0, 0, 0, 0, 0, 0, 9]], dtype=np.uint8)
    assert pack(q4, 4).tolist() == [[0x87654321, 0x9000000F]]
    q8 = np.array([[0x01, 0x02, 0x03, 0xFF, 0x10, 0, 0, 0x80]], dtype=np.uint8)
    assert pack(q8, 8).tolist() == [[0xFF030201, 0x80000010]]
    assert pack(q4, 4).dtype == np.uint32


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_matches_the_layout_formula_and_round_trips(bits):
    q = np.random.default_rng(bits).integers(0, 1 << bits, (5, 64)).astype(np.uint8)
    packed = pack(q, bits)
    assert packed.shape == (5, 64 * bits // 32)
    # Element k sits in word k*bits//32 at bit offset (k*bits) % 32.
    expected = np.zeros(packed.shape, dtype=np.uint64)
    for k in range(64):
        expected[:, k * bits // 32] |= q[:, k].astype(np.uint64) << np.uint64(k * bits % 32)
    np.testing.assert_array_equal(packed, expected)
    np.testing.assert_array_equal(unpack(packed, bits), q)


def test_scheme_validation():
    with pytest.raises(NibbleError, match="bits must be 4 or 8"):
        AffineScheme(3, 64)
    with pytest.raises(NibbleError, match="group size must be 32, 64 or 128"):
        AffineScheme(8, 16)   # groups of 16 are 4-bit only: GGUF's Q2_K, Q3_K and Q6_K
    assert AffineScheme(4, 16).group_size == 16


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.bits}bit-g{s.group_size}")
def test_quantize_layout_and_error_bound(scheme):
    w = gaussian()
    g = scheme.group_size
    rtn = quantize(w, scheme, method="rtn")
    assert rtn.weight.shape == (256, 512 * scheme.bits // 32) and rtn.weight.dtype == np.uint32
    assert rtn.scales.shape == rtn.biases.shape == (256, 512 // g)
    assert rtn.scales.dtype == rtn.biases.dtype == np.float16
    # Rounding to a uniform grid of step (max-min)/nmax leaves an RMS error of step/sqrt(12).
    groups = w.reshape(256, -1, g)
    step = (groups.max(-1) - groups.min(-1)) / scheme.nmax
    predicted = np.sqrt(np.mean(step**2) / 12) / np.sqrt(np.mean(w**2))
    err_rtn = reconstruction_error(w, rtn)
    err_search = reconstruction_error(w, quantize(w, scheme))
    assert 0.9 * predicted < err_rtn < 1.1 * predicted
    assert err_search < err_rtn
    assert err_search < (0.15 if scheme.bits == 4 else 0.01)


def test_error_is_measured_against_the_float16_values_stored():
    w = gaussian(64, 128, seed=1)
    scheme = AffineScheme(4, 32)
    qt = quantize(w, scheme)
    q = unpack(qt.weight, 4).reshape(64, 4, 32).astype(np.float32)
    w_hat = q * qt.scales.astype(np.float32)[..., None] + qt.biases.astype(np.float32)[..., None]
    np.testing.assert_allclose(dequantize(qt), w_hat.reshape(64, 128), rtol=1e-6)
    expected = np.linalg.norm(w - w_hat.reshape(64, 128)) / np.linalg.norm(w)
    assert reconstruction_error(w, qt) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("method", ["rtn", "search"])
def test_a_matrix_on_a_4bit_grid_is_reproduced(method):
    rng = np.random.default_rng(2)
    q = rng.integers(0, 16, (32, 8, 32))
    q[..., 0], q[..., 1] = 0, 15  # every group spans the whole grid
    s = rng.uniform(0.01, 0.1, (32, 8, 1)).astype(np.float16).astype(np.float32)
    b = rng.uniform(-1, 1, (32, 8, 1)).astype(np.float16).astype(np.float32)
    w = (s * q + b).reshape(32, 256)
    scheme = AffineScheme(4, 32)
    qt = quantize(w, scheme, method=method)
    assert reconstruction_error(w, qt) < 1e-3
    np.testing.assert_array_equal(unpack(qt.weight, 4), q.reshape(32, 256))


def test_constant_groups_are_exact():
    w = np.repeat(np.array([[0.5], [-2.0], [0.0]], dtype=np.float32), 64, axis=1)
    scheme = AffineScheme(4, 64)
    for method in ("rtn", "search"):
        np.testing.assert_array_equal(dequantize(quantize(w, scheme, method=method)), w)


def test_search_is_never_worse_than_rtn_and_clearly_better_with_an_imatrix():
    """The weighted error falls by 16-22% on these matrices; ignoring the imatrix gives half."""
    gains = []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        w = (rng.standard_t(5, (128, 256)) * 0.02).astype(np.float32)
        imatrix = rng.gamma(0.5, size=256).astype(np.float32)  # a few channels dominate
        for scheme in (AffineScheme(4, 64), AffineScheme(8, 32)):
            rtn = reconstruction_error(w, quantize(w, scheme, imatrix, "rtn"), imatrix)
            found = reconstruction_error(w, quantize(w, scheme, imatrix), imatrix)
            blind = reconstruction_error(w, quantize(w, scheme), imatrix)
            assert found <= rtn and found < blind
            gains.append(1 - found / rtn)
    assert np.mean(gains) > 0.1


def test_search_never_loses_group_by_group():
    x = (np.random.default_rng(5).standard_normal((2000, 32)) * 0.1).astype(np.float32)
    imp = np.random.default_rng(6).gamma(0.5, size=32).astype(np.float32)
    lo, hi = x.min(1), x.max(1)
    s, b = search_affine(x, lo, hi, imp, 15)

    def err(s, b):
        q = np.clip(np.rint((x - b[:, None]) / s[:, None]), 0, 15)
        return ((q * s[:, None] + b[:, None] - x) ** 2 * imp).sum(1)

    assert (err(s, b) <= err((hi - lo) / 15, lo) * (1 + 1e-4)).all()


@pytest.mark.parametrize("nmax,most_alike", [(15, 0.95), (255, 0.45)])
@pytest.mark.parametrize("imp_shape", [None, (64,), (12, 64)])
def test_the_search_kernel_fits_as_its_numpy_twin(nmax, most_alike, imp_shape):
    """The same candidates: most groups get the same scale and bias, and the total weighted error is
    the twin's within float32's summing noise (near-ties among 255 levels go either way)."""
    rng = np.random.default_rng(nmax)
    x = (rng.standard_t(5, (40, 12, 64)) * 0.02).astype(np.float32)
    imp = None if imp_shape is None else rng.gamma(0.5, size=imp_shape).astype(np.float32)
    lo, hi = x.min(-1), x.max(-1)
    s, b = search_affine(x, lo, hi, imp, nmax)
    s_ref, b_ref = reference.search_affine(x, lo, hi, imp, nmax)

    def err(s, b):
        q = np.clip(np.rint((x - b[..., None]) / s[..., None]), 0, nmax)
        return ((q * s[..., None] + b[..., None] - x).astype(np.float64) ** 2 * (1 if imp is None else imp)).sum(-1)
    alike = np.isclose(s, s_ref, rtol=1e-5) & np.isclose(b, b_ref, rtol=1e-5, atol=1e-7)
    assert alike.mean() >= most_alike
    assert err(s, b).sum() <= err(s_ref, b_ref).sum() * (1 + 1e-3)


def test_imatrix_and_shape_errors():
    w = gaussian(8, 64)
    scheme = AffineScheme(4, 32)
    with pytest.raises(NibbleError, match=r"shape \(32,\), expected \(64,\)"):
        quantize(w, scheme, np.ones(32, np.float32))
    with pytest.raises(NibbleError, match="non-negative"):
        quantize(w, scheme, -np.ones(64, np.float32))
    with pytest.raises(NibbleError, match="not a multiple of the group size 128"):
        quantize(w, AffineScheme(4, 128))
    with pytest.raises(NibbleError, match="unknown quantization method"):
        quantize(w, scheme, method="gptq")


def test_dequantize_accepts_float32_scales():
    w = gaussian(16, 64, seed=3)
    scheme = AffineScheme(8, 64)
    qt = quantize(w, scheme)
    wide = qt._replace(scales=qt.scales.astype(np.float32), biases=qt.biases.astype(np.float32))
    np.testing.assert_array_equal(dequantize(wide), dequantize(qt))


@pytest.mark.filterwarnings("error::RuntimeWarning")   # no numpy warning before the one line
def test_weights_near_float32_limit_refused_in_one_line():
    # Finite, but their range (hi - lo) overflows float32: found by the GGUF fuzz target.
    w = np.full((4, 64), 3e38, np.float32)
    w[:, ::2] = -3e38
    with pytest.raises(NibbleError, match="too large for float16 scales"):
        quantize(w, AffineScheme(bits=4, group_size=32))
