"""Speculative decoding by prompt lookup and by a draft model: the n-gram search against a plain
one, greedy output identical with and without drafts, the rejection rule against plain sampling
(whatever a draft proposes: a draft model's greedy guesses are a function of the sequence, as a
lookup's are, so the rule keeps the sampled output's distribution with either)."""
from collections import Counter

import numpy as np
import pytest

from nibble.formats.model_dir import read_model_dir, write_model_dir
from nibble.quant.convert import quantize_model
from nibble.runner.generation.draft import NGRAM_MAX, NGRAM_MIN, DraftModel, NgramIndex, PromptLookup
from nibble.runner.generation.generate import stream_generate
from nibble.runner.loader import from_model_dir
from nibble.runner.generation.sample import make_sampler, probabilities
from nibble.runner.generation.session import ChatSession
from nibble.runner.settings import SamplerSettings
from tests.tiny import tiny_model_dir

GREEDY = SamplerSettings(temperature=0)


def plain_continuation(seq, k):
    """The tokens after the latest earlier occurrence of seq's longest suffix n-gram, by brute force."""
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        if n > len(seq):
            continue
        for start in range(len(seq) - n - 1, -1, -1):   # occurrences that end before the last token
            if seq[start:start + n] == seq[len(seq) - n:]:
                return seq[start + n:start + n + k]
    return []


@pytest.mark.parametrize("alphabet", [2, 5, 50])
def test_ngram_search_matches_a_plain_one(alphabet):
    rng = np.random.default_rng(alphabet)
    seq, index = [], NgramIndex()
    for _ in range(300):
        seq.extend(int(t) for t in rng.integers(0, alphabet, rng.integers(1, 4)))   # grows by 1-3
        k = int(rng.integers(1, 9))
        assert index.continuation(seq, k) == plain_continuation(seq, k), seq


def test_drafts_grow_while_they_hit_and_rest_after_misses():
    seq = [1, 2, 3, 4] * 4
    drafter = PromptLookup(4)
    assert drafter.draft(seq, room=100) == [1]   # a first draft of one token
    drafter.update(1, 1)
    assert drafter.draft(seq, room=1) == [1]     # cut by the room
    assert drafter.draft(seq, room=100) == [1, 2]
    drafter.update(2, 2)
    assert drafter.draft(seq, room=100) == [1, 2, 3, 4]
    drafter.update(4, 0)   # a miss from the first token: one token without a draft
    assert [drafter.draft(seq, 100) for _ in range(2)] == [[], [1]]
    drafter.update(1, 0)   # another: two
    assert [drafter.draft(seq, 100) for _ in range(3)] == [[], [], [1]]
    drafter.update(1, 1)
    drafter.update(2, 2)   # two accepted: the next miss rests one token again
    drafter.update(4, 0)
    assert [drafter.draft(seq, 100) for _ in range(2)] == [[], [1]]


@pytest.fixture(scope="module", params=["float32", "int4"])
def tiny(request, tmp_path_factory):
    md = tiny_model_dir()
    if request.param == "int4":   # the integer decode kernels
        md = read_model_dir(write_model_dir(quantize_model(md, 4, 32).model,
                                            tmp_path_factory.mktemp("draft") / "q"))
    model, tok = from_model_dir(md)
    tok.eos_ids = frozenset()   # the random model would stop at random: let max_tokens decide
    return model, tok


class Passes:
    """Model.forward counting its passes."""

    def __init__(self, model):
        self.model, self.forward, self.count = model, model.forward, 0

    def __call__(self, tokens, cache, **kw):
        self.count += 1
        return self.forward(tokens, cache, **kw)


def greedy_ids(model, tok, prompt, draft, n=80, cache=None, draft_model=None):
    """The reply's ids, one by one; the reply ends after n (or at the cache's end)."""
    cache = cache or model.new_cache(len(prompt) + n + 1)
    for r in stream_generate(model, tok, prompt, sampler=make_sampler(GREEDY), max_tokens=n, cache=cache,
                             draft=draft, draft_model=draft_model):
        yield from r.tokens


@pytest.mark.parametrize("prompt", ["The quick brown fox jumps over the lazy dog. The quick brown fox",
                                    "naïve café 東京 😀"])
def test_greedy_output_is_the_same_with_drafts(tiny, prompt, monkeypatch):
    model, tok = tiny
    ids = tok.encode(prompt)
    plain = list(greedy_ids(model, tok, ids, draft=0))
    passes = Passes(model)
    monkeypatch.setattr(model, "forward", passes)
    assert list(greedy_ids(model, tok, ids, draft=8)) == plain
    assert passes.count < len(plain)   # drafts were accepted: fewer passes than tokens


