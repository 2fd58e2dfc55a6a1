"""Safetensors: a zero-copy reader over np.memmap, and an atomic writer.

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name to
{"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data region), an optional
"__metadata__" of string pairs, then the raw little-endian data. We read it ourselves because the
safetensors package's numpy loader copies every tensor and cannot return bf16, and write it
ourselves because its writer needs every tensor in memory at once (and cannot write bf16 either).
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .errors import FormatError
from .half import HalfTensor
from .tempfiles import temp_file

# Safetensors dtype name -> numpy dtype, for the dtypes numpy can view in place.
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
BF16 = "BF16"  # numpy has no bfloat16: read as a HalfTensor of its bits (no copy)
SUPPORTED = ", ".join(sorted([*DTYPES, BF16]))
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER = 100_000_000   # the safetensors crate's limit: a longer one is a corrupt length field
MAX_RANK = 32   # numpy 1's limit (numpy 2's is 64); no model's tensor comes near


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray | HalfTensor]:
    """Read a .safetensors file as read-only arrays keyed by tensor name.

    Every tensor is a view into one read-only memmap of the file; a BF16 tensor is a HalfTensor
    whose bits are such a view (np.asarray widens it to float32). Raises FormatError for a
    malformed file.
    """
    path = Path(path)
    header, data_start, data_len = _read_header(path)
    entries = _check_entries(path, header, data_len)
    if data_len == 0:  # mmap cannot map zero bytes; every tensor here is empty
        data = np.empty(0, dtype=np.uint8)
    else:
        # .view(np.ndarray): hand out plain arrays; their .base chain keeps the mapping alive.
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start,
                         shape=(data_len,)).view(np.ndarray)
    tensors = {}
    for name, (dtype, shape, begin, end) in entries.items():
        raw = data[begin:end]
        if dtype == BF16:
            tensors[name] = HalfTensor(raw.view("<u2").reshape(shape), bf16=True)
        else:
            tensors[name] = raw.view(DTYPES[dtype]).reshape(shape)
    return tensors


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The file's "__metadata__" string pairs ({} if it has none), read from the header alone."""
    return _read_header(Path(path))[0].get("__metadata__") or {}


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype ("BF16") and shape, from the header alone, checked as read_safetensors checks it."""
    path = Path(path)
    header, _, data_len = _read_header(path)
    return {name: (dtype, shape) for name, (dtype, shape, _, _) in _check_entries(path, header, data_len).items()}


def read_checkpoint(directory: str | os.PathLike) -> dict[str, np.ndarray | HalfTensor]:
    """Read all weights in a model directory.

    Looks for model.safetensors, then shards listed in model.safetensors.index.json, then any
    *.safetensors files. Raises FormatError if there are none or shards disagree with the index.
    """
    directory = Path(directory)
    single = directory / "model.safetensors"
    if single.is_file():
        return read_safetensors(single)
    index = directory / INDEX_NAME
    if index.is_file():
        return _read_sharded(directory, index)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{directory}: no weights found (expected model.safetensors, "
                          f"{INDEX_NAME} or *.safetensors files)")
    return _merge(files)


class TensorSpec(NamedTuple):
    """A tensor as the header describes it: its safetensors dtype name and its shape."""
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == BF16 else DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


class TensorStream(NamedTuple):
    """Tensors made one at a time, to write a file larger than memory: every tensor's spec up
    front (the header comes first), then (name, tensor) pairs as they are made, in any order."""
    specs: dict[str, TensorSpec]
    items: Iterable[tuple[str, np.ndarray | HalfTensor]]


def tensor_spec(t: np.ndarray | HalfTensor) -> TensorSpec:
    """How `t` is written: a HalfTensor as BF16 or F16 (its bits), an array as its dtype.
    Raises FormatError for a dtype safetensors has no name for."""
    if isinstance(t, HalfTensor):
        return TensorSpec(BF16 if t.bf16 else "F16", tuple(t.shape))
    name = _NAMES.get(t.dtype.newbyteorder("<"))
    if name is None:
        known = ", ".join(sorted(d.name for d in DTYPES.values()))
        raise FormatError(f"safetensors cannot hold dtype {t.dtype}: supported are {known} and bf16")
    return TensorSpec(name, tuple(t.shape))


def write_safetensors(tensors: dict[str, np.ndarray | HalfTensor] | TensorStream,
                      path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write tensors to a .safetensors file atomically: a temporary sibling, then a rename.

    `tensors` is a dict, or a TensorStream: the header is written from its specs, then each
    tensor at its place as it comes, so that no more than one is held at a time. A failure (or
    KeyboardInterrupt) leaves any existing file at `path` untouched and no temporary file; what a
    killed write left in the folder is removed first (formats/tempfiles.py).
    """
    path = Path(path)
    if not isinstance(tensors, TensorStream):
        tensors = TensorStream(_specs(tensors, path), tensors.items())
    header, offsets, size = _layout(tensors.specs, metadata)
    with temp_file(path) as (tmp, f):
        f.write(header)
        f.truncate(size)   # the data region, filled in as the tensors come
        for name, t in tensors.items:
            if name not in offsets:
                raise ValueError(f"{path}: tensor {name!r} is not in the header, or came twice")
            f.seek(offsets.pop(name))
            f.write(_raw_bytes(name, t, tensors.specs[name]))
        if offsets:
            raise ValueError(f"{path}: tensors never came: {', '.join(list(offsets)[:3])}")
        os.replace(tmp, path)


