"""Which KV blocks hold which tokens: the bookkeeping of a pool of blocks shared by sequences.

The keys and values live in the model's KVPool (runner/kv/cache.py); this module decides which
block each sequence's positions go to. A full block is known by a chained hash of every id up to
its end, so a prefix common to several conversations (a system prompt, a shared document) is
stored once, and a new sequence starts on the longest run of blocks its ids spell. A block nobody
holds stays cached until the pool needs it, least recently used first.

With a disk tier (runner/kv/disk.py), every full block is also kept on disk when it is hashed,
and a prefix the pool no longer holds (evicted, or held by a process that ended) is read back
from there.

Writes never land in a block another sequence reads: matching stops before the last id (it
always runs, since its logits choose the reply's first token), so a sequence writes only past
the full blocks it shares; a partly filled block is matched only while nobody holds it, and is
then the matcher's alone; truncating into a block that is hashed copies it first, so that what
its hash names stays true.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from nibble.formats.errors import NibbleError
from .cache import BLOCK, HostKV, KVCache, KVPool
from .disk import DiskBlocks

ROOT = bytes(16)   # the parent of a sequence's first block


class PoolFull(NibbleError):
    """Every block is held by a running sequence."""


@dataclass
class SeqBlocks:
    """One sequence's blocks: position p lives in blocks[p // BLOCK], at offset p % BLOCK."""
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)   # the chain of its leading full blocks
    cached: int = 0      # positions found in the pool when the sequence was made
    from_disk: int = 0   # of those, the ones read back from the disk tier

    @property
    def parent(self) -> bytes:
        return self.hashes[-1] if self.hashes else ROOT


def block_hash(parent: bytes, ids: Sequence[int], partial: bool = False) -> bytes:
    """The identity of a block: its ids after `parent` (the hash of all the ids before them).
    blake2b, not Python's hash(): a client must not be able to collide into another's prefix.
    A partly filled block is hashed apart (its own personalization): it is matched differently."""
    data = parent + np.asarray(ids, np.int32).tobytes()
    return hashlib.blake2b(data, digest_size=16, person=b"partial" if partial else b"").digest()


