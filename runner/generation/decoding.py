"""A reply's token side, whichever loop runs its model's passes (the serving engine's batched
pass, or stream_generate's pass of one sequence): the request, checked against the context once;
the sampler under a grammar and a thinking budget; the draft a pass checks beside the last id and
the ids the sampler accepts of it; logprobs; the text (`Reply`: detokenizer, thinking apart, stop
strings); and the `Event`s that say what each pass added, the last with why the reply ended.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nibble.formats.errors import NibbleError
from .draft import DraftModel, ModelDrafts, PromptLookup
from ..kernels.cpu import SMALL
from ..model import ContextFull
from ..text.reasoning import ReasoningSplit, Thinking
from .sample import Sampler, make_sampler
from ..settings import SamplerSettings
from ..text.tokenizer import Tokenizer

if TYPE_CHECKING:   # llguidance is imported only by those who constrain a reply
    from ..text.grammar import Constraint

MAX_LOGPROBS = 20   # top alternatives per token, at most (OpenAI's limit)


@dataclass
class Request:
    prompt_ids: list[int]
    settings: SamplerSettings
    max_tokens: int
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None     # a grammar's: masks what may not come next
    logprobs: int | None = None              # top-n alternatives per token (0..20); None: off
    skip_special: bool = True                # False when tools or thinking are on (markers may be special tokens)
    reasoning: ReasoningSplit | None = None  # the reply's thinking kept apart (and its budget)
    draft: int = 0                           # the most tokens a pass guesses ahead while it decodes alone
    adapters: tuple[float, ...] | None = None   # each of the model's LoRA adapters' scale; None: its lora_scales


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    text: str
    logprob: float                                  # log-softmax of the raw logits
    top: tuple[tuple[int, str, float], ...]         # the n likeliest: (id, text, logprob)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int        # of the prompt's, found in the pool rather than prefilled
    disk_tokens: int = 0      # of those, read back from the disk tier (runner/kv/disk.py)


@dataclass(frozen=True)
class Event:
    text: str                                # new answer text (may be "")
    logprobs: tuple[TokenLogprob, ...]       # for the tokens behind this event (empty if off)
    finish_reason: str | None                # None while running; "stop", "length" or "error" last
    usage: Usage | None                      # on the last event only
    error: str | None = None                 # with finish_reason "error": what went wrong
    # The sampled ids behind this event's text, an end token (whose text is never shown) left
    # out: a server remembers prompt text + reply text -> prompt ids + these (runner/kv/prompt_ids.py)
    # when they decode to the reply's text (a stop string cuts the text, not the ids).
    tokens: tuple[int, ...] = ()
    thinking: str = ""                       # new thinking text (with a Request's reasoning), before `text`
    stop_string: str | None = None           # on the last event: the stop string that ended the reply, if one did


def check(request: Request, room: int):
    """The one check of a request against the context it has `room` positions of: ContextFull or
    NibbleError, in words the user reads."""
    n = len(request.prompt_ids)
    if n == 0:
        raise NibbleError("the prompt is empty")
    if n >= room:
        raise ContextFull(f"the prompt is {n} tokens and the context holds {room}: shorten it or raise "
                          "the context size (-c)")
    if request.max_tokens < 1:
        raise NibbleError(f"max_tokens must be at least 1, got {request.max_tokens}")
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
        raise NibbleError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {request.logprobs}")


class Decoding:
    """One reply, token by token, for a loop that runs the passes:

        d = Decoding(request, tokenizer, room, ids=cache.ids)   # room: the context's positions
        logits = <the prompt's pass>                 # [1, V]: after its last id
        draft = []
        while not d.done:
            events, kept = d.next(logits, draft)     # emit them; of the draft's ids, `kept` stay
            draft = d.draft()
            logits = <a pass over [d.ids[-1]] + draft>   # [len(draft) + 1, V]

    The reply ends within `room` (its last id is sampled, never run): "length" there, as at
    max_tokens. `ids`: the sequence's record of its ids (KVCache.ids), which holds the prompt and
    takes each id sampled. `draft_model`: drafts by that model rather than by prompt lookup.
    """

    def __init__(self, request: Request, tokenizer: Tokenizer, room: int, sampler: Sampler | None = None, *,
                 ids: list[int], draft_model: DraftModel | None = None):
        check(request, room)
        r = self.request = request
        self.tokenizer = tokenizer
        self.ids = ids                            # the prompt, then each id sampled
        self.prompt_len = len(self.ids)
        self.asked = r.max_tokens
        self.reply = Reply(tokenizer, min(r.max_tokens, room - len(r.prompt_ids) + 1), r.stop, r.skip_special,
                           r.reasoning)
        self.sampler = sampler or make_sampler(r.settings, tokenizer)
        # A draft's ids are drawn as the rejection rule accepts them: not under a grammar's mask,
        # a budget's forced ids or logprobs, each of which asks for one id at a time.
        drafts = (r.draft > 0 and r.constraint is None and r.logprobs is None
                  and (r.reasoning is None or r.reasoning.budget is None))
        most = min(r.draft, SMALL - 1)
        self.drafter = (ModelDrafts(draft_model, most) if draft_model else PromptLookup(most)) if drafts else None
        self.cached = 0                           # of the prompt's positions, found in a cache
        self.from_disk = 0                        # of those, read back from the disk tier
        self.unsent: list[int] = []               # ids not yet in an event (end tokens left out)
        self.logprobs: list[TokenLogprob] = []    # of those

    @property
    def done(self) -> bool:
        return self.reply.finish_reason is not None

    @property
    def at_context(self) -> bool:
        """Whether the context, not max_tokens, bounds the reply."""
        return self.reply.max_tokens < self.asked

    def draft(self) -> list[int]:
        """Ids guessed to follow, for the next pass to check: up to what fits before the reply's end."""
        room = self.reply.max_tokens - self.reply.tokens - 1
        return self.drafter.draft(self.ids, room) if self.drafter and room > 0 else []

    def next(self, logits: np.ndarray, draft: Sequence[int] = ()) -> tuple[list[Event], int]:
        """After a pass whose rows ran the sequence's last id and then `draft`, logits [len(draft)
        + 1, V] (row i: after the pass's id i): the draft's ids the sampler accepts, then one it
        draws. -> (the events they make, how many of the draft's ids were kept: those ran, and
        their keys and values stay)."""
        events, kept = [], 0
        for guess in draft:
            token = self.sampler.accept(logits[kept], self.ids, guess)
            if not self._add(token, events) or token != guess:
                break
            kept += 1
        else:
            self._sample(logits[kept], events)
        if draft:
            self.drafter.update(len(draft), kept)
        return events, kept

    def close(self, reason: str) -> Event:
        """End the reply from outside (a server draining, say): the last event."""
        text = self.reply.close(reason)
        return self._event(text)

    def failed(self, error: str) -> Event:
        """The last event of a reply that cannot go on (NaN in the logits, a grammar's dead end)."""
        return Event("", (), "error", self.usage(), error)

    def usage(self) -> Usage:
        return Usage(len(self.request.prompt_ids), self.reply.tokens, self.cached, self.from_disk)

    def _sample(self, logits: np.ndarray, events: list[Event]):
        r = self.request
        if r.logprobs is not None:   # of the model's own distribution: before mask and penalties
            token_logprobs = _log_softmax(logits)
        token = self.reply.forced()
        if token is None:
            if r.constraint is not None:
                r.constraint.mask(logits)
            token = self.sampler(logits, self.ids)
        if r.constraint is not None:
            r.constraint.advance(token)
        if r.logprobs is not None:
            self.logprobs.append(self._token_logprob(token, token_logprobs, r.logprobs))
        self._add(token, events)

    def _add(self, token: int, events: list[Event]) -> bool:
        """The reply's next id: an event if it says something, the last if the reply ended.
        -> whether it goes on."""
        r = self.request
        self.ids.append(token)
        if token not in self.tokenizer.eos_ids:
            self.unsent.append(token)
        text = self.reply.add(token)
        if self.reply.finish_reason is None and r.constraint is not None and r.constraint.done:
            text += self.reply.close("stop")   # nothing may follow: the reply is complete
        if self.reply.finish_reason is not None or text or self.logprobs or self.reply.thinking:
            events.append(self._event(text))
        return self.reply.finish_reason is None

    def _event(self, text: str) -> Event:
        last = self.reply.finish_reason is not None
        event = Event(text, tuple(self.logprobs), self.reply.finish_reason, self.usage() if last else None,
                      tokens=tuple(self.unsent), thinking=self.reply.take_thinking(),
                      stop_string=self.reply.stop_string if last else None)
        self.logprobs.clear()
        self.unsent.clear()
        return event

    def _token_logprob(self, token: int, logprobs: np.ndarray, n: int) -> TokenLogprob:
        top = np.argpartition(-logprobs, n)[:n] if n else np.empty(0, np.int64)
        top = top[np.argsort(-logprobs[top], kind="stable")]
        text = self.tokenizer.decode
        return TokenLogprob(token, text([token]), float(logprobs[token]),
                            tuple((int(t), text([t]), float(logprobs[t])) for t in top))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


