"""Prefill on int8 activations (prefill_int8.py) against tests/reference.py's numpy twin of the
exact integer scheme: x rounded to int8 per block of 32, integer sums, then the scales and biases
in float. The twin computes in float64 from integers it unpacks itself: the kernel may differ
only by float32 rounding of its sums (1e-6 of the magnitude bound |x| @ |W|.T). Decode on int8
activations (quant_decode.py) is checked against the same twin in test_quant_kernels."""
import numpy as np
import pytest
from numba import njit, types
from numba.extending import intrinsic

from nibble.quant.affine import QuantizedTensor
from nibble.quant import target
from nibble.runner.kernels import prefill_int8
from nibble.runner.kernels.cpu import SMALL
from nibble.runner.kernels.linear import gated_mlp, prepare, project_qkv, qmatmul
from nibble.runner.kernels.prefill_int8 import matmul_int8
from tests import reference
from tests.test_quant_kernels import mlx_weight, twin_dequantize, twin_integers

rng = np.random.default_rng(14)
needs_int_dots = pytest.mark.skipif(prefill_int8.DOT is None, reason="this CPU has no byte dot product: "
                                    "prefill takes the float tiles (test_quant_kernels)")
FEATURES = target.features() or {}   # what numba compiles for: NIBBLE_CPU=avx2 leaves VNNI out
KINDS = [k for k, has in (("vnni", FEATURES.get("avx512vnni") and FEATURES.get("avx512vl")),
                          ("avx2", FEATURES.get("avx2"))) if has]


