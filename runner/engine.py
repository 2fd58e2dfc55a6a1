"""The serving engine: many replies at once, decoded together, on one pool of KV blocks.

One thread owns the model, the pool and Numba's threads; the rest of the program talks to it
through a thread-safe face (submit, cancel, drain). Each step is one forward pass over every
running reply's next token plus at most one chunk of a prompt, so the weights are read once per
step for all of them. Requests start in the order they came, up to `parallel` at a time; a
prompt starts on the longest prefix the pool already holds (runner/blocks.py), so a follow-up
turn, or a second request with the same system prompt, prefills only what is new.

The forward pass is batch invariant (Model.forward_batch), and a prompt is cut into chunks the
same way whatever runs beside it: a reply does not depend on what else the engine is doing.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from nibble.formats.errors import NibbleError
from .blocks import BlockPool, SeqBlocks
from .cache import BLOCK, Rows, blocks_for
from .draft import PromptLookup
from .generate import PREFILL_CHUNK, Reply
from .kernels.cpu import SMALL
from .model import ContextFull, Model
from .reasoning import ReasoningSplit
from .sample import Sampler, make_sampler
from .settings import SamplerSettings
from .tokenizer import Tokenizer

if TYPE_CHECKING:   # llguidance is imported only by those who constrain a reply
    from .grammar import Constraint

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


@dataclass(frozen=True)
class Event:
    text: str                                # new answer text (may be "")
    logprobs: tuple[TokenLogprob, ...]       # for the tokens behind this event (empty if off)
    finish_reason: str | None                # None while running; "stop", "length" or "error" last
    usage: Usage | None                      # on the last event only
    error: str | None = None                 # with finish_reason "error": what went wrong
    # The sampled ids behind this event's text, an end token (whose text is never shown) left
    # out: a server remembers prompt text + reply text -> prompt ids + these (runner/prompt_ids.py)
    # when they decode to the reply's text (a stop string cuts the text, not the ids).
    tokens: tuple[int, ...] = ()
    thinking: str = ""                       # new thinking text (with a Request's reasoning), before `text`
    stop_string: str | None = None           # on the last event: the stop string that ended the reply, if one did


class Busy(NibbleError):
    """parallel + queue requests are already running or waiting (the server's 503)."""


@dataclass(eq=False)
class Handle:
    """A submitted request, as its submitter holds it (to cancel it)."""
    request: Request
    emit: Callable[[Event], None]
    cancelled: bool = False


@dataclass(eq=False)
class _Sequence:
    """A request being served: everything here belongs to the engine thread."""
    handle: Handle
    blocks: SeqBlocks
    reply: Reply
    sampler: Sampler
    ids: list[int]             # the prompt, then the sampled tokens
    prompt_len: int
    pos: int                   # positions whose keys and values are in the pool
    unsent: list[int] = field(default_factory=list)   # sampled ids not yet emitted (end tokens left out)
    logprobs: list = field(default_factory=list)      # of the tokens not yet emitted
    drafter: PromptLookup | None = None               # guesses of the next ids (Request.draft)

    @property
    def prefilling(self) -> bool:
        return self.pos < self.prompt_len


class Engine:
    """Serve requests from other threads:

        engine = Engine(model, tokenizer, parallel=4)
        engine.start()
        handle = engine.submit(Request(ids, settings, max_tokens=64), emit)   # emit(Event) per step
        ...
        engine.close()

    `emit` runs on the engine thread: it must be quick and must not block (the server hands the
    event to its event loop). The last event of a reply has a finish_reason and the usage.
    """

    def __init__(self, model: Model, tokenizer: Tokenizer, *, parallel: int = 4, queue: int = 16,
                 ctx: int | None = None, kv_type: str = "f32", threads: int | None = None,
                 cache_tokens: int | None = None, prefill_chunk: int = PREFILL_CHUNK):
        if parallel < 1 or queue < 0:
            raise NibbleError(f"parallel must be at least 1 and queue at least 0, got {parallel} and {queue}")
        if model.gpu_stage is not None:
            raise NibbleError("the engine runs on the CPU only: load the model without --gpu-layers")
        longest = model.config.max_position_embeddings
        self.model, self.tokenizer = model, tokenizer
        self.parallel, self.queue = parallel, queue
        model.threads.pin(threads)
        self.ctx = min(ctx or longest, longest)        # each sequence's context
        self.prefill_chunk = prefill_chunk
        # Room for every running sequence's whole context, so that a step never runs out of
        # blocks (no preemption); what they do not hold is cache.
        blocks = max(blocks_for(cache_tokens or 0), parallel * blocks_for(self.ctx))
        self.pool = BlockPool(model.new_pool(blocks, kv_type))
        self._lock = threading.Condition()
        self._waiting: deque[Handle] = deque()
        self._running: list[_Sequence] = []
        self._draining = self._closed = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # The thread-safe face

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._running)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def start(self):
        """Start the engine thread and wait until its kernels are compiled (or loaded)."""
        self._thread = threading.Thread(target=self._loop, name="nibble engine", daemon=True)
        self._thread.start()
        self._ready.wait()

    def submit(self, request: Request, emit: Callable[[Event], None]) -> Handle:
        """Queue `request`; its events go to `emit`. Raises Busy past parallel + queue requests
        (counted here, so the limit does not depend on the engine's timing) or while draining,
        and NibbleError/ContextFull for a request that cannot run."""
        self._check(request)
        handle = Handle(request, emit)
        with self._lock:
            if self._draining or self._closed:
                raise Busy("the server is shutting down")
            if len(self._running) + len(self._waiting) >= self.parallel + self.queue:
                raise Busy(f"{self.parallel} requests are running and {self.queue} waiting: try again later")
            self._waiting.append(handle)
            self._lock.notify()
        return handle

    def cancel(self, handle: Handle):
        """Stop a request: no event follows, and its blocks are let go at the next step."""
        with self._lock:
            handle.cancelled = True
            if handle in self._waiting:
                self._waiting.remove(handle)
            self._lock.notify()

    def drain(self):
        """End every reply at its next step, with finish_reason "stop"; refuse new requests."""
        with self._lock:
            self._draining = True
            self._lock.notify()

    def close(self):
        """Drain, then stop the engine thread."""
        with self._lock:
            self._draining = self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    def _check(self, r: Request):
        n = len(r.prompt_ids)
        if n == 0:
            raise NibbleError("the prompt is empty")
        if n >= self.ctx:
            raise ContextFull(f"the prompt is {n} tokens and the context holds {self.ctx}")
        if r.max_tokens < 1:
            raise NibbleError(f"max_tokens must be at least 1, got {r.max_tokens}")
        if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
            raise NibbleError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {r.logprobs}")

    # The engine thread

    def _loop(self):
        self._warm_up()
        self._ready.set()
        while True:
            with self._lock:
                while not (self._waiting or self._running or self._closed):
                    self._lock.wait()
                cancelled = [s for s in self._running if s.handle.cancelled]
                for s in cancelled:
                    self._running.remove(s)
                unstarted = []
                if self._draining:
                    unstarted = list(self._waiting)
                    self._waiting.clear()
                while self._waiting and len(self._running) < self.parallel:
                    self._running.append(self._admit(self._waiting.popleft()))
                running, draining, closed = list(self._running), self._draining, self._closed
            for s in cancelled:
                self._free(s)
            for h in unstarted:
                self._emit(h, Event("", (), "stop", Usage(len(h.request.prompt_ids), 0, 0)))
            if draining:
                for s in running:
                    self._finish(s, s.reply.close("stop"))
            elif running:
                self._step(running)
            if closed and not running:
                return

    def _warm_up(self):
        """Compile (or load) the kernels of a pass: a prompt chunk beside a decoded row."""
        scratch = self.model.new_pool(2)
        rows = Rows.of([0, 1, 0], [0, 0, 1], [[0], [1]])
        self.model.forward_batch([0, 0, 0], rows, scratch, [1, 2])

    def _admit(self, handle: Handle) -> _Sequence:
        r = handle.request
        blocks = self.pool.sequence(r.prompt_ids)
        # the context bounds the reply too: its last token is sampled, never run
        max_tokens = min(r.max_tokens, self.ctx - len(r.prompt_ids) + 1)
        # A draft's tokens are sampled as the rejection rule accepts them: not under a grammar's
        # mask, a budget's forced ids or logprobs, each of which asks for one token at a time.
        drafts = (r.draft > 0 and r.constraint is None and r.logprobs is None
                  and (r.reasoning is None or r.reasoning.budget is None))
        return _Sequence(handle, blocks, Reply(self.tokenizer, max_tokens, r.stop, r.skip_special, r.reasoning),
                         make_sampler(r.settings, self.tokenizer), list(r.prompt_ids), len(r.prompt_ids),
                         blocks.cached, drafter=PromptLookup(min(r.draft, SMALL - 1)) if drafts else None)

    def _step(self, running: list[_Sequence]):
        """One forward pass: every decoding sequence's last token, and the next chunk of the
        oldest prompt still prefilling. A sequence that decodes alone runs a draft beside its
        last token (runner/draft.py), checked in the same pass."""
        batch = [s for s in running if not s.prefilling]
        prompt = next((s for s in running if s.prefilling), None)
        chunk = 0
        if prompt is not None:
            chunk = min(self.prefill_chunk, prompt.prompt_len - prompt.pos)
            batch.append(prompt)
        drafts = {id(s): self._draft(s) for s in batch if s.drafter is not None and len(batch) == 1}
        tokens, positions, seq, logit_rows, sampled = [], [], [], [], []
        for i, s in enumerate(batch):
            run = s.ids[s.pos:s.pos + chunk] if s is prompt else s.ids[s.pos:] + drafts.get(id(s), [])
            self.pool.reserve(s.blocks, s.pos + len(run))
            tokens += run
            positions += range(s.pos, s.pos + len(run))
            seq += [i] * len(run)
            if s.pos + len(run) >= len(s.ids):   # its last id, and a draft: their logits choose what comes next
                rows = len(run) - (len(s.ids) - 1 - s.pos)
                logit_rows += range(len(tokens) - rows, len(tokens))
                sampled.append((s, rows))
        width = max(len(s.blocks.blocks) for s in batch)
        tables = np.zeros((len(batch), width), np.int32)
        for i, s in enumerate(batch):
            tables[i, :len(s.blocks.blocks)] = s.blocks.blocks
        try:
            logits = self.model.forward_batch(tokens, Rows.of(positions, seq, tables), self.pool.kv, logit_rows)
        except Exception as e:   # NaN in the logits, say: those replies end, the engine goes on
            for s in batch:
                self._end(s, Event("", (), "error", self._usage(s), _message(e)))
            return
        for s in batch:
            if s is prompt:
                s.pos += chunk
        first = 0
        for s, rows in sampled:
            try:
                if s is not prompt:
                    s.pos += 1   # its last id ran
                self._next_tokens(s, logits[first:first + rows], drafts.get(id(s), []))
            except Exception as e:   # a grammar that cannot go on, say: this reply ends
                self._end(s, Event("", (), "error", self._usage(s), _message(e)))
            first += rows
        for s in batch:
            if s.pos // BLOCK > len(s.blocks.hashes) and s in self._running:   # a block filled: others may share it
                self.pool.commit(s.blocks, s.ids[:s.pos])

    def _draft(self, s: _Sequence) -> list[int]:
        """Up to the ids that fit before the context's and the reply's ends."""
        room = min(self.ctx - len(s.ids), s.reply.max_tokens - s.reply.tokens) - 1
        return s.drafter.draft(s.ids, room) if room > 0 else []

    def _next_tokens(self, s: _Sequence, logits: np.ndarray, draft: list[int]):
        """The ids after a pass whose rows ran the sequence's last id and `draft`: the draft's
        ids the sampler accepts (each ran, so its keys and values stay), then one it draws."""
        accepted = 0
        for guess in draft:
            token = s.sampler.accept(logits[accepted], s.ids, guess)
            if not self._add(s, token) or token != guess:
                break
            s.pos += 1
            accepted += 1
        else:
            self._next_token(s, logits[accepted])
        if draft:
            s.drafter.update(len(draft), accepted)

    def _next_token(self, s: _Sequence, logits: np.ndarray):
        r = s.handle.request
        if r.logprobs is not None:   # of the model's own distribution: before mask and penalties
            token_logprobs = _log_softmax(logits)
        token = s.reply.forced()
        if token is None:
            if r.constraint is not None:
                r.constraint.mask(logits)
            token = s.sampler(logits, s.ids)
        if r.constraint is not None:
            r.constraint.advance(token)
        if r.logprobs is not None:
            s.logprobs.append(self._token_logprob(token, token_logprobs, r.logprobs))
        self._add(s, token)

    def _add(self, s: _Sequence, token: int) -> bool:
        """The reply's next id: its text emitted, or the reply ended. -> whether it goes on."""
        r = s.handle.request
        s.ids.append(token)
        if token not in self.tokenizer.eos_ids:
            s.unsent.append(token)
        text = s.reply.add(token)
        if s.reply.finish_reason is None and r.constraint is not None and r.constraint.done:
            text += s.reply.close("stop")   # nothing may follow: the reply is complete
        if s.reply.finish_reason is not None:
            self._finish(s, text)
            return False
        if text or s.logprobs or s.reply.thinking:
            self._emit(s.handle, Event(text, tuple(s.logprobs), None, None, tokens=tuple(s.unsent),
                                       thinking=s.reply.take_thinking()))
            s.logprobs.clear()
            s.unsent.clear()
        return True

    def _token_logprob(self, token: int, logprobs: np.ndarray, n: int) -> TokenLogprob:
        top = np.argpartition(-logprobs, n)[:n] if n else np.empty(0, np.int64)
        top = top[np.argsort(-logprobs[top], kind="stable")]
        text = self.tokenizer.decode
        return TokenLogprob(token, text([token]), float(logprobs[token]),
                            tuple((int(t), text([t]), float(logprobs[t])) for t in top))

    def _finish(self, s: _Sequence, text: str):
        self._end(s, Event(text, tuple(s.logprobs), s.reply.finish_reason, self._usage(s), tokens=tuple(s.unsent),
                           thinking=s.reply.take_thinking(), stop_string=s.reply.stop_string))

    def _end(self, s: _Sequence, last: Event):
        with self._lock:
            if s in self._running:
                self._running.remove(s)
        self._free(s)
        self._emit(s.handle, last)

    def _free(self, s: _Sequence):
        """Its blocks become cache: a follow-up turn finds its prompt and reply there."""
        self.pool.release(s.blocks, s.ids[:s.pos])

    def _emit(self, handle: Handle, event: Event):
        if handle.cancelled:
            return
        try:
            handle.emit(event)
        except Exception:   # the submitter is gone (its event loop closed): stop its reply
            self.cancel(handle)

    @staticmethod
    def _usage(s: _Sequence) -> Usage:
        return Usage(s.prompt_len, s.reply.tokens, s.blocks.cached)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _message(e: Exception) -> str:
    return str(e) if isinstance(e, NibbleError) else f"{type(e).__name__}: {e}"
