"""nibble's kernel cache for a test's subprocess: this session's kernels but a few, which the
subprocess compiles as on a first run while it loads the rest. A test of what happens when some
kernels are not cached need not compile them all again."""
import os
import shutil
from pathlib import Path

import numba

from nibble.runner import kernels


def cache_without(home: Path, *dispatchers) -> Path:
    """Fill nibble's kernel cache under `home` (the subprocess's NIBBLE_HOME) with what this
    session's cache holds now, but for what `dispatchers` were compiled to (each signature of
    each); -> the folder. Files are hard links where they can be: numba replaces a cache file by a
    new one, never writes into it, so the subprocess leaves this session's files as they are."""
    source = Path(numba.config.CACHE_DIR)
    # named as the subprocess names it: by the kernels' sources and CPU, wherever its NIBBLE_HOME
    folder = home / "numba" / kernels._kernel_cache_dir().name
    left_out = tuple(d._cache._cache_file._index_name.removesuffix("nbi") for d in dispatchers)
    folder.mkdir(parents=True, exist_ok=True)
    if not source.is_dir():   # nothing compiled yet
        return folder
    shutil.copytree(source, folder, copy_function=_link, dirs_exist_ok=True,
                    ignore=lambda _, names: [n for n in names if n.startswith(left_out) or n.endswith(".lock")])
    return folder


def _link(source: str, target: str):
    try:
        os.link(source, target)
    except OSError:   # another file system
        shutil.copy2(source, target)
