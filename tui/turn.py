"""One reply being generated: the worker's loop, and the messages it posts to the chat screen.

The loop runs in a thread worker. It posts what it has at most every `frame` seconds, not every
token, and adapts that frame to what drawing costs the UI thread (see UIClock). Every SAVE seconds
it also stores the reply so far, thinking and answer (store.ReplyStream): a killed app loses that
much text at most. Cancelling the worker stops the reply: the loop stops iterating after the
current token (or prefill chunk).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from textual.message import Message as TextualMessage
from textual.worker import Worker

from .store import ReplyStream
from .widgets.messages import MessageView

# Seconds between two UI updates of a streaming reply: at least FRAME, at most FRAME_MAX.
FRAME, FRAME_MAX = 0.1, 1.0
# The share of a core that drawing a streaming reply should take at most: on a machine whose
# cores all generate, it is about what drawing costs generation.
UI_SHARE = 0.04
# Seconds between two writes of a streaming reply to the history: what a kill -9 may lose. Not the
# UI's frame, which grows while drawing is slow; a write costs about a tenth of a millisecond.
SAVE = 0.1


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
    worker: Worker | None = None   # the thread worker generating it
    text: str = ""                 # the answer the UI has received so far
    thinking: str = ""             # the thinking the UI has received so far (a model that thinks)
    stats: dict = field(default_factory=dict)   # TurnStats, and thinking_tokens where it thought
    saved: bool = False            # stored already (on quit), or not to be stored (chat deleted)
    noticed: bool = False          # the "oldest messages left out" notice is shown

    def stop(self):
        """Ask the worker to stop after the current token; what was written is kept."""
        if self.worker is not None:
            self.worker.cancel()

    @property
    def stopping(self) -> bool:
        return self.worker is not None and self.worker.is_cancelled


@dataclass
class TurnUpdate(TextualMessage):
    turn: Turn
    text: str                 # the new answer text
    stats: object             # runner.generation.session.TurnStats
    thinking: str = ""        # the new thinking text, which comes before the answer
    thinking_tokens: int = 0  # of the reply's tokens so far, those that were thinking


def stored_stats(stats, thinking_tokens: int) -> dict:
    """A reply's stats as stored with it: the TurnStats, and how long it thought if it did."""
    return asdict(stats) | ({"thinking_tokens": thinking_tokens} if thinking_tokens else {})


@dataclass
class TurnFailed(TextualMessage):
    turn: Turn
    error: Exception


def run_turn(post: Callable[[TextualMessage], object], turn: Turn, session, messages: list[dict],
             sampling, max_tokens: int, stream: ReplyStream | None = None, thinking=None):
    """Generate the reply to `messages` with `session` (a runner.generation.session.ChatSession),
    `sampling` (a SamplerSettings) and `thinking` (the chat's reasoning.ThinkingOptions, None:
    the session's), posting TurnUpdates (the last one with a finish_reason, "stopped" once the
    turn is stopping) or a TurnFailed, and writing the text so far to `stream` every SAVE
    seconds. Runs in the turn's worker thread."""
    text, thought, posted, posted_thought, frame, ui = "", "", 0, 0, FRAME, UIClock()
    last = saved = time.monotonic()
    chunks = session.reply(messages, sampling, max_tokens, thinking)
    try:
        for chunk in chunks:
            text += chunk.text
            thought += chunk.thinking
            now, s, thinking_tokens = time.monotonic(), chunk.stats, chunk.thinking_tokens
            if turn.stopping and not s.finish_reason:
                # Stop before the final update: once it is handled, the next reply may start.
                chunks.close()
                s = replace(s, finish_reason="stopped")
            if stream is not None and (s.finish_reason or s.generation_tokens <= 1 or now - saved >= SAVE):
                # before the UI has it: the app ends the reply
                stream.write(text, stored_stats(s, thinking_tokens), thought)
                saved = now
            if s.finish_reason or s.generation_tokens <= 1 or now - last >= frame:
                post(TurnUpdate(turn, text[posted:], s, thought[posted_thought:], thinking_tokens))
                posted, posted_thought, last = len(text), len(thought), now
                frame = ui.next_frame(frame)
    except Exception as e:   # shown as a notification; the app goes on
        post(TurnFailed(turn, e))
    finally:
        if stream is not None:
            stream.close()
