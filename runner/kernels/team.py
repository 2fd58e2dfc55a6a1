"""A decoded token's block as one parallel region, its threads meeting between steps (ggml's
threadpool's way), where decoder_layer would start and end one region for each of q/k/v,
attention, the output projection, gate, up, the activation and down: nine a layer, each paying
for numba's start and end of a parallel loop, a large part of a small model's token.

Each step is cut into chunks. A thread takes the next chunk from the step's counter (an atomic
add) until none is left, then waits until the step is done; whoever finishes a step's last chunk
does the serial work after it (RoPE and the cache, the next input's norm and rounding) and opens
the next step. A thread waits only on chunks some running thread has taken, so the block ends
however many threads numba actually runs it on: a thread that starts late finds the steps done.

Every row is the arithmetic decoder_layer's own kernels do (quant_decode.decode_tasks, cpu's
attention tasks): the same bits whichever way a block runs.
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from . import cpu, quant_decode
from .cpu import INNER, SMALL, _jit
from .linear import out_features
from .prefill import dims
from .quant_decode import alike, decode_tasks, round_into, rounding
from .sync import fetch_add, load_acquire, pause, store_release, threads

LINE = 8     # int64s a cache line: each counter on its own
CHUNKS = 1   # chunks a thread of a step's matrix: one range of rows each, the stream the prefetchers serve best
STEPS = 6    # q/k/v, attention, its merged splits, the output projection, gate and up, down
_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@njit(inline="always", **_jit)
def _take(sync, s):
    """The next chunk of step s (a number past its last: none left)."""
    return fetch_add(sync, 3 * LINE * s)


@njit(inline="always", **_jit)
def _last(sync, s, n):
    """Count a chunk of step s's n done -> whether it was the last."""
    return fetch_add(sync, 3 * LINE * s + LINE) == n - 1


@njit(inline="always", **_jit)
def _open(sync, s):
    store_release(sync, 3 * LINE * s + 2 * LINE)


@njit(inline="always", **_jit)
def _wait(sync, s):
    while load_acquire(sync, 3 * LINE * s + 2 * LINE) == 0:
        pause()


@njit(inline="always", **_jit)
def _tasks(w):
    """quant_decode.decode_tasks' tasks of w's products: two weight rows each."""
    return (out_features(w) + 1) // 2


