"""Compiling ahead in a second process: a weight's kind as text makes a weight of the same numba
type there, and numba's cache index tells a first run from a warm one."""
import subprocess
import sys

import numba
import numpy as np
import pytest
from numba import njit

from nibble.quant.affine import QuantizedTensor
from nibble.runner.kernels import ahead, quant_decode
from nibble.runner.kernels.linear import prepare, qmatvec
from tests.test_quant_kernels import as_kind


@pytest.mark.parametrize("bits,G", [(4, 32), (4, 128), (8, 32), (8, 64)])
@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("read_only", [True, False])
def test_a_kind_as_text_makes_the_same_numba_type(bits, G, kind, read_only):
    # zeros: the values do not matter here (and another module's random stream is left alone)
    w = np.zeros((6, 2 * G * bits // 32), np.uint32)
    s, b = np.ones((6, 2), np.float16), np.zeros((6, 2), np.float16)
    for a in (w, s, b):
        a.flags.writeable = not read_only
    qw = prepare(QuantizedTensor(w, as_kind(s, kind), as_kind(b, kind), bits, G))
    made = ahead.example(ahead.spec(qw))
    assert type(made) is quant_decode.KINDS[bits, G]
    assert numba.typeof(made) == numba.typeof(qw)


def test_a_table_of_levels_and_high_planes_are_in_the_text():
    w, s, b = np.zeros((6, 32), np.uint32), np.ones((6, 8), np.float16), np.zeros((6, 8), np.float16)
    two_level = np.zeros((6, 1, 18), np.int8)   # Q6_K's: groups of 16, signed integers
    for qt in (QuantizedTensor(w, s, b, 4, 32, values=np.arange(16, dtype=np.uint8)),
               QuantizedTensor(w, s, b, 4, 32, high=np.zeros((6, 32), np.uint8)),
               QuantizedTensor(w, two_level, two_level, 4, 16, high=np.zeros((6, 64), np.uint8))):
        qw = prepare(qt)
        assert numba.typeof(ahead.example(ahead.spec(qw))) == numba.typeof(qw)


def test_kinds_of_other_bits_or_groups_are_other_types():
    types = {numba.typeof(ahead.example(f"{bits} {G} uint16 0 rrr 0 0 0")) for bits, G in quant_decode.KINDS}
    assert len(types) == len(quant_decode.KINDS)


def test_the_cache_index_tells_what_is_compiled(tmp_path, monkeypatch):
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))

    @njit(cache=True)
    def twice(x):
        return 2 * x

    sig = (numba.float64,)
    assert not ahead.is_cached(twice, sig)
    twice.compile(sig)
    assert ahead.is_cached(twice, sig)
    assert not ahead.is_cached(twice, (numba.int64,))


def test_the_other_process_caches_the_decode_kernels_and_says_so():
    kinds = ["4 32 uint16 0 rrr 0 0 0", "8 32 uint16 0 rrr 0 0 0"]
    done = subprocess.run([sys.executable, "-m", "nibble.runner.kernels.ahead", *kinds], capture_output=True,
                          text=True, check=True)
    assert done.stdout.splitlines() == kinds
    for text in kinds:
        w = ahead.example(text)
        x, out = np.zeros((1, w.group_size), np.float32), np.zeros((1, 2), np.float32)
        assert ahead.is_cached(qmatvec, tuple(map(qmatvec.typeof_pyval, (x, w, out, False))))
