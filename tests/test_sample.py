"""Samplers: each filter against a direct numpy computation, seeding, validation and speed."""

import numpy as np
import pytest

from nibble.formats.errors import NibbleError
from nibble.runner.generation.sample import (apply_dry_penalty, apply_presence_frequency_penalty, apply_repetition_penalty,
                                  draw, make_sampler, top_k, top_p_min_p)
from nibble.runner.settings import SamplerSettings
from nibble.runner.text.tokenizer import Tokenizer
from tests.tiny import tiny_model_dir

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


def reference_dry(logits, seq, breakers, multiplier, base, allowed_length):
    """DRY as llama.cpp's koboldcpp port defines it, written plainly: for each earlier position, how
    far the tokens ending there match those ending the sequence (not past the last breaker); the
    token after it would extend that repeat."""
    n = len(seq)
    out = logits.astype(np.float64)
    if n <= allowed_length:
        return out
    limit = n
    for back in range(n):   # the last breaker, counted from the end
        if seq[n - 1 - back] in breakers:
            limit = back
            break
    if limit < allowed_length:
        return out
    longest = {}
    for end in range(n - 1):
        length = 0
        while length < limit and end - length >= 0 and seq[end - length] == seq[n - 1 - length]:
            length += 1
        if length >= allowed_length:
            token = seq[end + 1]
            longest[token] = max(longest.get(token, 0), length)
    most = int(88.7228391 / np.log(base)) if base > 1.000001 else None   # llama.cpp's clamp
    for token, length in longest.items():
        if token not in breakers:
            out[token] -= multiplier * base ** (length - allowed_length if most is None
                                                else min(length - allowed_length, most))
    return out


def breaker_mask(ids, vocab=8):
    mask = np.zeros(vocab, dtype=bool)
    mask[list(ids)] = True
    return mask


def random_sequence(rng, n, alphabet):
    """Random ids from a small alphabet with earlier stretches copied in: repeats of every length."""
    seq = list(rng.integers(0, alphabet, n))
    for _ in range(n // 8):
        a, b = sorted(rng.integers(0, n, 2))
        at = int(rng.integers(0, n))
        seq[at:at + (b - a)] = seq[a:b]
    return [int(t) for t in seq[:n]]


@pytest.mark.parametrize("seed", range(40))
def test_dry_matches_the_plain_rule(seed):
    rng = np.random.default_rng(seed)
    n, alphabet = int(rng.integers(0, 300)), int(rng.integers(2, 8))
    seq = random_sequence(rng, n, alphabet)
    breakers = set(rng.choice(8, int(rng.integers(0, 3)), replace=False).tolist()) if seed % 4 else set()
    allowed, base = int(rng.integers(0, 5)), float(rng.choice([1.0, 1.1, 1.75, 3.0]))
    logits = random_logits(seed, 8)
    out = apply_dry_penalty(logits, seq, breaker_mask(breakers) if breakers else None, 0.8, base, allowed)
    np.testing.assert_allclose(out, reference_dry(logits, seq, breakers, 0.8, base, allowed), rtol=1e-5)
    assert out.dtype == np.float32


def test_dry_runs_of_one_token_and_huge_exponents():
    seq = [3] * 500   # the repeat overlaps itself; 1.75 ** 498 would overflow float32 unclamped
    logits = random_logits(0, 8)
    out = apply_dry_penalty(logits, seq, None, 1.0, 1.75, 2)
    np.testing.assert_allclose(out, reference_dry(logits, seq, set(), 1.0, 1.75, 2), rtol=1e-5)
    assert np.isfinite(out[3]) and out[3] < -1e30


# llama.cpp's own cases (tests/test-sampling.cpp, test_dry): probabilities before and after DRY,
# with multiplier, base, allowed length, last n and the breakers.
@pytest.mark.parametrize("probs,seq,expected,multiplier,base,allowed,last_n,breakers", [
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, ()),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, ()),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, (3,)),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, ()),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, ()),
])
def test_dry_agrees_with_llama_cpps_tests(probs, seq, expected, multiplier, base, allowed, last_n, breakers):
    settings = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, dry_multiplier=multiplier,
                               dry_base=base, dry_allowed_length=allowed, dry_penalty_last_n=last_n)
    sampler = make_sampler(settings)
    sampler.breakers = breaker_mask(breakers, len(probs)) if breakers else None
    ids, cand = sampler.candidates(np.log(np.array(probs, dtype=np.float32)), seq)
    p = np.zeros(len(probs))
    p[ids] = softmax(cand.astype(np.float64))
    np.testing.assert_allclose(p, expected, atol=1e-5)


