"""The benchmark: prefill and decode speed, next to this machine's memory bandwidth.

Decode reads every weight once per token, so tokens/s x weight bytes / bandwidth says how close
it runs to the machine's limit. Each figure is the median of several repetitions.

With several streams (`--parallel N`), N sequences decode together, one forward pass a step for
all of them as the serving engine runs them: the weights are read once per step, so the streams'
tokens/s together can be a multiple of one stream's.

An embedding model has no decode: its figure is texts per second, a batch of N texts of P tokens
embedded at a time (Embedder.embed_ids: one pass, packed).
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass

import numba
import numpy as np
from numba import njit, prange

from nibble.quant.affine import QuantizedTensor

from ..embedding.rerank import Reranker
from ..kv.cache import Rows, blocks_for
from ..kernels.layer import weights_of
from ..kernels.moe import MoEWeights
from ..model import Model

# Ordinary English to tokenize for the prompt (the text of ../shared/reference/llamacpp_bench.py
# is similar in kind): the speed of prefill does not depend on what the tokens say.
PROMPT_TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. Early machines "
    "were programmed by physically rewiring circuits, and each new problem required a new "
    "arrangement of cables and switches. The stored-program concept changed this: instructions "
    "and data could live side by side in the same memory. "
)


@dataclass
class GPUFigures:
    gpu_layers: int                 # offloaded layers (the last ones)
    gpu_weight_bytes_per_token: int  # of the offloaded layers (and the head, when it runs there)
    gpu_bandwidth_gbs: float        # device-to-device copy, same run
    kernel_utilization: float       # median: GPU kernel time / wall time of the decode loop
    graph_error: str                # why decode launched its kernels one by one; "": as a CUDA graph

    def decode_fraction(self, decode_tps: float) -> float:
        """Decode's share of the GPU's measured memory bandwidth (its weights only)."""
        return decode_tps * self.gpu_weight_bytes_per_token / (self.gpu_bandwidth_gbs * 1e9)

    def summary(self, decode_tps: float) -> str:
        return (f"GPU: {self.gpu_layers} layers, weights read per token "
                f"{self.gpu_weight_bytes_per_token / 1e6:.1f} MB | memory bandwidth "
                f"{self.gpu_bandwidth_gbs:.1f} GB/s | decode at {self.decode_fraction(decode_tps):.0%} of it"
                f" | kernels busy {self.kernel_utilization:.0%} of decode | "
                + (f"kernels launched one by one: {self.graph_error}" if self.graph_error
                   else "one CUDA graph per token"))


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
    gpu: GPUFigures | None = None   # with GPU layers only (the CPU-only output stays as it was)
    prefill_gops: float = 0.0  # operations of prefill (prefill_ops) a second
    peak_gops: float | None = None   # this CPU's byte dot products at their peak (a quantized model's prefill)

    @property
    def decode_fraction(self) -> float:
        """Decode's share of the measured memory bandwidth."""
        return self.decode_tps * self.weight_bytes_per_token / (self.bandwidth_gbs * 1e9)

    def as_dict(self) -> dict:
        d = {**asdict(self), "decode_fraction": self.decode_fraction}
        gpu = d.pop("gpu")
        if gpu:
            d |= {**gpu, "gpu_decode_fraction": self.gpu.decode_fraction(self.decode_tps)}
        return d

    def summary(self) -> str:
        gpu = f"\n{self.gpu.summary(self.decode_tps)}" if self.gpu else ""
        return self._cpu_summary() + gpu

    def _cpu_summary(self) -> str:
        return (f"prefill {self.prefill_tps:.1f} tok/s ({self.prompt_tokens} tokens) | "
                f"decode {self.decode_tps:.1f} tok/s ({self.gen_tokens} tokens) | "
                f"first token {self.ttft_s * 1000:.0f} ms | peak RSS {self.peak_rss_mb:.0f} MB\n"
                f"weights read per token {self.weight_bytes_per_token / 1e6:.1f} MB | memory bandwidth "
                f"{self.bandwidth_gbs:.1f} GB/s | decode at {self.decode_fraction:.0%} of it "
                f"(median of {self.repeats})\n" + self._compute_summary())

    def _compute_summary(self) -> str:
        done = f"prefill {self.prefill_gops:.1f} GOPS"
        if not self.peak_gops:
            return done
        return (f"{done} | byte dot products at their peak {self.peak_gops:.1f} GOPS | "
                f"prefill at {self.prefill_gops / self.peak_gops:.0%} of it")


