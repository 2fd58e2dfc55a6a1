"""The block pool's bookkeeping: matching by chained hashes, refcounts, the LRU of cached blocks,
eviction, the last prompt id's block never shared, truncation copying a hashed block; and the
prompt memo."""
import numpy as np
import pytest

from nibble.runner.kv.blocks import ROOT, BlockPool, PoolFull, block_hash
from nibble.runner.kv.cache import BLOCK, KVCache
from nibble.runner.loader import load
from nibble.runner.kv.prompt_ids import PromptMemo


def ids(n, start=0):
    return list(range(start, start + n))


def admitted(pool, prompt):
    """A sequence put on `prompt` as the engine admits a request, its blocks not yet reserved."""
    seq = KVCache.on_pool(pool.kv, 256)
    pool.admit(seq, prompt, 0)
    return seq


def prefill(pool, prompt):
    """A sequence for `prompt`, its blocks reserved and hashed as if the prompt had run."""
    seq = admitted(pool, prompt)
    pool.reserve(seq, len(prompt))
    seq.pos = len(prompt)
    pool.commit(seq)
    return seq


def test_a_fresh_prompt_gets_fresh_blocks_and_hashes_its_full_ones(tiny):
    pool = new_pool(tiny, 8)
    prompt = ids(40)
    seq = prefill(pool, prompt).blocks
    assert seq.cached == 0 and seq.blocks == [0, 1, 2]
    assert [pool.refs[b] for b in seq.blocks] == [1, 1, 1]
    h0 = block_hash(ROOT, prompt[:BLOCK])
    h1 = block_hash(h0, prompt[BLOCK:2 * BLOCK])   # chained: its identity is its whole prefix
    assert seq.hashes == [h0, h1] and pool.by_hash == {h0: 0, h1: 1}
    assert 2 not in pool.hash_of   # the partly filled block is not shared


def test_a_shared_prefix_is_matched_and_held_by_both(tiny):
    pool = new_pool(tiny, 8)
    a = prefill(pool, ids(40)).blocks
    b = pool.sequence(ids(36) + [999, 1000])
    assert b.cached == 2 * BLOCK and b.blocks == a.blocks[:2]
    assert [pool.refs[x] for x in a.blocks] == [2, 2, 1]


def test_the_last_prompt_id_always_runs(tiny):
    """A prompt of exactly two blocks matches one: its last id's block is never shared."""
    pool = new_pool(tiny, 8)
    prefill(pool, ids(2 * BLOCK))
    assert pool.sequence(ids(2 * BLOCK)).cached == BLOCK
    assert pool.sequence(ids(2 * BLOCK + 1)).cached == 2 * BLOCK


def test_the_same_ids_after_another_prefix_do_not_match(tiny):
    pool = new_pool(tiny, 8)
    prefill(pool, ids(40))
    assert pool.sequence([7] + ids(40)[1:]).cached == 0


def test_released_blocks_become_cache_deepest_first_and_are_evicted_in_lru_order(tiny):
    pool = new_pool(tiny, 4)
    a, b = ids(33), ids(33, start=100)
    pool.release(prefill(pool, a))
    assert pool.refs[:3] == [0, 0, 0] and list(pool.cached) == [2, 1, 0]   # 2: a's partial block
    sb = admitted(pool, b)
    pool.reserve(sb, len(b))          # the free block, then the oldest cached ones
    assert sb.blocks.blocks == [3, 2, 1]
    assert pool.sequence(a).cached == BLOCK   # a's first block is left: the prefix outlives its tail


def test_a_block_held_by_a_running_sequence_is_never_evicted(tiny):
    pool = new_pool(tiny, 3)
    prompt = ids(40)
    seq = prefill(pool, prompt)
    with pytest.raises(PoolFull, match="all 3 KV blocks"):
        pool.reserve(admitted(pool, ids(20, start=500)), 20)
    pool.release(seq)
    assert pool.available == 3


def test_a_partly_filled_block_is_found_again_and_then_is_the_finders_alone(tiny):
    """Switching back to a conversation reuses even its last, partly filled block."""
    pool = new_pool(tiny, 8)
    chat = ids(2 * BLOCK + 5)
    pool.release(prefill(pool, chat))
    follow_up = chat + [900, 901]
    again = pool.sequence(follow_up)
    assert again.cached == len(chat) and again.blocks == [0, 1, 2]
    assert pool.refs[again.blocks[2]] == 1 and again.blocks[2] not in pool.hash_of
    assert pool.sequence(follow_up).cached == 2 * BLOCK   # taken: nobody else finds it


