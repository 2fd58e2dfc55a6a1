"""Compiled kernels are cached under nibble's cache directory, per version of the kernel sources."""
import os
import subprocess
import sys
from pathlib import Path

RUN_A_KERNEL = """
import numpy as np
from nibble.runner.kernels import cpu
x = np.ones((1, 8), np.float32)
cpu.rmsnorm(x, np.ones(8, np.float32), 1e-5, x)
"""


def test_kernels_are_cached_per_version_of_their_sources(tmp_path):
    stale = tmp_path / "numba" / "0123456789abcdef"           # the cache of older kernel sources
    stale.mkdir(parents=True)
    (stale / "cpu.rmsnorm-1.py311.nbi").write_bytes(b"old")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | {"NIBBLE_HOME": str(tmp_path)}
    root = Path(__file__).parent.parent
    subprocess.run([sys.executable, "-c", RUN_A_KERNEL], env=env, cwd=root, check=True)
    (current,) = (tmp_path / "numba").iterdir()
    assert current.name != stale.name and len(current.name) == 16
    assert any(p.name.startswith("cpu.rmsnorm") and p.suffix == ".nbi" for p in current.rglob("*"))