def run_bench(model: Model, prompt_ids: list[int], gen_tokens: int = 128, repeats: int = 3,
              kv_type: str = "f32") -> BenchResult:
    """Prefill `prompt_ids` as one batch, then decode `gen_tokens` greedy tokens (eos ignored)."""
    cache = model.new_cache(len(prompt_ids) + gen_tokens + 1, kv_type)
    _one_run(model, cache, prompt_ids, 2)   # load the compiled kernels (prefill's and decode's) before timing
    runs = [_one_run(model, cache, prompt_ids, gen_tokens) for _ in range(repeats)]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # before the 1 GiB probe
    med = lambda i: statistics.median(r[i] for r in runs)
    on_gpu = model.gpu_stage
    gpu = GPUFigures(len(on_gpu.layers), on_gpu.weight_nbytes, gpu_memory_bandwidth(),
                     med(3), on_gpu.graph_error) if on_gpu else None
    T = len(prompt_ids)
    return BenchResult(T, gen_tokens, med(0), med(1), med(2), weight_bytes_per_token(model),
                       peak_rss, memory_bandwidth(), repeats, gpu, prefill_ops(model, T) * med(0) / T / 1e9,
                       peak_gops() if _quantized(model) else None)


def _one_run(model, cache, prompt_ids, gen_tokens):
    """-> prefill tok/s, decode tok/s, time to first token, kernel utilization of decode (GPU)."""
    cache.truncate(0)
    on_gpu = model.gpu_stage
    start = time.perf_counter()
    token = int(np.argmax(model.forward(prompt_ids, cache)[-1]))
    if on_gpu:   # CUDA events around each kernel or each graph launch (GPUStage._decode)
        on_gpu.events = []
    first = time.perf_counter()
    for _ in range(gen_tokens):
        token = int(np.argmax(model.forward([token], cache)[-1]))
    end = time.perf_counter()
    # Each pass ends by copying its result to the host, so the loop's wall time holds every kernel:
    # the events' GPU time over it is the share the GPU is busy (the rest: CPU layers, launches,
    # copies, sampling).
    busy = on_gpu.kernel_seconds() / (end - first) if on_gpu else 0.0
    if on_gpu:
        on_gpu.events = None
    return len(prompt_ids) / (first - start), gen_tokens / (end - first), first - start, busy


@dataclass
class ParallelResult:
    streams: int
    prompt_tokens: int      # of each stream
    gen_tokens: int         # decoded by each stream
    single_tps: float       # median: one stream's decode tokens/s
    parallel_tps: float     # median: the N streams' decode tokens/s together
    repeats: int            # of each, one after the other

    @property
    def speedup(self) -> float:
        return self.parallel_tps / self.single_tps

    def as_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}

    def summary(self) -> str:
        return (f"decode: 1 stream {self.single_tps:.1f} tok/s | {self.streams} streams together "
                f"{self.parallel_tps:.1f} tok/s ({self.speedup:.2f}x) | {self.prompt_tokens} prompt "
                f"tokens, {self.gen_tokens} decoded a stream (median of {self.repeats}, interleaved)")


def run_parallel_bench(model: Model, prompt_ids: list[int], streams: int, gen_tokens: int = 128,
                       repeats: int = 3, kv_type: str = "f32") -> ParallelResult:
    """Decode `gen_tokens` greedy tokens after `prompt_ids` in 1 stream, then in `streams` streams
    together (Model.forward_batch, one pass a step), `repeats` times in turn: the machine's load
    weighs on both alike."""
    P, width = len(prompt_ids), blocks_for(len(prompt_ids) + gen_tokens + 1)
    pool = model.new_pool(streams * width, kv_type)
    tables = np.arange(streams * width, dtype=np.int32).reshape(streams, width)   # each stream's blocks
    first = []
    for s in range(streams):   # every stream's prompt, once: each run decodes after it again
        rows = Rows.of(np.arange(P), np.full(P, s), tables)
        first.append(int(np.argmax(model.forward_batch(prompt_ids, rows, pool, [P - 1])[0])))

    def decode(n: int, steps: int) -> float:
        tokens = first[:n]
        start = time.perf_counter()
        for step in range(steps):
            rows = Rows.of(np.full(n, P + step), np.arange(n), tables[:n])
            tokens = model.forward_batch(tokens, rows, pool, np.arange(n)).argmax(axis=1)
        return n * steps / (time.perf_counter() - start)

    decode(streams, 2)   # load the compiled kernels before timing
    runs = [(decode(1, gen_tokens), decode(streams, gen_tokens)) for _ in range(repeats)]
    return ParallelResult(streams, P, gen_tokens, statistics.median(r[0] for r in runs),
                          statistics.median(r[1] for r in runs), repeats)


@dataclass
class EmbedResult:
    texts: int             # a batch
    tokens: int            # each text's
    texts_per_s: float     # median
    threads: int           # the kernels' count in the last pass
    repeats: int
    kind: str = "embed"    # or "rerank": the texts are query and document pairs

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.texts_per_s * self.tokens}

    def summary(self) -> str:
        texts = "pairs" if self.kind == "rerank" else "texts"
        return (f"{self.kind}: {self.texts_per_s:.1f} {texts}/s ({self.texts_per_s * self.tokens:.0f} tokens/s), "
                f"batches of {self.texts} {texts} of {self.tokens} tokens, {self.threads} threads "
                f"(median of {self.repeats})")


