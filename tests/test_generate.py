"""The generation stack on the tiny model: the README's two calls, finish reasons, stop strings."""
import pytest

from nibble.runner.generation.decoding import Reply, StopStrings
from nibble.runner.generation.sample import make_sampler
from nibble.runner.settings import SamplerSettings
from nibble.runner.text.tokenizer import Tokenizer
from tests.tiny import tiny_model_dir

GREEDY = make_sampler(SamplerSettings(temperature=0))


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(tiny_model_dir())


def added(reply, ids):
    """The text a Reply emits for `ids`, up to where it ends."""
    out = ""
    for i in ids:
        out += reply.add(i)
        if reply.finish_reason:
            break
    return out


def test_readme_two_calls(tiny_dir):
    from nibble.runner import load, stream_generate
    model, tokenizer = load(str(tiny_dir))
    responses = list(stream_generate(model, tokenizer, tokenizer.prompt("Hi"), sampler=GREEDY, max_tokens=5))
    assert responses[-1].finish_reason in ("stop", "length")
    assert all(r.finish_reason is None for r in responses[:-1])
    assert responses[-1].generation_tokens <= 5 and responses[-1].prompt_tokens > 0


def test_length_and_context_limits(tiny_dir):
    from nibble.runner import load, stream_generate
    model, tok = load(str(tiny_dir))
    tok.eos_ids = frozenset()   # never stop early: the limits decide
    ids = tok.encode("The quick brown fox")
    last = list(stream_generate(model, tok, ids, sampler=GREEDY, max_tokens=7))[-1]
    assert (last.finish_reason, last.generation_tokens) == ("length", 7)
    cache = model.new_cache(len(ids) + 3)
    last = list(stream_generate(model, tok, ids, sampler=GREEDY, max_tokens=100, cache=cache))[-1]
    assert last.finish_reason == "context" and last.generation_tokens == 4   # 3 run + 1 sampled


LONG = "The quick brown fox jumps over the lazy dog. " * 3


def test_a_long_prompt_is_prefilled_in_chunks(tiny_dir, monkeypatch):
    from nibble.runner import load, stream_generate
    model, tok = load(str(tiny_dir))
    tok.eos_ids = frozenset()
    ids = tok.encode(LONG)
    whole = "".join(r.text for r in stream_generate(model, tok, ids, sampler=GREEDY, max_tokens=3))
    sizes = []   # tokens per forward pass
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda tokens, cache, **kw: sizes.append(len(tokens)) or forward(tokens, cache, **kw))
    responses = list(stream_generate(model, tok, ids, sampler=GREEDY, max_tokens=3, prefill_chunk=8, draft=0))
    full, rest = divmod(len(ids) - 1, 8)   # the last chunk holds 1 to 8 tokens
    assert full >= 2 and sizes == [8] * full + [rest + 1] + [1, 1]   # then one pass per token that ran
    prefilling = responses[:full]
    assert all((r.text, r.token, r.generation_tokens, r.ttft) == ("", None, 0, 0.0) for r in prefilling)
    assert "".join(r.text for r in responses) == whole
    assert responses[-1].finish_reason == "length" and responses[-1].prompt_tokens == len(ids)


def test_stopping_during_the_prefill_leaves_whole_chunks_in_the_cache(tiny_dir):
    from nibble.runner import load, stream_generate
    model, tok = load(str(tiny_dir))
    cache = model.new_cache(256)
    responses = stream_generate(model, tok, tok.encode(LONG), sampler=GREEDY, cache=cache, prefill_chunk=8)
    first = next(responses)
    responses.close()
    assert (first.text, first.token, first.finish_reason) == ("", None, None)
    assert cache.pos == 8


@pytest.mark.parametrize("pieces,stops,want", [
    (["Hello ", "wor", "ld! Bye"], ["world"], "Hello "),
    (["ab", "c", "d"], ["cx"], "abcd"),                  # a false start is released
    (["x<|", "end|>", "tail"], ["<|end|>"], "x"),
    (["one two"], [], "one two"),
])
def test_stop_strings(pieces, stops, want):
    s, out = StopStrings(stops), ""
    for p in pieces:
        text, stopped = s.feed(p)
        out += text
        if stopped:
            break
    else:
        out += s.flush()
    assert out == want


def test_reply_ends_at_eos_with_everything_flushed(tok):
    ids = tok.encode("naïve café 😀")
    reply = Reply(tok, max_tokens=100)
    assert added(reply, ids + [2, 5]) == tok.decode(ids)   # the eos (2) shows nothing; 5 never comes
    assert (reply.finish_reason, reply.tokens, reply.close("context")) == ("stop", len(ids) + 1, "")


def test_reply_cut_at_a_stop_string(tok):
    reply = Reply(tok, max_tokens=100, stop=["fox"])
    assert added(reply, tok.encode("The quick brown fox jumps")) == "The quick brown "
    assert (reply.finish_reason, reply.close("context")) == ("stop", "")
    with pytest.raises(ValueError, match="ended"):
        reply.add(5)


def test_reply_cut_at_max_tokens_flushes_what_it_held(tok):
    ids = tok.encode("The quick brown fox")
    reply = Reply(tok, max_tokens=len(ids), stop=["fox!"])   # "fox" is held back as a possible stop
    assert added(reply, ids) == "The quick brown fox"
    assert (reply.finish_reason, reply.tokens) == ("length", len(ids))


def test_reply_closed_from_outside(tok):
    reply = Reply(tok, max_tokens=100, stop=["dog!"])
    text = added(reply, tok.encode("the lazy dog"))
    assert reply.finish_reason is None and text + reply.close("context") == "the lazy dog"
    assert reply.finish_reason == "context"


def test_reply_keeps_special_tokens_when_asked(tok):
    ids = [1] + tok.encode("tool")   # <|im_start|>tool
    assert added(Reply(tok, 100), ids) == "tool"
    assert added(Reply(tok, 100, skip_special=False), ids) == "<|im_start|>tool"
