"""The KV cache: preallocated once for the whole context, filled left to right."""
import mmap
from dataclasses import dataclass, field

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.errors import NibbleError

KV_TYPES = {"f32": np.float32, "int8": np.int8}


@dataclass
class KVCache:
    k: np.ndarray         # [layers, Hkv, ctx, hd] float32, or int8 rows ...
    v: np.ndarray         # [layers, Hkv, ctx, hd]
    k_scale: np.ndarray   # [layers, Hkv, ctx] ... times these scales (ones for float32)
    v_scale: np.ndarray   # [layers, Hkv, ctx]
    pos: int = 0          # positions filled
    tokens: list[int] = field(default_factory=list)  # the ids behind those positions
    device: list | None = None   # GPU-offloaded layers' (k, v) [Hkv, ctx, hd] (runner/offload.py)

    @classmethod
    def allocate(cls, config: ModelConfig, ctx: int, kv_type: str = "f32") -> "KVCache":
        if kv_type not in KV_TYPES:
            raise NibbleError(f"unknown KV cache type {kv_type!r}: choose {' or '.join(KV_TYPES)}")
        shape = (config.num_hidden_layers, config.num_key_value_heads, ctx, config.head_dim)
        k, v = _lazy_zeros(shape, KV_TYPES[kv_type]), _lazy_zeros(shape, KV_TYPES[kv_type])
        return cls(k, v, np.ones(shape[:3], np.float32), np.ones(shape[:3], np.float32))

    def layer(self, i: int) -> tuple:
        """The arrays of layer i, as cpu.decoder_layer takes them."""
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    @property
    def size(self) -> int:
        return self.k.shape[2]

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