def run_embed_bench(embedder, ids: list[int], texts: int, repeats: int = 5) -> EmbedResult:
    """Run `texts` copies of the text `ids` through an Embedder (or a Reranker: a pair's ids)
    together, `repeats` times (after one untimed batch that loads the compiled kernels)."""
    ranks = isinstance(embedder, Reranker)
    batch, each = [ids] * texts, [[0] * len(ids) if ranks else 0] * texts
    embedder.run(batch, each)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        embedder.run(batch, each)
        times.append(time.perf_counter() - start)
    return EmbedResult(texts, len(ids), texts / statistics.median(times), embedder.encoder.threads.current, repeats,
                       "rerank" if ranks else "embed")


@dataclass
class ImageResult:
    width: int             # the image's pixels
    height: int
    tokens: int            # the image's tokens in the prompt
    preprocess_s: float    # median: resizing and scaling its pixels
    encode_s: float        # median: the tower and the projector
    threads: int
    repeats: int

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"image: {self.width} x {self.height} pixels, {self.tokens} tokens: the tower and projector "
                f"{self.encode_s:.2f} s, its pixels prepared in {self.preprocess_s * 1000:.0f} ms, "
                f"{self.threads} threads (median of {self.repeats})")


def run_image_bench(vision, picture, repeats: int = 3) -> ImageResult:
    """An image through a model's vision `repeats` times (after one untimed pass that loads the
    compiled kernels): its processor's pixels, then the tower and projector, timed apart."""
    pixels = vision.pixels(picture)
    vision.embed([pixels])
    prepare, encode = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        pixels = vision.pixels(picture)
        middle = time.perf_counter()
        vision.embed([pixels])
        prepare.append(middle - start)
        encode.append(time.perf_counter() - middle)
    return ImageResult(*picture.size, vision.count(picture), statistics.median(prepare), statistics.median(encode),
                       vision.threads.current, repeats)


def weight_bytes_per_token(model: Model) -> int:
    """Every matrix and norm is read once per decoded token; of the embedding, one row."""
    layers_and_head = sum(stage.weight_nbytes for stage in model.stages)
    return layers_and_head + model.embed.nbytes // model.config.vocab_size


def prefill_ops(model: Model, T: int) -> float:
    """Operations (a multiply and an add each) of prefilling T tokens: every matrix of the
    layers for each token (of a mixture's experts, the routed ones), attention's Q K^T and P V
    over T (T + 1) / 2 pairs of positions a head, the head's for the last token."""
    c = model.config
    per_token = sum(_products(w) for layer in model.layers for w in weights_of(layer))
    attention = c.num_hidden_layers * c.num_attention_heads * c.head_dim * T * (T + 1)
    return 2.0 * (T * per_token + attention + _products(model.lm_head))


def _products(w, routed: int = 0) -> float:
    """Multiply-adds of one row through weight w: a matrix's, a stack of experts' `routed` ones,
    the parts' of a mixture or of weights held together; a vector's none."""
    if isinstance(w, QuantizedTensor):
        (n, k), stack = w.shape, (w.weight.shape[0] if w.weight.ndim == 3 else 0)
    elif isinstance(w, MoEWeights):
        return (_products(w.router) + _products(w.shared)
                + sum(_products(x, w.top_k) for x in (w.w_gate, w.w_up, w.w_down)))
    elif isinstance(w, tuple):
        return sum(_products(v, routed) for v in w)
    elif getattr(w, "ndim", 0) >= 2:
        *rest, n, k = w.shape
        stack = rest[0] if rest else 0
    else:
        return 0.0
    return float(n) * k * (min(routed, stack) if stack else 1)


def _quantized(model: Model) -> bool:
    return any(isinstance(w, QuantizedTensor) for layer in model.layers for w in weights_of(layer))


def peak_gops(steps: int = 20_000_000, repeats: int = 3) -> float | None:
    """GOPS of the byte dot products prefill's tiles use, on all the kernels' threads (None on a
    CPU without them: prefill runs float tiles there)."""
    from ..kernels import prefill_int8
    if not prefill_int8.DOT:
        return None
    sums = np.zeros(numba.get_num_threads())
    prefill_int8.peak_products(1, sums)   # compiled or loaded before timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ops = prefill_int8.peak_products(steps, sums)
        times.append(time.perf_counter() - start)
    return ops / min(times) / 1e9


def gpu_memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of a device-to-device copy of `nbytes` (read + write: 2 x nbytes move). numba's
    simulator copies numpy arrays in Python: it gets 1 MiB, and a figure of no meaning."""
    from numba import config, cuda
    from ..offload import free_memory
    free = free_memory(cuda)
    # the two buffers take at most half of the free memory (the model is already loaded)
    nbytes = 1 << 20 if config.ENABLE_CUDASIM else min(nbytes, free // 4 if free else nbytes)
    src = cuda.device_array(nbytes // 4, np.float32)
    dst = cuda.device_array(nbytes // 4, np.float32)
    dst.copy_to_device(src)   # warm-up

    def copy():
        cuda.synchronize()
        start = time.perf_counter()
        dst.copy_to_device(src)
        cuda.synchronize()
        return time.perf_counter() - start
    return 2 * nbytes / min(copy() for _ in range(repeats)) / 1e9


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
