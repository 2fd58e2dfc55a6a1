"""The paged KV cache and Model.forward_batch: sequences at different positions in the blocks of
one pool, decoded rows and prompt chunks in one pass, each equal to the sequence run alone."""
import numpy as np
import pytest
from numba import cuda

from nibble.formats.errors import NibbleError
from nibble.runner.kv.cache import BLOCK, KVCache, Rows
from nibble.runner.model import ContextFull, Model
from tests.tiny import tiny_config, tiny_tensors

TYPES = ["llama", "qwen3", "gemma3_text", "phi3"]
rng = np.random.default_rng(0)


def tiny_model(model_type="llama", **config) -> Model:
    c = tiny_config(model_type, **config)
    return Model(c, tiny_tensors(c))


class Batch:
    """Sequences on one pool, each with its blocks scattered through it, passed together."""

    def __init__(self, model: Model, prompts: list, blocks_each: int = 4):
        self.model, self.prompts = model, prompts
        self.pool = model.new_pool(len(prompts) * blocks_each + 3)
        self.tables = rng.permutation(self.pool.blocks)[:len(prompts) * blocks_each].reshape(len(prompts), -1)
        self.pos = [0] * len(prompts)

    def step(self, chunks: dict) -> dict:
        """One pass of {sequence: its next tokens} -> {sequence: logits of its last token}."""
        seqs = list(chunks)
        tokens = np.concatenate([chunks[s] for s in seqs])
        positions = np.concatenate([np.arange(self.pos[s], self.pos[s] + len(chunks[s])) for s in seqs])
        seq = np.concatenate([[s] * len(chunks[s]) for s in seqs])
        last = np.cumsum([len(chunks[s]) for s in seqs]) - 1
        logits = self.model.forward_batch(tokens, Rows.of(positions, seq, self.tables), self.pool, last)
        for s in seqs:
            self.pos[s] += len(chunks[s])
        return dict(zip(seqs, logits))


def alone(model: Model, tokens, chunks: list[int]) -> list:
    """The logits of the last token of each chunk of `tokens`, on a cache of its own."""
    cache, out, done = model.new_cache(64), [], 0
    for n in chunks:
        out.append(model.forward(tokens[done:done + n], cache)[-1])
        done += n
    return out


