"""The KV cache in blocks: a pool of fixed-size blocks that sequences share, each sequence's
positions found through its block table (paged attention).

A KVPool holds one part per stage of the model (runner/stages.py): each stage allocates the keys
and values of its own layers where they run (HostKV on the CPU, device arrays on a GPU). A
KVCache is one sequence: its block table into a pool, and its positions and tokens. By default
(Model.new_cache) it has a private pool and the identity table, block i holding positions
16i..16i+15; a BlockPool (runner/kv/blocks.py) hands out blocks of a shared pool instead
(KVCache.on_pool). Cutting `pos` back forgets positions; the next pass overwrites the stale rows.

A KVCache is also the one record of its sequence that generation keeps: the ids (the prompt,
then each id sampled), how many of them ran, and the block table. A one-shot reply, a chat and
the serving engine each keep a sequence in one, and put it on a prompt the same way
(BlockPool.admit; keep_prefix where the blocks are its own). A pass that runs a draft stores its
keys and values past the positions it keeps: what the sampler rejects is overwritten by the next.

A pass over several sequences names, for each of its rows, the sequence and the position (Rows):
the kernels store the row's key and value at its position in its sequence's blocks, then attend
over that sequence's positions up to it.
"""
import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from nibble.formats.errors import NibbleError

BLOCK = 16   # positions per KV block
KV_TYPES = {"f32": np.float32, "int8": np.int8}


def kv_dtype(kv_type: str) -> np.dtype:
    """The element type of a host KV cache named `kv_type`."""
    if kv_type not in KV_TYPES:
        raise NibbleError(f"unknown KV cache type {kv_type!r}: choose {' or '.join(KV_TYPES)}")
    return np.dtype(KV_TYPES[kv_type])


def kv_type(dtype: np.dtype) -> str:
    """The name of a host KV cache whose elements are `dtype` (kv_dtype's inverse)."""
    return next(name for name, t in KV_TYPES.items() if np.dtype(t) == dtype)


def blocks_for(positions: int) -> int:
    """Blocks that hold `positions` positions."""
    return -(-positions // BLOCK)


class Rows(NamedTuple):
    """Which sequence and position each row of a pass is (numba takes it as it is)."""
    positions: np.ndarray   # [T] int64
    seq: np.ndarray         # [T] int32: index into tables
    tables: np.ndarray      # [S, max_blocks] int32: each sequence's blocks in order
    sees: np.ndarray        # [T] int64: the position after the last a row attends to: its own
                            # position + 1 (causal), or past it among an image's tokens (Gemma 3)
    turns: np.ndarray       # [T, R] int64: the position RoPE turns a row by: its own (R = 1), or
                            # one for each rotated pair (R = rotated dims / 2: multimodal RoPE)

    @classmethod
    def of(cls, positions, seq, tables, sees=None, turns=None) -> "Rows":
        """Rows with the dtypes the kernels are compiled for (another dtype compiles them again);
        causal and turned by their positions unless `sees` and `turns` say otherwise."""
        positions = np.ascontiguousarray(positions, np.int64)
        sees = positions + 1 if sees is None else np.ascontiguousarray(sees, np.int64)
        turns = positions[:, None].copy() if turns is None else np.ascontiguousarray(turns, np.int64)
        return cls(positions, np.ascontiguousarray(seq, np.int32), np.ascontiguousarray(np.atleast_2d(tables), np.int32),
                   sees, turns)

    @classmethod
    def single(cls, pos0: int, T: int, table: np.ndarray) -> "Rows":
        """T rows of one sequence at positions pos0.. through its block `table`."""
        return cls.of(np.arange(pos0, pos0 + T), np.zeros(T, np.int32), table[None])

    @classmethod
    def packed(cls, lengths) -> tuple["Rows", int]:
        """Sequences of `lengths` one after another, each from position 0 on blocks of its own (an
        encoder's texts, a tower's images) -> their rows and how many blocks they take."""
        blocks = [blocks_for(n) for n in lengths]
        tables = np.zeros((len(lengths), max(blocks)), np.int32)
        first = np.cumsum([0, *blocks])
        for s, b in enumerate(blocks):
            tables[s, :b] = np.arange(first[s], first[s] + b)
        positions = np.concatenate([np.arange(n) for n in lengths])
        return cls.of(positions, np.repeat(np.arange(len(lengths)), lengths), tables), int(first[-1])

    def part(self, rows: np.ndarray) -> "Rows":
        """Only these rows (indexes), on the same tables."""
        return Rows(self.positions[rows], self.seq[rows], self.tables, self.sees[rows], self.turns[rows])

    @property
    def plain(self) -> bool:
        """Whether every row attends causally and turns by its own position."""
        return (np.array_equal(self.sees, self.positions + 1) and self.turns.shape[1] == 1
                and np.array_equal(self.turns[:, 0], self.positions))


def identity_table(blocks: int) -> np.ndarray:
    return np.arange(blocks, dtype=np.int32)


@dataclass
class HostKV:
    """Keys and values of a run of layers on the CPU, in blocks."""
    k: np.ndarray         # [layers, blocks, Hkv, hd, BLOCK] float32, or int8 ... (a block's keys
    v: np.ndarray         # [layers, blocks, Hkv, BLOCK, hd]    transposed: kernels.cpu.attention)
    k_scale: np.ndarray   # [layers, blocks, Hkv, BLOCK] ... times these scales (ones for float32)
    v_scale: np.ndarray   # [layers, blocks, Hkv, BLOCK]

    @classmethod
    def allocate(cls, layers: int, n_kv_heads: int, blocks: int, head_dim: int, dtype) -> "HostKV":
        shape = (layers, blocks, n_kv_heads, BLOCK, head_dim)
        keys = (layers, blocks, n_kv_heads, head_dim, BLOCK)
        return cls(_lazy_zeros(keys, dtype), _lazy_zeros(shape, dtype),
                   np.ones(shape[:4], np.float32), np.ones(shape[:4], np.float32))

    def block_views(self, block: int) -> list[memoryview]:
        """Block `block`'s bytes: each array's slice of it, layer by layer (each contiguous)."""
        return [layer[block * size:(block + 1) * size] for layer, size in self._layer_bytes]

    @cached_property
    def _layer_bytes(self) -> list[tuple[memoryview, int]]:
        """Each array's layers as bytes, and a block's bytes in each (slicing these is a fifth of
        the time of making a block's views from the arrays)."""
        return [(memoryview(a[i]).cast("B"), a[i, 0].nbytes) for a in (self.k, self.v, self.k_scale, self.v_scale)
                for i in range(a.shape[0])]

    def layer(self, i: int) -> tuple:
        """The arrays of the part's layer i, as kernels.layer.decoder_layer takes them."""
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]


