"""The KV cache: preallocated once for the whole context, filled left to right."""
from dataclasses import dataclass, field

import numpy as np

from formats.config import ModelConfig


@dataclass
class KVCache:
    k: np.ndarray   # [layers, Hkv, ctx, hd]
    v: np.ndarray   # [layers, Hkv, ctx, hd]
    pos: int = 0    # positions filled
    tokens: list[int] = field(default_factory=list)  # the ids behind those positions

    @classmethod
    def allocate(cls, config: ModelConfig, ctx: int) -> "KVCache":
        shape = (config.num_hidden_layers, config.num_key_value_heads, ctx, config.head_dim)
        # np.zeros maps untouched pages lazily: memory grows with the positions used.
        return cls(np.zeros(shape, np.float32), np.zeros(shape, np.float32))

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
