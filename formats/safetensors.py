"""Safetensors: a zero-copy reader over np.memmap, and an atomic writer.

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name to
{"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data region), an optional
"__metadata__" of string pairs, then the raw little-endian data. We read it ourselves because the
safetensors package's numpy loader copies every tensor and cannot return bf16.
"""
from __future__ import annotations

import json
import math
import os
import struct
import uuid
from pathlib import Path

import numpy as np

from .errors import FormatError
from .half import HalfTensor

# Safetensors dtype name -> numpy dtype, for the dtypes numpy can view in place.
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
BF16 = "BF16"  # numpy has no bfloat16: read as a HalfTensor of its bits (no copy)
SUPPORTED = ", ".join(sorted([*DTYPES, BF16]))

INDEX_NAME = "model.safetensors.index.json"


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
    path = Path(path)
    metadata = _read_header(path)[0].get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    return metadata


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_safetensors(tensors: dict[str, np.ndarray | HalfTensor], path: str | os.PathLike,
                      metadata: dict[str, str] | None = None) -> None:
    """Write tensors to a .safetensors file atomically: a temporary sibling, then a rename.

    A HalfTensor is written widened to float32 (the safetensors package cannot write bf16).
    A failure (or KeyboardInterrupt) leaves any existing file at `path` untouched.
    """
    from safetensors.numpy import save_file  # only writers pay for the import

    path = Path(path)
    arrays = {}
    for name, t in tensors.items():
        t = np.asarray(t)
        if t.dtype.newbyteorder("<") not in DTYPES.values():
            known = ", ".join(sorted(d.name for d in DTYPES.values()))
            raise FormatError(f"cannot write tensor {name!r} of dtype {t.dtype} to {path}: "
                              f"supported are {known}")
        # The package writes from the raw data pointer: a strided view would be saved scrambled.
        arrays[name] = np.ascontiguousarray(t)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save_file(arrays, tmp, metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())   # save_file creates it 0600: others could not read the model
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_header(path: Path) -> tuple[dict, int, int]:
    """Parse the header: (header dict, byte offset of the data region, data region length)."""
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
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header, 8 + n, size - 8 - n


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
        if dtype != BF16 and dtype not in DTYPES:
            raise FormatError(f"{where} has unsupported dtype {dtype!r}; supported: {SUPPORTED}")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise FormatError(f"{where} has invalid shape {shape!r}: expected non-negative ints")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_uint(o) for o in offsets)):
            raise FormatError(f"{where} has invalid data_offsets {offsets!r}: "
                              f"expected [begin, end], non-negative ints")
        begin, end = offsets
        if begin > end or end > data_len:
            raise FormatError(f"{where} has data_offsets [{begin}, {end}] outside the data "
                              f"region of {data_len} bytes")
        itemsize = 2 if dtype == BF16 else DTYPES[dtype].itemsize
        expected = math.prod(shape) * itemsize
        if end - begin != expected:
            raise FormatError(f"{where}: shape {shape} of {dtype} needs {expected} bytes, "
                              f"but data_offsets span {end - begin}")
        entries[name] = (dtype, tuple(shape), begin, end)
    _check_overlaps(path, entries)
    return entries


def _check_overlaps(path: Path, entries: dict[str, tuple]) -> None:
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items())
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise FormatError(f"{path}: tensors {prev!r} and {name!r} overlap in the data region")


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
