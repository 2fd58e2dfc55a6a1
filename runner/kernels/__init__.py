"""Numba kernels, compiled once and cached on disk.

The cache lives in nibble's cache directory, in a folder named after a hash of these sources:
numba checks each function against its own file only, and a kernel that inlines another file's
(decoder_layer inlines cpu's, linear's, quant_decode's, half's and prefill's) would keep the old
code after an upgrade or an edit. Kernels compiled for this CPU without AVX-512 (NIBBLE_CPU=avx2,
quant/target.py) have folders of their own, `avx2-<hash>`. The folders of older sources of the same
kind are deleted when this process first compiles a kernel: a run with NIBBLE_CPU and one without
keep each other's. A NUMBA_CACHE_DIR set by the user is left alone.

Loading a cached kernel skips two steps of numba's that only a compile needs (cache_load.py);
compiling one skips copies of the same IR that numba makes again (compile_time.py) and calls
big compiled code rather than compiling it again into each caller (linking.py), and says how far
along it is (compiling.py).
"""
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import numba
from numba.core import event

from nibble.formats.paths import kernels_dir
from nibble.quant import target   # numba.config's CPU, set before anything compiled (quant/target.py)
from . import cache_load, compile_time, compiling, linking

# `workqueue` costs ~0.1 ms per parallel region (~20 ms a token): prefer OpenMP, then TBB.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
# Start the thread pool before any cached kernel is loaded: a kernel compiled against cached
# parallel callees is cached without numba's hook that starts the pool (numba#8578), and loaded
# into a process without it, its calls into the pool and Python resolve to address 0 (SIGSEGV).
numba.get_num_threads()
cache_load.install()
compile_time.install()
linking.install()
compiling.install()


# The modules outside this folder whose types the kernels take: numba's cache names a type by its
# module, so a kernel compiled before one of them moved or changed must not be loaded after.
TYPE_MODULES = ("nibble.formats.half", "nibble.runner.kv.cache")


def _kernel_cache_dir() -> Path:
    # Every file here whose code a cached kernel may inline; the CUDA kernels are compiled at run
    # time, never cached: they do not name the folder.
    sources = sorted(p for p in Path(__file__).parent.glob("*.py") if not p.name.startswith("cuda"))
    types = [(name.encode(), Path(importlib.util.find_spec(name).origin)) for name in TYPE_MODULES]
    kind = target.CHOICE or ""
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sources)
                          + b"".join(name + p.read_bytes() for name, p in types) + kind.encode()).hexdigest()[:16]
    return kernels_dir() / (f"{kind}-{digest}" if kind else digest)


def _kind(folder: Path) -> str:
    """The CPU a cache folder's kernels compile for: '' (this one's own instructions) or a choice of NIBBLE_CPU."""
    return folder.name.rpartition("-")[0]


class _RemoveOlderKernels(event.Listener):
    """At this process's first compile (numba is about to write to the cache), deletes the cache
    folders of other kernel sources compiled for the same CPU (`_kind`): they will not be read again."""

    def __init__(self, current: Path):
        self.current = current
        self.done = False   # stays registered: unregistering while numba notifies would skip a listener

    def on_start(self, ev):
        if self.done:
            return
        self.done = True
        for folder in self.current.parent.iterdir() if self.current.parent.is_dir() else []:
            if folder != self.current and _kind(folder) == _kind(self.current):
                shutil.rmtree(folder, ignore_errors=True)

    def on_end(self, ev):
        pass


if not os.environ.get("NUMBA_CACHE_DIR"):
    _dir = _kernel_cache_dir()
    numba.config.CACHE_DIR = str(_dir)
    event.register("numba:compile", _RemoveOlderKernels(_dir))