@intrinsic
def _store(typingctx, arr, v):
    """arr[:8] = the int32 lanes of v."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        builder.store(args[1], builder.bitcast(ary.data, args[1].type.as_pointer()), align=4)
    return types.none(arr, v), codegen


def _dot_kernel(kind, pairs):
    udot, udot2 = prefill_int8.dot_intrinsic(kind)
    load = prefill_int8.load_u8x32

    @njit
    def dots(w, x, small):
        """int32 [8] per 32 bytes of w and x, summed: 4 adjacent products a lane; by udot2 on two
        steps at a time where `pairs`."""
        acc = prefill_int8.zero_i32()
        for k in range(0, w.shape[0], 64 if pairs else 32):
            if pairs:
                acc = udot2(acc, load(w, k), load(x, k), load(w, k + 32), load(x, k + 32), small)
            else:
                acc = udot(acc, load(w, k), load(x, k), small)
        out = np.empty(8, np.int32)
        _store(out, acc)
        return out
    return dots


@pytest.mark.skipif(not KINDS, reason="not an x86 CPU with AVX2")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("small", [True, False])
@pytest.mark.parametrize("pairs", [False, True])
def test_byte_dot_product(kind, small, pairs):
    """Every instruction sequence on this CPU (VNNI and AVX2 where it has both), at the extremes:
    255 * -127 pairs overflow AVX2's int16 pair sums unless split into nibbles; 63 * -127, 4 in
    one int16 (udot2's two steps added before they widen), do not."""
    w = rng.integers(0, 64 if small else 256, 32 * 64).astype(np.uint8)
    x = rng.integers(-127, 128, 32 * 64).astype(np.int8)
    w[:64], x[:64] = (63 if small else 255), -127
    want = (w.astype(np.int64) * x).reshape(-1, 8, 4).sum((0, 2))
    np.testing.assert_array_equal(_dot_kernel(kind, pairs)(w, x.view(np.uint8), small), want)


@pytest.mark.parametrize("blocks", range(1, 26))
@pytest.mark.parametrize("bits", [4, 8])
def test_the_layout_holds_every_weight_once_and_lanes_in_one_block(blocks, bits):
    K = 32 * blocks
    units, lane_block = prefill_int8.layout(K)
    assert lane_block.shape[0] == 8 * -(-units.shape[0] // 64)     # 8 lanes a superblock of 64 units
    ks = [prefill_int8._k(u, j, bits) for u in units if u >= 0 for j in range(4)]
    assert sorted(ks) == list(range(K))
    for i, u in enumerate(units):   # position 4i: superblock i // 64, lane i % 8
        lane = 8 * (i // 64) + i % 8
        assert u < 0 or u // 8 == lane_block[lane]


def integers(w, bits):
    return twin_integers(w, bits).astype(np.int64)


@needs_int_dots
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("G,blocks", [(G, blocks) for G in (32, 64, 128) for blocks in (1, 4, 7, 9, 18, 19, 48)
                                      if blocks % (G // 32) == 0])   # K = 32 blocks: one superblock,
@pytest.mark.parametrize("accumulate", [False, True])                 # odd, one step past whole ones
def test_prefill_matches_the_integer_twin(bits, G, blocks, accumulate):   # (1, 9), SmolLM2's 576 and 1536
    K = 32 * blocks
    N, T = 37, 45                               # odd: the edges of the 4 x 3 and 4 x 2 micro-kernels
    w, s, b = mlx_weight(N, K, bits, G)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[3, 5] = 40.0                              # an outlier channel, as LLM activations have
    x[7] = 0                                    # a row of zeros: scale 0
    out = rng.standard_normal((T, N)).astype(np.float32)
    before = out.copy()
    matmul_int8(x, prepare(QuantizedTensor(w, s, b, bits, G)), out, accumulate)
    want = reference.int8_product(x, integers(w, bits), s, b, G) + (before if accumulate else 0)
    W = twin_dequantize(w, s, b, bits, G)
    bound = np.abs(x) @ np.abs(W).T + np.abs(before)
    assert np.all(np.abs(out - want) <= 1e-6 * bound), np.abs(out - want).max()
    # and the product's error is int8's rounding: at most half a step dx of each x, times |W|
    _, dx = reference.quantize_blocks_int8(x)
    rounding = np.repeat(dx.astype(np.float64) / 2, 32, axis=1) @ np.abs(W).T
    exact = x.astype(np.float64) @ W.T + (before if accumulate else 0)
    assert np.all(np.abs(out - exact) <= rounding + 1e-6 * bound)


@needs_int_dots
def test_int8_rounding_is_q8s():
    """The twin's rounding is llama.cpp's Q8 blocks: scale max |x| / 127, ties to even."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127.0, 0.5, 1.5, -63.5]
    xq, dx = reference.quantize_blocks_int8(x)
    assert dx[0, 0] == 1.0 and list(xq[0, :4]) == [127, 0, 2, -64]


@needs_int_dots
def test_each_row_is_quantized_alone():
    """A row's result does not depend on the rows beside it (its own scales, exact integers)."""
    N, K, G = 29, 576, 64
    w, s, b = mlx_weight(N, K, 4, G)
    qw = prepare(QuantizedTensor(w, s, b, 4, G))
    x = rng.standard_normal((2 * SMALL, K)).astype(np.float32)
    out = np.empty((2 * SMALL, N), np.float32)
    matmul_int8(x, qw, out, False)
    x2 = x * 1000
    x2[5] = x[5]
    out2 = np.empty_like(out)
    matmul_int8(x2, qw, out2, False)
    np.testing.assert_allclose(out2[5], out[5], rtol=1e-6, atol=1e-6)


@needs_int_dots
@pytest.mark.parametrize("T", [3, 2 * SMALL + 3])                       # decode rows, prefill
@pytest.mark.parametrize("bits,groups", [((4, 4, 4), (32, 32, 32)), ((4, 8, 4), (32, 32, 32)),
                                         ((4, 4, 4), (32, 64, 32))])
def test_x_rounded_once_for_the_projections_of_one_input(T, bits, groups):
    """q/k/v and gate/up: x rounded once for weights of one kind (the same bits and groups; others
    each their own), every output equal bit for bit to its matrix alone."""
    K = 128
    ws = [prepare(QuantizedTensor(*mlx_weight(N, K, b, G), b, G)) for N, b, G in zip((40, 16, 24), bits, groups)]
    x = rng.standard_normal((T, K)).astype(np.float32)
    alone = []
    for w in ws:
        alone.append(np.empty((T, w.weight.shape[0]), np.float32))
        qmatmul(x, w, alone[-1], False)
    q, k, v = (np.empty_like(a) for a in alone)
    _project_qkv_jit(x, *ws, q, k, v)
    for got, want in zip((q, k, v), alone):
        np.testing.assert_array_equal(got, want)
    gate, up = ws[0], ws[2]
    out = np.empty_like(alone[0][:, :gate.weight.shape[0]])
    _swiglu_jit(x, gate, gate, out)
    g = alone[0].astype(np.float64)
    np.testing.assert_allclose(out, reference.silu(g) * g, rtol=1e-6, atol=1e-7)
    _geglu_jit(x, gate, gate, out)
    np.testing.assert_allclose(out, reference.gelu_tanh(g) * g, rtol=1e-5, atol=1e-6)   # as test_gelu_tanh_mul


@njit
def _project_qkv_jit(x, wq, wk, wv, q, k, v):
    project_qkv(x, wq, wk, wv, q, k, v)


@njit
def _swiglu_jit(x, w_gate, w_up, out):
    gated_mlp(x, w_gate, w_up, out, False)


@njit
def _geglu_jit(x, w_gate, w_up, out):
    gated_mlp(x, w_gate, w_up, out, True)
