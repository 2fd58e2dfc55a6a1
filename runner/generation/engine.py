"""The serving engine: many replies at once, decoded together, on one pool of KV blocks.

One thread owns the model, the pool and Numba's threads; the rest of the program talks to it
through a thread-safe face (submit, cancel, drain). Each step is one forward pass over every
running reply's next token plus at most one chunk of a prompt, so the weights are read once per
step for all of them. Requests start in the order they came, up to `parallel` at a time; a
prompt starts on the longest prefix the pool already holds (runner/kv/blocks.py), so a follow-up
turn, or a second request with the same system prompt, prefills only what is new.

The forward pass is batch invariant (Model.forward_batch), and a prompt is cut into chunks the
same way whatever runs beside it: a reply does not depend on what else the engine is doing.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nibble.formats.errors import NibbleError
from ..kv.blocks import BlockPool
from ..kv.cache import BLOCK, KVCache, Rows, blocks_for
from .decoding import Decoding, Event, Request, Usage, check
from .draft import DraftModel
from .generate import PREFILL_CHUNK
from ..kv.disk import open_disk
from ..model import Model
from ..text.image_ids import whole_images
from ..text.tokenizer import Tokenizer


class Busy(NibbleError):
    """parallel + queue requests are already running or waiting (the server's 503)."""


class ModelThread:
    """The one thread that runs a model (and Numba's threads with it), and the lock of the
    thread-safe face the rest of the program calls: drain refuses new work (what runs ends as
    the subclass's loop says), close drains, then ends the thread."""

    def __init__(self):
        self._lock = threading.Condition()
        self._draining = self._closed = False
        self._thread: threading.Thread | None = None

    def _start_thread(self, name: str):
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self):
        raise NotImplementedError

    def drain(self):
        with self._lock:
            self._draining = True
            self._lock.notify()

    def close(self):
        with self._lock:
            self._draining = self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()


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
    cache: KVCache             # its ids, the positions that ran, its blocks in the pool
    decoding: Decoding         # its reply, sampled into cache.ids
    adapters: np.ndarray       # its scale of each of the model's LoRA adapters

    @property
    def prefilling(self) -> bool:
        return self.cache.pos < self.decoding.prompt_len


