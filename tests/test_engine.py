"""The serving engine on the tiny model: replies under load equal to each one's reply alone,
prefix reuse, cancel, Busy, drain, stops, logprobs."""
import json
import queue
import threading

import numpy as np
import pytest

from nibble.runner.generation.decoding import Request
from nibble.runner.generation.draft import DraftModel
from nibble.runner.generation.engine import Busy, Engine
from nibble.runner.generation.generate import stream_generate
from nibble.runner.loader import from_model_dir, load
from nibble.runner.model import ContextFull
from nibble.runner.kv.prompt_ids import PromptMemo
from nibble.runner.generation.sample import make_sampler
from nibble.runner.settings import SamplerSettings
from tests.tiny import tiny_model_dir

GREEDY = SamplerSettings(temperature=0)
QUESTIONS = ["The quick brown fox", "Numba compiles Python", "the capital of France", "the sky",
             "naïve café", "def f(x): return x**2", "jumps over the lazy dog", "A small model answers"]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model, tok = load(str(tiny_dir))
    tok.eos_ids = frozenset()   # the random model would stop at random: let max_tokens decide
    return model, tok


@pytest.fixture
def engine(tiny):
    e = Engine(*tiny, parallel=4, queue=8, ctx=256, prefill_chunk=8)
    e.start()
    yield e
    e.close()


class Collector:
    """A request's events, gathered from the engine thread; `on_first(collector)`, if given, runs
    there at its first event (to cancel or drain at a known point)."""

    def __init__(self, on_first=None):
        self.events = queue.Queue()
        self.done = threading.Event()
        self.on_first = on_first
        self.handle = None

    def __call__(self, event):
        if self.events.empty() and self.on_first:
            self.on_first(self)
        self.events.put(event)
        if event.finish_reason:
            self.done.set()

    def all(self):
        assert self.done.wait(60)
        return list(self.events.queue)

    def text(self):
        return "".join(e.text for e in self.all())

    def last(self):
        return self.all()[-1]


def submit(engine, prompt_ids, max_tokens=12, on_first=None, settings=GREEDY, **kw):
    c = Collector(on_first)
    c.handle = engine.submit(Request(list(prompt_ids), settings, max_tokens, **kw), c)
    return c


def alone(tiny, prompt_ids, max_tokens=12, settings=GREEDY, stop=()):
    """The reply stream_generate gives the prompt by itself (its prompt cut into the same chunks)."""
    return "".join(r.text for r in stream_generate(*tiny, prompt_ids, sampler=make_sampler(settings, tiny[1]),
                                                    max_tokens=max_tokens, stop=stop, prefill_chunk=8,
                                                    cache=tiny[0].new_cache(256)))


