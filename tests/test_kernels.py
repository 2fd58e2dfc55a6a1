"""Every CPU kernel against its numpy twin in tests/reference.py."""
import numpy as np
import pytest
from numba import njit

from nibble.runner.kv.cache import BLOCK, Rows
from nibble.runner.kernels import cpu
from nibble.runner.kernels.cpu import SMALL
from tests import reference

rng = np.random.default_rng(0)
f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)


# decode; tiles and their edges; a w packed in two parts (cpu.PACKED), the second a part of a panel
@pytest.mark.parametrize("T,K,N", [(1, 96, 40), (7, 96, 42), (70, 33, 21), (71, 96, 42), (20, 1024, 1031)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul(T, K, N, accumulate):
    x, w, out = f32(T, K), f32(N, K), f32(T, N)
    want = x.astype(np.float64) @ w.T + (out if accumulate else 0)
    cpu.matmul(x, w, out, accumulate)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("K", [96, 33])   # whole steps of 16, and leftovers
def test_decode_rows_are_each_as_alone(K):
    """Up to SMALL rows (decoded tokens of several sequences): each row of matmul, project_qkv
    and swiglu bit-identical to the same row alone."""
    x, w, w2, w3 = f32(SMALL, K), f32(40, K), f32(16, K), f32(16, K)
    out = lambda T, N: np.empty((T, N), np.float32)
    runs = [(lambda x, o: cpu.matmul(x, w, o[0], False), (40,)),
            (lambda x, o: cpu.project_qkv(x, w, w2, w3, *o), (40, 16, 16)),
            (lambda x, o: cpu.swiglu(x, w2, w3, o[0]), (16,))]
    for run, widths in runs:
        together = [out(SMALL, N) for N in widths]
        run(x, together)
        for t in range(SMALL):
            alone = [out(1, N) for N in widths]
            run(x[t:t + 1], alone)
            for a, b in zip(together, alone):
                np.testing.assert_array_equal(a[t], b[0])


def test_matmul_reads_memmapped_weights(tmp_path):
    w = f32(16, 32)
    w.tofile(tmp_path / "w.bin")
    mapped = np.memmap(tmp_path / "w.bin", np.float32, "r", shape=w.shape)
    x, out = f32(2, 32), np.empty((2, 16), np.float32)
    cpu.matmul(x, mapped, out, False)
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 5, 12])
def test_swiglu(T):
    x, wg, wu = f32(T, 64), f32(48, 64), f32(48, 64)
    out = np.empty((T, 48), np.float32)
    cpu.swiglu(x, wg, wu, out)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(out, reference.silu(x64 @ wg.T) * (x64 @ wu.T), rtol=1e-4, atol=1e-4)


def test_exp_within_an_ulp_and_clamped():
    """cpu.exp (arithmetic only, to vectorize) against float64's: within about 1 ulp over its
    range; past it, e ** -87 and e ** 88."""
    x = np.linspace(-87, 88, 400_001, dtype=np.float32)
    got, want = _exps(x), np.exp(x.astype(np.float64))
    assert np.all(np.abs(got - want) <= 1.5 * np.spacing(want.astype(np.float32)))
    edges = _exps(np.array([-1e30, -90, 90, 1e30], np.float32))
    np.testing.assert_array_equal(edges, _exps(np.float32([-87, -87, 88, 88])))


@njit
def _exps(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = cpu.exp(x[i])
    return out


@pytest.mark.parametrize("T", [1, 7])
def test_silu_mul(T):
    g, up = 6 * f32(T, 50), f32(T, 50)   # silu's both tails
    want = reference.silu(g.astype(np.float64)) * up
    cpu.silu_mul(g, up)
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7)


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


