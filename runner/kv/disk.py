"""The KV cache's disk tier: full blocks kept as files, found again by their chained hash
(runner/kv/blocks.py) after the pool let them go or the process ended.

A block's file holds its keys and values in every layer, the pool's bytes as they are (each
array's slice of the block, layer by layer), behind a header: a magic, the payload's length, its
CRC-32 and the block's hash. It is written beside its place and renamed into it, so that no reader
(this process or another sharing the folder) sees half of one; a file torn or damaged on disk (a
machine that lost power) fails its check and is deleted, never used. It is read straight into a
pool block (preadv: one copy, where a memory map would fault its pages in and copy them too).

Each model has a folder named by a fingerprint of everything that makes a block's bytes: the
weights (catalog.identity of their files), the pool's shapes and types (the KV type among them),
nibble's sources and the CPU's arithmetic. A block of another model or another nibble is never
looked for. The folders of every model together are bounded (--kv-disk): past the bound, the least
recently used files go first (a file's time is touched when it is read).
"""
from __future__ import annotations

import hashlib
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from nibble.formats.errors import NibbleError
from nibble.formats.paths import kv_dir
from nibble.formats.tempfiles import remove_leftovers, temp_file
from .cache import HostKV, KVPool

MAGIC = b"nibbleKV"
_HEADER = struct.Struct("<8sQI16s")   # magic, payload bytes, CRC-32 of the payload, the block's hash
_SUFFIX = ".kv"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'8G', '500M', '1.5T', '0' (K, M, G, T: powers of 1024; a trailing B or iB allowed) -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        value = float(t[:len(t) - len(unit)])
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise NibbleError(f"--kv-disk {text!r} is not a size: say 8G, 500M or 0 (no disk tier)")
    return int(value * _UNITS[unit])


class DiskBlocks:
    """One model's block files, in `folder`, under a bound of `limit` bytes for every model's."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = folder, limit
        folder.mkdir(parents=True, exist_ok=True)
        remove_leftovers(folder, say=False)   # a killed writer's; then never looked for again
        self._used: int | None = None          # bytes of every model's blocks, once measured
        self._readers: ThreadPoolExecutor | None = None

    def path(self, h: bytes) -> Path:
        return self.folder / (h.hex() + _SUFFIX)

    def __contains__(self, h: bytes) -> bool:
        return self.path(h).is_file()

    def save(self, h: bytes, views: list[memoryview]):
        """Keep the block whose hash is `h` and whose bytes are `views` (HostKV.block_views). A
        disk that cannot take it (full, read-only) leaves it out: the tier is a cache."""
        dest = self.path(h)
        if dest.exists():
            return
        crc = 0
        for v in views:
            crc = zlib.crc32(v, crc)
        n = sum(v.nbytes for v in views)
        try:
            with temp_file(dest, clean=False) as (tmp, f):
                f.write(_HEADER.pack(MAGIC, n, crc, h))
                f.flush()
                if _vectored(os.writev, f.fileno(), views) == n:
                    os.replace(tmp, dest)
                else:
                    return
        except OSError:
            return
        self._grow(_HEADER.size + n)

    def load(self, h: bytes, views: list[memoryview]) -> bool:
        """Read the block `h` into `views`; False if the disk has none, or none whole (then its
        file is deleted: the pool block's bytes are left undefined)."""
        path = self.path(h)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            head = os.pread(fd, _HEADER.size, 0)
            n = sum(v.nbytes for v in views)
            if len(head) == _HEADER.size:
                magic, size, crc, stored = _HEADER.unpack(head)
                if (magic, size, stored) == (MAGIC, n, h) and _vectored(os.preadv, fd, views, _HEADER.size) == n:
                    got = 0
                    for v in views:
                        got = zlib.crc32(v, got)
                    if got == crc:
                        os.utime(fd)   # used: the last to go when the folder is trimmed
                        return True
        except OSError:
            pass
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        return False

    def load_all(self, blocks: list[tuple[bytes, list[memoryview]]]) -> list[bool]:
        """load(h, views) for each (h, views) of `blocks`, on a few threads at once (the reads and
        checksums let go of the GIL: one thread alone reads at about 0.6 of the rate of two)."""
        if self._readers is None:
            self._readers = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="nibble kv disk")
        return list(self._readers.map(lambda block: self.load(*block), blocks))

    def _grow(self, n: int):
        if self._used is None:
            self._used = sum(size for _, size, _ in _files())
        self._used += n
        if self._used > self.limit:
            self._trim()

    def _trim(self):
        """Delete the least recently used files of every model until they take 90% of the bound
        (not just under it: each new block would measure the folders again)."""
        files = sorted(_files())
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= 0.9 * self.limit:
                break
            try:
                path.unlink()
                total -= size
            except FileNotFoundError:   # another process trimmed it
                total -= size
            except OSError:
                pass
        self._used = total


def _vectored(call, fd: int, views: list[memoryview], *offset) -> int:
    """os.writev(fd, views) or os.preadv(fd, views, offset) in runs the system takes (IOV_MAX);
    -> the bytes done, short where a run was."""
    done = 0
    for i in range(0, len(views), _IOV):
        run = views[i:i + _IOV]
        n = call(fd, run, *(o + done for o in offset))
        done += n
        if n < sum(v.nbytes for v in run):
            break
    return done


_IOV = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def _files() -> list[tuple[int, int, Path]]:
    """(time used, bytes, path) of every model's block files."""
    found = []
    root = kv_dir()
    for model in os.scandir(root) if root.is_dir() else []:
        if model.is_dir():
            for e in os.scandir(model.path):
                if e.name.endswith(_SUFFIX):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    found.append((st.st_mtime_ns, st.st_size, Path(e.path)))
    return found


def open_disk(source: str | None, kv: KVPool, limit: int) -> DiskBlocks | None:
    """The disk tier of a pool's blocks of the weights named `source` (Model.source), bounded by
    `limit` bytes; None where it is off (limit 0), where the weights have no files to name them
    by, where a part of the pool is not on the CPU, or where its folder cannot be made (a
    read-only cache folder: the tier is a cache, the model runs without it)."""
    if not limit or source is None or not all(isinstance(p, HostKV) for p in kv.parts):
        return None
    try:
        return DiskBlocks(kv_dir() / fingerprint(source, kv), limit)
    except OSError:
        return None


def fingerprint(source: str, kv: KVPool) -> str:
    """What makes a block's bytes: the weights, each array of the pool's layout and type, nibble's
    sources and the CPU's arithmetic (the byte products a CPU has, or not, round differently)."""
    from llvmlite import binding as llvm
    from nibble.quant import target
    from ..kernels import prefill_int8
    layout = [(a.shape[0], a.shape[2:], a.dtype.str) for p in kv.parts for a in (p.k, p.v, p.k_scale, p.v_scale)]
    cpu = (llvm.get_host_cpu_name(), target.CHOICE, prefill_int8.DOT)
    return hashlib.sha1(repr((source, layout, cpu, _sources_digest())).encode()).hexdigest()[:20]


@cache
def _sources_digest() -> str:
    """A hash of nibble's code that runs a model (formats, quant, runner): any change to it may
    change a block's bytes."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(f for d in ("formats", "quant", "runner") for f in (root / d).rglob("*.py"))
    h = hashlib.sha1()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()