def prompts(tok):
    return [tok.chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_eight_requests_four_at_a_time_each_get_their_reply_alone(tiny, engine):
    ids = prompts(tiny[1])
    collectors = [submit(engine, p, max_tokens=10 + i) for i, p in enumerate(ids)]
    for i, (p, c) in enumerate(zip(ids, collectors)):
        assert c.text() == alone(tiny, p, max_tokens=10 + i)
        last = c.last()
        assert last.finish_reason == "length"
        assert last.usage.prompt_tokens == len(p) and last.usage.completion_tokens == 10 + i
    assert engine.running == engine.waiting == 0


def test_seeded_sampling_per_request_reproduces_alone(tiny, engine):
    settings = SamplerSettings(temperature=1.0, seed=7)
    ids = prompts(tiny[1])[:3]
    collectors = [submit(engine, p, settings=settings) for p in ids]
    for p, c in zip(ids, collectors):
        assert c.text() == alone(tiny, p, settings=settings)


def test_dry_per_request_reproduces_alone(tiny, engine):
    dry = SamplerSettings(temperature=0, dry_multiplier=0.8)
    ids = prompts(tiny[1])[:3]
    collectors = [submit(engine, p, max_tokens=40, settings=dry) for p in ids]
    for p, c in zip(ids, collectors):
        assert c.text() == alone(tiny, p, max_tokens=40, settings=dry)
    assert [alone(tiny, p, max_tokens=40, settings=dry) for p in ids] != \
        [alone(tiny, p, max_tokens=40) for p in ids]   # the greedy random model repeats itself


def test_a_second_request_with_the_same_prefix_prefills_only_its_tail(tiny, engine):
    tok = tiny[1]
    system = {"role": "system", "content": "The quick brown fox jumps over the lazy dog. " * 3}
    first = tok.chat([system, {"role": "user", "content": "the sky"}])
    second = tok.chat([system, {"role": "user", "content": "the sea"}])
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert submit(engine, first).last().usage.cached_tokens == 0
    reply = submit(engine, second)
    assert reply.last().usage.cached_tokens == common // 16 * 16 > 0


def test_a_follow_up_turn_reuses_the_prompt_and_the_sampled_reply(tiny, engine):
    """The server's way: the memo remembers the reply's sampled ids, which the next prompt's text
    starts with, and the pool still holds them (BPE may tokenize the reply's text otherwise)."""
    tok = tiny[1]
    memo = PromptMemo(tok)
    conv = [{"role": "user", "content": "the sky"}]
    text = tok.chat_template.render(conv)
    ids = memo.encode(text)
    first = submit(engine, ids, max_tokens=20, settings=SamplerSettings(temperature=1.5, seed=3))
    reply, sampled = first.text(), [t for e in first.all() for t in e.tokens]
    assert len(sampled) == 20 and tok.decode(sampled) == reply
    memo.remember(text + reply, ids + sampled)
    follow = memo.encode(tok.chat_template.render(conv + [{"role": "assistant", "content": reply},
                                                          {"role": "user", "content": "more"}]))
    assert follow[:len(ids) + 20] == ids + sampled
    # all that ran: the prompt and the reply but its last token, in full blocks and a partial one
    assert submit(engine, follow).last().usage.cached_tokens == len(ids) + 19


def test_cancel_frees_the_blocks_at_the_next_step(tiny, engine):
    c = submit(engine, prompts(tiny[1])[0], max_tokens=200, on_first=lambda c: engine.cancel(c.handle))
    submit(engine, prompts(tiny[1])[1], max_tokens=2).all()   # a step after the cancel
    assert engine.running == 0 and sum(engine.pool.refs) == 0
    assert not c.done.is_set() and c.events.qsize() == 1   # nothing after the one it was cancelled at


def test_busy_past_parallel_and_queue(tiny):
    e = Engine(*tiny, parallel=1, queue=1, ctx=256)   # not started: nothing leaves the queue
    p = prompts(tiny[1])[0]
    e.submit(Request(p, GREEDY, 4), lambda ev: None)
    e.submit(Request(p, GREEDY, 4), lambda ev: None)
    with pytest.raises(Busy, match="1 requests are running and 1 waiting"):
        e.submit(Request(p, GREEDY, 4), lambda ev: None)
    e.start()
    e.close()


@pytest.mark.parametrize("where", ["admission", "step"])
def test_a_fault_in_the_engine_ends_its_replies_and_the_engine_goes_on(engine, tiny, where):
    """Not a reply's own error (NaN logits, a grammar's dead end: the step ends those) but the
    engine's, admitting the request or running a step: the replies it touched end with the
    error, and the next request is served."""
    ids = tiny[1].encode("The quick brown fox")
    reserve, faults = engine.pool.reserve, [RuntimeError("a fault")]

    def faulty(cache, positions):   # admission reserves no positions, a step those it runs
        if faults and (positions == 0) == (where == "admission"):
            raise faults.pop()
        return reserve(cache, positions)
    engine.pool.reserve = faulty
    last = submit(engine, ids).last()
    assert (last.finish_reason, last.error) == ("error", "RuntimeError: a fault") and engine.running == 0
    assert submit(engine, ids).text() == alone(tiny, ids)


def test_drain_ends_running_and_waiting_replies_with_stop(tiny):
    e = Engine(*tiny, parallel=1, queue=4, ctx=256)
    p = prompts(tiny[1])[0]
    first, second = Collector(on_first=lambda c: e.drain()), Collector()
    e.submit(Request(p, GREEDY, 200), first)
    e.submit(Request(p, GREEDY, 200), second)
    e.start()
    assert first.last().finish_reason == second.last().finish_reason == "stop"
    assert first.last().usage.completion_tokens < 200
    assert alone(tiny, p, max_tokens=200).startswith(first.text())
    assert second.last().usage.completion_tokens == 0
    with pytest.raises(Busy, match="shutting down"):
        e.submit(Request(p, GREEDY, 4), lambda ev: None)
    e.close()


def test_stop_strings_per_sequence(tiny, engine):
    ids = prompts(tiny[1])[:2]
    whole = alone(tiny, ids[0], max_tokens=30)
    stop = whole[5:8]
    cut, other = submit(engine, ids[0], 30, stop=(stop,)), submit(engine, ids[1], 30)
    assert cut.text() == alone(tiny, ids[0], max_tokens=30, stop=(stop,)) == whole[:whole.index(stop)]
    assert cut.last().finish_reason == "stop"
    assert other.text() == alone(tiny, ids[1], max_tokens=30)


def test_logprobs_are_the_log_softmax_of_the_raw_logits(tiny, engine):
    model, tok = tiny
    p = prompts(tok)[0]
    events = submit(engine, p, max_tokens=3, logprobs=2).all()
    lps = [lp for e in events for lp in e.logprobs]
    assert len(lps) == 3
    logits = model.forward(p, model.new_cache(256))[0].astype(np.float64)
    expect = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    first = lps[0]
    assert first.token == int(np.argmax(logits)) and first.logprob == pytest.approx(expect[first.token])
    assert [t for t, _, _ in first.top] == list(np.argsort(-expect)[:2])
    assert first.text == tok.decode([first.token])


def test_a_prompt_past_the_context_is_refused_naming_both_numbers(tiny, engine):
    with pytest.raises(ContextFull, match="the prompt is 300 tokens and the context holds 256"):
        engine.submit(Request([5] * 300, GREEDY, 4), lambda ev: None)


def test_a_reply_ends_at_the_context(tiny):
    e = Engine(*tiny, parallel=2, ctx=48)
    e.start()
    p = prompts(tiny[1])[0]
    c = Collector()
    e.submit(Request(p, GREEDY, 500), c)
    last = c.last()
    e.close()
    assert last.finish_reason == "length" and last.usage.completion_tokens == 48 - len(p) + 1


def test_a_grammar_per_sequence(tiny, engine):
    """One reply under a JSON schema beside one without: the constrained one is the reply
    stream_generate gives under the same grammar, parses, and ends "stop" where the JSON ends."""
    from nibble.runner.text.grammar import Grammar
    model, tok = tiny
    grammar = Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                                   "required": ["n"], "additionalProperties": False})
    ids = prompts(tok)[:2]
    shaped = submit(engine, ids[0], 60, constraint=grammar.constraint(tok))
    free = submit(engine, ids[1], 30)
    expected = "".join(r.text for r in stream_generate(model, tok, ids[0], sampler=make_sampler(GREEDY),
                                                         max_tokens=60, prefill_chunk=8,
                                                         constraint=grammar.constraint(tok)))
    assert shaped.text() == expected and isinstance(json.loads(expected)["n"], int)
    assert shaped.last().finish_reason == "stop"
    assert free.text() == alone(tiny, ids[1], max_tokens=30)


