"""linking.py: a kernel calls big compiled code where it is instead of linking it in again, and a
cached kernel loaded in a fresh process brings the code it calls."""
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from nibble.runner.kernels import linking

pytestmark = pytest.mark.skipif(not numba.__version__.startswith(linking.TESTED),
                                reason=f"linking.py patches numba {linking.TESTED} only")
ROOT = Path(__file__).parent.parent

KERNELS = """
import numpy as np
from numba import njit, prange
import nibble.runner.kernels   # the cache and the patches


@njit(cache=True, parallel=True)
def inner(x, out):
    for i in prange(x.shape[0]):
        out[i] = np.sqrt(x[i]) + 1.0


@njit(cache=True)
def middle(x):
    out = np.empty_like(x)
    inner(x, out)
    return out


@njit(cache=True)
def outer(x):
    if x.shape[0] == 0:
        raise ValueError("outer: empty")
    return middle(x)
"""

# Each argument a kernel to call first: the cache holds each alone and as another's callee.
CALLS = """
import sys
import numpy as np
from nibble.runner.kernels import linking
linking.BIG = 0   # every library called, none linked: numba's own helpers too
import kernels
x = np.arange(12.0)
for name in sys.argv[1:]:
    if name == "inner":
        out = np.empty_like(x)
        kernels.inner(x, out)
    else:
        out = getattr(kernels, name)(x)
    print(name, *out.tolist())
try:
    kernels.outer(x[:0])
except ValueError as e:
    print("raised", e)
"""


def _run(tmp_path: Path, *names: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "NIBBLE_HOME"}
    env |= {"NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT.parent}"}
    done = subprocess.run([sys.executable, "-c", CALLS, *names], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.mark.slow
def test_cached_kernels_bring_the_code_they_call_into_a_fresh_process(tmp_path):
    (tmp_path / "kernels.py").write_text(KERNELS)
    x = np.arange(12.0)
    want = lambda name: " ".join([name, *map(str, (np.sqrt(x) + 1.0).tolist())])
    orders = [("outer",), ("outer", "inner", "middle", "outer"), ("inner", "outer"), ("middle", "inner", "outer")]
    for names in orders:   # the first compiles; then each loads from the cache in another order
        assert _run(tmp_path, *names) == [want(name) for name in names] + ["raised outer: empty"], names


def test_a_big_callee_is_declared_in_its_caller_and_a_small_one_linked_in(monkeypatch):
    @numba.njit
    def small(x):
        return x + 1.0

    @numba.njit
    def big(x):
        total = 0.0
        for i in range(10):
            total += np.sin(x * i) ** 2 + np.cos(x + i) / (1.0 + x * x)
        return total

    @numba.njit
    def caller(x):
        return small(x) + big(x)

    small(1.0), big(1.0)
    library = lambda dispatcher: dispatcher.overloads[dispatcher.signatures[0]].library
    monkeypatch.setattr(linking, "BIG", linking._bitcode_size(library(small)))
    assert linking._bitcode_size(library(big)) > linking.BIG
    assert caller(3.0) == small(3.0) + big(3.0)
    declared = {f.name for f in library(caller)._final_module.functions if f.is_declaration}
    name = lambda dispatcher: dispatcher.overloads[dispatcher.signatures[0]].fndesc.mangled_name
    assert name(big) in declared and name(small) not in declared   # small: linked in (and inlined)
    assert linking.called(library(caller)) == (linking.machine_code(library(big)),)
