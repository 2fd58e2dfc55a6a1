"""Every CPU kernel against its numpy twin in tests/reference.py."""
import numpy as np
import pytest

from nibble.runner.kernels import cpu
from tests import reference

rng = np.random.default_rng(0)
f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("T,K,N", [(1, 96, 40), (7, 96, 42), (70, 33, 21)])   # tiles and their edges
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul(T, K, N, accumulate):
    x, w, out = f32(T, K), f32(N, K), f32(T, N)
    want = x.astype(np.float64) @ w.T + (out if accumulate else 0)
    cpu.matmul(x, w, out, accumulate)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def test_matmul_reads_memmapped_weights(tmp_path):
    w = f32(16, 32)
    w.tofile(tmp_path / "w.bin")
    mapped = np.memmap(tmp_path / "w.bin", np.float32, "r", shape=w.shape)
    x, out = f32(2, 32), np.empty((2, 16), np.float32)
    cpu.matmul(x, mapped, out, False)
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 5])
def test_swiglu(T):
    x, wg, wu = f32(T, 64), f32(48, 64), f32(48, 64)
    out = np.empty((T, 48), np.float32)
    cpu.swiglu(x, wg, wu, out)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(out, reference.silu(x64 @ wg.T) * (x64 @ wu.T), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T", [1, 5])
def test_gelu_tanh_mul(T):
    g, up = 3 * f32(T, 40), f32(T, 40)   # wide enough for both tails of the tanh
    want = reference.gelu_tanh(g.astype(np.float64)) * up
    cpu.gelu_tanh_mul(g, up)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_rmsnorm_in_place():
    x, w = f32(3, 80), f32(80)
    want = reference.rmsnorm(x, w, 1e-5)
    cpu.rmsnorm(x, w, 1e-5, x)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotated", [16, 12, 0])   # whole heads, phi3's partial rotary, none
def test_rope(rotated):
    hd, pos0 = 16, 5
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotated, 2) / max(rotated, 1))
    ang = np.outer(np.arange(64), inv_freq)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x = f32(4, 3, hd)
    want = reference.rotate(x.astype(np.float64), np.arange(pos0, pos0 + 4), inv_freq)
    cpu.rope(x, cos, sin, pos0)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(x[..., rotated:], want[..., rotated:])   # passed through as they were


@pytest.mark.parametrize("T,pos0,window", [(1, 9, 0), (6, 0, 0), (4, 3, 0), (6, 2, 3)])
def test_attention(T, pos0, window):
    H, Hkv, hd, ctx = 6, 2, 8, 16
    q = f32(T, H, hd)
    k_cache, v_cache = f32(Hkv, ctx, hd), f32(Hkv, ctx, hd)
    out = np.empty_like(q)
    ones = np.ones((Hkv, ctx), np.float32)
    cpu.attention(q, k_cache, v_cache, ones, ones, pos0, window, out)
    S = pos0 + T   # keys 0..S-1 are filled
    want = reference.attention(q.astype(np.float64), k_cache[:, :S].transpose(1, 0, 2),
                               v_cache[:, :S].transpose(1, 0, 2), np.arange(pos0, S), window)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_attention_when_each_key_sets_a_new_maximum():
    """The online softmax rescales its sums at every new maximum: scores rising along the context
    (from ~0 to ~40) make it rescale at about every other key, from weights of exp(-40) up."""
    T, H, Hkv, hd, ctx = 3, 4, 2, 8, 40
    q = np.abs(f32(T, H, hd)) * 4
    k_cache = np.abs(f32(Hkv, ctx, hd)) * np.linspace(0.1, 2, ctx, dtype=np.float32)[:, None]
    v_cache = f32(Hkv, ctx, hd)
    out, ones = np.empty_like(q), np.ones((Hkv, ctx), np.float32)
    cpu.attention(q, k_cache, v_cache, ones, ones, ctx - T, 0, out)
    want = reference.attention(q.astype(np.float64), k_cache.transpose(1, 0, 2),
                               v_cache.transpose(1, 0, 2), np.arange(ctx - T, ctx))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T", [1, 3])
def test_project_qkv(T):
    x, wq, wk, wv = f32(T, 32), f32(24, 32), f32(8, 32), f32(8, 32)
    q, k, v = np.empty((T, 24), np.float32), np.empty((T, 8), np.float32), np.empty((T, 8), np.float32)
    cpu.project_qkv(x, wq, wk, wv, q, k, v)
    for got, w in ((q, wq), (k, wk), (v, wv)):
        np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)


def test_int8_kv_rows_and_attention():
    """An int8 cache stores each head's row to 1/254 of its largest value; attention over it
    equals attention over the rows it decodes to."""
    Hkv, ctx, hd = 2, 8, 16
    x = f32(ctx, Hkv, hd)
    cache, scales = np.zeros((Hkv, ctx, hd), np.int8), np.ones((Hkv, ctx), np.float32)
    for pos in range(ctx):
        cpu.store_kv(cache, scales, x[pos], pos)
    decoded = (cache * scales[..., None]).transpose(1, 0, 2)
    assert np.all(np.abs(decoded - x) <= np.abs(x).max(-1, keepdims=True) / 254 + 1e-7)
    q, out = f32(3, 4, hd), np.empty((3, 4, hd), np.float32)
    cpu.attention(q, cache, cache, scales, scales, 5, 0, out)
    want = reference.attention(q.astype(np.float64), decoded[:8], decoded[:8], np.arange(5, 8))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