@pytest.mark.parametrize("settings", [GREEDY, SamplerSettings(temperature=0.8, seed=3)])
def test_a_reply_decoding_alone_checks_drafts_and_says_the_same(tiny, engine, settings, monkeypatch):
    """As generate_step does: greedy, the same ids as one pass a token, in fewer passes; sampled
    (the rejection rule draws as often as it judges a guess, so the ids differ), a whole reply."""
    model, tok = tiny
    ids = tok.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")
    plain = submit(engine, ids, 60, settings=settings).all()
    passes = []
    real = model.forward_batch
    monkeypatch.setattr(model, "forward_batch", lambda *a: passes.append(len(a[0])) or real(*a))
    drafted = submit(engine, ids, 60, settings=settings, draft=8).all()
    tokens = lambda events: [t for e in events for t in e.tokens]
    assert len(tokens(drafted)) == 60 and drafted[-1].finish_reason == "length"
    if settings is GREEDY:
        assert tokens(drafted) == tokens(plain) and "".join(e.text for e in drafted) == "".join(e.text for e in plain)
        prefill = -(-len(ids) // 8)   # its chunks' passes: the last gives the first token
        assert len(passes) < prefill + 59   # drafts were checked and accepted


def test_a_draft_models_guesses_are_checked_as_lookups_are(tiny, engine, monkeypatch):
    """With a draft model (the tiny model itself: its guesses are the reply), the same greedy ids
    in fewer passes of the model, as nibble serve --draft-model runs them."""
    model, tok = tiny
    ids = tok.encode("Once upon a time, in a small town by the sea,")
    plain = submit(engine, ids, 40).all()
    drafting = Engine(model, tok, parallel=1, ctx=256, prefill_chunk=8, draft_model=DraftModel(
        from_model_dir(tiny_model_dir())[0], 256))
    drafting.start()
    passes, real = [], model.forward_batch
    monkeypatch.setattr(model, "forward_batch", lambda *a: passes.append(len(a[0])) or real(*a))
    try:
        drafted = submit(drafting, ids, 40, draft=8).all()
    finally:
        drafting.close()
    tokens = lambda events: [t for e in events for t in e.tokens]
    assert tokens(drafted) == tokens(plain) and len(tokens(plain)) == 40
    assert len(passes) < -(-len(ids) // 8) + 39 and max(passes) > 1   # passes that checked guesses


def test_drafts_stay_inside_the_context_and_the_cache_holds_what_ran(tiny):
    model, tok = tiny
    ids = tok.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")
    e = Engine(model, tok, parallel=1, ctx=len(ids) + 21, prefill_chunk=8)
    e.start()
    try:
        out = submit(e, ids, 100, draft=8).all()
        assert sum(len(ev.tokens) for ev in out) == 22 and out[-1].finish_reason == "length"
        again = ids + [t for ev in out for t in ev.tokens][:-2]   # the reply's own ids: in the pool
        assert submit(e, again, 1).all()[-1].usage.cached_tokens == (len(again) - 1) // 16 * 16
    finally:
        e.close()