@pytest.mark.parametrize("seed", [0, 1])   # the model itself (float: its guesses taken), another one
def test_greedy_output_is_the_same_with_a_draft_model(tiny, seed, monkeypatch):
    model, tok = tiny
    drafts = DraftModel(from_model_dir(tiny_model_dir(seed=seed))[0], 256)
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    plain = list(greedy_ids(model, tok, ids, draft=0))
    passes = Passes(model)
    monkeypatch.setattr(model, "forward", passes)
    assert list(greedy_ids(model, tok, ids, draft=8, draft_model=drafts)) == plain
    if seed == 0:
        assert passes.count < len(plain) // 2   # guesses were taken: fewer passes than tokens
    # another prompt on the same draft model: its cache follows, keeping the common prefix
    other = tok.encode("The quick brown fox sleeps.")
    assert list(greedy_ids(model, tok, other, draft=8, draft_model=drafts)) == list(greedy_ids(model, tok, other, 0))
    assert drafts.cache.ids[:len(other)] == other


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_dir, tmp_path):
    from nibble.formats.errors import NibbleError
    from nibble.runner.loader import load, load_draft
    from tests.tiny import tiny_coder_dir
    _, tok = load(str(tiny_dir))
    coder = write_model_dir(tiny_coder_dir(), tmp_path / "coder")
    with pytest.raises(NibbleError, match="has another vocabulary than the model's"):
        load_draft(str(coder), None, tok, 256)
    assert load_draft(str(tiny_dir), None, tok, 256).cache.size == 256


def stored(cache):
    """The keys and values of the positions that ran, [layers, positions, Hkv, hd] each."""
    kv = cache.parts[0]
    keys = kv.k.transpose(0, 1, 4, 2, 3).reshape(kv.k.shape[0], -1, *kv.k.shape[2:4])
    values = kv.v.transpose(0, 1, 3, 2, 4).reshape(keys.shape)
    return keys[:, :cache.pos], values[:, :cache.pos]


