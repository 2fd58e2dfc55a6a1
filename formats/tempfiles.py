"""Temporary files and directories beside what they become, and the leftovers of killed runs.

A writer works in `.<name>.<8 hex>.<tag>` next to its destination and renames it into place. A
run killed with `kill -9` cannot remove it, so every writer first removes the leftovers in the
folder it writes into. To tell a leftover from a live run's temporary, each one is flock()ed by its
writer for as long as it lives: the kernel drops the lock when the process dies, and the cleaner
removes only what it can lock itself. The lock is on the file or directory itself (not a lock file
inside it), so it follows the rename into place and no moment leaves a temporary unlocked.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, NamedTuple

# tmp: a model directory or a safetensors file being written; old: a model directory being
# replaced (out of the way until the new one is in place); fetch: a model being downloaded.
# The last alternative is the fetch directory of nibble 0.1 (tempfile.TemporaryDirectory's).
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{8}\.(?P<tag>tmp|old|fetch)|\.(?P<fetch>.+)-fetch-[a-z0-9_]{8}")
WHAT = {"tmp": "an interrupted write", "old": "an interrupted replace", "fetch": "an interrupted download"}


class Leftover(NamedTuple):
    path: Path
    kind: str                      # "directory" or "file"
    nbytes: int
    restored: Path | None = None   # where an interrupted replace's old directory was put back


def sibling(dest: Path, tag: str) -> Path:
    """A new name beside `dest` for a temporary of the kind `tag`."""
    return dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.{tag}")


@contextmanager
def temp_dir(dest: Path, tag: str = "tmp") -> Iterator[Path]:
    """A new empty directory beside `dest`, locked while the block runs and removed at its end
    unless it was renamed into place (the lock follows it there until the block ends)."""
    # Not mkdtemp: its 0700 mode would survive the rename; mkdir honours the umask.
    path, fd = _create(dest, tag, lambda p: (p.mkdir(), os.open(p, os.O_RDONLY | os.O_DIRECTORY))[1])
    try:
        yield path
    finally:
        try:
            if _same(fd, path):
                shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


@contextmanager
def temp_file(dest: Path, clean: bool = True) -> Iterator[tuple[Path, BinaryIO]]:
    """A new file beside `dest`, open for writing and locked while the block runs; removed at
    its end unless it was renamed into place. clean=False: the folder's leftovers are not looked
    for (a writer of many small files that removed them once, when it started)."""
    path, fd = _create(dest, "tmp", lambda p: os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), clean)
    with os.fdopen(fd, "r+b") as f:
        try:
            yield path, f
        finally:
            if _same(f.fileno(), path):
                path.unlink(missing_ok=True)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold `path` (a directory being replaced) locked while the block runs, so that a cleaner
    never takes it for a leftover while it is out of the way under an `old` name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _lock(fd, wait=True)
        yield
    finally:
        os.close(fd)


def remove_leftovers(folder: Path, say: bool = True) -> list[Leftover]:
    """Remove the temporaries in `folder` whose writer died, and say so in one line on stderr
    (unless not `say`). An interrupted replace's old directory whose new one never arrived is put
    back instead."""
    try:
        names = sorted(e.name for e in os.scandir(folder) if _LEFTOVER.fullmatch(e.name))
    except OSError:   # no such folder yet: nothing left over
        return []
    found = [f for f in (_remove_if_dead(folder / name) for name in names) if f is not None]
    if found and say:
        print(f"nibble: {describe(found)}", file=sys.stderr)
    return found


def describe(found: list[Leftover]) -> str:
    """One line: what was removed (or put back), from what, and its size."""
    def one(f: Leftover) -> str:
        m = _LEFTOVER.fullmatch(f.path.name)
        what = WHAT[m["tag"] or "fetch"]
        if f.restored:
            return f"put back {f.restored} from {what} ({f.path.name})"
        return f"removed a leftover temporary {f.kind} from {what}: {f.path}, {_size(f.nbytes)}"
    return "; ".join(one(f) for f in found)


def _create(dest: Path, tag: str, make: Callable[[Path], int], clean: bool = True) -> tuple[Path, int]:
    """Remove dest's folder's leftovers (if `clean`), then make (and lock) a new temporary beside `dest`."""
    if clean:
        remove_leftovers(dest.parent)
    while True:
        path = sibling(dest, tag)
        fd = make(path)
        _lock(fd, wait=True)
        # A cleaner in another process may have locked and removed it between make and _lock.
        if _same(fd, path):
            return path, fd
        os.close(fd)


def _remove_if_dead(path: Path) -> Leftover | None:
    """Remove `path` if no process holds its lock; None if it lives (or is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:   # gone already (renamed into place), or a link: not ours
        return None
    try:
        if not _lock(fd, wait=False) or not _same(fd, path):
            return None
        kind, nbytes = ("directory" if path.is_dir() else "file"), _nbytes(path)
        m = _LEFTOVER.fullmatch(path.name)
        dest = path.with_name(m["name"]) if m["tag"] == "old" else None
        if dest is not None and not dest.exists():
            path.rename(dest)   # killed between the two renames of a replace: the old one is all there is
            return Leftover(path, kind, nbytes, dest)
        if kind == "directory":
            shutil.rmtree(path)
        else:
            path.unlink()
        return Leftover(path, kind, nbytes)
    except OSError:   # cannot remove it: left for next time
        return None
    finally:
        os.close(fd)


def _lock(fd: int, wait: bool) -> bool:
    """flock(fd) exclusively; False if another open file holds it (or this file system has no
    flock: then nothing is ever taken for a leftover)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except OSError:
        return False


def _same(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


def _nbytes(path: Path) -> int:
    if not path.is_dir():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _size(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB" if n >= 1e3 else f"{n} bytes"
