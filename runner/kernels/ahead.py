"""A first run's compile on two cores at once: the decode kernels of a model's quantized weights
(then the output head's, if of another kind) compile in a second process while this one compiles
the rest, into the same on-disk cache.

Numba compiles on one core. The decode kernel of each kind of weight depends on nothing the rest
compiles, and the rest finds it in the cache once it is there. So the other process gets a
weight's kind as a line of text (bits, group, the scales' dtype, which arrays are writable,
whether a first run's kind: all that makes its numba type), makes a tiny weight of that type, runs
the decode kernel on it, and prints the line back when it is cached. Meanwhile this process
compiles the prefill kernels and attention, then waits for the decode kernels before compiling
the layer that calls them (a kernel it compiled itself first would be compiled twice).

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
from .quant_decode import FIRST_KINDS, KINDS

T = TypeVar("T")

# Seconds a first pass's compile takes on compiling.machine_pace's reference machine, by a first
# run's kinds (True) or the full ones: the decode kernel of a kind of weight in the other process,
# its prefill kernels and attention here (a step lasts the longer of the two, and a quarter more for
# the cores they share with the rest), then the layer, which calls them.
DECODE_SECONDS = {True: 4.5, False: 7.0}
PREFILL_SECONDS = {True: 0.0, False: 5.0}
ATTENTION_SECONDS = 6.5
LAYER_SECONDS = {True: 5.0, False: 5.0}
SHARED = 1.25


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
    """The text of a prepared weight's numba type: its kind (a first run's or not), scales, table
    of levels and planes."""
    writable = "".join("w" if a.flags.writeable else "r" for a in (w.weight, w.scales, w.biases))
    return (f"{w.bits} {w.group_size} {w.scales.dtype} {int(w.bf16)} {writable} {int(w.values is not None)} "
            f"{int(w.high is not None)} {int(type(w).FIRST)}")


def example(text: str) -> QuantizedTensor:
    """A tiny prepared weight (2 rows of one group) of the type `text` (spec) describes."""
    bits, G, dtype, bf16, writable, levels, planes, first = text.split()
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
    return (FIRST_KINDS if first == "1" else KINDS)[bits, G](*arrays, bits, G, bool(int(bf16)), values, high)


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


def first_pass(layers: list, head, compile_layers: Callable[[], T], meanwhile: list[tuple] = ()) -> T:
    """compile_layers() on a first run, on two cores: the decode kernels of the quantized weights
    of `layers` (named tuples of weights) in another process, then those of `head` (None: none)
    where its kind is not theirs; here meanwhile their prefill kernels (none for a first run's
    kinds, which never prefill) and the kernels `meanwhile` ((dispatcher, signature) pairs: what
    the layers call beside them), then the layers' kernel itself once the kernels it calls are
    cached. Returns what compile_layers returns, once the head's decode kernel is cached too."""
    from .linear import qprefill
    quantized = lambda ws: [w for w in ws if isinstance(w, QuantizedTensor)]
    kinds = list({spec(w): w for layer in layers for w in quantized(layer)}.values())
    heads = [w for w in quantized([head]) if spec(w) not in set(map(spec, kinds))]
    first = all(type(w).FIRST for w in kinds + heads)
    matrices = max(DECODE_SECONDS[first] * len(kinds + heads), ATTENTION_SECONDS + PREFILL_SECONDS[first] * len(kinds))
    expected = [("the matrix kernels", SHARED * matrices), ("the layer", LAYER_SECONDS[first])]
    with compiling.steps(expected) as steps:
        other = Ahead(kinds + heads)   # one process beside this one: two cores
        for w in kinds:
            if type(w).FIRST:
                continue
            N, K = w.shape
            x, out = np.zeros((2, K), np.float32), np.zeros((2, N), np.float32)
            qprefill.compile(tuple(map(qprefill.typeof_pyval, (x, w, out, False))))
        for kernel, sig in meanwhile:
            kernel.compile(sig)
        other.wait(kinds)
        steps.next()
        compiled = compile_layers()
        other.wait(heads)
    return compiled


def main(specs: list[str]):
    for text in specs:
        compile_decode(text)
        print(text, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
