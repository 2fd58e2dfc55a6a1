"""Benchmark of the quantized kernels on SmolLM2-135M shapes (not collected by pytest).

    python -m tests.bench_quant_kernels [--repeats 15]

Decode: one token through 30 layers of distinct random matrices (q, k, v, o, gate, up, down) and
the 49152 x 576 head, so caches do not help; GB/s counts the bytes of weights, scales and biases
read, next to a parallel float32 sum over 1 GiB measured in the same run. Prefill: GFLOP/s of
qmatmul at T = 128 and 512 next to cpu.matmul on the dequantized float32 weights.

The machine is shared, and a 2-thread parallel region whose other thread is pre-empted waits a
whole time slice: each round of repeats first waits (a bounded time) until other processes use
less than 0.15 cores, variants run interleaved, and the best of the rounds is reported (median
beside it, and how many rounds were quiet).
"""
import argparse
import os
import statistics
import time

import numba
import numpy as np
from numba import njit

from nibble.quant.affine import QuantizedTensor
from nibble.runner.measure.bench import memory_bandwidth
from nibble.runner.kernels import cpu
from nibble.runner.kernels.linear import prepare, qmatmul
from nibble.runner.kernels.quant_decode import KINDS
from nibble.runner.kernels.prefill import dequantize

LAYERS, G = 30, 64
SHAPES = {"q": (576, 576), "k": (192, 576), "v": (192, 576), "o": (576, 576),   # (N, K)
          "gate": (1536, 576), "up": (1536, 576), "down": (576, 1536)}
HEAD = (49152, 576)


def random_weight(rng, layers, N, K, bits):
    """[layers] stacked MLX tensors: uint32 words, float16 scales and biases, then prepared."""
    w = rng.integers(0, 2**32, size=(layers, N, K * bits // 32), dtype=np.uint32)
    s = (rng.random((layers, N, K // G)) * 0.01 + 1e-3).astype(np.float16)
    b = (rng.standard_normal((layers, N, K // G)) * 0.02).astype(np.float16)
    qws = [prepare(QuantizedTensor(w[i], s[i], b[i], bits, G)) for i in range(layers)]
    return (np.stack([q.weight for q in qws]), np.stack([q.scales for q in qws]),
            np.stack([q.biases for q in qws]))


def _token_of(bits: int):
    """One matrix shape for every layer, as the decoder calls it, for weights of `bits` bits."""
    kind = KINDS[bits, G]

    @njit(nogil=True)
    def token(x, q3, s3, b3, out):
        for layer in range(q3.shape[0]):
            qmatmul(x, kind(q3[layer], s3[layer], b3[layer], bits, G, False), out, False)
    return token


_token = {bits: _token_of(bits) for bits in (4, 8)}


def decode_bench(rng, bits, repeats):
    mats = {name: random_weight(rng, LAYERS, N, K, bits) for name, (N, K) in SHAPES.items()}
    mats["head"] = random_weight(rng, 1, *HEAD, bits)
    xs = {K: rng.standard_normal((1, K)).astype(np.float32) for K in (576, 1536)}
    nbytes = sum(a.nbytes for m in mats.values() for a in m)
    dims = {**SHAPES, "head": HEAD}

    def token():
        for name, (q3, s3, b3) in mats.items():
            N, K = dims[name]
            _token[bits](xs[K], q3, s3, b3, np.empty((1, N), np.float32))
    return token, nbytes


def _busy_jiffies():
    """CPU time used by every process on the machine, and by this one."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return sum(v) - v[3] - v[4], int(own[11]) + int(own[12])


def foreign_cores(seconds):
    """Cores used by other processes over the next `seconds`."""
    (all0, own0), start = _busy_jiffies(), time.perf_counter()
    time.sleep(seconds)
    (all1, own1), dt = _busy_jiffies(), time.perf_counter() - start
    return max(0, (all1 - all0) - (own1 - own0)) / os.sysconf("SC_CLK_TCK") / dt


def wait_quiet(budget_s=20.0):
    """Wait until other processes use < 0.15 cores (up to budget_s); True if they do."""
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end:
        if foreign_cores(0.3) < 0.15:
            return True
    return False


QUIET = {"rounds": 0, "quiet": 0}


def timed(fns, repeats):
    """Best and median seconds of each function, run interleaved after waiting for quiet."""
    runs = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(repeats):
        QUIET["rounds"] += 1
        QUIET["quiet"] += wait_quiet()
        for k, f in fns.items():
            start = time.perf_counter()
            f()
            runs[k].append(time.perf_counter() - start)
    return {k: (min(v), statistics.median(v)) for k, v in runs.items()}


def prefill_bench(rng, repeats):
    print("\nprefill (GFLOP/s, best / median):")
    for T in (128, 512):
        for N, K in [(1536, 576), (576, 1536)]:
            x = rng.standard_normal((T, K)).astype(np.float32)
            out = np.empty((T, N), np.float32)
            fns, flops = {}, 2.0 * T * N * K
            for bits in (8, 4):
                (q,), (s,), (b,) = random_weight(rng, 1, N, K, bits)
                qw = KINDS[bits, G](q, s, b, bits, G, False)
                fns[f"int{bits}"] = lambda qw=qw: qmatmul(x, qw, out, False)
            wf = dequantize(qw)
            fns["float32 cpu.matmul"] = lambda: cpu.matmul(x, wf, out, False)
            res = timed(fns, repeats)
            print(f"  T={T:3d} {N}x{K}: " + " | ".join(
                f"{k} {flops / best / 1e9:5.1f} / {flops / med / 1e9:5.1f}" for k, (best, med) in res.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"threads: {numba.get_num_threads()}")
    tok8, nb8 = decode_bench(rng, 8, args.repeats)
    tok4, nb4 = decode_bench(rng, 4, args.repeats)
    wait_quiet()
    bw = memory_bandwidth()
    res = timed({"int8": tok8, "int4": tok4}, args.repeats)
    wait_quiet()
    bw = max(bw, memory_bandwidth())
    print(f"decode, one token = 30 layers x 7 matrices + head, group size {G}; "
          f"memory bandwidth (parallel float32 sum over 1 GiB): {bw:.1f} GB/s")
    for k, nb in (("int8", nb8), ("int4", nb4)):
        best, med = res[k]
        print(f"  {k}: {nb / 1e6:6.1f} MB/token  {best * 1e3:6.2f} ms  {nb / best / 1e9:5.1f} GB/s = "
              f"{nb / best / 1e9 / bw:4.0%} of bandwidth  (median {med * 1e3:6.2f} ms, {nb / med / 1e9:5.1f} GB/s)")
    print(f"  int4 / int8 speed per token: {res['int8'][0] / res['int4'][0]:.2f}x "
          f"(median {res['int8'][1] / res['int4'][1]:.2f}x)")
    prefill_bench(rng, max(3, args.repeats // 3))
    print(f"\n{QUIET['quiet']} of {QUIET['rounds']} rounds started with other processes using < 0.15 cores")


if __name__ == "__main__":
    main()