def dry_penalty(seq, allowed=2, breakers=(), multiplier=1.0, base=2.0):
    """How much DRY takes from each of 8 ids' logits after `seq`."""
    logits = np.zeros(8, dtype=np.float32)
    return -apply_dry_penalty(logits, seq, breaker_mask(breakers) if breakers else None, multiplier, base, allowed)


def test_dry_spares_repeats_shorter_than_the_allowed_length():
    np.testing.assert_array_equal(dry_penalty([5, 6, 1, 2, 5], allowed=2), 0)   # "5" again: 1 token
    np.testing.assert_array_equal(dry_penalty([5, 6, 1, 2, 5, 6], allowed=3), 0)
    assert dry_penalty([5, 6, 1, 2, 5, 6], allowed=2)[1] == 1.0   # "5 6" again: 1 would make it 3


def test_dry_penalty_grows_with_the_repeat():
    cycle = [1, 2, 3, 4, 5]
    seen = [dry_penalty(cycle + cycle[:k])[cycle[k]] for k in range(1, 5)]
    assert seen == [0.0, 1.0, 2.0, 4.0]   # multiplier * base ** (length - allowed)
    # the longest repeat an id would extend sets its penalty, not the first found
    assert dry_penalty([1, 2, 7, 0, 1, 2, 3, 4, 9, 0, 1, 2, 3])[4] == 4.0


def test_dry_breakers_reset_the_repeat():
    seq = [1, 2, 3, 4, 1, 2, 3]
    assert dry_penalty(seq)[4] == 2.0
    assert dry_penalty(seq, breakers=[0])[4] == 2.0               # no breaker in the sequence
    np.testing.assert_array_equal(dry_penalty(seq, breakers=[2]), 0)   # only "3" since the break
    assert dry_penalty([1, 2, 3, 4, 7, 1, 2, 3], breakers=[7])[4] == 2.0   # the breaker is behind
    np.testing.assert_array_equal(dry_penalty([1, 2, 6, 4, 1, 2], breakers=[6]), 0)  # never itself


def test_dry_looks_at_the_last_n_ids_only():
    logits = np.array([0, 0, 0, 0, 0.5, 0, 0, 0], dtype=np.float32)
    seq = [1, 2, 3, 4, 5, 0, 0, 0, 1, 2, 3]
    settings = dict(temperature=0.0, dry_multiplier=1.0, dry_base=2.0)
    assert make_sampler(SamplerSettings(**settings))(logits, seq) == 0   # 4 loses 2.0
    assert make_sampler(SamplerSettings(**settings, dry_penalty_last_n=6))(logits, seq) == 4


def test_the_tokenizers_sequence_breakers_are_the_ids_whose_text_holds_one():
    tok = Tokenizer(tiny_model_dir())
    mask = tok.sequence_breakers
    pieces = [tok.tokenizer.decode([i], skip_special_tokens=False) for i in range(tok.tokenizer.get_vocab_size())]
    assert mask.shape == (max(tok.vocab_size, len(pieces)),)
    assert [i for i, p in enumerate(pieces) if any(b in p for b in "\n:\"*")] == list(np.flatnonzero(mask))
    assert mask[tok.encode("\n")].all() and not mask[tok.encode("fox")].any()
    assert make_sampler(SamplerSettings(dry_multiplier=0.8), tok).breakers is mask
    assert make_sampler(SamplerSettings(), tok).breakers is None   # DRY off: not built


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
    dict(presence_penalty=float("nan")), dict(dry_multiplier=-0.1), dict(dry_multiplier=float("inf")),
    dict(dry_base=0.9), dict(dry_allowed_length=-1), dict(dry_penalty_last_n=-2),
])
def test_bad_settings_raise_nibble_error(bad):
    with pytest.raises(NibbleError, match="Bad sampler setting"):
        SamplerSettings(**bad)