def test_a_stopped_reply_leaves_the_cache_as_without_drafts(tiny):
    """At each response (where the consumer may stop), the cache's record holds the prompt and
    the reply so far, every id but the last sampled one run; the keys and values of the ids a
    draft guessed wrong were overwritten: the cache holds what decoding without drafts stores."""
    model, tok = tiny
    ids = tok.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")
    cache, seen = model.new_cache(256), []
    steps = stream_generate(model, tok, ids, sampler=make_sampler(GREEDY), max_tokens=60, cache=cache, draft=8)
    for r in steps:
        seen += r.tokens
        assert cache.ids[:len(ids) + len(seen)] == ids + seen and cache.pos == len(cache.ids) - 1
        if len(seen) > 30:
            steps.close()
    assert len(seen) > 30 and cache.pos == len(cache.ids) - 1
    plain = model.new_cache(256)
    for _ in stream_generate(model, tok, ids, sampler=make_sampler(GREEDY), max_tokens=len(cache.ids) - len(ids),
                             cache=plain, draft=0):
        pass
    assert plain.ids == cache.ids and plain.pos == cache.pos
    for got, want in zip(stored(cache), stored(plain)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_drafts_stay_inside_the_context(tiny):
    model, tok = tiny
    ids = tok.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")
    cache = model.new_cache(len(ids) + 20)
    tokens = list(greedy_ids(model, tok, ids, draft=8, n=100, cache=cache))
    assert tokens == list(greedy_ids(model, tok, ids, draft=0, n=21)) and cache.pos == cache.size


@pytest.mark.parametrize("pool", [False, True])
def test_chat_session_replies_the_same_with_drafts(tiny, pool):
    from nibble.runner.kv.blocks import BlockPool
    from nibble.runner.kv.cache import blocks_for
    model, tok = tiny
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. The quick"}]

    def turn(draft):
        shared = BlockPool(model.new_pool(2 * blocks_for(256))) if pool else None
        session = ChatSession(model, tok, ctx=256, pool=shared, draft=draft)
        first = "".join(c.text for c in session.reply(messages, GREEDY, max_tokens=40))
        follow = messages + [{"role": "assistant", "content": first}, {"role": "user", "content": "Again"}]
        return first, "".join(c.text for c in session.reply(follow, GREEDY, max_tokens=40))
    assert turn(8) == turn(0)


def test_sampled_replies_with_drafts_are_seeded():
    """Sampling with drafts: the same seed gives the same reply (a different one than without
    drafts: the rejection rule draws differently, from the same distribution)."""
    model, tok = from_model_dir(tiny_model_dir())
    ids = tok.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")
    settings = SamplerSettings(temperature=0.5, seed=3)

    def text():
        return "".join(r.text for r in stream_generate(model, tok, ids, sampler=make_sampler(settings),
                                                       max_tokens=40, draft=8))
    assert text() == text() != ""


@pytest.mark.slow
@pytest.mark.parametrize("settings", [SamplerSettings(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=1),
                                      SamplerSettings(temperature=1.3, top_k=5, top_p=0.9, min_p=0.02, seed=2),
                                      SamplerSettings(temperature=0.9, repetition_penalty=1.3, seed=3)])
def test_the_rejection_rule_draws_as_plain_sampling(settings):
    """On a vocabulary of 8, whatever the draft proposes, accept() draws each token as often as
    the sampler's own distribution says (fixed seeds, 40,000 draws)."""
    logits = np.array([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0], np.float32)
    recent = [1, 4]
    ids, cand = make_sampler(settings).candidates(logits, recent)
    want = np.zeros(len(logits))
    want[ids] = probabilities(cand, np.log(np.exp(cand.astype(np.float64)).sum()))
    n = 40_000
    plain = make_sampler(settings)
    got = {"plain": Counter(plain(logits, recent) for _ in range(n))}
    for proposed in (0, 2, 7):   # the likeliest, another, and one the filters may drop
        sampler = make_sampler(settings)
        got[proposed] = Counter(sampler.accept(logits, recent, proposed) for _ in range(n))
    for name, counts in got.items():
        freq = np.array([counts[i] for i in range(len(logits))]) / n
        # 4.5 standard deviations of a binomial frequency: a wrong rule is off by far more
        assert np.all(np.abs(freq - want) <= 4.5 * np.sqrt(want * (1 - want) / n) + 1e-12), (name, freq, want)


def test_greedy_accept_is_the_argmax():
    logits = np.array([0.5, 2.0, 1.0], np.float32)
    sampler = make_sampler(SamplerSettings(temperature=0, repetition_penalty=4.0))
    assert sampler.accept(logits, [], 2) == 1
    assert sampler.accept(logits, [1], 1) == 2   # 2.0 / 4 < 1.0: the penalty applies


CODE = """\
def summarize(x):
    total = 0
    for item in x:
        total += item
    mean = total / len(x)
    smallest = min(x)
    largest = max(x)
    spread = largest - smallest
    squares = [(item - mean) ** 2 for item in x]
    variance = sum(squares) / len(x)
    deviation = variance ** 0.5
    ordered = sorted(x)
    middle = len(x) // 2
    if len(x) % 2 == 0:
        median = (ordered[middle - 1] + ordered[middle]) / 2
    else:
        median = ordered[middle]
    counts = {}
    for item in x:
        counts[item] = counts.get(item, 0) + 1
    mode = max(counts, key=counts.get)
    print("count:", len(x))
    print("mean:", mean)
    print("median:", median)
    print("mode:", mode)
    print("spread:", spread)
    print("deviation:", deviation)
    return mean, median, mode
"""


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [
    "Repeat this code with the variable renamed from x to count:\n\n" + CODE,
    "Write a short story about a lighthouse keeper who finds a message in a bottle."])
def test_smollm2_greedy_output_is_the_same_with_drafts(smollm2_dir, prompt, monkeypatch):
    """The real model (int4 layers, Q8_0 head), a reply that quotes its prompt and free text."""
    from nibble.runner.loader import load
    model, tok = load(str(smollm2_dir))
    ids = tok.prompt(prompt)
    plain = list(greedy_ids(model, tok, ids, draft=0, n=160))
    passes = Passes(model)
    monkeypatch.setattr(model, "forward", passes)
    assert list(greedy_ids(model, tok, ids, draft=8, n=160)) == plain
    if prompt.startswith("Repeat"):
        assert passes.count < len(plain) / 2   # most of the quote came in drafts


def test_nibble_run_with_a_draft_model_says_the_same(tiny_dir, tmp_path):
    from tests.test_cli import assert_one_line_error, invoke
    from tests.tiny import tiny_coder_dir
    plain = invoke("run", "-m", tiny_dir, "--temp", "0", "-n", "12", "--no-draft", "Hello there")
    drafted = invoke("run", "-m", tiny_dir, "--temp", "0", "-n", "12", "--draft-model", tiny_dir, "Hello there")
    assert plain.exit_code == drafted.exit_code == 0 and plain.stdout == drafted.stdout != ""
    coder = write_model_dir(tiny_coder_dir(), tmp_path / "coder")
    assert_one_line_error(invoke("run", "-m", tiny_dir, "--draft-model", coder, "Hi"), 1, "has another vocabulary")
