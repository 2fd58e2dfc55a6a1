"""Samplers: each filter against a direct numpy computation, seeding, validation and speed."""

import numpy as np
import pytest

from nibble.formats.errors import NibbleError
from nibble.runner.sample import (apply_presence_frequency_penalty, apply_repetition_penalty, draw, make_sampler,
                                  top_k, top_p_min_p)
from nibble.runner.settings import SamplerSettings

VOCAB = 49_152  # SmolLM2's vocabulary


def random_logits(seed=0, n=VOCAB):
    return (np.random.default_rng(seed).standard_normal(n) * 3).astype(np.float32)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature_zero_is_argmax():
    logits = random_logits()
    sample = make_sampler(SamplerSettings(temperature=0.0))
    assert sample(logits, []) == int(np.argmax(logits))


def test_greedy_sees_the_repetition_penalty():
    logits = np.array([1.0, 3.0, 2.5], dtype=np.float32)
    sample = make_sampler(SamplerSettings(temperature=0.0, repetition_penalty=1.5))
    assert sample(logits, [1]) == 2     # 3.0 / 1.5 = 2.0 < 2.5
    assert sample(logits, [0]) == 1
    assert logits[1] == 3.0             # the caller's logits are untouched


def test_repetition_penalty_rule():
    logits = np.array([2.0, -2.0, 0.0, 4.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 2, 0, 1], 2.0)
    np.testing.assert_array_equal(out, [1.0, -4.0, 0.0, 4.0])  # once per distinct id
    np.testing.assert_array_equal(logits, [2.0, -2.0, 0.0, 4.0])


def test_repeat_last_n_limits_the_window():
    logits = np.array([5.0, 4.0], dtype=np.float32)
    sample = make_sampler(SamplerSettings(temperature=0.0, repetition_penalty=10.0, repeat_last_n=1))
    assert sample(logits, [0, 1]) == 0  # id 0 is outside the last 1 id, so not penalised
    assert sample(logits, [1, 0]) == 1


def reference_presence_frequency(logits, reply_ids, presence, frequency):
    """OpenAI's definition, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.astype(np.float64)
    for j in range(len(out)):
        c = reply_ids.count(j)
        out[j] -= c * frequency + (c > 0) * presence
    return out


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.4), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_match_openais_rule(presence, frequency):
    logits = random_logits(2, 500)
    reply = list(np.random.default_rng(3).integers(0, 40, 60))
    from collections import Counter
    out = apply_presence_frequency_penalty(logits, Counter(reply), presence, frequency)
    np.testing.assert_allclose(out, reference_presence_frequency(logits, reply, presence, frequency), rtol=1e-6)
    assert out.dtype == np.float32 and not np.shares_memory(out, logits)


def test_the_sampler_penalises_the_tokens_it_drew_not_the_prompts():
    logits = np.array([3.0, 2.5, 0.0], dtype=np.float32)
    sample = make_sampler(SamplerSettings(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.25))
    prompt = [1, 1, 1]   # the sequence so far: not the reply, so not penalised
    assert [sample(logits, prompt) for _ in range(4)] == [0, 1, 0, 0]
    # 3.0 vs 2.5; 3.0 - 1.25 vs 2.5; 1.75 vs 2.5 - 1.25; 3.0 - 1.5 vs 1.25


def test_a_negative_presence_penalty_favours_repeats():
    logits = np.array([1.0, 1.2], dtype=np.float32)
    sample = make_sampler(SamplerSettings(temperature=0.0, presence_penalty=-0.5))
    assert [sample(logits) for _ in range(3)] == [1, 1, 1]
    assert make_sampler(SamplerSettings(temperature=0.0))(logits) == 1


def test_top_k_keeps_the_k_largest():
    logits = random_logits()
    ids, kept = top_k(logits, 40)
    assert set(ids) == set(np.argsort(-logits)[:40])
    np.testing.assert_array_equal(kept, logits[ids])
    np.testing.assert_array_equal(top_k(logits, 0)[0], np.arange(VOCAB))


def reference_top_p_min_p(logits, top_p, min_p):
    """llama.cpp's order, written plainly: full sort, top-p, then min-p."""
    order = np.argsort(-logits)
    p = softmax(logits.astype(np.float64))[order]
    n = int(np.searchsorted(np.cumsum(p), top_p)) + 1
    order, p = order[:n], p[:n]
    return order[p >= min_p * p[0]]


# A flat distribution needs the full sort; a peaked one is settled by nucleus()'s short guess.
@pytest.mark.parametrize("scale", [0.5, 3.0])
@pytest.mark.parametrize("top_p,min_p", [(0.95, 0.05), (0.5, 0.0), (1.0, 0.1), (0.9, 0.3), (0.3, 0.5)])
def test_top_p_min_p_matches_the_plain_chain(top_p, min_p, scale):
    logits = random_logits(1, 5000) * scale
    ids, kept = top_p_min_p(np.arange(5000), logits, top_p, min_p)
    assert sorted(ids) == sorted(reference_top_p_min_p(logits, top_p, min_p))
    np.testing.assert_array_equal(kept, logits[ids])


def test_top_p_always_keeps_one():
    logits = np.array([10.0, 0.0, 0.0], dtype=np.float32)
    ids, _ = top_p_min_p(np.arange(3), logits, 0.01, 0.0)
    assert list(ids) == [0]


def test_draw_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2, 0.0], dtype=np.float32) + 1e-30)
    rng = np.random.default_rng(0)
    counts = np.bincount([draw(logits, rng) for _ in range(20_000)], minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), [0.5, 0.3, 0.2, 0.0], atol=0.015)


def test_temperature_reshapes_only_the_kept_tokens():
    logits = np.array([2.0, 1.0, -5.0], dtype=np.float32)
    sample = make_sampler(SamplerSettings(temperature=100.0, top_k=2, top_p=1.0, min_p=0.0, seed=0))
    draws = [sample(logits, []) for _ in range(2000)]
    assert set(draws) == {0, 1}  # flattened to near-uniform, but token 2 stays cut
    assert abs(draws.count(0) / 2000 - 0.5) < 0.05


def test_seeded_runs_reproduce():
    logits = [random_logits(i) for i in range(50)]
    settings = SamplerSettings(temperature=1.0, seed=1234)
    a, b = make_sampler(settings), make_sampler(settings)
    assert [a(x, []) for x in logits] == [b(x, []) for x in logits]
    c = make_sampler(SamplerSettings(temperature=1.0, seed=4321))
    assert [a(x, []) for x in logits] != [c(x, []) for x in logits]


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1), dict(top_p=0.0),
    dict(top_p=1.5), dict(min_p=-0.1), dict(min_p=1.1), dict(repetition_penalty=0.0),
    dict(repeat_last_n=-1), dict(seed=-3), dict(presence_penalty=2.5), dict(frequency_penalty=-2.1),
    dict(presence_penalty=float("nan")),
])
def test_bad_settings_raise_nibble_error(bad):
    with pytest.raises(NibbleError, match="Bad sampler setting"):
        SamplerSettings(**bad)
