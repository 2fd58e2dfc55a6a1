"""One reply being generated: the worker's loop, and the messages it posts to the chat screen.

The loop runs in a thread. It posts what it has at most every `frame` seconds, not every token,
and adapts that frame to what drawing costs the UI thread (see UIClock).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from textual.message import Message as TextualMessage

from .widgets.messages import MessageView

# Seconds between two UI updates of a streaming reply: at least FRAME, at most FRAME_MAX.
FRAME, FRAME_MAX = 0.1, 1.0
# The share of a core that drawing a streaming reply should take at most: on a machine whose
# cores all generate, it is about what drawing costs generation.
UI_SHARE = 0.04


class UIClock:
    """The UI thread's CPU time, read from the generation thread.

    Generation runs on every core, and its parallel loops wait for their slowest thread: while the
    UI thread takes a core to draw, the whole loop waits. So the generation thread spaces its
    updates to keep drawing under UI_SHARE of a core.
    """

    def __init__(self):
        try:
            self.clock = time.pthread_getcpuclockid(threading.main_thread().ident)
            self.cpu = time.clock_gettime(self.clock)
        except (AttributeError, OSError):   # not on this platform: a fixed frame
            self.clock = None
        self.wall = time.monotonic()

    def next_frame(self, frame: float) -> float:
        """The next interval: longer while drawing takes more than UI_SHARE of a core."""
        if self.clock is None:
            return frame
        cpu, wall = time.clock_gettime(self.clock), time.monotonic()
        if wall - self.wall < 0.05:
            return frame
        share = (cpu - self.cpu) / (wall - self.wall)
        self.cpu, self.wall = cpu, wall
        return min(FRAME_MAX, max(FRAME, frame * (share / UI_SHARE) ** 0.5))


@dataclass(eq=False)
class Turn:
    """A reply being generated, and where it goes."""
    chat_id: int
    view: MessageView
    cancel: threading.Event = field(default_factory=threading.Event)
    text: str = ""                 # what the UI has received so far
    stats: dict = field(default_factory=dict)
    saved: bool = False            # stored already (on quit), or not to be stored (chat deleted)
    noticed: bool = False          # the "oldest messages left out" notice is shown


@dataclass
class TurnUpdate(TextualMessage):
    turn: Turn
    text: str
    stats: object   # runner.session.TurnStats


@dataclass
class TurnFailed(TextualMessage):
    turn: Turn
    error: Exception


def run_turn(post: Callable[[TextualMessage], object], turn: Turn, session, messages: list[dict],
             sampler, max_tokens: int):
    """Generate the reply to `messages` with `session` (a runner.session.ChatSession), posting
    TurnUpdates (the last one with a finish_reason) or a TurnFailed. Runs in a worker thread."""
    pending, frame, ui = "", FRAME, UIClock()
    last = time.monotonic()
    try:
        for chunk in session.reply(messages, sampler, max_tokens, turn.cancel):
            pending += chunk.text
            now, s = time.monotonic(), chunk.stats
            if s.finish_reason or s.generation_tokens <= 1 or now - last >= frame:
                post(TurnUpdate(turn, pending, s))
                pending, last = "", now
                frame = ui.next_frame(frame)
    except Exception as e:   # shown as a notification; the app goes on
        post(TurnFailed(turn, e))
