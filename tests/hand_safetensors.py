"""Safetensors files written byte by byte from the format's description, apart from nibble's own
writer: to check that nibble reads what other tools write, without a copy (memmap_backed)."""
import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np


def write_safetensors_by_hand(tensors: dict[str, np.ndarray], path: Path,
                              bf16: Callable[[str], bool] = lambda name: False):
    """The layout: u64 header size, JSON header, then the raw little-endian bytes. float32 tensors
    whose name `bf16` picks are stored as bfloat16 (truncated: round them first to keep them exact)."""
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        if a.dtype == np.float32 and bf16(name):
            dtype, raw = "BF16", (np.ascontiguousarray(a).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            dtype, raw = {np.dtype(np.uint32): "U32", np.dtype(np.float32): "F32"}[a.dtype], a.tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def memmap_backed(a: np.ndarray) -> bool:
    """Whether `a` is a view of a file's memory map, not a copy."""
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = a.base
    return False
