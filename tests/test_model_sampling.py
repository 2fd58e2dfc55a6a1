"""A model's sampling defaults: read from its generation_config.json, and used where no one says otherwise."""
from dataclasses import replace

import pytest

from nibble.runner.generation.generate import stream_generate
from nibble.runner.loader import from_model_dir, load
from nibble.runner.generation.sample import make_sampler
from nibble.runner.generation.session import ChatSession
from nibble.runner.settings import SamplerSettings, model_sampling
from tests.tiny import tiny_model_dir


@pytest.mark.parametrize("generation_config, want", [
    ({"eos_token_id": 2}, SamplerSettings()),
    # Llama 3 Instruct's and Qwen2.5 Instruct's files
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9},
     SamplerSettings(temperature=0.6, top_p=0.9)),
    ({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
     SamplerSettings(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)),
    # without do_sample, what the file sets is meant all the same
    ({"temperature": 0.2, "min_p": 0.1}, SamplerSettings(temperature=0.2, min_p=0.1)),
    # do_sample false: greedy, as transformers reads it; its repetition penalty still applies
    ({"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.1},
     SamplerSettings(temperature=0, repetition_penalty=1.1)),
    # null is unset; a whole float is a whole number; 0 turns a filter off, as in nibble
    ({"min_p": None, "top_k": 20.0, "top_p": 1}, SamplerSettings(top_k=20, top_p=1.0)),
    ({"temperature": 0, "top_k": 0}, SamplerSettings(temperature=0, top_k=0)),
    # DRY's fields and OpenAI's penalties, which nibble writes for an alias
    ({"dry_multiplier": 0.8, "dry_allowed_length": 3.0, "dry_penalty_last_n": -1},
     SamplerSettings(dry_multiplier=0.8, dry_allowed_length=3, dry_penalty_last_n=-1)),
    ({"presence_penalty": 1.5, "frequency_penalty": 0.5}, SamplerSettings(presence_penalty=1.5, frequency_penalty=0.5)),
])
def test_the_fields_the_file_sets_over_nibble_s_defaults(generation_config, want):
    got, note = model_sampling(generation_config)
    assert got == want and note == ""
    assert type(got.top_k) is int and type(got.temperature) is float


def test_values_nibble_cannot_use_are_ignored_and_named():
    got, note = model_sampling({"do_sample": True, "temperature": -1, "top_k": "40", "top_p": 2,
                                "min_p": True, "repetition_penalty": 1.2})
    assert got == SamplerSettings(repetition_penalty=1.2)   # the rest: nibble's defaults
    assert "\n" not in note and note.startswith("ignored in the model's generation_config.json")
    for part in ["temperature must be 0 (greedy) or positive, got -1", "top_k '40' is not a whole number",
                 "top_p must be in (0, 1] (1 is off), got 2", "min_p True is not a number"]:
        assert part in note
    assert "repetition_penalty" not in note
    assert model_sampling({"top_k": 2.5})[1].endswith("top_k 2.5 is not a whole number")
    assert model_sampling({"dry_allowed_length": 2.5})[1].endswith("dry_allowed_length 2.5 is not a whole number")
    assert model_sampling({"dry_multiplier": -1})[1].endswith("dry_multiplier must be 0 (off) or positive, got -1")


def test_load_gives_the_tokenizer_the_model_s_defaults(sampled_dir, tiny_dir):
    _, tokenizer = load(str(sampled_dir))
    assert tokenizer.sampling == SamplerSettings(temperature=0.3, top_k=5, top_p=0.7)
    assert tokenizer.sampling_note == ""
    assert load(str(tiny_dir))[1].sampling == SamplerSettings()


def test_generation_without_a_sampler_uses_the_model_s_defaults():
    """A model whose file says greedy answers as argmax does, in stream_generate and in a chat session."""
    model, tokenizer = from_model_dir(replace(tiny_model_dir(), generation_config={"eos_token_id": 2,
                                                                                   "do_sample": False}))
    ids = tokenizer.prompt("The quick brown fox")
    argmax = make_sampler(SamplerSettings(temperature=0))

    def text(**kwargs):
        return "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=16, **kwargs))
    assert text() == text(sampler=argmax) != ""
    messages = [{"role": "user", "content": "The quick brown fox"}]
    replies = [ChatSession(model, tokenizer, ctx=128).reply(messages, settings, max_tokens=16)
               for settings in (None, SamplerSettings(temperature=0))]
    assert "".join(c.text for c in replies[0]) == "".join(c.text for c in replies[1]) != ""
