"""`nibble bench --matrices`: where a decoded token's time goes, matrix by matrix.

Decode reads every weight once a token, so its speed is the matrices' bytes over the memory's
bandwidth, unless a kernel's arithmetic cannot keep up. For each matrix of the layers (wq, wk, ...,
w_down, grouped by name and kind: a GGUF K-quant file mixes kinds) and for the output head, one
row's product through it as decode runs it (a parallel region of its own, as the kernels a
layer at a time run it; the one-region block of kernels/team.py saves part of that), timed two ways:
- from memory: each call another layer's matrix, its bytes read from DRAM as in a token;
- cached: the same matrix again, what the kernel's arithmetic allows (weights a second).
Beside the machine's bandwidth, the first says how close each matrix gets to it; the second says
whether the kernel could get there: to read at the bandwidth it must take bandwidth / (bytes a
weight) weights a second. A mixture's stacked experts are left out (their rows are routed).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numba
import numpy as np

from nibble.formats import superblocks
from nibble.formats.half import HalfTensor
from nibble.quant.affine import QuantizedTensor

from .bench import memory_bandwidth
from ..kernels import cpu, linear
from ..model import Model

CACHED_CALLS = 10   # calls on one matrix a round, timed after the first (which brings it into cache)


@dataclass
class MatrixFigures:
    """One name and kind of matrix: `layers` of them a token (1 for the head)."""
    name: str          # the layer's field ("w_down"), or "head"
    kind: str          # "int4 g32", "int6 g16, two-level scales", "float16", "float32"
    rows: int          # N (outputs)
    cols: int          # K (inputs)
    layers: int
    nbytes: int        # one matrix's
    memory_s: float    # one product, its matrix from memory (median)
    cached_s: float    # one product, the same matrix again (median)

    @property
    def token_s(self) -> float:
        return self.layers * self.memory_s

    @property
    def memory_gbs(self) -> float:
        return self.nbytes / self.memory_s / 1e9

    @property
    def cached_gws(self) -> float:
        """Weights a second (billions) from cache."""
        return self.rows * self.cols / self.cached_s / 1e9

    def needed_gws(self, bandwidth_gbs: float) -> float:
        """Weights a second that reading at the bandwidth takes."""
        return bandwidth_gbs * self.rows * self.cols / self.nbytes


@dataclass
class MatrixProfile:
    matrices: list[MatrixFigures]
    bandwidth_gbs: float   # parallel float32 sum over 1 GiB, same run
    repeats: int
    threads: int

    @property
    def token_s(self) -> float:
        return sum(m.token_s for m in self.matrices)

    @property
    def nbytes(self) -> int:
        return sum(m.layers * m.nbytes for m in self.matrices)

    def as_dict(self) -> dict:
        return {"bandwidth_gbs": self.bandwidth_gbs, "repeats": self.repeats, "threads": self.threads,
                "token_s": self.token_s,
                "nbytes": self.nbytes,
                "matrices": [asdict(m) | {"token_s": m.token_s, "memory_gbs": m.memory_gbs,
                                          "cached_gws": m.cached_gws,
                                          "needed_gws": m.needed_gws(self.bandwidth_gbs)} for m in self.matrices]}

    def summary(self) -> str:
        head = (f"{'matrix':8} {'kind':30} {'rows x cols':>13} {'MB':>7} {'x':>3} {'ms a token':>10} "
                f"{'GB/s':>6} {'cached Gw/s':>11} {'needed':>7}")
        lines = [head] + [
            f"{m.name:8} {m.kind:30} {f'{m.rows}x{m.cols}':>13} {m.nbytes / 1e6:7.2f} {m.layers:3d} "
            f"{m.token_s * 1e3:10.2f} {m.memory_gbs:6.1f} {m.cached_gws:11.1f} "
            f"{m.needed_gws(self.bandwidth_gbs):7.1f}" for m in self.matrices]
        at_bandwidth = self.nbytes / (self.bandwidth_gbs * 1e9)
        lines.append(f"the matrices: {self.token_s * 1e3:.2f} ms a token for {self.nbytes / 1e6:.1f} MB; at the "
                     f"memory bandwidth ({self.bandwidth_gbs:.1f} GB/s) {at_bandwidth * 1e3:.2f} ms "
                     f"({self.threads} thread{'s' * (self.threads != 1)}, median of {self.repeats})")
        lines.append("GB/s: from memory, each call another layer's; cached Gw/s: billions of weights a second, "
                     "the same matrix again; needed: what reading at the bandwidth takes")
        return "\n".join(lines)


def run_matrix_bench(model: Model, repeats: int = 3) -> MatrixProfile:
    """Each name and kind of matrix of the model's layers, and its head (see the module's docstring)."""
    groups: dict[tuple[str, str], list] = {}
    for layer in model.layers:
        for name in getattr(layer, "_fields", ()):
            w = getattr(layer, name)
            if _is_matrix(w):
                groups.setdefault((name, kind(w)), []).append(w)
    if model.lm_head is not None and _is_matrix(model.lm_head):
        groups[("head", kind(model.lm_head))] = [model.lm_head]
    # one count throughout: -t's, else the cores free as it starts (a pass's probes would change it)
    threads = model.threads.next_count(1)
    numba.set_num_threads(threads)
    bandwidth = memory_bandwidth()
    return MatrixProfile([_timed(name, k, ws, repeats) for (name, k), ws in groups.items()], bandwidth, repeats,
                         threads)


def kind(w) -> str:
    """A matrix's kind as the kernels see it."""
    if isinstance(w, QuantizedTensor):
        levels = ", a table of levels" if w.values is not None else ""
        two_level = ", two-level scales" if superblocks.is_two_level(w.scales) else ""
        return f"int{w.integer_bits} g{w.group_size}{two_level}{levels}"
    if isinstance(w, HalfTensor):
        return "bfloat16" if w.bf16 else "float16"
    return str(w.dtype)


def _is_matrix(w) -> bool:
    if isinstance(w, QuantizedTensor):
        return w.weight.ndim == 2
    if isinstance(w, HalfTensor):
        return w.ndim == 2
    return isinstance(w, np.ndarray) and w.ndim == 2 and w.dtype == np.float32


def _timed(name: str, k: str, ws: list, repeats: int) -> MatrixFigures:
    N, K = ws[0].shape
    x = np.random.default_rng(0).standard_normal((1, K)).astype(np.float32)
    out = np.empty((1, N), np.float32)
    kernel = cpu.matmul if isinstance(ws[0], np.ndarray) else linear.qmatvec   # linear.linear's, for one row
    # the compiled entry point: numba's dispatcher would type the weight's named tuple at each call
    entry = kernel.compile(tuple(map(kernel.typeof_pyval, (x, ws[0], out, False))))
    product = lambda w: entry(x, w, out, False)
    for w in ws:   # mapped in first: a weight's first read takes its pages from the file
        product(w)
    memory, cached = [], []
    for _ in range(repeats):
        for w in ws:
            memory.append(_seconds(product, w))
        product(ws[0])
        cached += [_seconds(product, ws[0]) for _ in range(CACHED_CALLS)]
    return MatrixFigures(name, k, N, K, len(ws), ws[0].nbytes, statistics.median(memory),
                         statistics.median(cached))


def _seconds(f, w) -> float:
    start = time.perf_counter()
    f(w)
    return time.perf_counter() - start
