"""The generation stack on the tiny model: the README's two calls, finish reasons, stop strings."""
import pytest

from nibble.runner.generate import StopStrings
from nibble.runner.sample import make_sampler
from nibble.runner.settings import SamplerSettings

GREEDY = make_sampler(SamplerSettings(temperature=0))


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
