"""Generation as a stack of generators: ids -> responses (text deltas with timings) -> text."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .cache import BLOCK, KVCache
from .draft import PromptLookup
from .kernels.cpu import SMALL
from .model import ContextFull, Model
from .reasoning import ReasoningSplit, Thinking
from .sample import Sampler, make_sampler
from .settings import DEFAULT_DRAFT, MAX_TOKENS
from .tokenizer import Tokenizer

if TYPE_CHECKING:   # llguidance is imported only by those who constrain a reply
    from .grammar import Constraint

# Prompt tokens per forward pass of a long prefill: the consumer may stop between two chunks.
PREFILL_CHUNK = 256


@dataclass
class GenerationResponse:
    """One step of a reply. While a long prompt is prefilled, one response (text "", token None,
    no tokens generated yet) follows each chunk but the last."""
    text: str                   # the new text since the previous response
    token: int | None           # the token behind it (None while prefilling and on a final flush)
    prompt_tokens: int          # tokens prefilled for this call
    prompt_tps: float           # prefill tokens/s (0 until the first token)
    generation_tokens: int      # tokens generated so far
    generation_tps: float       # decode tokens/s (after the first token)
    ttft: float                 # seconds from the call to the first token (0 until then)
    finish_reason: str | None   # None while running; "stop" (eos or stop string), "length", "context"
    thinking: str = ""          # new thinking text (a model that thinks, with a reasoning split), before `text`


def generate_step(model: Model, prompt_ids: Sequence[int], cache: KVCache, sampler: Sampler,
                  prefill_chunk: int = PREFILL_CHUNK, constraint: Constraint | None = None,
                  draft: int = DEFAULT_DRAFT, forced: Callable[[], int | None] | None = None
                  ) -> Iterator[int | None]:
    """Prefill the prompt in chunks of at most `prefill_chunk` tokens, then yield sampled ids;
    with a `constraint`, only ids its grammar allows; where `forced()` gives an id, that one
    (Reply.forced: the end of thinking past its budget).

    Each pass runs the last token and a draft of up to `draft` tokens looked up in the sequence
    (runner/draft.py), and yields the draft's tokens the sampler accepts, then one of the model's
    own: the ids come as they would one pass each (greedy: the same ids; sampling: the same
    distribution). No draft (draft=0, a constraint, a model with GPU layers): one pass a token.

    Yields None after each prefill chunk but the last, so that a consumer can stop a long prefill;
    the cache then holds whole chunks. Ends when the context is full. The consumer cancels by
    stopping the iteration; the last yielded id is not in the cache (it was never run).
    """
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
    done = 0
    while len(prompt_ids) - done > prefill_chunk:
        model.forward(prompt_ids[done:done + prefill_chunk], cache)
        done += prefill_chunk
        yield None
    logits = model.forward(prompt_ids[done:], cache)[-1:]
    # A draft is checked in one pass of up to SMALL rows, which the kernels compute each as they
    # would alone (on the CPU): its logits are those of one pass a token, bit for bit.
    drafter = (PromptLookup(min(draft, SMALL - 1))
               if draft > 0 and constraint is None and forced is None and model.gpu_stage is None else None)
    proposed: list[int] = []
    while True:
        token = forced() if forced is not None else None
        tokens = [token] if token is not None else _verify(logits, proposed, cache, sampler, constraint)
        if drafter and proposed:
            drafter.update(len(proposed), len(tokens) - 1)
        # At each yield the cache holds what one pass a token would: the ids yielded but the
        # last. The draft's accepted ids come back one by one (their keys and values are stored).
        cache.truncate(cache.pos - len(proposed))
        for i, token in enumerate(tokens):
            if i:
                cache.advance(tokens[i - 1:i])
            yield token
        if cache.pos >= cache.size:
            return
        room = min(cache.size, len(cache.table) * BLOCK) - cache.pos - 1
        proposed = drafter.draft(cache.tokens + [token], room) if drafter else []
        logits = model.forward([token] + proposed, cache, all_logits=bool(proposed))


def _verify(logits: np.ndarray, proposed: list[int], cache: KVCache, sampler: Sampler,
            constraint: Constraint | None) -> list[int]:
    """The ids to emit after a pass over the last token and the draft `proposed`, which end the
    cache now; logits [len(proposed) + 1, V], row i the one after the pass's token i. -> the
    draft's ids the sampler accepts, in order, then the id it drew where it stopped."""
    first = cache.pos - len(proposed)   # positions up to the pass's first token, and it
    for i, guess in enumerate(proposed):
        token = sampler.accept(logits[i], cache.tokens[:first + i], guess)
        if token != guess:
            return proposed[:i] + [token]
    if constraint is not None:
        constraint.mask(logits[-1])
    token = sampler(logits[-1], cache.tokens)
    if constraint is not None:
        constraint.advance(token)
    return proposed + [token]