class BlockPool:
    """Refcounted blocks, their hashes, and the LRU of the hashed blocks nobody holds.

        pool = BlockPool(model.new_pool(blocks), disk)   # disk: disk.open_disk(...) or None
        seq = pool.sequence(ids)          # seq.cached positions are already there
        pool.reserve(seq, len(ids))       # blocks for the rest; run ids[seq.cached:]
        pool.commit(seq, ids)             # hash the blocks that became full
        pool.release(seq, ids)            # when done: its blocks become cache

    `kv` holds the keys and values (the model's KVPool; forward_batch takes it). One thread uses
    a pool at a time.
    """

    def __init__(self, kv: KVPool, disk: DiskBlocks | None = None):
        self.kv, self.disk = kv, disk
        self.blocks = blocks = kv.blocks
        self.free = list(range(blocks - 1, -1, -1))   # popped from the end: block 0 first
        self.refs = [0] * blocks
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()   # hashed, refs 0: oldest first

    @property
    def available(self) -> int:
        """Blocks a sequence could get now: free or only cached."""
        return len(self.free) + len(self.cached)

    def sequence(self, ids: Sequence[int]) -> SeqBlocks:
        """A sequence for a prompt of `ids`, holding the longest prefix of them that the pool
        has, or its disk tier (at most len(ids) - 1 positions: the last id always runs)."""
        seq, limit = SeqBlocks(), len(ids) - 1
        reading = []   # the indices in seq.blocks of the blocks that the disk tier fills
        while (len(seq.blocks) + 1) * BLOCK <= limit:
            start = len(seq.blocks) * BLOCK
            h = block_hash(seq.parent, ids[start:start + BLOCK])
            block = self.by_hash.get(h)
            if block is not None:
                self._hold(block)
            elif self.disk is not None and h in self.disk and (block := self._spare()) is not None:
                reading.append(len(seq.blocks))
            else:
                break
            seq.blocks.append(block)
            seq.hashes.append(h)
        if reading:
            self._read(seq, reading)
        seq.cached = start = len(seq.blocks) * BLOCK
        for n in range(min(BLOCK - 1, limit - start), 0, -1):   # the longest partly filled block
            block = self.by_hash.get(block_hash(seq.parent, ids[start:start + n], partial=True))
            if block is not None:
                self._unhash(block)   # it will be written past n: it is this sequence's alone
                self._hold(block)
                seq.blocks.append(block)
                seq.cached += n
                break
        return seq

    def reserve(self, seq: SeqBlocks, positions: int):
        """Give `seq` blocks enough for `positions` positions (evicting cached blocks if needed)."""
        while len(seq.blocks) * BLOCK < positions:
            block = self._allocate()
            self.refs[block] = 1
            seq.blocks.append(block)

    def commit(self, seq: SeqBlocks, ids: Sequence[int]):
        """Hash the blocks that `ids` (the ids at positions 0.. whose keys and values are written)
        fill, so that other sequences can find them. A block whose hash another block already has
        stays unhashed (two sequences prefilled the same prefix at once): it is freed when done."""
        for i in range(len(seq.hashes), len(ids) // BLOCK):
            h = block_hash(seq.parent, ids[i * BLOCK:(i + 1) * BLOCK])
            seq.hashes.append(h)
            if h not in self.by_hash:
                self._hash(seq.blocks[i], h)
                if self.disk is not None:
                    self.disk.save(h, self._views(seq.blocks[i]))

    def release(self, seq: SeqBlocks, ids: Sequence[int]):
        """The sequence is done: its blocks become cache (hashed: full ones, and its partly
        filled last block if `ids`, its written ids, end in one) or free."""
        self._drop(seq, ids, 0)
        seq.hashes.clear()

    def truncate(self, seq: SeqBlocks, ids: Sequence[int], pos: int):
        """Keep positions ..pos-1 of the sequence whose written ids are `ids`; the blocks past
        them become cache. A kept block that is hashed is copied to a fresh one first: pos..
        will be overwritten, and its hash (maybe another sequence's block too) must stay true."""
        keep = -(-pos // BLOCK)
        self._drop(seq, ids, keep)
        del seq.hashes[pos // BLOCK:]
        last = pos // BLOCK
        if pos % BLOCK and self.hash_of.get(seq.blocks[last]) is not None:
            block = self._allocate()
            _copy(self.kv, seq.blocks[last], block)
            self.refs[block] = 1
            self._unref(seq.blocks[last])
            seq.blocks[last] = block

    def _drop(self, seq: SeqBlocks, ids: Sequence[int], keep: int):
        """Let go of seq.blocks[keep:], hashing what they hold first."""
        self.commit(seq, ids)
        full = len(ids) // BLOCK
        if len(ids) % BLOCK and keep <= full < len(seq.blocks) and self.refs[seq.blocks[full]] == 1:
            parent = seq.hashes[full - 1] if full else ROOT
            h = block_hash(parent, ids[full * BLOCK:], partial=True)
            if h not in self.by_hash:
                self._hash(seq.blocks[full], h)
        # The deepest blocks first: they become the oldest cache, evicted before the prefix
        # that leads to them (which more sequences may share).
        for block in reversed(seq.blocks[keep:]):
            self._unref(block)
        del seq.blocks[keep:]

    def _spare(self) -> int | None:
        """A block held once, taken from the free ones or the cache; None if the pool has none."""
        try:
            block = self._allocate()
        except PoolFull:
            return None
        self.refs[block] = 1
        return block

    def _read(self, seq: SeqBlocks, reading: list[int]):
        """Fill the blocks seq.blocks[i] for i in `reading` from the disk tier, all at once. Each
        one read whole is hashed; the sequence ends before the first that is not."""
        read = self.disk.load_all([(seq.hashes[i], self._views(seq.blocks[i])) for i in reading])
        end = next((i for i, whole in zip(reading, read) if not whole), len(seq.blocks))
        for i, whole in zip(reading, read):
            if whole:
                self._hash(seq.blocks[i], seq.hashes[i])
        seq.from_disk = BLOCK * sum(i < end for i in reading)
        for block in reversed(seq.blocks[end:]):   # the ones read whole past it stay as cache
            self._unref(block)
        del seq.blocks[end:], seq.hashes[end:]

    def _views(self, block: int) -> list[memoryview]:
        return [v for part in self.kv.parts for v in part.block_views(block)]

    def _hold(self, block: int):
        self.cached.pop(block, None)
        self.refs[block] += 1

    def _unref(self, block: int):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.cached[block] = None
            else:
                self.free.append(block)

    def _allocate(self) -> int:
        if self.free:
            return self.free.pop()
        if not self.cached:
            raise PoolFull(f"all {self.blocks} KV blocks ({self.blocks * BLOCK} positions) are in use")
        block, _ = self.cached.popitem(last=False)
        self._unhash(block)
        return block

    def _hash(self, block: int, h: bytes):
        self.hash_of[block] = h
        self.by_hash[h] = block

    def _unhash(self, block: int):
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.by_hash[h]
        self.cached.pop(block, None)


def resume(pool: BlockPool, ids: Sequence[int], size: int) -> tuple[KVCache, SeqBlocks]:
    """A cache of `size` positions on `pool` (blocks for all of them reserved) holding the longest
    prefix of `ids` that the pool or its disk tier has (its positions filled: run ids[cache.pos:]);
    and its blocks, to commit once it ran."""
    seq = pool.sequence(ids)
    pool.reserve(seq, size)
    cache = KVCache.on_pool(pool.kv, seq.blocks, size)
    cache.advance(ids[:seq.cached])
    return cache, seq


def _copy(kv: KVPool, src: int, dst: int):
    """Copy block src's keys and values to block dst, in every layer."""
    for part in kv.parts:
        if not isinstance(part, HostKV):
            raise NibbleError("a shared KV pool is on the CPU only: load the model without --gpu-layers")
        for a in (part.k, part.v, part.k_scale, part.v_scale):   # [layers, blocks, ...]
            a[:, dst] = a[:, src]
