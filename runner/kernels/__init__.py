"""Numba kernels, compiled once and cached on disk.

The cache lives in nibble's cache directory, in a folder named after a hash of these sources:
numba checks each function against its own file only, and a kernel that inlines another file's
(decoder_layer inlines cpu's and quant_cpu's) would keep the old code after an upgrade or an
edit. A NUMBA_CACHE_DIR set by the user is left alone.
"""
import hashlib
import os
import shutil
from pathlib import Path

import numba

from nibble.formats.hub import nibble_home

# `workqueue` costs ~0.1 ms per parallel region (~20 ms a token): prefer OpenMP, then TBB.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
# Start the thread pool before any cached kernel is loaded: a kernel compiled against cached
# parallel callees is cached without numba's hook that starts the pool (numba#8578), and loaded
# into a process without it, its calls into the pool and Python resolve to address 0 (SIGSEGV).
numba.get_num_threads()


def _kernel_cache_dir() -> Path:
    # The CUDA kernels are compiled at run time, never cached: they do not name the folder.
    sources = sorted(p for p in Path(__file__).parent.glob("*.py") if not p.name.startswith("cuda"))
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    return nibble_home() / "numba" / digest


if not os.environ.get("NUMBA_CACHE_DIR"):
    _dir = _kernel_cache_dir()
    if not _dir.is_dir():   # new kernels: the caches of older ones will not be read again
        shutil.rmtree(_dir.parent, ignore_errors=True)
    numba.config.CACHE_DIR = str(_dir)