class Engine(ModelThread):
    """Serve requests from other threads:

        engine = Engine(model, tokenizer, parallel=4)
        engine.start()
        handle = engine.submit(Request(ids, settings, max_tokens=64), emit)   # emit(Event) per step
        ...
        engine.close()

    `emit` runs on the engine thread: it must be quick and must not block (the server hands the
    event to its event loop). The last event of a reply has a finish_reason and the usage. Drained,
    it ends every reply at its next step with finish_reason "stop".

    kv_disk: the bytes the disk tier of the pool's blocks may take (runner/kv/disk.py; 0: none),
    so that a prefix seen before a restart, or evicted since, is read back rather than prefilled.
    """

    def __init__(self, model: Model, tokenizer: Tokenizer, *, parallel: int = 4, queue: int = 16,
                 ctx: int | None = None, kv_type: str = "f32", threads: int | None = None,
                 cache_tokens: int | None = None, prefill_chunk: int = PREFILL_CHUNK, kv_disk: int = 0,
                 draft_model: DraftModel | None = None):
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
        self.draft_model = draft_model   # drafts by it rather than by prompt lookup (None)
        # Room for every running sequence's whole context, so that a step never runs out of
        # blocks (no preemption); what they do not hold is cache.
        blocks = max(blocks_for(cache_tokens or 0), parallel * blocks_for(self.ctx))
        kv = model.new_pool(blocks, kv_type)
        self.pool = BlockPool(kv, open_disk(model.source, kv, kv_disk))
        super().__init__()
        self._waiting: deque[Handle] = deque()
        self._running: list[_Sequence] = []
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
        self._start_thread("nibble engine")
        self._ready.wait()

    def submit(self, request: Request, emit: Callable[[Event], None]) -> Handle:
        """Queue `request`; its events go to `emit`. Raises Busy past parallel + queue requests
        (counted here, so the limit does not depend on the engine's timing) or while draining,
        and NibbleError/ContextFull for a request that cannot run."""
        check(request, self.ctx)
        if request.adapters is not None and len(request.adapters) != len(self.model.adapters):
            raise NibbleError(f"the model runs {len(self.model.adapters)} LoRA adapters, the request gives "
                              f"{len(request.adapters)} scales")
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
                refused = []
                while self._waiting and len(self._running) < self.parallel:
                    handle = self._waiting.popleft()
                    try:
                        self._running.append(self._admit(handle))
                    except Exception as e:   # the disk tier unreadable, say: this request ends
                        refused.append((handle, e))
                running, draining, closed = list(self._running), self._draining, self._closed
            for h, e in refused:
                self._emit(h, Event("", (), "error", Usage(len(h.request.prompt_ids), 0, 0), _message(e)))
            for s in cancelled:
                self._free(s)
            for h in unstarted:
                self._emit(h, Event("", (), "stop", Usage(len(h.request.prompt_ids), 0, 0)))
            if draining:
                for s in running:
                    self._end(s, s.decoding.close("stop"))
            elif running:
                try:
                    self._step(running)
                except Exception as e:   # a fault of the step itself: its replies end, the engine goes on
                    for s in running:
                        self._end(s, s.decoding.failed(_message(e)))
            if closed and not running:
                return

    def _warm_up(self):
        """Compile (or load) the kernels of a pass: a prompt chunk beside a decoded row."""
        scratch = self.model.new_pool(2)
        rows = Rows.of([0, 1, 0], [0, 0, 1], [[0], [1]])
        self.model.forward_batch([0, 0, 0], rows, scratch, [1, 2])

    def _admit(self, handle: Handle) -> _Sequence:
        r = handle.request
        adapters = np.array(self.model.lora_scales if r.adapters is None else r.adapters, np.float32)
        cache = KVCache.on_pool(self.pool.kv, self.ctx)
        cached, from_disk = self.pool.admit(cache, r.prompt_ids, 0,   # blocks for what runs: each step's
                                            self.model.prefix_root(adapters))
        decoding = Decoding(r, self.tokenizer, self.ctx, ids=cache.ids, draft_model=self.draft_model)
        decoding.cached, decoding.from_disk = cached, from_disk
        return _Sequence(handle, cache, decoding, adapters)

    def _step(self, running: list[_Sequence]):
        """One forward pass: every decoding sequence's last token, and the next chunk of the
        oldest prompt still prefilling. A sequence that decodes alone runs a draft beside its
        last token (runner/generation/draft.py), checked in the same pass."""
        batch = [s for s in running if not s.prefilling]
        prompt = next((s for s in running if s.prefilling), None)
        chunk = 0
        if prompt is not None:
            pos = prompt.cache.pos
            chunk = whole_images(prompt.cache.ids, pos, pos + min(self.prefill_chunk, prompt.decoding.prompt_len - pos)) - pos
            batch.append(prompt)
        drafts = {id(s): s.decoding.draft() for s in batch if len(batch) == 1 and s is not prompt}
        tokens, positions, seq, logit_rows, sampled = [], [], [], [], []
        for i, s in enumerate(batch):
            ids, pos = s.cache.ids, s.cache.pos
            run = ids[pos:pos + chunk] if s is prompt else ids[pos:] + drafts.get(id(s), [])
            self.pool.reserve(s.cache, pos + len(run))
            tokens += run
            positions += range(pos, pos + len(run))
            seq += [i] * len(run)
            if pos + len(run) >= len(ids):   # its last id, and a draft: their logits choose what comes next
                rows = len(run) - (len(ids) - 1 - pos)
                logit_rows += range(len(tokens) - rows, len(tokens))
                sampled.append((s, rows))
        width = max(len(s.cache.blocks.blocks) for s in batch)
        tables = np.zeros((len(batch), width), np.int32)
        for i, s in enumerate(batch):
            tables[i, :len(s.cache.blocks.blocks)] = s.cache.blocks.blocks
        try:
            adapters = np.stack([s.adapters for s in batch]) if self.model.adapters else None
            logits = self.model.forward_batch(tokens, Rows.of(positions, seq, tables), self.pool.kv, logit_rows,
                                              [s.cache.ids for s in batch], adapters)
        except Exception as e:   # NaN in the logits, say: those replies end, the engine goes on
            for s in batch:
                self._end(s, s.decoding.failed(_message(e)))
            return
        if prompt is not None:
            prompt.cache.pos += chunk
        first = 0
        for s, rows in sampled:
            if s is not prompt:
                s.cache.pos += 1   # its last id ran
            try:
                events, kept = s.decoding.next(logits[first:first + rows], drafts.get(id(s), []))
            except Exception as e:   # a grammar that cannot go on, say: this reply ends
                events, kept = [s.decoding.failed(_message(e))], 0
            s.cache.pos += kept   # the draft's ids it kept ran; the next pass overwrites the rest
            for event in events:
                if event.finish_reason is None:
                    self._emit(s.handle, event)
                else:
                    self._end(s, event)
            first += rows
        for s in batch:
            if s.cache.pos // BLOCK > len(s.cache.blocks.hashes) and s in self._running:   # a block filled: others may share it
                self.pool.commit(s.cache)

    def _end(self, s: _Sequence, last: Event):
        with self._lock:
            if s not in self._running:
                return   # ended already
            self._running.remove(s)
        self._free(s)
        self._emit(s.handle, last)

    def _free(self, s: _Sequence):
        """Its blocks become cache: a follow-up turn finds its prompt and reply there."""
        self.pool.release(s.cache)

    def _emit(self, handle: Handle, event: Event):
        if handle.cancelled:
            return
        try:
            handle.emit(event)
        except Exception:   # the submitter is gone (its event loop closed): stop its reply
            self.cancel(handle)


def _message(e: Exception) -> str:
    return str(e) if isinstance(e, NibbleError) else f"{type(e).__name__}: {e}"