@njit(inline="always", **_jit)
def _chunk_size(w, members):
    """Tasks a chunk of w's products, for CHUNKS chunks a thread."""
    return max(1, (_tasks(w) + CHUNKS * members - 1) // (CHUNKS * members))


@njit(inline="always", **_jit)
def _chunks(w, size):
    return (_tasks(w) + size - 1) // size


@njit(inline="always", **_jit)
def _products(c, size, rounded, x, w, experts, accumulate, out):
    """Chunk c (of `size` tasks) of out (+)= x @ w.T."""
    tasks = _tasks(w)
    # own_x a plain bool, as quant_decode.products passes it: a literal would compile them again
    decode_tasks(c * size, min(tasks, (c + 1) * size), rounded, x, w, experts, bool(False), accumulate, out)


def decoded_in_one_region(x, w, kv, rows, cos, sin, eps, window, act_sq):
    """decoder_layer's arguments -> True where the block ran here as one region (decode_layer), or
    False: where its weights are all of quant_decode's KINDS on int8 activations, a few rows, not
    collecting act_sq (njit code only)."""


@overload(decoded_in_one_region, inline="always", jit_options=_jit)
def _decoded_in_one_region_typed(x, w, kv, rows, cos, sin, eps, window, act_sq):
    fields = dict(zip(getattr(w, "fields", ()), getattr(w, "types", ())))
    if not quant_decode.INT8 or not all(isinstance(fields.get(name), types.BaseNamedTuple)
                                        and fields[name].instance_class in quant_decode.KINDS.values()
                                        for name in _WEIGHTS):
        return lambda x, w, kv, rows, cos, sin, eps, window, act_sq: False

    def one_region(x, w, kv, rows, cos, sin, eps, window, act_sq):
        if x.shape[0] > SMALL or act_sq.shape[0] > 0:
            return False
        decode_layer(x, w, kv, rows, cos, sin, eps, window)
        return True
    return one_region


@njit(**_jit, **INNER)
def decode_layer(x, w, kv, rows, cos, sin, eps, window):
    """decoder_layer for a few rows of x (at most SMALL) and LayerWeights of quantized KINDS on
    int8 activations, as one parallel region (see the module's docstring)."""
    k_cache, v_cache = kv[0], kv[1]
    T, D = x.shape
    Hkv, hd = v_cache.shape[1], v_cache.shape[3]
    H = out_features(w.wq) // hd
    F = out_features(w.w_gate)
    cpu.check_cache(k_cache, v_cache, hd)
    if (dims(w.wq)[1] != D or dims(w.wk) != (Hkv * hd, D) or dims(w.wv) != (Hkv * hd, D)
            or dims(w.wo) != (D, H * hd) or dims(w.w_gate)[1] != D or dims(w.w_up) != (F, D)
            or dims(w.w_down) != (D, F)):
        raise ValueError("decode_layer: the weights' shapes do not fit the layer")
    # the inputs of q/k/v, rounded before the region; room for the others, filled in it
    h = np.empty_like(x)
    cpu.rmsnorm(x, w.input_norm, eps, h)
    rq = _rounded(h, w.wq)
    rk = rq if alike(w.wk, w.wq) else _rounded(h, w.wk)
    rv = rq if alike(w.wv, w.wq) else _rounded(h, w.wv)
    q3, k3, v3 = np.empty((T, H, hd), np.float32), np.empty((T, Hkv, hd), np.float32), np.empty((T, Hkv, hd), np.float32)
    attn = np.empty((T, H * hd), np.float32)
    ra = rounding(attn, w.wo)
    scaled = w.residual_scale != 1   # Granite's: the outputs go through o and y, times the scale
    o = np.zeros_like(x) if scaled else x
    y = np.zeros_like(x) if scaled else x
    h2 = np.empty_like(x)
    rg = rounding(h2, w.w_gate)
    ru = rg if alike(w.w_up, w.w_gate) else rounding(h2, w.w_up)
    g, u, mlp = np.empty((T, F), np.float32), np.empty((T, F), np.float32), np.empty((T, F), np.float32)
    rm = rounding(mlp, w.w_down)
    plan = cpu.plan(rows, Hkv, H // Hkv, hd, window)
    # made here: in a parallel function numba makes each np.zeros a parallel loop of its own
    experts, sync = np.zeros(1, np.int64), np.zeros(3 * LINE * STEPS, np.int64)
    # numba's parallel loop takes named tuples only as arguments, and one level deep: each weight its own
    _team(x, h, q3, k3, v3, attn, ra, o, y, h2, rq, rk, rv, rg, ru, g, u, mlp, rm, scaled, w.wq, w.wk, w.wv, w.wo,
          w.w_gate, w.w_up, w.w_down, w.bq, w.bk, w.bv, w.q_norm, w.k_norm, w.bo, w.sinks, w.post_norm,
          w.attention_scale, w.residual_scale, kv, rows, cos, sin, eps, plan, experts, sync)


@njit(inline="always", **_jit)
def _rounded(x, w):
    """x rounded for w's kind (rounding's room, filled)."""
    r = rounding(x, w)
    round_into(x, w, r)
    return r


@njit(parallel=True, **_jit, **INNER)
def _team(x, h, q3, k3, v3, attn, ra, o, y, h2, rq, rk, rv, rg, ru, g, u, mlp, rm, scaled, wq, wk, wv, wo, w_gate,
          w_up, w_down, bq, bk, bv, q_norm, k_norm, bo, sinks, post_norm, attention_scale, residual_scale, kv, rows,
          cos, sin, eps, plan, experts, sync):
    """decode_layer's region: its rows' buffers, the weights one by one, cpu.plan's attention tasks."""
    order, lo, hi, first, count, kv_of, split, lone, head_task, head_splits, merged, pm, pl, pacc = plan
    k_cache, v_cache, k_scale, v_scale = kv
    T, F = x.shape[0], mlp.shape[1]
    q, k, v = q3.reshape(T, -1), k3.reshape(T, -1), v3.reshape(T, -1)
    attn3 = attn.reshape(q3.shape)
    members = threads()
    zq, zk, zv = _chunk_size(wq, members), _chunk_size(wk, members), _chunk_size(wv, members)
    cq, ck, cv = _chunks(wq, zq), _chunks(wk, zk), _chunks(wv, zv)
    zo, zg, zd = _chunk_size(wo, members), _chunk_size(w_gate, members), _chunk_size(w_down, members)
    co, cg, cd = _chunks(wo, zo), _chunks(w_gate, zg), _chunks(w_down, zd)
    tasks, n_merged = first.shape[0], merged.shape[0]
    for _ in prange(members):
        c = _take(sync, 0)   # q, k, v
        while c < cq + ck + cv:
            if c < cq:
                _products(c, zq, rq, h, wq, experts, bool(False), q)
            elif c < cq + ck:
                _products(c - cq, zk, rk, h, wk, experts, bool(False), k)
            else:
                _products(c - cq - ck, zv, rv, h, wv, experts, bool(False), v)
            if _last(sync, 0, cq + ck + cv):
                cpu.place_qkv(q3, k3, v3, bq, bk, bv, q_norm, k_norm, kv, rows, cos, sin, eps)
                _open(sync, 0)
            c = _take(sync, 0)
        _wait(sync, 0)
        c = _take(sync, 1)   # attention: a task a chunk
        while c < tasks:
            cpu.attend(cpu.from_both_ends(c, tasks), first, count, kv_of, split, lone, order, lo, hi, q3,
                       attention_scale, rows, k_cache, v_cache, k_scale, v_scale, sinks, pm, pl, pacc, attn3)
            if _last(sync, 1, tasks):
                if n_merged == 0:
                    round_into(attn, wo, ra)
                _open(sync, 1)
            c = _take(sync, 1)
        _wait(sync, 1)
        c = _take(sync, 2)   # the decoded rows whose keys came in several splits
        while c < n_merged:
            i0 = head_task[merged[c]]
            cpu.finish(attn3, order[first[i0]], kv_of[i0], sinks, pm, pl, pacc, i0, head_splits[merged[c]])
            if _last(sync, 2, n_merged):
                round_into(attn, wo, ra)
                _open(sync, 2)
            c = _take(sync, 2)
        if n_merged:
            _wait(sync, 2)
        c = _take(sync, 3)   # x += attn @ wo.T (+ bo), then the MLP's input
        while c < co:
            _products(c, zo, ra, attn, wo, experts, not scaled, o)
            if _last(sync, 3, co):
                _attention_out(x, o, bo, residual_scale, scaled)
                cpu.rmsnorm(x, post_norm, eps, h2)
                round_into(h2, w_gate, rg)
                if not alike(w_up, w_gate):
                    round_into(h2, w_up, ru)
                _open(sync, 3)
            c = _take(sync, 3)
        _wait(sync, 3)
        c = _take(sync, 4)   # mlp = silu(h2 @ w_gate.T) * (h2 @ w_up.T), a chunk's columns at a time
        while c < cg:
            _products(c, zg, rg, h2, w_gate, experts, bool(False), g)
            _products(c, zg, ru, h2, w_up, experts, bool(False), u)
            _activate(g, u, mlp, 2 * c * zg, min(F, 2 * (c + 1) * zg))
            if _last(sync, 4, cg):
                round_into(mlp, w_down, rm)
                _open(sync, 4)
            c = _take(sync, 4)
        _wait(sync, 4)
        c = _take(sync, 5)   # x += mlp @ w_down.T (through y for a scale)
        while c < cd:
            _products(c, zd, rm, mlp, w_down, experts, bool(True), y)
            if _last(sync, 5, cd) and scaled:
                _scaled_add(x, y, residual_scale)
            c = _take(sync, 5)


@njit(**cpu.ACTIVATION, **INNER)
def _activate(g, u, mlp, j0, j1):
    for t in range(g.shape[0]):
        for j in range(j0, j1):
            mlp[t, j] = cpu.silu_times(g[t, j], u[t, j])


@njit(**_jit, **INNER)
def _attention_out(x, o, bo, s, scaled):
    """decoder_layer's residual after attention, o its output projection's (x itself unless scaled)."""
    if scaled:
        if bo.shape[0]:
            o += bo
        _scaled_add(x, o, s)
    elif bo.shape[0]:
        x += bo


@njit(**_jit, **INNER)
def _scaled_add(x, y, s):
    x += s * y
