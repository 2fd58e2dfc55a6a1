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

import numpy as np

from nibble.formats.errors import NibbleError
from .cache import BLOCK, ROOT, HostKV, KVCache, KVPool, SeqBlocks, shared_prefix
from .disk import DiskBlocks


class PoolFull(NibbleError):
    """Every block is held by a running sequence."""


def block_hash(parent: bytes, ids: Sequence[int], partial: bool = False) -> bytes:
    """The identity of a block: its ids after `parent` (the hash of all the ids before them).
    blake2b, not Python's hash(): a client must not be able to collide into another's prefix.
    A partly filled block is hashed apart (its own personalization): it is matched differently."""
    data = parent + np.asarray(ids, np.int64).tobytes()   # an image's ids take 63 bits (text/image_ids.py)
    return hashlib.blake2b(data, digest_size=16, person=b"partial" if partial else b"").digest()


def chain_root(salt: str) -> bytes:
    """The root of the chains of sequences whose keys and values depend on `salt` beside their
    ids (the LoRA adapters they run: Model.prefix_root); "" -> ROOT."""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"root").digest() if salt else ROOT


class BlockPool:
    """Refcounted blocks, their hashes, and the LRU of the hashed blocks nobody holds.

        pool = BlockPool(model.new_pool(blocks), disk)   # disk: disk.open_disk(...) or None
        cache = KVCache.on_pool(pool.kv, size)
        pool.admit(cache, ids, size)      # cache.pos positions are already there: run ids[cache.pos:]
        pool.commit(cache)                # hash the blocks that became full
        pool.release(cache)               # when done: its blocks become cache

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

    def sequence(self, ids: Sequence[int], root: bytes = ROOT) -> SeqBlocks:
        """A sequence for a prompt of `ids`, holding the longest prefix of them that the pool
        has, or its disk tier (at most len(ids) - 1 positions: the last id always runs), among
        the blocks chained from `root` (chain_root)."""
        seq, limit = SeqBlocks(root=root), len(ids) - 1
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

    def admit(self, cache: KVCache, ids: Sequence[int], positions: int, root: bytes = ROOT) -> tuple[int, int]:
        """Make `ids` the sequence of `cache` (a sequence of this pool: a new one, or one that ran
        before), on whichever holds more of them: its own blocks, cut to the prefix they share,
        or the blocks the pool (or its disk tier) has of them, another sequence's say; of those
        chained from `root` (chain_root: its own blocks too). Give it blocks for `positions`
        positions. -> (positions that need not run, of those read back from disk)."""
        found, ran = self.sequence(ids, root), cache.ran
        reused, from_disk = shared_prefix(ran, ids) if cache.blocks.root == root else -1, 0
        if found.cached > reused:   # another chat, say, that the pool (or its disk) still holds
            self._release(cache.blocks, ran)
            cache.blocks, reused, from_disk = found, found.cached, found.from_disk
        else:
            self._release(found, ids[:found.cached])
            self._truncate(cache.blocks, ran, reused)
        cache.ids[:], cache.pos = ids, reused
        self.reserve(cache, positions)
        return reused, from_disk

    def reserve(self, cache: KVCache, positions: int):
        """Give `cache` blocks enough for `positions` positions (evicting cached blocks if needed)."""
        blocks = cache.blocks.blocks
        while len(blocks) * BLOCK < positions:
            block = self._allocate()
            self.refs[block] = 1
            blocks.append(block)

    def commit(self, cache: KVCache):
        """Hash the blocks that the ids that ran fill, so that other sequences can find them."""
        self._commit(cache.blocks, cache.ran)

    def _commit(self, seq: SeqBlocks, ids: Sequence[int]):
        """Hash the blocks that `ids` (the ids at positions 0.. whose keys and values are written)
        fill. A block whose hash another block already has stays unhashed (two sequences
        prefilled the same prefix at once): it is freed when done."""
        for i in range(len(seq.hashes), len(ids) // BLOCK):
            h = block_hash(seq.parent, ids[i * BLOCK:(i + 1) * BLOCK])
            seq.hashes.append(h)
            if h not in self.by_hash:
                self._hash(seq.blocks[i], h)
                if self.disk is not None:
                    self.disk.save(h, self._views(seq.blocks[i]))

    def release(self, cache: KVCache):
        """The sequence is done: its blocks become cache (hashed: full ones, and its partly
        filled last block if the ids that ran end in one) or free."""
        self._release(cache.blocks, cache.ran)

    def truncate(self, cache: KVCache, pos: int):
        """Forget positions pos.. of the sequence; the blocks past them become cache."""
        self._truncate(cache.blocks, cache.ran, pos)
        cache.truncate(pos)

    def _release(self, seq: SeqBlocks, ids: Sequence[int]):
        self._drop(seq, ids, 0)
        seq.hashes.clear()

    def _truncate(self, seq: SeqBlocks, ids: Sequence[int], pos: int):
        """Keep positions ..pos-1 of the blocks `seq` whose written ids are `ids`. A kept block
        that is hashed is copied to a fresh one first: pos.. will be overwritten, and its hash
        (maybe another sequence's block too) must stay true."""
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
        self._commit(seq, ids)
        full = len(ids) // BLOCK
        if len(ids) % BLOCK and keep <= full < len(seq.blocks) and self.refs[seq.blocks[full]] == 1:
            parent = seq.hashes[full - 1] if full else seq.root
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


def _copy(kv: KVPool, src: int, dst: int):
    """Copy block src's keys and values to block dst, in every layer."""
    for part in kv.parts:
        if not isinstance(part, HostKV):
            raise NibbleError("a shared KV pool is on the CPU only: load the model without --gpu-layers")
        for a in (part.k, part.v, part.k_scale, part.v_scale):   # [layers, blocks, ...]
            a[:, dst] = a[:, src]
