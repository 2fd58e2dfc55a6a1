"""A first run's compile on two cores or more at once: the decode kernels of a model's quantized
weights compile in a second process (the output head's, if of another kind, in a third) while
this one compiles the rest, into the same on-disk cache.

Numba compiles on one core, and a first run spends a minute or more in it. The decode kernel of
each kind of weight (quant_decode's, the biggest: 10-20 s each on 2 cores) depends on nothing
the rest compiles, and the rest finds it in the cache once it is there. So the other process gets
a weight's kind as a line of text (bits, group, the scales' dtype, which arrays are writable: all
that makes its numba type), makes a tiny weight of that type, runs the decode kernel on it, and
prints the line back when it is cached. Meanwhile this process compiles the prefill kernels,
then waits for the decode kernels before compiling the layer that calls them (a kernel it
compiled itself first would be compiled twice).

A first run is told from a warm one by numba's cache index: whether it holds the layer for its
argument types (`is_cached`), looked up without loading anything.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from numba.core.dispatcher import Dispatcher

from nibble.quant.affine import QuantizedTensor
from . import compiling
from .quant_decode import KINDS

T = TypeVar("T")

# Seconds each step of a first pass takes on two cores of a 2.x GHz Xeon (the compile's progress
# line scales them by the pace of the steps done): the decode and prefill kernels of one kind of
# weight (side by side: the longer of the two), then the layer, which calls them.
KIND_SECONDS = 35.0
LAYER_SECONDS = 18.0


def is_cached(dispatcher: Dispatcher, sig: tuple) -> bool:
    """Whether numba's on-disk cache holds `dispatcher` compiled for `sig`, read from its index
    (numba's own files: on a numba whose index cannot be read so, as if it did)."""
    cache = dispatcher._cache
    try:
        key = cache._index_key(sig, dispatcher.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:   # another numba's internals: no compile ahead
        return True


def spec(w: QuantizedTensor) -> str:
    """The text of a prepared weight's numba type: its kind, scales, table of levels and planes."""
    writable = "".join("w" if a.flags.writeable else "r" for a in (w.weight, w.scales, w.biases))
    return f"{w.bits} {w.group_size} {w.scales.dtype} {int(w.bf16)} {writable} {int(w.values is not None)} {int(w.high is not None)}"


def example(text: str) -> QuantizedTensor:
    """A tiny prepared weight (2 rows of one group) of the type `text` (spec) describes."""
    bits, G, dtype, bf16, writable, levels, planes = text.split()
    bits, G = int(bits), int(G)
    if dtype in ("uint8", "int8"):   # scales in two levels: one super-block of 256 weights
        arrays = [np.zeros((2, 256 * bits // 32), np.uint32), *(np.zeros((2, 1, 2 + 256 // G), dtype) for _ in "sb")]
    else:
        arrays = [np.zeros((2, G * bits // 32), np.uint32), np.ones((2, 1), dtype), np.zeros((2, 1), dtype)]
    for a, w in zip(arrays, writable):
        a.flags.writeable = w == "w"
    values = np.arange(16, dtype=np.uint8) if levels == "1" else None
    high = np.zeros((2, 32), np.uint8) if planes == "1" else None   # one plane of one super-block
    for a in (values, high):
        if a is not None:
            a.flags.writeable = False   # as prepare keeps them
    return KINDS[bits, G](*arrays, bits, G, bool(int(bf16)), values, high)


def compile_decode(text: str):
    """Run the decode kernel on a weight of the type `text` describes (compiling it, once)."""
    from .linear import qmatvec
    w = example(text)
    x = np.zeros((1, w.shape[1]), np.float32)
    qmatvec(x, w, np.zeros((1, 2), np.float32), False)


class Ahead:
    """The other process, compiling the decode kernels of `weights` (prepared QuantizedTensors,
    one of each type, in the order they are needed)."""

    def __init__(self, weights: list[QuantizedTensor]):
        self.pending = list(dict.fromkeys(map(spec, weights)))
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, *self.pending], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True) if self.pending else None

    def wait(self, weights: list[QuantizedTensor]):
        """Until the decode kernels of `weights` are cached (or the other process has ended)."""
        wanted = set(map(spec, weights))
        with compiling.elsewhere("the decode kernels, in a second process"):
            while wanted & set(self.pending):
                line = self.proc.stdout.readline()
                if not line:   # it ended early: what it left is compiled here
                    self.pending = []
                    break
                self.pending.remove(line.strip())
        if not self.pending and self.proc is not None:
            self.proc.wait()


def first_pass(layers: list, head, compile_layers: Callable[[], T]) -> T:
    """compile_layers() on a first run, on two cores or more: the decode kernels of the quantized
    weights of `layers` (named tuples of weights) in another process, those of `head` (None:
    none) in a third where its kind is not theirs, their prefill kernels here, then the layers'
    kernel itself once the kernels it calls are cached. Returns what compile_layers returns, once
    the head's decode kernel is cached too."""
    from .linear import qprefill
    quantized = lambda ws: [w for w in ws if isinstance(w, QuantizedTensor)]
    kinds = list({spec(w): w for layer in layers for w in quantized(layer)}.values())
    heads = [w for w in quantized([head]) if spec(w) not in set(map(spec, kinds))]
    expected = [("the matrix kernels", KIND_SECONDS * len(kinds)), ("the layer", LAYER_SECONDS)]
    with compiling.steps(expected) as steps:
        other, the_head = Ahead(kinds), Ahead(heads)
        for w in kinds:
            N, K = w.shape
            x, out = np.zeros((2, K), np.float32), np.zeros((2, N), np.float32)
            qprefill.compile(tuple(map(qprefill.typeof_pyval, (x, w, out, False))))
        other.wait(kinds)
        steps.next()
        compiled = compile_layers()
        the_head.wait(heads)
    return compiled


def main(specs: list[str]):
    for text in specs:
        compile_decode(text)
        print(text, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
