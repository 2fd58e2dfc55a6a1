"""Token samplers: small composed filters over (ids, logits) candidate pairs, as llama.cpp does.

The chain is llama.cpp's default: repetition penalty -> presence and frequency penalties -> top-k
-> top-p -> min-p -> temperature -> draw. Truncation sees the untempered distribution, so
temperature only reshapes what is kept.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from .settings import SamplerSettings

# How many top candidates nucleus() tries before falling back to sorting all of them.
NUCLEUS_GUESS = 256


class Sampler:
    """One reply's sampler: `sampler(logits, recent_ids) -> token id` draws the next token, and
    `sampler.accept(logits, recent_ids, proposed)` judges a draft's token (speculative decoding).

    It owns a `np.random.Generator`, so two samplers with the same seed, fed the same logits, draw
    the same tokens. It also counts the tokens it has drawn: those are the reply, which the
    presence and frequency penalties look at (OpenAI's rule), while the repetition penalty looks
    at `recent_ids` (the sequence, prompt included: llama.cpp's). So a reply needs a sampler of
    its own. `logits` [vocab] float32 is never modified.
    """

    def __init__(self, settings: SamplerSettings):
        self.settings = settings
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
        if self.greedy:
            return np.array([np.argmax(logits)]), logits[:0]
        ids, cand = top_k(logits, s.top_k)
        ids, cand = top_p_min_p(ids, cand, s.top_p, s.min_p)
        return ids, cand / s.temperature

    def _drawn(self, token: int) -> int:
        if self.drawn is not None:
            self.drawn[token] += 1
        return token


def make_sampler(settings: SamplerSettings) -> Sampler:
    """A Sampler for one reply, drawing as `settings` say."""
    return Sampler(settings)


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
