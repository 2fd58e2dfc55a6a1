"""Drafts for speculative decoding: guesses of the next few tokens, which the model checks in one
pass (runner/generation/decoding.py). By prompt lookup (PromptLookup): copied from what followed
the same n-gram earlier in the sequence (the prompt and the reply so far); or by a draft model
(ModelDrafts): a smaller model of the same vocabulary, as llama.cpp's --model-draft, LM Studio's
and mlx-lm's draft models.

A reply that quotes its prompt (code to edit, a text to fix, a summary's names) repeats long runs
of it: the tokens after the last n-gram's earlier occurrence are then the reply's next ones, and
the model checks several of them in one pass (runner/generation/decoding.py). Free text rarely repeats: a
lookup finds nothing there, or guesses that miss, and `PromptLookup` then drafts less and
rests, so that a reply that does not quote loses (almost) nothing. llama.cpp's lookup decoding
and transformers' prompt_lookup_num_tokens do the same.
"""
from __future__ import annotations

import itertools

from collections.abc import Sequence

import numpy as np

from ..settings import DEFAULT_DRAFT

# The n-grams looked up: the longest first, as a longer match predicts better (in code, a short
# one recurs: `len(x)`); 8 drafted more of a quote than 3 or 5 did on SmolLM2.
NGRAM_MAX, NGRAM_MIN = 8, 2
# After a draft that missed from its first token, draft nothing for a while: the rest doubles
# with each such miss (up to REST_MAX tokens), and a draft with two or more tokens accepted ends it.
REST_MAX = 64


class NgramIndex:
    """Where each n-gram of a growing sequence last occurred, for n in [NGRAM_MIN, NGRAM_MAX].

    `continuation(seq, k)` indexes the tokens of `seq` it has not seen (the caller only appends
    to it) and returns up to k tokens that followed the latest earlier occurrence of seq's
    longest suffix n-gram that occurred before; [] when none did.
    """

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN):
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self.after: dict[tuple[int, ...], int] = {}   # n-gram -> where its latest occurrence ends
        self.seen = 0                                  # positions indexed: seq[:seen]

    def continuation(self, seq: Sequence[int], k: int) -> list[int]:
        # Index each n-gram that ends before the last position: its occurrence at the very end
        # is the one looked up, and it has no continuation yet.
        for end in range(max(self.seen, 1), len(seq)):
            for n in self.sizes:
                if n <= end:
                    self.after[tuple(seq[end - n:end])] = end
        self.seen = max(self.seen, len(seq))
        for n in self.sizes:
            if n <= len(seq) and (end := self.after.get(tuple(seq[len(seq) - n:]))) is not None:
                return list(itertools.takewhile(lambda t: t >= 0, seq[end:end + k]))   # an image's ids are no reply's
        return []


class PromptLookup:
    """Drafts for one reply, at most `max_tokens` each, fewer where recent drafts missed.

        drafter = PromptLookup(8)
        draft = drafter.draft(sequence, room)   # the prompt and the reply so far
        ...                                      # the model checks it: `accepted` of them agree
        drafter.update(len(draft), accepted)

    A checked draft token costs about half a pass (SmolLM2, int4): drafts start at one token,
    double while the model takes them all and shrink to what it took, so that a reply leaving
    its quote wastes little.
    """

    def __init__(self, max_tokens: int = DEFAULT_DRAFT):
        self.max_tokens = max_tokens
        self.index = NgramIndex()
        self.limit = 1            # the next draft's length
        self.rest = 0             # tokens to go without drafting
        self.next_rest = 1        # how long the next rest lasts

    def draft(self, seq: Sequence[int], room: int) -> list[int]:
        """Up to min(limit, room) tokens guessed to follow `seq` (which only ever grows)."""
        found = self.index.continuation(seq, min(self.limit, room))
        if self.rest:
            self.rest -= 1
            return []
        return found

    def update(self, drafted: int, accepted: int):
        """Note how many of a draft's `drafted` tokens the model agreed with."""
        if accepted == drafted:
            self.limit = min(self.max_tokens, 2 * self.limit)
        else:
            self.limit = max(1, min(self.limit, 2 * accepted))
        if accepted == 0:
            self.rest, self.next_rest = self.next_rest, min(REST_MAX, 2 * self.next_rest)
        elif accepted >= 2:
            self.next_rest = 1


class DraftModel:
    """A smaller model of the target's vocabulary that guesses: greedily, a pass a token, on a KV
    cache of its own that follows the sequence that asked last (what it ran that the sequence
    still holds stays; the rest runs again), so that one draft model serves every reply of an
    engine, which drafts only while one reply decodes alone."""

    def __init__(self, model, ctx: int):
        self.model = model
        self.cache = model.new_cache(ctx)

    def guess(self, seq: Sequence[int], k: int) -> list[int]:
        """Up to k ids the draft model picks after `seq` (none where it cannot read the sequence:
        an image's ids, past its context)."""
        c, n = self.cache, 0
        ran = c.ids[:c.pos]
        while n < len(ran) and n < len(seq) and ran[n] == seq[n]:
            n += 1
        n = min(n, len(seq) - 1)   # the last id runs again: its logits pick the first guess
        if len(seq) + k > c.size or min(seq[n:]) < 0:
            return []
        c.pos = n
        del c.ids[n:]
        logits, out = self.model.forward(list(seq[n:]), c), []
        while True:
            out.append(int(np.argmax(logits[-1])))
            if len(out) == k:
                return out
            logits = self.model.forward(out[-1:], c)


class ModelDrafts:
    """Drafts for one reply by a DraftModel, at most `max_tokens` each: as many as the target took
    of the last draft, doubled while it takes them all (each guess costs the draft model a pass)."""

    def __init__(self, draft_model: DraftModel, max_tokens: int = DEFAULT_DRAFT):
        self.model, self.max_tokens = draft_model, max_tokens
        self.limit = max_tokens

    def draft(self, seq: Sequence[int], room: int) -> list[int]:
        return self.model.guess(seq, min(self.limit, room))

    def update(self, drafted: int, accepted: int):
        self.limit = min(self.max_tokens, 2 * self.limit) if accepted == drafted else max(1, 2 * accepted)
