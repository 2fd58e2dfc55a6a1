"""Helpers for the chat app's pilots: one shared tiny model, waiting, sending, reading the database."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from nibble.runner.settings import SamplerSettings
from nibble.tui.app import ChatApp
from nibble.tui.store import ChatSettings, process_tag
from nibble.tui.widgets.prompt import PromptInput

# make_app's new chats on the tiny model (whose generation_config.json sets no sampling)
GREEDY = ChatSettings(sampling=SamplerSettings(temperature=0), max_tokens=8)


def make_app(tiny, model: str | None = "tiny", load=None, **kwargs) -> ChatApp:
    """The app on the shared, already loaded tiny model (or on `load`), greedy unless told otherwise."""
    kwargs.setdefault("sampling", {"temperature": 0})
    kwargs.setdefault("max_tokens", GREEDY.max_tokens)
    return ChatApp(model, load=load or (lambda ref, quant: tiny), **kwargs)


async def wait_for(pilot, condition, timeout: float = 180.0, what: str = "condition"):
    # generous: a reply's first tokens may wait for the kernels' first compile, which on a cold
    # cache, beside the suite's other worker, took over 20 s
    for _ in range(int(timeout / 0.01)):   # at least `timeout` seconds of pauses
        if condition():
            return
        await pilot.pause(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def ready(pilot):
    await wait_for(pilot, lambda: pilot.app.session is not None, what="the model")


async def idle(pilot):
    """Until no reply runs or is due, and the UI has caught up."""
    screen = pilot.app.chat_screen
    await wait_for(pilot, lambda: screen.turn is None and not screen.want_reply, what="the reply")
    await pilot.pause()


async def send(pilot, text: str, wait: bool = True):
    """Type `text` and press Enter; with wait, until the reply is done. (Without: no pilot.press,
    which waits for the process to look idle, and a generating process never does.)"""
    screen = pilot.app.chat_screen
    screen.prompt.text = text
    if wait:
        await pilot.press("enter")
        await idle(pilot)
    else:
        screen.prompt.post_message(PromptInput.Submitted(text))
        # Sent (or queued) once the box is cleared. (pilot.pause() waits for an idle process too.)
        await wait_for(pilot, lambda: screen.prompt.text == "", what="the message to be taken")


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


def db_rows(home: Path, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(home / "history.db") as db:
        return db.execute(sql, args).fetchall()


def stored_messages(home: Path) -> list[tuple]:
    return db_rows(home, "SELECT chat_id, role, content, finish FROM messages ORDER BY id")


def dead_writer() -> str:
    """The writer tag (store.process_tag) of a process that has exited, as a killed app leaves."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    tag = process_tag(p.pid)
    p.kill()
    p.wait()
    assert tag is not None and process_tag(p.pid) != tag
    return tag