@pytest.mark.parametrize("each", [False, True])   # a position a row, or one a pair (multimodal RoPE)
@pytest.mark.parametrize("rotated", [16, 12, 0])   # whole heads, phi3's partial rotary, none
def test_rope(rotated, each):
    hd, positions = 16, np.array([5, 6, 40, 0])   # each row its own position (rows of a batch)
    if each:   # three axes' positions, each pair turned by one of them
        positions = np.random.default_rng(1).integers(0, 64, (4, 3))[:, np.arange(rotated // 2) % 3]
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotated, 2) / max(rotated, 1))
    ang = np.outer(np.arange(64), inv_freq)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x = f32(4, 3, hd)
    want = reference.rotate(x.astype(np.float64), positions, inv_freq)
    cpu.rope(x, cos, sin, positions if each else positions[:, None])
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(x[..., rotated:], want[..., rotated:])   # passed through as they were


def pool(blocks, Hkv, hd):
    """A float32 KV pool full of keys (a block's transposed) and values, and its scales (ones)."""
    ones = np.ones((blocks, Hkv, BLOCK), np.float32)
    return f32(blocks, Hkv, hd, BLOCK), f32(blocks, Hkv, BLOCK, hd), ones, ones


def attend(q, kv, rows, window, sinks=None):
    out = np.empty_like(q)
    cpu.attention(q, *kv, rows, window, 1 / np.sqrt(q.shape[-1]),
                  np.zeros(0, np.float32) if sinks is None else sinks, out)
    return out


def want_attention(q, kv, rows, window, sinks=None):
    """Each row against its own sequence's keys and values, read through its table in numpy."""
    k, v, ks, vs = kv
    want = np.empty(q.shape)
    for t, (p, s) in enumerate(zip(rows.positions, rows.seq)):
        table = rows.tables[s]
        want[t] = reference.attention(q[t:t + 1].astype(np.float64), reference.paged(k, ks, table, p + 1, True),
                                      reference.paged(v, vs, table, p + 1), np.array([p]), window,
                                      sinks=sinks)[0]
    return want


@pytest.mark.parametrize("T,pos0,window", [(1, 9, 0), (6, 0, 0), (9, 40, 19)])
def test_attention_sinks_join_the_softmax(T, pos0, window):
    """gpt-oss's sinks: a logit per head in every row's softmax, weighing no value; large ones
    take most of the weight (the first row's too, which sees one key)."""
    H, Hkv, hd = 6, 2, 8
    kv = pool(12, Hkv, hd)
    rows = Rows.single(pos0, T, rng.permutation(12)[:4])
    q = f32(T, H, hd)
    sinks = np.array([-30, -1, 0, 1, 3, 30], np.float32)
    got = attend(q, kv, rows, window, sinks)
    np.testing.assert_allclose(got, want_attention(q, kv, rows, window, sinks), rtol=1e-4, atol=1e-5)
    assert np.abs(got[:, 5]).max() < 1e-6 < np.abs(got[:, 0]).max()


@pytest.mark.parametrize("T,pos0,window", [(1, 9, 0), (6, 0, 0), (4, 3, 0), (6, 2, 3), (5, 30, 0), (9, 40, 19)])
def test_attention_through_a_shuffled_block_table(T, pos0, window):
    """One sequence whose blocks are anywhere in the pool; windows ending across block edges."""
    H, Hkv, hd = 6, 2, 8
    kv = pool(12, Hkv, hd)
    rows = Rows.single(pos0, T, rng.permutation(12)[:4])
    q = f32(T, H, hd)
    np.testing.assert_allclose(attend(q, kv, rows, window), want_attention(q, kv, rows, window),
                               rtol=1e-4, atol=1e-5)


def test_attention_refuses_keys_not_transposed():
    """Keys laid out as the values are ([blocks, Hkv, BLOCK, hd]): an error, not reads and writes
    past the cache."""
    H, Hkv, hd = 4, 2, 8
    k, v, ks, vs = pool(2, Hkv, hd)
    with pytest.raises(ValueError, match="keys .blocks, Hkv, hd, BLOCK."):
        attend(f32(1, H, hd), (v.copy(), v, ks, vs), Rows.single(3, 1, np.arange(2)), 0)


