"""The CUDA kernels against numpy twins, and one whole layer against the CPU path.

CI has no GPU: conftest.py sets NUMBA_ENABLE_CUDASIM=1 and these run in numba's CUDA simulator
(a Python thread per CUDA thread: tiny shapes only). NUMBA_ENABLE_CUDASIM=0 runs them on a GPU.
The simulator computes in float64 where numba-cuda computes in float32, hence tolerances of 1e-4.
"""
import numpy as np
import pytest
from numba import cuda

from nibble.runner.kv.cache import Rows
from nibble.runner.kernels import cuda as gpu
from nibble.runner.kernels import layer as cpu_layer
from nibble.runner.kernels.layer import LayerWeights
from nibble.runner.kernels.cuda_kernels import ATT_THREADS, SLAB
from nibble.formats import superblocks
from nibble.formats.errors import UnsupportedModel
from nibble.quant.affine import QuantizedTensor
from nibble.runner.kernels.linear import prepare
from tests import reference
from tests.test_quant_kernels import mlx_weight, twin_dequantize, two_level

pytestmark = [pytest.mark.skipif(not cuda.is_available(), reason="no CUDA GPU (NUMBA_ENABLE_CUDASIM=1 simulates one)"),
              pytest.mark.usefixtures("simulated_gpu")]

rng = np.random.default_rng(0)
f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)


def on_device(*arrays):
    return [cuda.to_device(a) for a in arrays]


def quantized(N, K, bits, G):
    """A random MLX weight: (prepared QuantizedTensor, its float64 dequantization [N, K])."""
    w, s, b = mlx_weight(N, K, bits, G)
    return prepare(QuantizedTensor(w, s, b, bits, G)), twin_dequantize(w, s, b, bits, G)


def device_pos(p):
    """The position as the kernels read it: int32 [1] in device memory."""
    return cuda.to_device(np.array([p], np.int32))


def run_linear(x, weight, out, accumulate, **normed):
    x_dev, out_dev = on_device(x, out)
    gpu.linear(x_dev, gpu.upload(weight), out_dev, accumulate, **normed)
    return out_dev.copy_to_host()


def expected(x, W, before, accumulate):
    return x.astype(np.float64) @ W.T + (before if accumulate else 0)


