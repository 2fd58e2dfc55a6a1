"""What a long step is doing, for the person waiting: a first run's download, import and kernel
compile each say so on stderr, one line, so that no terminal sits silent.

On a terminal the line is rewritten in place as the step goes on, and ended by its last word
(`done`); elsewhere (a pipe, a log file, `nibble serve`'s log) each update is a plain line of its
own, the first once the step has lasted PLAIN_EVERY seconds and then at most one that often (a
step that ends sooner writes only its last word). Whoever shows progress another way (the chat app's
status bar) hands its own function to `shown_by` for the time it does.
"""
from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator

PLAIN_EVERY = 5.0   # seconds between two plain lines of one step (a terminal sees every update)

_lock = threading.Lock()
_show: Callable[[str], None] | None = None
_open = False          # a terminal line written in place and not yet ended
_began: float | None = None   # when the step under way began (its first update)
_last_plain = 0.0             # when a plain line was last written


def update(text: str):
    """`text` is now the state of the step under way ("compiling kernels ...: 12 s")."""
    global _open, _began, _last_plain
    with _lock:
        stream = _stderr_unless_shown(text)
        if stream is None:
            return
        now = time.monotonic()
        if _began is None:
            _began = _last_plain = now
        if _is_terminal(stream):
            width = shutil.get_terminal_size().columns
            stream.write("\r\x1b[K" + text[:max(width - 1, 20)])
            _open = True
        elif now - _last_plain >= PLAIN_EVERY:
            stream.write(text + "\n")
            _last_plain = now
        else:
            return
        stream.flush()


def done(text: str):
    """The step has ended: `text` is its last word, always written (it replaces a terminal's line)."""
    global _open, _began
    with _lock:
        _began = None
        stream = _stderr_unless_shown(text)
        if stream is None:
            return
        stream.write(("\r\x1b[K" if _open and _is_terminal(stream) else "") + text + "\n")
        stream.flush()
        _open = False


def clear():
    """The step has ended with nothing to say: a terminal's line is erased."""
    global _open, _began
    with _lock:
        stream = sys.stderr
        if _show is None and _open and stream is not None and _is_terminal(stream):
            stream.write("\r\x1b[K")
            stream.flush()
        _open, _began = False, None


@contextlib.contextmanager
def step() -> Iterator[None]:
    """A step whose line is cleared when it ends, however it ends (a terminal's erased, a log's
    count begun again): an error after it stands alone, and the next step starts afresh."""
    try:
        yield
    finally:
        clear()


@contextlib.contextmanager
def ticking(say: Callable[[], str], every: float = 1.0) -> Iterator[None]:
    """update(say()) now and every `every` seconds until the block ends, from a thread: a step
    whose own events come seldom (a large matrix quantizing) still shows that it goes on."""
    stop = threading.Event()

    def tick():
        while True:
            update(say())
            if stop.wait(every):
                return
    thread = threading.Thread(target=tick, name="nibble-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def shown_by(show: Callable[[str], None]) -> Iterator[None]:
    """Progress goes to `show` instead of stderr while inside (from any thread)."""
    global _show
    with _lock:
        before, _show = _show, show
    try:
        yield
    finally:
        with _lock:
            _show = before


def _stderr_unless_shown(text: str):
    """stderr to write `text` to, or None: `shown_by`'s function took it, or there is no stderr."""
    if _show is not None:
        _show(text)
        return None
    return sys.stderr


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # a replaced or closed stream
        return False
