"""compile_time.py's faster copies in numba's passes give the IR numba's own give."""
from collections import defaultdict

import numba
import numpy as np
import pytest
from numba.core import ir_utils, types
from numba.core.compiler import run_frontend

from nibble.runner.kernels import compile_time, cpu, quant_decode

pytestmark = pytest.mark.skipif(not numba.__version__.startswith(compile_time.TESTED),
                                reason=f"compile_time.py patches numba {compile_time.TESTED} only")
compile_time._install()   # else at this process's first compile


@pytest.mark.parametrize("func", [quant_decode.quantize_activation, quant_decode.products, cpu.rmsnorm])
def test_copy_propagation_finds_the_copies_numbas_does(func):
    blocks = run_frontend(func.py_func).blocks
    typemap = defaultdict(lambda: types.float32)   # every variable one type: every a = b a copy
    found = compile_time._copy_propagate(blocks, typemap)
    assert found == compile_time.numba_copy_propagate(blocks, typemap) and any(found[1].values())
    assert ir_utils.copy_propagate is compile_time._copy_propagate


def test_the_blocks_of_one_function_are_copied_with_one_scope():
    blocks = run_frontend(quant_decode.quantize_activation.py_func).blocks
    token = compile_time._memo.set({})
    try:
        copies = {label: compile_time._deepcopy(block) for label, block in blocks.items()}
    finally:
        compile_time._memo.reset(token)
    assert copies == blocks and all(copies[label] is not blocks[label] for label in blocks)
    (scope,) = {id(block.scope) for block in copies.values()}
    assert scope != id(next(iter(blocks.values())).scope)


def test_an_inlined_function_computes_as_in_python():
    @numba.njit(inline="always")
    def clipped_sum(x, top):
        total = 0.0
        for v in x:
            total += min(v, top) if v > 0 else v
        return total

    @numba.njit
    def twice(x):
        return clipped_sum(x, 0.5) + clipped_sum(x[::-1], 0.25)

    x = np.random.default_rng(0).standard_normal(50)
    assert twice(x) == pytest.approx(clipped_sum.py_func(x, 0.5) + clipped_sum.py_func(x[::-1], 0.25))