# ---- matrix products ------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("T,accumulate", [(1, False), (3, True)])   # matrix-vector, matrix-matrix
def test_quantized_linear(bits, G, T, accumulate):
    N, K = 21, 2 * G                 # N: a partial block of rows; K: two groups
    qw, W = quantized(N, K, bits, G)
    x, out = f32(T, K), f32(T, N)
    got = run_linear(x, qw, out, accumulate)
    np.testing.assert_allclose(got, expected(x, W, out, accumulate), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T,accumulate", [(1, True), (33, False)])    # 33: two tiles of tokens
def test_float_linear(T, accumulate):
    N, K = 37, 70    # N: two tiles of rows; K: not a multiple of the 4-float chunk or the k-slab
    w, x, out = f32(N, K), f32(T, K), f32(T, N)
    got = run_linear(x, w, out, accumulate)
    np.testing.assert_allclose(got, expected(x, w, out, accumulate), rtol=1e-4, atol=1e-4)


def test_matvec_over_several_slabs_of_x():
    """K past the SLAB elements of x staged at a time: int4 and a float tail."""
    qw, W = quantized(3, SLAB + 64, 4, 64)
    x = f32(1, SLAB + 64)
    np.testing.assert_allclose(run_linear(x, qw, np.zeros((1, 3), np.float32), False),
                               expected(x, W, 0, False), rtol=1e-4, atol=1e-4)
    w, x = f32(2, SLAB + 5), f32(1, SLAB + 5)
    np.testing.assert_allclose(run_linear(x, w, np.zeros((1, 2), np.float32), False),
                               expected(x, w, 0, False), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kind", ["int4", "float"])
def test_swiglu_of_interleaved_gate_and_up(T, kind):
    F, D = 24, 64
    if kind == "int4":
        (gate, gate_W), (up, up_W) = quantized(F, D, 4, 32), quantized(F, D, 4, 32)
    else:
        gate, up = gate_W, up_W = f32(F, D), f32(F, D)
    w = gpu._stacked([gate, up], gpu._interleave)
    x = f32(T, D)
    x_dev, out = cuda.to_device(x), cuda.device_array((T, F), np.float32)
    gpu._product(gpu.DEFAULT, x_dev, w, out, gpu.SWIGLU)
    x64 = x.astype(np.float64)
    want = reference.silu(x64 @ gate_W.T) * (x64 @ up_W.T)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T", [1, 2])   # the norm inside the matrix-vector kernel, or before
@pytest.mark.parametrize("kind", ["int8", "float"])
def test_linear_of_the_normalized_input(T, kind):
    """linear(norm=...) = rmsnorm(x) @ W.T: the output head, and every decode projection of a
    normalized residual. K spans two slabs of x for the matrix-vector kernel."""
    N, K = 5, SLAB + 128
    weight, W = quantized(N, K, 8, 64) if kind == "int8" else (f32(N, K), None)
    W = W if W is not None else weight
    x, norm = f32(T, K) * 3, 1 + 0.1 * f32(K)
    got = run_linear(x, weight, np.zeros((T, N), np.float32), False, norm=cuda.to_device(norm),
                     eps=1e-5, scratch=cuda.device_array((T, K), np.float32))
    want = reference.rmsnorm(x, norm, 1e-5).astype(np.float64) @ W.T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_linear_checks_shapes():
    w = gpu.upload(f32(8, 16))
    x, out = on_device(f32(1, 16), f32(1, 9))
    with pytest.raises(ValueError, match=r"x must be \[T, 16\] and out \[T, 8\]"):
        gpu.linear(x, w, out)


# ---- normalization, RoPE, attention ---------------------------------------------------------------

def test_rmsnorm_in_place():
    x, w = f32(3, 80), f32(80)
    want = reference.rmsnorm(x, w, 1e-5)
    x_dev, w_dev = on_device(x, w)
    gpu.rmsnorm(x_dev, w_dev, 1e-5, x_dev)
    np.testing.assert_allclose(x_dev.copy_to_host(), want, rtol=1e-5, atol=1e-5)


def rope_tables(hd, ctx):
    inv_freq = 1.0 / 10000 ** (np.arange(0, hd, 2) / hd)
    ang = np.outer(np.arange(ctx), inv_freq)
    return inv_freq, np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def test_rope_and_kv_store():
    T, H, Hkv, hd, ctx, pos0 = 3, 4, 2, 16, 12, 5
    inv_freq, cos, sin = rope_tables(hd, ctx)
    qkv, bias = f32(T, (H + 2 * Hkv) * hd), f32((H + 2 * Hkv) * hd)
    k_cache, v_cache = gpu.allocate_kv(Hkv, ctx, hd)
    qkv_dev = cuda.to_device(qkv)
    gpu.rope_store(qkv_dev, *on_device(bias, cos, sin), device_pos(pos0), (k_cache, v_cache))
    heads = (qkv + bias).astype(np.float64).reshape(T, H + 2 * Hkv, hd)
    positions = np.arange(pos0, pos0 + T)
    q, k, v = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    got_q = qkv_dev.copy_to_host().reshape(T, H + 2 * Hkv, hd)[:, :H]
    np.testing.assert_allclose(got_q, reference.rotate(q, positions, inv_freq), rtol=1e-5, atol=1e-5)
    got_k = k_cache.copy_to_host()[:, pos0:pos0 + T].transpose(1, 0, 2)
    np.testing.assert_allclose(got_k, reference.rotate(k, positions, inv_freq), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v_cache.copy_to_host()[:, pos0:pos0 + T].transpose(1, 0, 2), v, rtol=1e-6)


def check_attention(q, k_cache, v_cache, pos0, window):
    """q [T, H, hd] against the cache [Hkv, ctx, hd] holding positions 0..pos0+T-1."""
    T, H, hd = q.shape
    Hkv = k_cache.shape[0]
    qkv = np.concatenate([q.reshape(T, H * hd), np.zeros((T, 2 * Hkv * hd), np.float32)], 1)
    out = cuda.device_array((T, H * hd), np.float32)
    gpu.attention(cuda.to_device(qkv), on_device(k_cache, v_cache), device_pos(pos0), window, out)
    S = pos0 + T
    want = reference.attention(q.astype(np.float64), k_cache[:, :S].transpose(1, 0, 2),
                               v_cache[:, :S].transpose(1, 0, 2), np.arange(pos0, S), window)
    np.testing.assert_allclose(out.copy_to_host().reshape(T, H, hd), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T,pos0,window", [(1, 9, 0), (4, 0, 0), (3, 4, 3)])
def test_attention(T, pos0, window):
    H, Hkv, hd, ctx = 4, 2, 16, 16
    check_attention(f32(T, H, hd), f32(Hkv, ctx, hd), f32(Hkv, ctx, hd), pos0, window)


@pytest.mark.parametrize("window", [0, ATT_THREADS + 3])
def test_attention_over_several_chunks_of_keys(window):
    """More keys than a block stages at once; the second query's window starts inside a chunk."""
    T, H, Hkv, hd, ctx = 2, 2, 1, 8, ATT_THREADS + 9
    check_attention(f32(T, H, hd), f32(Hkv, ctx, hd), f32(Hkv, ctx, hd), ctx - T, window)


def test_attention_when_scores_keep_rising():
    """Scores growing along the context (from ~0 to ~40) make the online softmax rescale its sums
    at nearly every chunk and key."""
    T, H, Hkv, hd, ctx = 1, 2, 1, 8, ATT_THREADS + 20
    q = np.abs(f32(T, H, hd)) * 4
    k_cache = np.abs(f32(Hkv, ctx, hd)) * np.linspace(0.1, 2, ctx, dtype=np.float32)[:, None]
    check_attention(q, k_cache, f32(Hkv, ctx, hd), ctx - T, 0)


@pytest.mark.parametrize("window", [0, 5])
def test_decode_attention_is_rope_store_then_attention(window):
    """One token: the fused kernel leaves the caches and the output as the two kernels do,
    with a KV group of two query heads writing the same k and v."""
    H, Hkv, hd, ctx, pos0 = 4, 2, 16, 12, 7
    _, cos, sin = rope_tables(hd, ctx)
    qkv, bias = f32(1, (H + 2 * Hkv) * hd), f32((H + 2 * Hkv) * hd)
    k_cache, v_cache = f32(Hkv, ctx, hd), f32(Hkv, ctx, hd)    # positions before pos0: history
    tables, pos = on_device(bias, cos, sin), device_pos(pos0)
    results = []
    for fused in (True, False):
        kv, q_dev, out = on_device(k_cache, v_cache), cuda.to_device(qkv), cuda.device_array((1, H * hd), np.float32)
        if fused:
            gpu.decode_attention(q_dev, *tables, pos, kv, window, out)
        else:
            gpu.rope_store(q_dev, *tables, pos, kv)
            gpu.attention(q_dev, kv, pos, window, out)
        results.append([out.copy_to_host(), *(a.copy_to_host() for a in kv)])
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(results[0][1][:, pos0], k_cache[:, pos0])   # the new k was stored


# ---- uploads --------------------------------------------------------------------------------------

def test_upload_keeps_weights_quantized():
    qw, _ = quantized(5, 64, 4, 32)
    w = gpu.upload(qw)
    assert (*w.shape, w.bits, w.group_size) == (5, 64, 4, 32)
    np.testing.assert_array_equal(w.weight.copy_to_host(), qw.weight)


def test_two_level_scales_go_up_as_their_float32_values():
    """A GGUF K-quant's scales and biases in two levels are expanded once on upload: the kernels
    read one float32 a group, the same product as the CPU's."""
    w = rng.integers(0, 2**32, size=(21, 512 // 8), dtype=np.uint32)
    s, b = two_level(21, 512, rng), two_level(21, 512, rng)
    qw = prepare(QuantizedTensor(w, s, b, 4, 32))
    x, out = f32(3, 512), f32(3, 21)
    W = twin_dequantize(w, superblocks.expand(s), superblocks.expand(b), 4, 32)
    np.testing.assert_allclose(run_linear(x, qw, out, False), expected(x, W, out, False), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(gpu.upload(qw).scales.copy_to_host(), superblocks.expand(s))


def test_what_the_kernels_cannot_run_is_refused():
    (wq, _), (wk, _) = quantized(16, 64, 4, 32), quantized(8, 64, 8, 32)
    with pytest.raises(UnsupportedModel, match="one quantization"):
        gpu._stacked([wq, wk, wk], np.concatenate)
    with pytest.raises(UnsupportedModel, match="head_dim"):
        gpu.allocate_kv(2, 8, 256)
    w, s, b = mlx_weight(16, 64, 4, 32)
    levels = prepare(QuantizedTensor(w, s, b, 4, 32, values=np.arange(16, dtype=np.uint8)[::-1].copy()))
    for refused in (lambda: gpu.upload(levels), lambda: gpu._stacked([levels, levels], np.concatenate)):
        with pytest.raises(UnsupportedModel, match="table of levels"):
            refused()
    planes = prepare(QuantizedTensor(w, s, b, 4, 32, high=np.zeros((16, 32), np.uint8)))   # GGUF's Q5 types
    two_level = np.zeros((16, 1, 18), np.int8)
    sixteen = prepare(QuantizedTensor(np.zeros((16, 32), np.uint32), two_level, two_level, 4, 16))   # Q2_K, Q3_K
    for weight in (planes, sixteen):
        with pytest.raises(UnsupportedModel, match="high bits or in groups of 16"):
            gpu.upload(weight)


# ---- the whole block ------------------------------------------------------------------------------

def tiny_layer(kind, D, H, Hkv, hd, F):
    """A random layer as (the GPU's LayerWeights, the CPU's): float with q/k/v biases (qwen2), the
    same on both sides; or int4 without, the CPU's its float dequantization, since the CPU's int4
    products round activations (to int8 blocks where it multiplies bytes) and the GPU's do not."""
    gpu_side, cpu_side = [], []
    def linear(N, K):
        if kind == "float":
            w = f32(N, K) / np.float32(np.sqrt(K))   # float32, as a model's: np.sqrt's float64 would widen them
            gpu_side.append(w), cpu_side.append(w)
        else:
            prepared, dequantized = quantized(N, K, 4, 32)
            gpu_side.append(prepared), cpu_side.append(dequantized.astype(np.float32))
    bias = (lambda n: f32(n) * 0.1) if kind == "float" else (lambda n: np.zeros(n, np.float32))
    none = np.zeros(0, np.float32)   # no q/k norms: the GPU does not run them
    attn_norm = 1 + 0.1 * f32(D)
    for N, K in ((H * hd, D), (Hkv * hd, D), (Hkv * hd, D)):
        linear(N, K)
    biases = bias(H * hd), bias(Hkv * hd), bias(Hkv * hd)
    linear(D, H * hd)
    mlp_norm = 1 + 0.1 * f32(D)
    for N, K in ((F, D), (F, D), (D, F)):
        linear(N, K)
    def layer(w):
        return LayerWeights(attn_norm, w[0], w[1], w[2], *biases, none, none, w[3], none, none,
                            mlp_norm, np.float32(hd ** -0.5), np.float32(1), w[4], w[5], w[6])
    return layer(gpu_side), layer(cpu_side)


@pytest.mark.slow
@pytest.mark.parametrize("kind,window", [("float", 0), ("int4", 3)])
def test_decoder_layer_matches_the_cpu(kind, window):
    """Prefill 3 tokens, then decode 2, through one layer on each side."""
    D, H, Hkv, hd, F, ctx, eps, tol = 64, 2, 1, 16, 32, 8, 1e-5, 1e-4
    weights, cpu_weights = tiny_layer(kind, D, H, Hkv, hd, F)
    _, cos, sin = rope_tables(hd, ctx)
    # the CPU's cache: one block of ctx positions, its keys transposed
    kv_cpu = (np.zeros((1, Hkv, hd, ctx), np.float32), np.zeros((1, Hkv, ctx, hd), np.float32),
              np.ones((1, Hkv, ctx), np.float32), np.ones((1, Hkv, ctx), np.float32))
    kv_gpu = gpu.allocate_kv(Hkv, ctx, hd)
    on_gpu = gpu.upload_layer(weights)
    cos_dev, sin_dev = on_device(cos, sin)
    work = gpu.Workspace.allocate(on_gpu, 3)
    pos0 = 0
    for T in (3, 1, 1):
        x = f32(T, D)
        x_dev = cuda.to_device(x)
        cpu_layer.decoder_layer(x, cpu_weights, kv_cpu, Rows.single(pos0, T, np.zeros(1)), cos, sin, eps, window,
                                np.zeros((0, 0)))
        gpu.decoder_layer(x_dev, on_gpu, kv_gpu, device_pos(pos0), cos_dev, sin_dev, eps, window, work)
        np.testing.assert_allclose(x_dev.copy_to_host(), x, rtol=tol, atol=tol * np.abs(x).max())
        pos0 += T
    k_gpu = kv_gpu[0].copy_to_host()[:, :pos0]
    k_cpu = kv_cpu[0][0, :, :, :pos0].swapaxes(1, 2)
    np.testing.assert_allclose(k_gpu, k_cpu, rtol=tol, atol=tol * np.abs(k_gpu).max())
