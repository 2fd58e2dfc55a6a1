"""A GGUF file's header without its arrays: the scalar metadata and each tensor's shape and type.

`nibble ls` needs a model's architecture, file type and parameter count. gguf's GGUFReader
decodes every array of the metadata into numpy objects, a 50k-token vocabulary and its merges
among them: seconds a file. Here an array of strings is stepped over by its lengths and a
numeric one skipped whole, so a header reads in milliseconds. Damaged bytes are a FormatError.
"""
from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import FormatError

MAGIC = b"GGUF"
# llama.cpp's gguf-split names a model's parts NAME-00001-of-00003.gguf; the first holds the metadata
SPLIT_PART = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
# A header holds the tokenizer at most, a few MB: a length that reads further is damage, and the
# walk over string arrays stops there instead of stepping through a whole damaged file.
MAX_HEADER = 256 << 20
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    ggml_type: int   # gguf.GGMLQuantizationType's value

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, object]     # scalars and strings; arrays are left out
    tensors: dict[str, TensorInfo]


def read_gguf_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file at `path` (version 2 or 3)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _Walk(mm, path).header()
    except (OSError, ValueError) as e:   # ValueError: mmap of an empty file
        raise FormatError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


class _Walk:
    """A cursor over the header's bytes."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.at = buf, path, 0
        self.end = min(len(buf), MAX_HEADER)

    def header(self) -> GGUFHeader:
        if self.take(4) != MAGIC:
            raise self.damaged("not a GGUF file (no GGUF magic)")
        version = self.u32()
        if version not in (2, 3):
            raise self.damaged(f"GGUF version {version}: nibble reads versions 2 and 3")
        n_tensors, n_kv = self.u64(), self.u64()
        metadata = {}
        for _ in range(n_kv):
            key, kind = self.string(), self.u32()
            value = self.value(kind)
            if kind != _ARRAY:
                metadata[key] = value
        tensors = {}
        for _ in range(n_tensors):
            name, n_dims = self.string(), self.u32()
            if n_dims > 8:
                raise self.damaged(f"tensor {name!r} has {n_dims} dimensions")
            shape = tuple(self.u64() for _ in range(n_dims))
            tensors[name] = TensorInfo(shape, self.u32())
            self.u64()   # its offset in the data
        return GGUFHeader(metadata, tensors)

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item == _STRING:
                for _ in range(count):   # bounded: each step moves at least 8 bytes on
                    self.skip(self.u64())
            elif item in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[item]))
            elif item == _ARRAY:
                for _ in range(count):
                    self.value(_ARRAY)
            else:
                raise self.damaged(f"unknown array item type {item}")
            return None
        if kind not in _SCALARS:
            raise self.damaged(f"unknown value type {kind}")
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.u64())
        return raw.decode("utf-8", errors="replace")

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def take(self, n: int) -> bytes:
        start = self.at
        self.skip(n)
        return self.buf[start:self.at]

    def skip(self, n: int):
        if n > self.end - self.at:
            past = "the end of the file" if self.end == len(self.buf) else f"{MAX_HEADER >> 20} MiB"
            raise self.damaged(f"its header runs past {past}: the file is truncated or damaged")
        self.at += n

    def damaged(self, why: str) -> FormatError:
        return FormatError(f"{self.path}: {why}")


def split_parts(path: Path) -> list[Path]:
    """The files of the GGUF model `path` is part of: itself, or every part of a split model, in
    order, whichever part `path` is."""
    m = SPLIT_PART.fullmatch(path.name)
    if not m or int(m["count"]) < 1:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
