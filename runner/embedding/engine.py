"""An embedding model's or a reranker's thread (what generation/engine.py's Engine is to a model that
generates): the texts of every request waiting when a pass starts run through the encoder
together, so that many small requests (an indexer's) cost few passes."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from .embed import PASS_TOKENS, Embedder
from .rerank import Reranker
from ..generation.engine import Busy, ModelThread


class EmbedEngine(ModelThread):
    """Jobs of texts queued and run together a pass, at most `parallel + queue` of them at once
    (then Busy). Drained, it refuses new jobs and runs those queued."""

    def __init__(self, embedder: Embedder | Reranker, *, parallel: int = 4, queue: int = 16,
                 threads: int | None = None):
        self.embedder, self.limit = embedder, parallel + queue   # what runs the texts (its `run`)
        embedder.encoder.threads.pin(threads)
        self.ctx = embedder.max_length   # a text's most tokens
        super().__init__()
        self._jobs: deque[_Job] = deque()
        self._running = 0

    @property
    def running(self) -> int:
        with self._lock:
            return self._running

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._jobs)

    def start(self):
        """A first pass (the kernels compiled or loaded), then the thread."""
        self.embedder.run([[0]], [[0]] if isinstance(self.embedder, Reranker) else [0])
        self._start_thread("nibble embed" if isinstance(self.embedder, Embedder) else "nibble rerank")

    def submit(self, ids: list[list[int]], each: list) -> Future:
        """What `embedder.run` makes of texts already tokenized and what goes with each (an
        embedder's token to pool from, a reranker's token types): a Future of an array, a row a
        text. Busy past the jobs allowed or while shutting down."""
        job = _Job(ids, each, Future())
        with self._lock:
            if self._draining or self._closed:
                raise Busy("the server is shutting down")
            if self._running + len(self._jobs) >= self.limit:
                raise Busy(f"{self.limit} embedding requests are running or waiting: try again later")
            self._jobs.append(job)
            self._lock.notify()
        return job.future

    def _loop(self):
        while True:
            with self._lock:
                while not (self._jobs or self._closed):
                    self._lock.wait()
                if not self._jobs:
                    return
                jobs, tokens = [], 0   # the jobs waiting, as many as fill a pass (at least one)
                while self._jobs and (not jobs or tokens + self._jobs[0].tokens <= PASS_TOKENS):
                    tokens += self._jobs[0].tokens
                    jobs.append(self._jobs.popleft())
                self._running = len(jobs)
            try:
                vectors = self.embedder.run([i for j in jobs for i in j.ids], [e for j in jobs for e in j.each])
                for job, part in zip(jobs, np.split(vectors, np.cumsum([len(j.ids) for j in jobs])[:-1])):
                    job.future.set_result(part)
            except Exception as e:   # NaN, a bug: each request answers, the thread goes on
                for job in jobs:
                    job.future.set_exception(e)
            finally:
                with self._lock:
                    self._running = 0


@dataclass
class _Job:
    ids: list[list[int]]
    each: list
    future: Future

    @property
    def tokens(self) -> int:
        return sum(len(i) for i in self.ids)
