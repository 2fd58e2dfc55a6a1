"""The kernels' one-time compile, said as it goes: a first run spends a minute or more in Numba
before its first token, and the person waiting sees which kernel is compiling, how many are done
and for how long (formats.progress, updated every second), then how long it took in all.

numba tells each compile's start and end (its "numba:compile" events, which a kernel loaded from
the cache does not send). The caller whose first pass made the compiles says when it is over
(`finish`: the first token of `nibble run`, a warm-up's end); a caller that never says so (the
library, tests) has its line ended (cleared) once nothing has compiled for IDLE seconds.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator

from numba.core import event

from nibble.formats import progress

TICK = 1.0   # seconds between two updates of the line
IDLE = 3.0   # seconds without a compile after which the line is left as it is
# _probe() on the machine whose compile the steps' expected seconds were measured on (an AMD EPYC,
# Zen 5, two cores): a compile is mostly Python and LLVM on one core, which scale alike
REFERENCE_PROBE = 0.0026


class _Compiles(event.Listener):
    def __init__(self):
        self.lock = threading.Lock()
        self.start: float | None = None   # the first compile since the last finish()
        self.depth = 0                    # compiles under way: a kernel compiles the ones it calls
        self.count = 0                    # compiles ended since start
        self.kernel = ""                  # the outermost kernel compiling
        self.last = 0.0                   # when the last compile ended
        self.steps: Steps | None = None   # the steps ahead, if the caller named them
        self.rest = False                 # the full kernels compile in the background (runner/background.py)

    def on_start(self, ev):
        with self.lock:
            self._begin()
            self.depth += 1
            if self.depth == 1:
                self.kernel = _name(ev.data["dispatcher"])
        self._show()

    def _begin(self):
        """The first compile since the last finish(): the line starts (under the lock)."""
        if self.start is None:
            self.start, self.count = time.monotonic(), 0
            threading.Thread(target=self._tick, name="nibble-compile-progress", daemon=True).start()

    def on_end(self, ev):
        with self.lock:
            self.depth -= 1
            self.count += 1
            self.last = time.monotonic()

    @contextlib.contextmanager
    def elsewhere(self, what: str):
        with self.lock:
            self._begin()
            self.depth += 1
            self.kernel = what
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1
                self.last = time.monotonic()

    def _tick(self):
        while True:
            time.sleep(TICK)
            with self.lock:
                if self.start is None:
                    return
                idle = self.depth == 0 and time.monotonic() - self.last > IDLE
                if idle:
                    self.start = None
            if idle:
                progress.clear()   # nobody said the compile was over: its line ends here
                return
            self._show()

    def _show(self):
        with self.lock:
            if self.start is None:
                return
            now = time.monotonic()
            if self.steps is None:
                text = (f"compiling the kernels for this CPU (once, about a minute): {now - self.start:.0f} s, "
                        f"{self.count} done, now {self.kernel}")
            else:
                text = f"compiling the kernels for this CPU, once: {self.steps.say(now)}"
        progress.update(text)

    @contextlib.contextmanager
    def planned(self, steps: Steps) -> Iterator[Steps]:
        with self.lock:
            self._begin()
            self.steps = steps
            self.depth += 1   # the line goes on between two steps' compiles
        try:
            yield steps
        finally:
            with self.lock:
                self.steps = None
                self.depth -= 1
                self.last = time.monotonic()

    def finish(self):
        with self.lock:
            start, self.start = self.start, None
            rest, self.rest = self.rest, False
        if start is not None:
            took = time.monotonic() - start
            progress.done(f"compiled the kernels a first answer needs in {took:.0f} s; the rest compile in the "
                          f"background, for later runs" if rest else
                          f"compiled the kernels for this CPU in {took:.0f} s; later runs load them at once")


class Steps:
    """The steps of a compile, in order, each with the seconds it is expected to take on the
    machine of REFERENCE_PROBE."""

    def __init__(self, expected: list[tuple[str, float]]):
        self.expected = expected
        self.done = 0
        self.began = self.step_began = time.monotonic()

    def next(self):
        """The step under way has ended."""
        self.step_began = time.monotonic()
        self.done += 1
        _compiles._show()

    def left(self, now: float) -> float:
        """Seconds the steps not done are expected to take from `now`, at the pace of those done
        (a machine twice as slow takes twice as long; before any is done, at this machine's
        pace())."""
        before = sum(seconds for _, seconds in self.expected[:self.done])
        pace = (self.step_began - self.began) / before if before > 0 else machine_pace()
        rest = [pace * seconds for _, seconds in self.expected[self.done:]]
        if not rest:
            return 0.0
        return max(rest[0] - (now - self.step_began), 0.0) + sum(rest[1:])

    def say(self, now: float) -> str:
        """"31 s so far, about 25 s left; step 2 of 2, the layer": the times first, which a
        narrow status bar keeps."""
        n = len(self.expected)
        what = self.expected[min(self.done, n - 1)][0]
        left = self.left(now)
        ahead = f"about {left:.0f} s left" if left >= 3 else "a few seconds left"
        return f"{now - self.began:.0f} s so far, {ahead}; step {min(self.done + 1, n)} of {n}, {what}"


@functools.cache
def machine_pace() -> float:
    """How much longer than the reference machine this one takes to compile, from a short piece
    of Python timed at its best of a dozen runs (some 30 ms, once)."""
    return _probe() / REFERENCE_PROBE


def _probe() -> float:
    best = float("inf")
    for _ in range(12):
        start = time.perf_counter()
        total = 0
        for i in range(100_000):
            total += i % 7
        best = min(best, time.perf_counter() - start)
    return best


def _name(dispatcher) -> str:
    """A kernel's name as the user may read it: `attention`, `quant_decode._rows`."""
    f = dispatcher.py_func
    module = f.__module__.rsplit(".", 1)[-1]
    name = f.__qualname__.split(".<locals>")[0]
    return name if module in ("cpu", "layer") else f"{module}.{name}"


_compiles = _Compiles()


def install():
    event.register("numba:compile", _compiles)


def elsewhere(what: str):
    """A context inside which kernels compile in another process (`what`): the line goes on."""
    return _compiles.elsewhere(what)


def steps(expected: list[tuple[str, float]]):
    """A context inside which the compile goes through these steps ((what, expected seconds),
    in order): the line says which is under way and about how long is left. The yielded
    Steps' next() says that one has ended."""
    return _compiles.planned(Steps(expected))


def rest_in_background():
    """This compile is a first run's kernels; the full ones compile in the background (finish's line says so)."""
    with _compiles.lock:
        _compiles.rest = True


def finish():
    """The caller's first pass is over: if kernels compiled for it, say how long it took."""
    _compiles.finish()
