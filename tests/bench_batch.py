"""Benchmark of batched decoding (not collected by pytest).

    python -m tests.bench_batch [-m smollm2 | --shapes llama-2-7b] [-t 2] [--rounds 3]

1. Kernels: every layer matrix of the model through the decode kernel (quant_decode.matvec_rows)
   and through prefill's tiles, at B rows of x: ms per row, which places cpu.SMALL (the most rows
   the decode kernel takes).
2. Steps: Model.forward_batch with 1, 4 and 8 sequences decoding together (one row each, every
   sequence ~64 positions in), tokens/s summed over the sequences, next to one sequence's
   Model.forward.

The machine is shared: each round waits (a bounded time) for the other processes to go quiet
(tests/bench_quant_kernels.py), variants run interleaved, and the best and the median of the
rounds are reported.
"""
import argparse
import statistics
import time

import numba
import numpy as np

from nibble.runner.kv.cache import BLOCK, Rows
from nibble.runner.kernels import prefill, quant_decode
from tests.bench_quant_kernels import wait_quiet

BATCHES = (1, 2, 4, 6, 8, 12, 16)
SEQUENCES = (1, 4, 8)


def rounds_of(variants: dict, rounds: int) -> dict:
    """Seconds of each variant in each round, interleaved, each round after waiting for quiet."""
    times = {v: [] for v in variants}
    for _ in range(rounds):
        wait_quiet()
        for v, f in variants.items():
            start = time.perf_counter()
            f()
            times[v].append(time.perf_counter() - start)
    return times


def kernels(model, rounds: int):
    """ms per row of x through all layer matrices: decode kernel and tiles, at each B."""
    mats = [w for layer in model.layers for w in (layer.wq, layer.wk, layer.wv, layer.wo,
                                                    layer.w_gate, layer.w_up, layer.w_down)]
    rng = np.random.default_rng(0)
    xs = {(B, w.shape[1]): rng.standard_normal((B, w.shape[1])).astype(np.float32) for B in BATCHES for w in mats}
    outs = {(B, w.shape[0]): np.empty((B, w.shape[0]), np.float32) for B in BATCHES for w in mats}

    def run(kernel, B):
        return lambda: [kernel(xs[B, w.shape[1]], w, outs[B, w.shape[0]], False) for w in mats]
    variants = {(name, B): run(kernel, B) for B in BATCHES
                for name, kernel in (("decode", quant_decode.matvec_rows), ("tiles", prefill.matmul))}
    for f in variants.values():
        f()   # compile and warm
    times = rounds_of(variants, rounds)
    print(f"all {len(mats)} layer matrices ({sum(w.nbytes for w in mats) / 1e6:.0f} MB), ms per row "
          f"of x, best / median of {rounds}:")
    print("  B      " + "".join(f"{B:>14}" for B in BATCHES))
    for name in ("decode", "tiles"):
        print(f"  {name:7s}" + "".join(f"{min(times[name, B]) * 1e3 / B:7.2f}/{statistics.median(times[name, B]) * 1e3 / B:<6.2f}"
                                       for B in BATCHES))


def steps(model, rounds: int, n_steps: int, prompt: int):
    """tokens/s of S sequences decoding together, one forward_batch a step."""
    V = model.config.vocab_size
    per_seq = -(-(prompt + rounds * n_steps + 1) // BLOCK)
    rng = np.random.default_rng(1)

    def setup(S):
        pool = model.new_pool(S * per_seq)
        tables = np.arange(S * per_seq, dtype=np.int32).reshape(S, per_seq)
        for s in range(S):   # prefill each sequence, one a pass
            ids = rng.integers(0, V, prompt)
            model.forward_batch(ids, Rows.of(np.arange(prompt), np.full(prompt, s), tables), pool, [prompt - 1])
        return dict(pool=pool, tables=tables, pos=prompt, tokens=rng.integers(0, V, S))

    state = {S: setup(S) for S in SEQUENCES}
    cache = model.new_cache(prompt + rounds * n_steps + 1)
    model.forward(rng.integers(0, V, prompt), cache)

    def batched(S):
        st = state[S]
        for _ in range(n_steps):
            rows = Rows.of(np.full(S, st["pos"]), np.arange(S), st["tables"])
            st["tokens"] = model.forward_batch(st["tokens"], rows, st["pool"], np.arange(S)).argmax(-1)
            st["pos"] += 1

    def alone():
        token = 0
        for _ in range(n_steps):
            token = int(model.forward([token], cache)[-1].argmax())
    variants = {"Model.forward": alone, **{f"forward_batch x{S}": (lambda S=S: batched(S)) for S in SEQUENCES}}
    rows = {"Model.forward": 1, **{f"forward_batch x{S}": S for S in SEQUENCES}}
    times = rounds_of(variants, rounds)
    tps = {v: (rows[v] * n_steps / min(t), rows[v] * n_steps / statistics.median(t)) for v, t in times.items()}
    best, med = tps["Model.forward"]
    print(f"decode steps ({n_steps} a round, from position {prompt}), tokens/s summed over the sequences, "
          f"best / median of {rounds}:")
    for v, (b, m) in tps.items():
        print(f"  {v:18s} {b:7.1f} x{b / best:.2f} / {m:7.1f} x{m / med:.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--shapes", help="random int4 weights of these shapes (runner/measure/synthetic.py) instead of a model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--no-kernels", action="store_true")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    if args.shapes:
        from nibble.runner.measure.synthetic import random_model
        model = random_model(args.shapes, 4)
    else:
        from nibble.runner.loader import load
        model, _ = load(args.model)
    print(f"{args.shapes or args.model}, {args.threads} threads")
    if not args.no_kernels:
        kernels(model, args.rounds)
    steps(model, args.rounds, args.steps, args.prompt)


if __name__ == "__main__":
    main()
