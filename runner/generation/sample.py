"""Token samplers: small composed filters over (ids, logits) candidate pairs, as llama.cpp does.

The chain is llama.cpp's default: repetition penalty -> presence and frequency penalties -> DRY ->
top-k -> top-p -> min-p -> temperature -> draw. Truncation sees the untempered distribution, so
temperature only reshapes what is kept.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..settings import SamplerSettings

if TYPE_CHECKING:
    from ..text.tokenizer import Tokenizer

# How many top candidates nucleus() tries before falling back to sorting all of them.
NUCLEUS_GUESS = 256

# About log(float32's max): DRY's exponent is clamped below it, as llama.cpp does.
FLOAT_MAX_LOG = 88.7228391


class Sampler:
    """One reply's sampler: `sampler(logits, recent_ids) -> token id` draws the next token, and
    `sampler.accept(logits, recent_ids, proposed)` judges a draft's token (speculative decoding).

    It owns a `np.random.Generator`, so two samplers with the same seed, fed the same logits, draw
    the same tokens. It also counts the tokens it has drawn: those are the reply, which the
    presence and frequency penalties look at (OpenAI's rule), while the repetition penalty looks
    at `recent_ids` (the sequence, prompt included: llama.cpp's), as DRY does. So a reply needs a
    sampler of its own. `logits` [vocab] float32 is never modified. `breakers` [vocab] bool: the
    ids DRY's repeats stop at (Tokenizer.sequence_breakers); None: none.
    """

    def __init__(self, settings: SamplerSettings, breakers: np.ndarray | None = None):
        self.settings = settings
        self.breakers = breakers
        self.rng = np.random.default_rng(settings.seed)
        penalised = settings.presence_penalty or settings.frequency_penalty
        self.drawn = Counter() if penalised else None   # the reply so far
        self.greedy = settings.temperature == 0

    def __call__(self, logits: np.ndarray, recent_ids: Sequence[int] = ()) -> int:
        ids, cand = self.candidates(logits, recent_ids)
        return self._drawn(int(ids[0] if self.greedy else ids[draw(cand, self.rng)]))

    def accept(self, logits: np.ndarray, recent_ids: Sequence[int], proposed: int) -> int:
        """The next token where a draft proposes `proposed`, distributed exactly as __call__'s
        draw (the rejection rule of speculative sampling, for a draft that is one token for sure):
        `proposed` with its probability p, else a draw from the others renormalised. Greedy:
        the argmax, whatever was proposed."""
        ids, cand = self.candidates(logits, recent_ids)
        if self.greedy:
            return self._drawn(int(ids[0]))
        at = np.flatnonzero(ids == proposed)
        if len(at):
            if self.rng.random() < probabilities(cand, logsumexp(cand))[at[0]]:
                return self._drawn(proposed)
            cand = cand.copy()
            cand[at[0]] = -np.inf   # a draw without it: the rest of the mass, renormalised
        return self._drawn(int(ids[draw(cand, self.rng)]))

    def candidates(self, logits: np.ndarray, recent_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The ids left after the penalties and filters, and their logits over the temperature,
        whose softmax is the distribution drawn from; greedy: the argmax alone."""
        s = self.settings
        if s.repetition_penalty != 1.0 and s.repeat_last_n > 0:
            logits = apply_repetition_penalty(logits, recent_ids[-s.repeat_last_n:], s.repetition_penalty)
        if self.drawn:
            logits = apply_presence_frequency_penalty(logits, self.drawn, s.presence_penalty,
                                                      s.frequency_penalty)
        if s.dry_multiplier > 0 and s.dry_penalty_last_n != 0:
            recent = recent_ids[-s.dry_penalty_last_n:] if s.dry_penalty_last_n > 0 else recent_ids
            logits = apply_dry_penalty(logits, recent, self.breakers, s.dry_multiplier, s.dry_base,
                                       s.dry_allowed_length)
        if self.greedy:
            return np.array([np.argmax(logits)]), logits[:0]
        ids, cand = top_k(logits, s.top_k)
        ids, cand = top_p_min_p(ids, cand, s.top_p, s.min_p)
        return ids, cand / s.temperature

    def _drawn(self, token: int) -> int:
        if self.drawn is not None:
            self.drawn[token] += 1
        return token


def make_sampler(settings: SamplerSettings, tokenizer: Tokenizer | None = None) -> Sampler:
    """A Sampler for one reply, drawing as `settings` say; DRY's sequence breakers are the
    `tokenizer`'s (without one, no id breaks a repeat)."""
    dry = settings.dry_multiplier > 0 and tokenizer is not None
    return Sampler(settings, tokenizer.sequence_breakers if dry else None)


def apply_repetition_penalty(logits: np.ndarray, recent_ids: Sequence[int], penalty: float) -> np.ndarray:
    """A copy of `logits` with each distinct recent id made less likely (HF / llama.cpp rule).

    Positive logits are divided by the penalty and negative ones multiplied, so both move down.
    """
    if len(recent_ids) == 0:
        return logits
    ids = np.unique(np.asarray(recent_ids, dtype=np.int64))
    seen = logits[ids]
    out = logits.copy()
    out[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    return out


def apply_presence_frequency_penalty(logits: np.ndarray, counts: Mapping[int, int], presence: float,
                                     frequency: float) -> np.ndarray:
    """A copy of `logits` less `presence` for each id in `counts` and `frequency` times its count
    (OpenAI's rule, over the reply's own tokens)."""
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
    out = logits.copy()
    out[ids] -= np.float32(presence) + np.float32(frequency) * n
    return out


def apply_dry_penalty(logits: np.ndarray, recent_ids: Sequence[int], breakers: np.ndarray | None,
                      multiplier: float, base: float, allowed_length: int) -> np.ndarray:
    """A copy of `logits` with DRY's penalty (llama.cpp's rule): each id that would extend a repeat,
    n >= allowed_length tokens that end `recent_ids` and also stand earlier in it followed by that
    id, loses multiplier * base ** (n - allowed_length), n its longest such repeat. A repeat never
    reaches back past the last breaker id of `recent_ids`, and breakers themselves are never
    penalised. `breakers` [vocab] bool, or None for no breakers.
    """
    # llama.cpp clamps the exponent where base ** exponent would pass float32's max: repeats longer
    # than that are penalised alike, so none need be measured further.
    most = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else None
    longest = allowed_length + most if most is not None else None
    ids, n = dry_repeats(np.asarray(recent_ids, dtype=np.int64), breakers, allowed_length, longest)
    if len(ids) == 0:
        return logits
    out = logits.copy()
    out[ids] -= (multiplier * np.power(base, (n - allowed_length).astype(np.float64))).astype(np.float32)
    return out


def dry_repeats(seq: np.ndarray, breakers: np.ndarray | None, allowed_length: int,
                longest: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ids that would extend a repeat of the end of `seq` [n] of at least `allowed_length`
    tokens, and for each the longest such repeat (at most `longest`): (ids, lengths), ids distinct.

    The repeat ending at each earlier position e is the longest common suffix of seq[:e + 1] and
    seq, found for all positions at once in a few numpy passes: each pass extends the positions
    still matching by a block of tokens twice as long as the last, so the passes number about
    log2 of the longest repeat. (llama.cpp runs the Z-algorithm, one token at a time.)
    """
    none = np.zeros(0, np.int64)
    n = len(seq)
    if n <= allowed_length:
        return none, none
    # A repeat reaches back at most to the last breaker, exclusive.
    at = np.flatnonzero(breakers[seq]) if breakers is not None else none
    limit = n - 1 - int(at[-1]) if len(at) else n
    if limit < allowed_length:
        return none, none
    if longest is not None:
        limit = min(limit, longest)
    length = np.zeros(n - 1, np.int64)   # [n - 1] the repeat ending at each position but the last
    active = np.flatnonzero(seq[:-1] == seq[-1]) if limit else none   # repeats of one token or more
    length[active] = 1
    done, width = 1, 1
    while len(active) and done < limit:
        width = min(2 * width, limit - done)
        back = done + np.arange(width)                   # [width] steps back from either end
        here = active[:, None] - back                    # [active, width]
        same = (here >= 0) & (seq[np.maximum(here, 0)] == seq[n - 1 - back])
        whole = same.all(axis=1)
        length[active] = done + np.where(whole, width, same.argmin(axis=1))
        active = active[whole]
        done += width
    ends = np.flatnonzero(length >= allowed_length)
    ids, inverse = np.unique(seq[ends + 1], return_inverse=True)
    most = np.zeros(len(ids), np.int64)
    np.maximum.at(most, inverse, length[ends])
    if breakers is not None:
        keep = ~breakers[ids]
        ids, most = ids[keep], most[keep]
    return ids, most


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The candidates (ids, logits) with the `k` highest logits, unordered; every id when k is 0."""
    if k <= 0 or k >= logits.shape[0]:
        return np.arange(logits.shape[0]), logits
    # argpartition is O(vocab): a full sort of 49k logits costs ~15x more.
    ids = np.argpartition(logits, -k)[-k:]
    return ids, logits[ids]


def top_p_min_p(ids: np.ndarray, logits: np.ndarray, top_p: float,
                min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Nucleus then min-p filtering, in llama.cpp's order.

    Both filters keep a prefix of the candidates sorted by logit, so min-p can run first as a cheap
    threshold (p >= min_p * p_max is logit >= max + log(min_p)) and shrink what top-p sorts;
    top-p still normalises over every candidate, exactly as if it had run first.
    """
    if top_p < 1.0:
        log_z = logsumexp(logits)
    if min_p > 0.0:
        keep = np.flatnonzero(logits >= logits.max() + math.log(min_p))
        ids, logits = ids[keep], logits[keep]
    if top_p < 1.0:
        ids, logits = nucleus(ids, logits, top_p, log_z)
    return ids, logits


def nucleus(ids: np.ndarray, logits: np.ndarray, top_p: float, log_z: float) -> tuple[np.ndarray, np.ndarray]:
    """The fewest highest-logit candidates whose probability exp(logit - log_z) reaches top_p."""
    if logits.shape[0] > NUCLEUS_GUESS:
        # A few hundred tokens usually hold the mass: when they do, sort only those.
        guess = np.argpartition(logits, -NUCLEUS_GUESS)[-NUCLEUS_GUESS:]
        if probabilities(logits[guess], log_z).sum() >= top_p:
            ids, logits = ids[guess], logits[guess]
    order = np.argsort(-logits)
    cum = np.cumsum(probabilities(logits[order], log_z))
    n = min(int(np.searchsorted(cum, top_p)) + 1, cum.shape[0])  # at least one token
    return ids[order[:n]], logits[order[:n]]


def logsumexp(logits: np.ndarray) -> float:
    top = float(logits.max())
    return top + math.log(probabilities(logits, top).sum())


def probabilities(logits: np.ndarray, log_z: float) -> np.ndarray:
    # float64: a float32 running sum over 49k tokens drifts enough to move the top-p cut.
    return np.exp(logits.astype(np.float64) - log_z)


def draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """An index into `logits`, drawn with probability softmax(logits)."""
    weights = np.exp(logits - logits.max(), dtype=np.float64)
    cum = np.cumsum(weights)
    return min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(cum) - 1)