@dataclass
class KVPool:
    """Blocks that sequences share: one part per stage of the model, each `blocks` blocks."""
    parts: list           # per stage of the model, in order: what its new_cache gave
    stages: list          # the model's stages it was made for (Model.stages)
    blocks: int           # how many blocks it holds


ROOT = bytes(16)   # the parent of a sequence's first block (runner/kv/blocks.py's hashes)


@dataclass
class SeqBlocks:
    """A sequence's block table: position p lives in blocks[p // BLOCK], at offset p % BLOCK."""
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)   # the chain of its leading full blocks
    cached: int = 0      # positions found in the pool when the table was looked up (BlockPool.sequence)
    from_disk: int = 0   # of those, the ones read back from the disk tier
    root: bytes = ROOT   # the parent of its first block: what else than its ids its blocks hold depends on

    @property
    def parent(self) -> bytes:
        return self.hashes[-1] if self.hashes else self.root


@dataclass
class KVCache:
    """One sequence on a pool: its ids, the positions that ran, its blocks."""
    pool: KVPool
    size: int             # positions the context holds
    blocks: SeqBlocks     # its blocks in order (the table may grow, as long as it covers each pass)
    ids: list[int] = field(default_factory=list)   # the sequence: ids[:pos] ran, ids[pos:] are to run
    pos: int = 0          # positions whose keys and values are stored

    @classmethod
    def on_pool(cls, pool: KVPool, size: int, blocks: Iterable[int] = ()) -> "KVCache":
        """A sequence of up to `size` positions in the `blocks` of a pool (none yet: a BlockPool
        gives them, runner/kv/blocks.py)."""
        return cls(pool, size, SeqBlocks(list(blocks)))

    @property
    def table(self) -> np.ndarray:
        return np.asarray(self.blocks.blocks, np.int32)

    @property
    def parts(self) -> list:
        return self.pool.parts

    @property
    def stages(self) -> list:
        return self.pool.stages

    @property
    def ran(self) -> list[int]:
        """The ids whose keys and values are stored."""
        return self.ids[:self.pos]

    def truncate(self, pos: int):
        """Forget positions pos.. and the ids there (their keys and values are overwritten on the
        next store)."""
        self.pos = min(self.pos, pos)
        del self.ids[self.pos:]

    def keep_prefix(self, ids: Sequence[int]) -> int:
        """Make `ids` the sequence, keeping the positions that ran of the prefix it shares with
        them (on its own blocks; a BlockPool's sequence: BlockPool.admit). -> positions kept."""
        self.pos = shared_prefix(self.ran, ids)
        self.ids[:] = ids
        return self.pos


def shared_prefix(ran: Sequence[int], ids: Sequence[int]) -> int:
    """Of the positions a sequence that ran `ran` holds, those that a sequence of `ids` keeps: the
    prefix they share, but the last of `ids` (its logits choose what follows: it always runs)."""
    n = min(len(ran), len(ids) - 1)
    return next((i for i in range(n) if ran[i] != ids[i]), max(n, 0))


def _lazy_zeros(shape, dtype) -> np.ndarray:
    """Zeros whose memory is taken page by page as positions are written. Not np.zeros: numpy
    asks for 2 MB huge pages on large arrays, and one write per (layer, head) would then take
    the whole context's memory at once (8192 positions of SmolLM2: 360 MB)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype, int(np.prod(shape))).reshape(shape)
