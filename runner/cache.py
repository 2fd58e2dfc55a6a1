"""The KV cache: preallocated once for the whole context, filled left to right.

A KVCache holds one part per stage of the model (runner/stages.py): each stage allocates the
keys and values of its own layers where they run (HostKV on the CPU, device arrays on a GPU).
The positions and tokens are the cache's, shared by all parts: truncating forgets them
everywhere, and the next pass overwrites the stale rows.
"""
import mmap
from dataclasses import dataclass, field

import numpy as np

from nibble.formats.errors import NibbleError

KV_TYPES = {"f32": np.float32, "int8": np.int8}


def kv_dtype(kv_type: str) -> np.dtype:
    """The element type of a host KV cache named `kv_type`."""
    if kv_type not in KV_TYPES:
        raise NibbleError(f"unknown KV cache type {kv_type!r}: choose {' or '.join(KV_TYPES)}")
    return np.dtype(KV_TYPES[kv_type])


@dataclass
class HostKV:
    """Keys and values of a run of layers on the CPU."""
    k: np.ndarray         # [layers, Hkv, ctx, hd] float32, or int8 rows ...
    v: np.ndarray         # [layers, Hkv, ctx, hd]
    k_scale: np.ndarray   # [layers, Hkv, ctx] ... times these scales (ones for float32)
    v_scale: np.ndarray   # [layers, Hkv, ctx]

    @classmethod
    def allocate(cls, layers: int, n_kv_heads: int, ctx: int, head_dim: int, dtype) -> "HostKV":
        shape = (layers, n_kv_heads, ctx, head_dim)
        return cls(_lazy_zeros(shape, dtype), _lazy_zeros(shape, dtype),
                   np.ones(shape[:3], np.float32), np.ones(shape[:3], np.float32))

    def layer(self, i: int) -> tuple:
        """The arrays of the part's layer i, as kernels.layer.decoder_layer takes them."""
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]


@dataclass
class KVCache:
    parts: list           # per stage of the model, in order: what its new_cache gave
    stages: list          # the model's stages it was made for (Model.stages)
    size: int             # positions the context holds
    pos: int = 0          # positions filled
    tokens: list[int] = field(default_factory=list)  # the ids behind those positions

    def advance(self, tokens):
        self.pos += len(tokens)
        self.tokens.extend(int(t) for t in tokens)

    def truncate(self, pos: int):
        """Forget positions pos.. (their values are overwritten on the next store)."""
        self.pos = min(self.pos, pos)
        del self.tokens[self.pos:]


def _lazy_zeros(shape, dtype) -> np.ndarray:
    """Zeros whose memory is taken page by page as positions are written. Not np.zeros: numpy
    asks for 2 MB huge pages on large arrays, and one write per (layer, head) would then take
    the whole context's memory at once (8192 positions of SmolLM2: 360 MB)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype, int(np.prod(shape))).reshape(shape)
