"""NIBBLE_CPU=avx2: the kernels compiled for this CPU without AVX-512, the path a laptop takes,
each check in a process of its own (numba's CPU is set once, before its first compile)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from llvmlite import binding as llvm

from tests.test_cli import assert_one_line_error, invoke

ROOT = Path(__file__).parent.parent
HOST = llvm.get_host_cpu_features()
needs_avx2 = pytest.mark.skipif(not all(HOST.get(f) for f in ("avx2", "fma", "f16c")),
                                reason="not an x86 CPU with AVX2, FMA and F16C")
# AVX-512's registers in AT&T assembly: zmm, the upper 16 of xmm/ymm, the mask registers k1-k7.
AVX512_REGISTERS = re.compile(r"%zmm\d|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[1-7]\b")

# A quantized matmul of a few rows on int8 activations against its numpy twin (as
# test_prefill_int8's), on AVX2's byte dot products, in the suite's kernel cache (its own folder).
AVX2_PREFILL = """
import numpy as np
from numba.core.registry import cpu_target
from nibble.quant.affine import QuantizedTensor
from nibble.runner.kernels import prefill_int8
from nibble.runner.kernels.linear import prepare
from tests import reference
from tests.test_prefill_int8 import integers
from tests.test_quant_kernels import mlx_weight, twin_dequantize

assert prefill_int8.host_dot() == prefill_int8.DOT == "avx2", prefill_int8.host_dot()
features = cpu_target.target_context.codegen().magic_tuple()[2].split(",")   # the target machine's
assert {"+avx2", "+fma", "+f16c"} <= set(features), features
assert not [f for f in features if f.startswith("+avx512")], features
N, K, T, bits, G = 7, 96, 5, 4, 32         # odd: the edges of the 4 x 3 micro-kernel; 3 blocks
w, s, b = mlx_weight(N, K, bits, G)
x = np.random.default_rng(3).standard_normal((T, K)).astype(np.float32)
out = np.empty((T, N), np.float32)
prefill_int8.matmul_int8(x, prepare(QuantizedTensor(w, s, b, bits, G)), out, False)
want = reference.int8_product(x, integers(w, bits), s, b, G)
bound = np.abs(x) @ np.abs(twin_dequantize(w, s, b, bits, G)).T
assert np.all(np.abs(out - want) <= 1e-6 * bound), np.abs(out - want).max()
"""

# A kernel compiled, not run, as if on an AVX-512 CPU (Zen 4, which LLVM vectorizes 512 bits
# wide): llvmlite's host CPU is faked before numba or nibble ask for it. Prints the byte dot
# product and the kernel's assembly.
ON_AN_AVX512_CPU = """
import llvmlite.binding as ll
host = ll.get_host_cpu_features
def avx512_host():
    features = host()
    features.update(dict.fromkeys(["avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512vnni"], True))
    return features
ll.get_host_cpu_features, ll.get_host_cpu_name = avx512_host, lambda: "znver4"
import numba
from nibble.runner.kernels import cpu, prefill_int8
sig = (numba.float32[:, ::1], numba.float32[::1], numba.float64, numba.float32[:, ::1])
cpu.rmsnorm.compile(sig)
print(prefill_int8.host_dot())
print(cpu.rmsnorm.inspect_asm(sig))
"""


def _env(**more) -> dict:
    """This environment's without a CPU chosen (nibble's or numba's), and `more`."""
    return {k: v for k, v in os.environ.items() if k != "NIBBLE_CPU" and not k.startswith("NUMBA_CPU")} | more


@needs_avx2
def test_the_avx2_path_multiplies_bytes_with_avx2_as_the_twin_does():
    done = subprocess.run([sys.executable, "-c", AVX2_PREFILL], env=_env(NIBBLE_CPU="avx2"), cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@needs_avx2
@pytest.mark.parametrize("chosen", [None, "avx2"])
def test_the_avx2_path_emits_no_avx512_instruction_on_a_cpu_that_has_them(chosen, tmp_path):
    """The same kernel vectorized over zmm registers for the CPU itself: the assembly check is not
    empty on any machine, this one without AVX-512 included."""
    env = _env(NIBBLE_HOME=str(tmp_path)) | ({"NIBBLE_CPU": chosen} if chosen else {})
    done = subprocess.run([sys.executable, "-c", ON_AN_AVX512_CPU], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    dot, asm = done.stdout.split("\n", 1)
    assert "vfmadd" in asm or "vmulps" in asm             # vector code, the assembly as expected
    if chosen:
        assert dot == "avx2" and not AVX512_REGISTERS.search(asm)
    else:
        assert dot == "vnni" and "%zmm" in asm


def test_another_value_is_one_line_naming_the_choices(tmp_path):
    r = invoke("run", "-m", tmp_path / "nowhere", "Hi", env={"NIBBLE_CPU": "avx512"})
    assert_one_line_error(r, match="NIBBLE_CPU='avx512' is not a CPU nibble compiles for: set NIBBLE_CPU=avx2")


def test_numba_s_own_cpu_and_nibble_s_both_set_is_one_line_at_the_start(tmp_path):
    done = subprocess.run([sys.executable, "-m", "nibble.tui.cli.main", "ls"], cwd=ROOT, capture_output=True, text=True,
                          env=_env(NIBBLE_CPU="avx2", NUMBA_CPU_NAME="haswell", NIBBLE_HOME=str(tmp_path)))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == ["Error: NIBBLE_CPU=avx2 and NUMBA_CPU_NAME or NUMBA_CPU_FEATURES both say "
                                        "which CPU to compile for: unset one of them"]
