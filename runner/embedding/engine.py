"""An embedding model's thread (what generation/engine.py's Engine is to a model that generates): the texts of
every request waiting when a pass starts run through the encoder together, so that many small
requests (an indexer's) cost few passes."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from .embed import PASS_TOKENS, Embedder
from ..generation.engine import Busy, ModelThread


class EmbedEngine(ModelThread):
    """Jobs of texts queued and run together a pass, at most `parallel + queue` of them at once
    (then Busy). Drained, it refuses new jobs and runs those queued."""

    def __init__(self, embedder: Embedder, *, parallel: int = 4, queue: int = 16, threads: int | None = None):
        self.embedder, self.limit = embedder, parallel + queue
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
        self.embedder.embed_ids([[0]])
        self._start_thread("nibble embed")

    def submit(self, ids: list[list[int]], skip: int) -> Future:
        """The vectors of texts already tokenized, pooled from token `skip` on: a Future of
        [len(ids), dimensions]. Busy past the jobs allowed or while shutting down."""
        job = _Job(ids, skip, Future())
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
                vectors = self.embedder.embed_ids([i for j in jobs for i in j.ids],
                                                  [j.skip for j in jobs for _ in j.ids])
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
    skip: int
    future: Future

    @property
    def tokens(self) -> int:
        return sum(len(i) for i in self.ids)