@pytest.mark.parametrize("window", [0, 7])
def test_attention_of_several_sequences_in_one_pass(window):
    """Decoded rows of three sequences and a chunk of a fourth's prompt, each at its own position
    in its own blocks of one pool: each row equals its sequence attended alone."""
    H, Hkv, hd = 4, 2, 8
    kv = pool(16, Hkv, hd)
    tables = rng.permutation(16).reshape(4, 4)
    rows = Rows.of([37, 0, 16, 12, 13, 14, 15], [2, 0, 1, 3, 3, 3, 3], tables)
    q = f32(7, H, hd)
    got = attend(q, kv, rows, window)
    np.testing.assert_allclose(got, want_attention(q, kv, rows, window), rtol=1e-4, atol=1e-5)
    alone = Rows.of([37], [0], tables[2:3])
    np.testing.assert_array_equal(got[:1], attend(q[:1], kv, alone, window))   # batch invariant


def test_attention_when_each_key_sets_a_new_maximum():
    """The online softmax rescales its sums at every new maximum: scores rising along the context
    (from ~0 to ~40) make it rescale at about every other key, from weights of exp(-40) up."""
    T, H, Hkv, hd, ctx = 3, 4, 2, 8, 48
    q = np.abs(f32(T, H, hd)) * 4
    k, v, ones, _ = pool(ctx // BLOCK, Hkv, hd)
    rising = np.linspace(0.1, 2, ctx, dtype=np.float32).reshape(ctx // BLOCK, 1, 1, BLOCK)
    kv = (np.abs(k) * rising, v, ones, ones)
    rows = Rows.single(ctx - T, T, np.arange(ctx // BLOCK))
    np.testing.assert_allclose(attend(q, kv, rows, 0), want_attention(q, kv, rows, 0), rtol=1e-4, atol=1e-5)


def int8_pool(blocks, Hkv, hd):
    """An int8 KV pool of random rows and scales."""
    k = rng.integers(-127, 128, (blocks, Hkv, hd, BLOCK)).astype(np.int8)
    v = rng.integers(-127, 128, (blocks, Hkv, BLOCK, hd)).astype(np.int8)
    ks, vs = rng.uniform(0.001, 0.02, (2, blocks, Hkv, BLOCK)).astype(np.float32)
    return k, v, ks, vs


@pytest.mark.parametrize("window,kv_type,with_sinks", [(0, "f32", False), (0, "int8", True), (300, "f32", True), (7, "int8", False)])
def test_prefilled_rows_equal_each_row_decoded_alone(window, kv_type, with_sinks):
    """A prompt's 40 rows at positions 560-599 (two tasks of rows; keys in three splits, a
    window across their edges), heads of 64 dims (the cache's own values, no copy): each row
    equals the reference, and, bit for bit, that row decoded alone (its splits on all threads)."""
    H, Hkv, hd = 6, 2, 64
    kv = pool(40, Hkv, hd) if kv_type == "f32" else int8_pool(40, Hkv, hd)
    table = rng.permutation(40)
    q = f32(40, H, hd)
    sinks = np.array([-30, -1, 0, 1, 3, 30], np.float32) if with_sinks else None
    got = attend(q, kv, Rows.single(560, 40, table), window, sinks)
    np.testing.assert_allclose(got, want_attention(q, kv, Rows.single(560, 40, table), window, sinks),
                               rtol=1e-4, atol=1e-5)
    for t in range(40):
        np.testing.assert_array_equal(got[t], attend(q[t:t + 1], kv, Rows.single(560 + t, 1, table), window, sinks)[0])


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_bidirectional_attention_of_several_sequences(dtype, with_sinks):
    """window < 0 (an encoder's): each row sees every position of its sequence, later ones too;
    sequences of 1 to 70 rows (tiles of rows and steps of keys with edges), their rows shuffled
    in the pass, through shuffled blocks; an int8 cache times its scales. Each row equals its
    sequence attended alone, bit for bit."""
    H, Hkv, hd, lengths = 6, 2, 8, [1, 17, 70, 5]
    shape = (20, Hkv, BLOCK, hd)
    if dtype == np.int8:
        k, v = (rng.integers(-127, 128, s).astype(np.int8) for s in ((20, Hkv, hd, BLOCK), shape))
        ks, vs = (rng.uniform(0.001, 0.02, shape[:3]).astype(np.float32) for _ in range(2))
        kv = (k, v, ks, vs)
    else:
        kv = pool(20, Hkv, hd)
    tables = rng.permutation(20).reshape(4, 5)
    positions = np.concatenate([np.arange(n) for n in lengths])
    seq = np.repeat(np.arange(4), lengths)
    shuffled = rng.permutation(len(positions))
    rows = Rows.of(positions[shuffled], seq[shuffled], tables)
    q = f32(len(positions), H, hd)
    sinks = np.array([-30, -1, 0, 1, 3, 30], np.float32) if with_sinks else None
    got = attend(q, kv, rows, -1, sinks)
    k, v, ks, vs = kv
    for t, (p, s) in enumerate(zip(rows.positions, rows.seq)):
        n = lengths[s]
        want = reference.attention(q[t:t + 1].astype(np.float64), reference.paged(k, ks, tables[s], n, True),
                                   reference.paged(v, vs, tables[s], n), np.array([n - 1]), sinks=sinks)[0]
        np.testing.assert_allclose(got[t], want, rtol=1e-4, atol=1e-5)
    mine = np.flatnonzero(rows.seq == 2)
    mine = mine[np.argsort(rows.positions[mine])]   # in order: other rows share each one's tile
    alone = Rows.of(rows.positions[mine], np.zeros(len(mine)), tables[2:3])
    np.testing.assert_array_equal(got[mine], attend(q[mine], kv, alone, -1, sinks))


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_store_kv_through_a_block_table(dtype):
    """Rows stored at their positions in their sequences' blocks read back through the tables,
    keys into a block's columns and values into its rows: a float32 cache as they were, an int8
    one to 1/254 of each head's largest value; attention over an int8 cache equals attention
    over the rows it decodes to."""
    Hkv, hd, blocks = 2, 8, 6
    keys, values = np.zeros((blocks, Hkv, hd, BLOCK), dtype), np.zeros((blocks, Hkv, BLOCK, hd), dtype)
    k_scales, v_scales = np.ones((2, blocks, Hkv, BLOCK), np.float32)
    tables = np.array([[4, 1, 5], [0, 3, 2]], np.int32)
    rows = Rows.of(np.r_[0:40, 0:20], np.r_[[0] * 40, [1] * 20], tables)
    x = f32(60, Hkv, hd)
    for t in range(60):
        cpu.store_kv(keys, k_scales, x[t], rows, t, True)
        cpu.store_kv(values, v_scales, x[t], rows, t, False)
    for s, (first, n) in enumerate([(0, 40), (40, 20)]):
        want = x[first:first + n]
        for got in (reference.paged(keys, k_scales, tables[s], n, True), reference.paged(values, v_scales, tables[s], n)):
            assert np.all(np.abs(got - want) <= np.abs(want).max(-1, keepdims=True) / 254 + 1e-7)
            if dtype == np.float32:
                np.testing.assert_array_equal(got, want)
    kv = (keys, values, k_scales, v_scales)
    q, rows = f32(3, 4, hd), Rows.single(37, 3, tables[0])
    np.testing.assert_allclose(attend(q, kv, rows, 0), want_attention(q, kv, rows, 0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T", [1, 3, 12])
def test_project_qkv(T):
    x, wq, wk, wv = f32(T, 32), f32(24, 32), f32(8, 32), f32(8, 32)
    q, k, v = np.empty((T, 24), np.float32), np.empty((T, 8), np.float32), np.empty((T, 8), np.float32)
    cpu.project_qkv(x, wq, wk, wv, q, k, v)
    for got, w in ((q, wq), (k, wk), (v, wv)):
        np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)