def release(t: np.ndarray | HalfTensor) -> None:
    """Give back the memory pages this process holds of a tensor read by read_safetensors.

    Every page of a memory map that was read counts as resident until the map goes: reading a
    checkpoint larger than memory tensor by tensor, releasing each, keeps the resident set at
    about one tensor. The data stays in the file (and the OS's cache); using the tensor again
    reads it again. Does nothing for a tensor in memory, or in a map it could have changed.
    """
    _advise(t, getattr(mmap, "MADV_DONTNEED", None))


def prefetch(t: np.ndarray | HalfTensor) -> None:
    """Ask the OS to start reading a tensor of read_safetensors' from disk, and return: what is
    computed meanwhile overlaps the read. Does nothing for a tensor in memory."""
    _advise(t, getattr(mmap, "MADV_WILLNEED", None))


def _advise(t: np.ndarray | HalfTensor, advice: int | None) -> None:
    """madvise the pages of `t`, where it lies in a read-only memory map."""
    a = t.bits if isinstance(t, HalfTensor) else t
    owner = a
    while owner is not None and not isinstance(owner, np.memmap):
        owner = owner.base
    mapping = getattr(owner, "_mmap", None)
    # Read-only maps only: a copy-on-write map's changed pages would be lost.
    if mapping is None or owner.mode != "r" or a.nbytes == 0 or advice is None:
        return
    # np.memmap maps from the allocation boundary below its offset: that is where `mapping` starts.
    start = a.ctypes.data - owner.ctypes.data + owner.offset % mmap.ALLOCATIONGRANULARITY
    first_page = start - start % mmap.PAGESIZE
    mapping.madvise(advice, first_page, start + a.nbytes - first_page)


def _specs(tensors: dict, path: Path) -> dict[str, TensorSpec]:
    specs = {}
    for name, t in tensors.items():
        try:
            specs[name] = tensor_spec(t)
        except FormatError as e:
            raise FormatError(f"cannot write tensor {name!r} to {path}: {e}") from None
    return specs


def _layout(specs: dict[str, TensorSpec], metadata: dict[str, str] | None) -> tuple[bytes, dict, int]:
    """The file's first bytes (length and header), each tensor's file offset, the file's size.

    As the safetensors package does, the header is padded to 8 bytes and the tensors are laid out
    widest dtype first, so each starts aligned to its item size (numba wants aligned arrays)."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise TypeError("safetensors metadata maps strings to strings")
    header = {"__metadata__": metadata} if metadata else {}
    offsets, begin = {}, 0
    for name in sorted(specs, key=lambda name: -specs[name].itemsize):   # stable: else as given
        spec = specs[name]
        header[name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                        "data_offsets": [begin, begin + spec.nbytes]}
        offsets[name] = begin
        begin += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data_start = 8 + len(raw)
    return (struct.pack("<Q", len(raw)) + raw, {name: data_start + o for name, o in offsets.items()},
            data_start + begin)


def _raw_bytes(name: str, t: np.ndarray | HalfTensor, spec: TensorSpec) -> np.ndarray:
    """The bytes of `t` as the file holds them: little-endian, in logical (C) order."""
    if tensor_spec(t) != spec:
        raise ValueError(f"tensor {name!r} is {tensor_spec(t)}, the header says {spec}")
    a = t.bits if isinstance(t, HalfTensor) else t
    return np.ascontiguousarray(a, a.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)


def _read_header(path: Path) -> tuple[dict, int, int]:
    """Parse the header: (header dict, byte offset of the data region, data region length).

    As strict as the safetensors crate: UTF-8 JSON (no NaN or Infinity), an object, no key twice,
    a "__metadata__" of string pairs; trailing spaces (the writers' padding to 8 bytes) are JSON
    whitespace."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FormatError(f"{path}: truncated safetensors file ({size} bytes, "
                                  f"shorter than the 8-byte header length)")
            (n,) = struct.unpack("<Q", prefix)
            if 8 + n > size:
                raise FormatError(f"{path}: header length {n} runs past the end of the file "
                                  f"({size} bytes); the file is truncated or not safetensors")
            if n > MAX_HEADER:
                raise FormatError(f"{path}: header length {n} is over the {MAX_HEADER} bytes "
                                  f"safetensors allows; the file is not safetensors")
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys,
                            parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError) as e:   # ValueError: JSONDecodeError, a key twice
        raise FormatError(f"{path}: header is not valid JSON ({e})") from None
    except RecursionError:
        raise FormatError(f"{path}: header is not valid JSON (nested too deeply)") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    return header, 8 + n, size - 8 - n