@pytest.mark.parametrize("model_type", TYPES)
def test_decoded_rows_are_bit_identical_to_each_sequence_alone(model_type):
    """Three sequences prefilled one by one, then decoded together at different positions
    (5, 20, 33: in their second and third blocks), with a fourth's prompt chunks mixed in."""
    model = tiny_model(model_type)
    V = model.config.vocab_size
    ids = [rng.integers(0, V, n) for n in (9, 24, 37, 30)]
    lengths = (5, 20, 33)
    batch = Batch(model, ids)
    for s, n in enumerate(lengths):   # prefill: one sequence a pass, as alone
        batch.step({s: ids[s][:n]})
    got = {s: [] for s in range(4)}
    for i in range(4):
        step = {s: ids[s][n + i:n + i + 1] for s, n in enumerate(lengths)}
        step[3] = ids[3][6 * i:6 * i + 6]     # a prompt chunk beside the decoded rows
        for s, logits in batch.step(step).items():
            got[s].append(logits)
    for s, n in enumerate(lengths):
        want = alone(model, ids[s], [n, 1, 1, 1, 1])[1:]
        np.testing.assert_array_equal(np.array(got[s]), np.array(want))
    np.testing.assert_allclose(np.array(got[3]), np.array(alone(model, ids[3], [6] * 4)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", TYPES)
def test_prompt_chunks_of_several_sequences_in_one_pass(model_type):
    """Prompts of 7, 18 and 3 tokens prefilled in one pass, then a second chunk of each in another,
    every logit row asked for: each equals its sequence run alone."""
    model = tiny_model(model_type)
    V = model.config.vocab_size
    ids = [rng.integers(0, V, n) for n in (12, 30, 5)]
    batch = Batch(model, ids)
    first = {0: ids[0][:7], 1: ids[1][:18], 2: ids[2][:3]}
    got = batch.step(first)
    second = batch.step({0: ids[0][7:], 1: ids[1][18:], 2: ids[2][3:]})
    for s, tokens in enumerate(ids):
        n = len(first[s])
        want = alone(model, tokens, [n, len(tokens) - n])
        np.testing.assert_allclose(np.array([got[s], second[s]]), np.array(want), rtol=1e-4, atol=1e-4)


def test_every_logit_row_in_the_order_asked():
    model = tiny_model()
    pool = model.new_pool(4)
    tokens = np.array([3, 9, 27, 81, 5])
    rows = Rows.of([0, 1, 2, 3, 0], [0, 0, 0, 0, 1], [[2, 0], [1, 3]])
    logits = model.forward_batch(tokens, rows, pool, [4, 1, 3, 1])
    whole = model.forward(tokens[:4], model.new_cache(16), all_logits=True)
    np.testing.assert_allclose(logits[[1, 2, 3]], whole[[1, 3, 1]], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(logits[0], model.forward(tokens[4:], model.new_cache(16))[0])


@pytest.mark.parametrize("kv_type", ["f32", "int8"])
def test_caches_on_one_pool_interleaved_equal_private_caches(kv_type):
    """Two KVCaches on blocks of one pool (KVCache.on_pool), run turn about with Model.forward, as
    a BlockPool's sequences are: the same logits as each on a cache of its own."""
    model = tiny_model("qwen3", sliding_window=5, use_sliding_window=True, max_window_layers=1)
    pool = model.new_pool(8, kv_type)
    shared = [KVCache.on_pool(pool, 40, table) for table in ([5, 0, 7], [2, 6, 1])]
    private = [model.new_cache(40, kv_type) for _ in range(2)]
    ids = rng.integers(0, model.config.vocab_size, (2, 40))
    for start, n in [(0, 17), (17, 1), (18, 14), (32, 1), (33, 1)]:
        for s in range(2):
            got = model.forward(ids[s, start:start + n], shared[s])
            np.testing.assert_array_equal(got, model.forward(ids[s, start:start + n], private[s]))
    assert shared[0].pos == 34 and shared[0].ids == list(ids[0, :34])


def test_new_cache_is_an_identity_table_on_a_private_pool():
    model = tiny_model()
    cache = model.new_cache(40)
    assert cache.pool.blocks == 3 and list(cache.table) == [0, 1, 2] and cache.size == 40
    assert cache.parts[0].k.shape == (2, 3, 2, 16, BLOCK)   # [layers, blocks, Hkv, hd, BLOCK]
    assert cache.parts[0].v.shape == (2, 3, 2, BLOCK, 16)
    assert cache.stages is model.stages


@pytest.mark.parametrize("rows,logit_rows,message", [
    (Rows.of([0, 1], [0, 0], [[0, 1]]), [0], "a pass of 3 tokens needs 3 positions and sequences, got 2 and 2"),
    (Rows.of([0, 1, 2], [0, 0, 1], [[0, 1]]), [0], "the rows name sequences outside the 1 block tables given"),
    (Rows.of([0, 1, 32], [0, 0, 0], [[0, 1]]), [0], "position 32 is past the context: 256 positions for the model, 32 in the block tables"),
    (Rows.of([0, 1, 16], [0, 0, 0], [[0, 4]]), [0], "a block table names blocks outside the pool of 4"),
    (Rows.of([0, 1, 2], [0, 0, 0], [[0, -1]]), [3], "logit_rows must index the 3 rows of the pass"),
])
def test_rows_out_of_bounds_are_one_line(rows, logit_rows, message):
    model = tiny_model()
    with pytest.raises(NibbleError, match=f"^{message}$"):
        model.forward_batch([1, 2, 3], rows, model.new_pool(4), logit_rows)


def test_a_cache_past_its_table_is_refused():
    model = tiny_model()
    cache = KVCache.on_pool(model.new_pool(4), 64, [3])
    model.forward(np.arange(16), cache)
    with pytest.raises(NibbleError, match="the KV cache's block table holds 16 positions, not the 17 this pass needs"):
        model.forward([1], cache)
    with pytest.raises(ContextFull):
        model.forward(np.arange(60), cache)


@pytest.mark.skipif(not cuda.is_available(), reason="no CUDA GPU (NUMBA_ENABLE_CUDASIM=1 simulates one)")
@pytest.mark.filterwarnings("ignore:Simulator timings are bogus")
def test_several_sequences_with_a_gpu_stage_are_refused():
    from tests.test_offload import NARROW
    model = tiny_model(**NARROW)
    assert model.offload_layers(1, 32) == ""
    rows = Rows.of([0, 0], [0, 1], [[0, 1], [2, 3]])
    with pytest.raises(NibbleError, match="^a pass over several sequences runs on the CPU only"):
        model.forward_batch([1, 2], rows, model.new_pool(4), [0, 1])
    shuffled = KVCache.on_pool(model.new_pool(4), 32, [2, 0])
    with pytest.raises(NibbleError, match="^the GPU runs one sequence whose KV blocks are in order"):
        model.forward([1, 2], shuffled)