def test_two_sequences_prefilling_the_same_prefix_keep_one_hash(tiny):
    pool = new_pool(tiny, 8)
    prompt = ids(20)
    a, b = admitted(pool, prompt), admitted(pool, prompt)   # both before either ran
    for seq in (a, b):
        pool.reserve(seq, len(prompt))
        seq.pos = len(prompt)
        pool.commit(seq)
    assert pool.by_hash == {a.blocks.hashes[0]: a.blocks.blocks[0]}
    pool.release(b)
    assert b.blocks.blocks == [] and 2 in pool.free and 3 in pool.cached   # b's unhashed twin is freed


def test_truncating_into_a_hashed_block_copies_it(tiny):
    pool = new_pool(tiny, 8)
    written = ids(40)
    seq = prefill(pool, written)
    k = pool.kv.parts[0].k                  # [layers, blocks, Hkv, hd, BLOCK]
    k[:, 1] = np.random.default_rng(0).standard_normal(k[:, 1].shape)   # what block 1 holds
    pool.truncate(seq, 20)   # inside block 1, which is hashed: keep it for its hash
    assert seq.blocks.blocks == [0, 3] and len(seq.blocks.hashes) == 1 and seq.ids == written[:20]
    assert np.array_equal(k[:, 3], k[:, 1]) and k[:, 1].any()
    assert pool.refs[1] == 0 and 1 in pool.cached and 2 in pool.cached   # 2: the partial tail
    assert pool.sequence(written + [5]).cached == 2 * BLOCK + 8   # both still findable


def test_truncating_into_the_unhashed_last_block_keeps_it(tiny):
    pool = new_pool(tiny, 8)
    written = ids(40)
    seq = prefill(pool, written)
    pool.truncate(seq, 35)
    assert seq.blocks.blocks == [0, 1, 2] and len(seq.blocks.hashes) == 2
    pool.truncate(seq, 32)   # at a block's edge: the block is let go whole
    assert seq.blocks.blocks == [0, 1] and 2 in pool.cached


def test_admit_keeps_the_prefix_a_sequence_shares_or_takes_the_pool_s_longer_one(tiny):
    """A chat's next turn: its own blocks, cut where the new prompt differs (a hashed block
    copied); a switch back to another chat the pool still holds: that chat's blocks."""
    pool = new_pool(tiny, 8)
    other = ids(40, start=100)
    pool.release(prefill(pool, other))   # another chat, left in the pool: blocks 0, 1, 2
    seq = prefill(pool, ids(40))         # blocks 3, 4, 5
    edited = ids(20) + [7, 8]
    assert pool.admit(seq, edited, 22) == (20, 0)
    assert seq.blocks.blocks == [3, 6] and seq.ids == edited and seq.pos == 20
    back = other + [1, 2]
    assert pool.admit(seq, back, 42) == (40, 0)
    assert seq.blocks.blocks == [0, 1, 2] and seq.ids == back and seq.pos == 40
    assert pool.sequence(edited).cached == 20   # what it left is cache


def test_the_memo_reuses_the_ids_of_a_remembered_prefix(tiny_tokenizer):
    memo = PromptMemo(tiny_tokenizer)
    text = "hello world, hello"
    sampled = tiny_tokenizer.encode(text)[:-1] + tiny_tokenizer.encode("o", add_bos=False)
    assert tiny_tokenizer.decode(sampled) == text
    memo.remember(text, sampled)
    assert memo.encode(text + " again") == sampled + tiny_tokenizer.encode(" again", add_bos=False)
    assert memo.encode("other") == tiny_tokenizer.encode("other")


def test_the_memo_forgets_the_least_recently_used(tiny_tokenizer):
    memo = PromptMemo(tiny_tokenizer, size=2)
    memo.remember("a", [1])
    memo.remember("b", [2])
    memo.encode("a!")          # used: now the most recent
    memo.remember("c", [3])
    assert list(memo.texts) == ["a", "c"]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(str(tiny_dir))


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny):
    return tiny[1]


def new_pool(tiny, blocks):
    return BlockPool(tiny[0].new_pool(blocks))
