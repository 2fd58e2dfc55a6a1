"""The benchmark: prefill and decode speed, next to this machine's memory bandwidth.

Decode reads every weight once per token, so tokens/s x weight bytes / bandwidth says how close
it runs to the machine's limit. Each figure is the median of several repetitions.
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
from numba import njit, prange

from .model import Model

# Ordinary English to tokenize for the prompt (the text of ../shared/reference/llamacpp_bench.py
# is similar in kind): the speed of prefill does not depend on what the tokens say.
PROMPT_TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. Early machines "
    "were programmed by physically rewiring circuits, and each new problem required a new "
    "arrangement of cables and switches. The stored-program concept changed this: instructions "
    "and data could live side by side in the same memory. "
)


@dataclass
class BenchResult:
    prompt_tokens: int
    gen_tokens: int
    prefill_tps: float         # median
    decode_tps: float          # median
    ttft_s: float              # median: prefill + choosing the first token
    weight_bytes_per_token: int
    peak_rss_mb: float
    bandwidth_gbs: float       # parallel float32 sum over 1 GiB, same run
    repeats: int

    @property
    def decode_fraction(self) -> float:
        """Decode's share of the measured memory bandwidth."""
        return self.decode_tps * self.weight_bytes_per_token / (self.bandwidth_gbs * 1e9)

    def as_dict(self) -> dict:
        return {**asdict(self), "decode_fraction": self.decode_fraction}

    def summary(self) -> str:
        return (f"prefill {self.prefill_tps:.1f} tok/s ({self.prompt_tokens} tokens) | "
                f"decode {self.decode_tps:.1f} tok/s ({self.gen_tokens} tokens) | "
                f"first token {self.ttft_s * 1000:.0f} ms | peak RSS {self.peak_rss_mb:.0f} MB\n"
                f"weights read per token {self.weight_bytes_per_token / 1e6:.1f} MB | memory bandwidth "
                f"{self.bandwidth_gbs:.1f} GB/s | decode at {self.decode_fraction:.0%} of it "
                f"(median of {self.repeats})")


def run_bench(model: Model, prompt_ids: list[int], gen_tokens: int = 128, repeats: int = 3,
              kv_type: str = "f32") -> BenchResult:
    """Prefill `prompt_ids` as one batch, then decode `gen_tokens` greedy tokens (eos ignored)."""
    cache = model.new_cache(len(prompt_ids) + gen_tokens + 1, kv_type)
    _one_run(model, cache, prompt_ids[:8], 2)   # load the compiled kernels before timing
    runs = [_one_run(model, cache, prompt_ids, gen_tokens) for _ in range(repeats)]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # before the 1 GiB probe
    med = lambda i: statistics.median(r[i] for r in runs)
    return BenchResult(len(prompt_ids), gen_tokens, med(0), med(1), med(2), weight_bytes_per_token(model),
                       peak_rss, memory_bandwidth(), repeats)


def _one_run(model, cache, prompt_ids, gen_tokens):
    cache.truncate(0)
    start = time.perf_counter()
    token = int(np.argmax(model.forward(prompt_ids, cache)[-1]))
    first = time.perf_counter()
    for _ in range(gen_tokens):
        token = int(np.argmax(model.forward([token], cache)[-1]))
    end = time.perf_counter()
    return len(prompt_ids) / (first - start), gen_tokens / (end - first), first - start


def weight_bytes_per_token(model: Model) -> int:
    """Every matrix and norm is read once per decoded token; of the embedding, one row."""
    layer_bytes = sum(_nbytes(w) for layer in model.layers for w in layer.weights)
    head = _nbytes(model.lm_head) + model.norm.nbytes
    return layer_bytes + head + _nbytes(model.embed) // model.config.vocab_size


def _nbytes(w) -> int:
    """Bytes of a float array or of a quantized weight's arrays (as held in memory)."""
    return w.nbytes if isinstance(w, np.ndarray) else w.q.nbytes + w.scales.nbytes + w.biases.nbytes


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of a parallel float32 sum over `nbytes` (large enough that caches do not count)."""
    a = np.ones(nbytes // 4, np.float32)
    _sum(a)
    best = min(_timed(_sum, a) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(f, a):
    start = time.perf_counter()
    f(a)
    return time.perf_counter() - start


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _sum(a):
    s = np.float32(0.0)
    for i in prange(a.shape[0]):
        s += a[i]
    return s