def _not_json(name: str):
    """NaN and Infinity, which Python's json reads and JSON (and the crate) do not have."""
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object as a dict, refusing a key given twice (json keeps the last one silently)."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r} appears twice")
        obj[key] = value
    return obj


def _check_entries(path: Path, header: dict, data_len: int) -> dict[str, tuple]:
    """Validate every tensor entry: name -> (dtype name, shape, begin, end)."""
    entries = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
            raise FormatError(f"{where} needs dtype, shape and data_offsets")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str) or (dtype != BF16 and dtype not in DTYPES):
            raise FormatError(f"{where} has unsupported dtype {dtype!r}; supported: {SUPPORTED}")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise FormatError(f"{where} has invalid shape {shape!r}: expected non-negative ints")
        if len(shape) > MAX_RANK:
            raise FormatError(f"{where} has {len(shape)} dimensions; at most {MAX_RANK} are read")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_uint(o) for o in offsets)):
            raise FormatError(f"{where} has invalid data_offsets {offsets!r}: "
                              f"expected [begin, end], non-negative ints")
        begin, end = offsets
        if begin > end or end > data_len:
            raise FormatError(f"{where} has data_offsets [{begin}, {end}] outside the data "
                              f"region of {data_len} bytes")
        itemsize = 2 if dtype == BF16 else DTYPES[dtype].itemsize
        # numpy sizes an array by its non-zero dims: [2**64, 0] holds no bytes, yet cannot be made.
        if math.prod(max(d, 1) for d in shape) * itemsize > sys.maxsize:
            raise FormatError(f"{where} has shape {shape}, too large for any array")
        expected = math.prod(shape) * itemsize
        if end - begin != expected:
            raise FormatError(f"{where}: shape {shape} of {dtype} needs {expected} bytes, "
                              f"but data_offsets span {end - begin}")
        entries[name] = (dtype, tuple(shape), begin, end)
    _check_tiling(path, entries, data_len)
    return entries


def _check_tiling(path: Path, entries: dict[str, tuple], data_len: int) -> None:
    """The tensors must cover the data region exactly, one after another from byte 0: a gap or
    bytes left over mean a header length or an offset is wrong, and every tensor read is shifted."""
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items())
    at, prev = 0, None
    for begin, end, name in spans:
        if begin != at:
            after = f"tensor {prev!r} ends" if prev is not None else "the data region starts"
            kind = "overlap" if begin < at else "gap"
            raise FormatError(f"{path}: tensor {name!r} starts at byte {begin} of the data region, "
                              f"but {after} at byte {at} ({kind})")
        at, prev = end, name
    if at != data_len:
        last = f"tensor {prev!r}" if prev is not None else "the header"
        raise FormatError(f"{path}: {data_len - at} bytes after {last} belong to no tensor; "
                          f"the header length or data_offsets are wrong")


def _is_uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _read_sharded(directory: Path, index: Path) -> dict[str, np.ndarray | HalfTensor]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError) as e:
        raise FormatError(f"{index}: not a valid index with a weight_map ({e})") from None
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        raise FormatError(f"{index} lists shards that are not in {directory}: {', '.join(missing)}")
    tensors = _merge([directory / s for s in shards])
    absent = [name for name in weight_map if name not in tensors]
    if absent:
        raise FormatError(f"{index} maps tensors that no shard holds: {', '.join(absent[:5])}")
    return tensors


def _merge(files: list[Path]) -> dict[str, np.ndarray | HalfTensor]:
    tensors, owner = {}, {}
    for f in files:
        for name, t in read_safetensors(f).items():
            if name in tensors:
                raise FormatError(f"tensor {name!r} is in both {owner[name]} and {f}")
            tensors[name], owner[name] = t, f
    return tensors