class Reply:
    """The text side of one reply, token by token: streaming detokenization, thinking kept apart
    from the answer (runner/text/reasoning.py), stop strings held back and cut at, and why the reply
    ended. `stream_generate` and the serving engine share it.

        reply = Reply(tokenizer, max_tokens=64, stop=["END"])
        for token in tokens:
            emit(reply.take_thinking(), reply.add(token))
            if reply.finish_reason:
                break
        else:
            emit(reply.take_thinking(), reply.close("context"))   # ended from outside: flush what was held back

    With a `reasoning` split, its budget may force the ids that end thinking: sample only when
    `forced()` is None. Stop strings cut the answer, not the thinking.
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, stop: Sequence[str] = (),
                 skip_special: bool = True, reasoning: ReasoningSplit | None = None):
        self.eos_ids = tokenizer.eos_ids
        self.max_tokens = max_tokens
        self.decoder = tokenizer.decoder(skip_special)
        self.stops = StopStrings(stop)
        self.reasoning = reasoning
        self.thinking: list[str] = []            # thinking text not yet taken
        self.tokens = 0                          # tokens added, an eos among them
        self.finish_reason: str | None = None    # None while running; "stop" or "length"
        self.stop_string: str | None = None      # the stop string that ended it, if one did

    def forced(self) -> int | None:
        """The id to add next in place of a sampled one, or None."""
        return self.reasoning.forced() if self.reasoning is not None else None

    def take_thinking(self) -> str:
        """The thinking text added since the last call."""
        text, self.thinking = "".join(self.thinking), []
        return text

    def add(self, token: int) -> str:
        """Add a sampled token; return the answer text now safe to emit (its thinking goes to
        take_thinking). When the reply ends (eos, a stop string, max_tokens), finish_reason is
        set and the text returned is all there is to emit."""
        if self.finish_reason is not None:
            raise ValueError(f"the reply has ended ({self.finish_reason})")
        self.tokens += 1
        if token in self.eos_ids:   # the eos token's own text is never shown
            return self.close("stop")
        text = self.decoder.add(token)
        if self.reasoning is not None:
            self.reasoning.count(token)
            text = self._answer(self.reasoning.feed(text))
        text, self.stop_string = self.stops.feed(text)
        if self.stop_string:   # what follows the stop string is dropped
            self.finish_reason = "stop"
            self.decoder.flush()
            return text
        if self.tokens >= self.max_tokens:
            return text + self.close("length")
        return text

    def close(self, reason: str | None = None) -> str:
        """End the reply from outside (the context is full, a grammar is done, the client left):
        return the text held back, and set finish_reason to `reason` if it is still None."""
        if self.finish_reason is None:
            self.finish_reason = reason
        text = self.decoder.flush()
        if self.reasoning is not None:
            text = self._answer(self.reasoning.feed(text) + self.reasoning.finish())
        text, stop = self.stops.feed(text)   # a stop string inside it cuts it there
        self.stop_string = self.stop_string or stop
        return text + self.stops.flush()

    def _answer(self, parts: list[Thinking | str]) -> str:
        self.thinking += [p.text for p in parts if isinstance(p, Thinking)]
        return "".join(p for p in parts if isinstance(p, str))


class StopStrings:
    """Holds back text that may be the start of a stop string, and cuts at the first one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """-> (text safe to emit, the stop string reached or None)"""
        self.pending += text
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            i, stop = min(hits, key=lambda hit: hit[0])
            out, self.pending = self.pending[:i], ""
            return out, stop
        keep = max((k for s in self.stops for k in range(1, len(s))
                    if self.pending.endswith(s[:k])), default=0)
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