def stream_generate(model: Model, tokenizer: Tokenizer, prompt_ids: Sequence[int], *,
                    sampler: Sampler | None = None, max_tokens: int = MAX_TOKENS,
                    stop: Sequence[str] = (), cache: KVCache | None = None,
                    prefill_chunk: int = PREFILL_CHUNK, constraint: Constraint | None = None,
                    draft: int = DEFAULT_DRAFT, reasoning: ReasoningSplit | None = None
                    ) -> Iterator[GenerationResponse]:
    """Stream the reply to `prompt_ids` (appended to `cache`, a fresh one if None).

    The consumer cancels by stopping the iteration, between two tokens or two prefill chunks: the
    cache keeps what ran. The timings are measured here, from the call. Without a `sampler`, the
    model's sampling defaults apply (tokenizer.sampling). With a `constraint` (a grammar's,
    runner/grammar.py), the reply follows the grammar and ends "stop" where the grammar is complete.
    `draft`: the most tokens a pass guesses ahead (generate_step); 0 for one pass a token. With a
    `reasoning` split (runner/reasoning.py: a model that thinks), its thinking comes apart in each
    response's `thinking`, and its budget holds. The decode tokens/s count the tokens emitted.
    """
    cache = cache if cache is not None else model.new_cache()
    room = cache.size - cache.pos
    if len(prompt_ids) >= room:
        raise ContextFull(f"the prompt is {len(prompt_ids)} tokens and the context holds {room}: "
                          "shorten the prompt or raise --ctx-size")
    if not prompt_ids:
        raise ContextFull("the prompt is empty")
    sampler = sampler or make_sampler(tokenizer.sampling, tokenizer)
    reply = Reply(tokenizer, max_tokens, stop, reasoning is None, reasoning)
    start = time.perf_counter()
    n, first, prompt_tps = 0, 0.0, 0.0

    def response(text, token):
        now = time.perf_counter()
        decode_tps = (n - 1) / (now - first) if n > 1 and now > first else 0.0
        return GenerationResponse(text, token, len(prompt_ids), prompt_tps, n, decode_tps,
                                  first - start if n else 0.0, reply.finish_reason, reply.take_thinking())

    budget = reply.forced if reasoning is not None and reasoning.budget is not None else None
    for token in generate_step(model, prompt_ids, cache, sampler, prefill_chunk, constraint, draft, budget):
        if token is None:   # a prefill chunk ran: a point to stop at
            yield response("", None)
            continue
        n += 1
        if n == 1:
            first = time.perf_counter()
            prompt_tps = len(prompt_ids) / (first - start)
        text = reply.add(token)
        if constraint is not None and constraint.done and not reply.finish_reason:
            text += reply.close("stop")
        if text or reply.finish_reason or reply.thinking:
            yield response(text, token)
        if reply.finish_reason:
            return
    yield response(reply.close("context"), None)


class Reply:
    """The text side of one reply, token by token: streaming detokenization, thinking kept apart
    from the answer (runner/reasoning.py), stop strings held back and cut at, and why the reply
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
