"""How many threads the kernels run with: the number -t pins, or one chosen pass by pass from how
fast the passes run.

A parallel region ends when its slowest thread does. When another program holds a core (a browser,
a build), the thread the OS parks behind it makes every region of the pass wait for a time slice:
two threads on two cores then decode several times slower than one. Which cores are free is not
known ahead and changes, so it is measured. Every so often one pass runs with one thread fewer or
more, or half as many (a probe); if it ran clearly faster than the recent passes with as many rows,
that count stays. A probe that loses is tried again twice as late, up to MAX_INTERVAL passes; a
pass much slower than the recent ones (a program started) brings the next probe forward. A probe
with more threads is skipped while other programs' threads wait to run (Linux's procs_running):
there it would only wait behind them, and one such pass can cost as much as a hundred others. The
first pass runs with as many threads as cores are free then.

The kernels give the same results whatever the number of threads (each output is summed by one
thread), so the choice changes the speed only. Passes from two threads at once (the server's engine
and a caller of the same model) share the chooser: its state changes under a lock, and a probe whose
baseline went meanwhile (cleared, or a switch another pass made) teaches nothing.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

FIRST_PROBE = 4       # passes before the first probe: a busy machine shows at once
MIN_INTERVAL = 16     # passes between probes after a switch
MAX_INTERVAL = 1024   # ... and at most, after probes that lost
RECENT = 8            # passes at the current count a probe is compared with (their median)
MARGIN = 0.9          # a probe must take less than this much of that median to win
SLOWER = 1.5          # a pass this much slower than that median makes the next pass a probe


class ThreadChooser:
    """The thread count for each forward pass of one model (see the module's docstring).

        with chooser.pass_of(rows):    # sets numba's count for this thread, times the pass
            run_the_pass()

    `others_running` says how many threads of other programs are ready to run right now (None:
    unknown); the default reads Linux's /proc/stat.
    """

    def __init__(self, most: int | None = None, pinned: int | None = None,
                 others_running: Callable[[], int | None] | None = None):
        if most is None:
            import numba
            most = numba.config.NUMBA_NUM_THREADS
        self.most = most
        self.pinned = pinned        # -t: always this many
        self.current = most
        self.others_running = others_running or procs_running_elsewhere
        self._recent: dict[int, deque] = {}   # rows of a pass -> its latest times at `current`
        self._interval = MIN_INTERVAL
        self._countdown = FIRST_PROBE
        self._turn = 0              # which of the candidates the next probe tries
        self._started = False
        self._lock = threading.Lock()

    def pin(self, threads: int | None):
        """Always run `threads` threads (None: choose again)."""
        self.pinned = min(threads, self.most) if threads else None

    @contextmanager
    def pass_of(self, rows: int) -> Iterator[int]:
        """Run one pass of `rows` rows with the count chosen for it (yielded)."""
        import numba
        threads = self.next_count(rows)
        numba.set_num_threads(threads)   # per calling thread: the chat app's and server's workers too
        start = time.perf_counter()
        yield threads
        self.record(rows, threads, time.perf_counter() - start)

    def next_count(self, rows: int) -> int:
        """The count the next pass of `rows` rows runs with: the current one, or a probe."""
        if self.pinned:
            return self.pinned
        with self._lock:
            return self._next_count(rows)

    def _next_count(self, rows: int) -> int:
        if not self._started:   # the first pass: as many as the cores free now
            self._started = True
            others = self._others_now()
            if others is not None:
                self.current = max(1, self.most - others)
        self._countdown -= 1
        if self._countdown > 0 or len(self._recent.get(rows, ())) < RECENT // 2 or self.most == 1:
            return self.current
        c = self.current
        # one fewer, one more, and half: a count past the free cores is as slow as one more, so
        # stepping by one alone would not find the way down from all cores when several are busy
        candidates = sorted({c - 1, c + 1, max(1, c // 2)} - {0, c, self.most + 1})
        probe = candidates[self._turn % len(candidates)]
        others = self._others_now() if probe > c else None
        if others is not None and others + probe > self.most:
            self._lost()   # no core free for another thread
            return c
        return probe

    def _others_now(self) -> int | None:
        """Other programs' threads ready to run: the fewest of three looks a millisecond apart,
        as one can catch a thread that runs for an instant."""
        seen = []
        for i in range(3):
            if i:
                time.sleep(0.001)
            seen.append(self.others_running())
            if seen[-1] is None or seen[-1] == 0:
                return seen[-1]
        return min(seen)

    def record(self, rows: int, threads: int, seconds: float):
        """How long a pass of `rows` rows took with `threads` threads."""
        if self.pinned:
            return
        with self._lock:
            self._record(rows, threads, seconds)

    def _record(self, rows: int, threads: int, seconds: float):
        recent = self._recent.setdefault(rows, deque(maxlen=RECENT))
        if threads == self.current:
            if len(recent) >= RECENT // 2 and seconds > SLOWER * statistics.median(recent):
                recent.clear()   # the machine changed: judge by the passes from now on
                self._countdown = min(self._countdown, RECENT // 2)
            recent.append(seconds)
        elif len(recent) < RECENT // 2:
            pass   # a pass on another thread cleared the baseline or switched the count meanwhile
        elif seconds < MARGIN * statistics.median(recent):
            self.current, self._recent, self._interval = threads, {}, MIN_INTERVAL
            self._countdown, self._turn = MIN_INTERVAL, self._turn + 1
        else:
            self._lost()

    def _lost(self):
        self._turn += 1
        self._interval = min(2 * self._interval, MAX_INTERVAL)
        self._countdown = self._interval


def procs_running_elsewhere(stat: str = "/proc/stat") -> int | None:
    """Threads ready to run on this machine right now but the one asking (Linux: /proc/stat's
    procs_running); None where the system does not say."""
    try:
        with open(stat, "rb") as f:
            for line in f:
                if line.startswith(b"procs_running "):
                    return max(0, int(line.split()[1]) - 1)
    except (OSError, ValueError):
        pass
    return None

