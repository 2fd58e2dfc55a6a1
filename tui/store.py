"""Conversations kept in SQLite: chats with their settings, and their messages.

One file, `history.db` in nibble's data directory. Every write is its own transaction, so a chat
is on disk as soon as a message is sent, and a reply as it is written: its row is made when it
starts, names its writer (a process), and grows a few times a second until it ends. A reply whose
writer died (kill -9, a crash, a power cut) is marked "interrupted" when the history is next read,
and kept as far as it was written. A file that cannot be read is moved aside (never overwritten)
and a new history started; a file another program keeps locked is left alone and this session's
chats are kept in memory.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from nibble.formats.errors import NibbleError
from nibble.formats.image import ImageError, Picture, open_image
from nibble.formats.paths import data_home
from nibble.runner.text.reasoning import ThinkingOptions
from nibble.runner.settings import MAX_TOKENS, SamplerSettings

# Seconds to wait for another nibble chat's write before calling the file locked.
BUSY_TIMEOUT = 2.0

VERSION = 4
WRITING_INDEX = "CREATE INDEX messages_being_written ON messages(writer) WHERE writer IS NOT NULL"
IMAGES = """
CREATE TABLE images (
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    position   INTEGER NOT NULL,            -- its place among the message's images
    name       TEXT NOT NULL,
    data       BLOB NOT NULL,               -- the file's bytes, as attached
    PRIMARY KEY (message_id, position)
)"""
SCHEMA = ["""
CREATE TABLE chats (
    id       INTEGER PRIMARY KEY,
    title    TEXT NOT NULL,
    model    TEXT NOT NULL DEFAULT '',      -- the model the chat was started with
    settings TEXT NOT NULL DEFAULT '{}',    -- ChatSettings as JSON
    created  REAL NOT NULL,
    updated  REAL NOT NULL                  -- the sidebar lists the latest first
)""", """
CREATE TABLE messages (
    id      INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role    TEXT NOT NULL,                  -- system, user or assistant
    content TEXT NOT NULL,                  -- a reply's answer
    thinking TEXT NOT NULL DEFAULT '',      -- a reply's thinking (a model that thinks), before its answer
    finish  TEXT,                           -- a reply's end: stop, length, context, stopped
                                            -- (Esc, quit), error or interrupted (its writer died)
    stats   TEXT,                           -- a reply's TurnStats as JSON
    created REAL NOT NULL,
    writer  TEXT                            -- a reply being written: its process (process_tag)
)""", "CREATE INDEX messages_by_chat ON messages(chat_id, id)", WRITING_INDEX, IMAGES]
# Each version's way to the next.
MIGRATIONS = {1: ["ALTER TABLE messages ADD COLUMN writer TEXT", WRITING_INDEX],
              2: ["ALTER TABLE messages ADD COLUMN thinking TEXT NOT NULL DEFAULT ''"],
              3: [IMAGES]}


@dataclass(frozen=True)
class ChatSettings:
    """A chat's system prompt, sampling settings, reply length and thinking, stored with the chat."""
    system: str = ""                                # "": the chat template's own
    sampling: SamplerSettings = SamplerSettings()   # its seed is unused: the app's (--seed) applies
    max_tokens: int = MAX_TOKENS
    # think and budget only; unsaid, the app's (--think, --reasoning-budget) or the model's way
    thinking: ThinkingOptions = ThinkingOptions()

    def flat(self) -> dict:
        """The settings under one level of names (SamplerSettings' own, but the seed, plus system,
        max_tokens, think and reasoning_budget): as stored, and as the settings screen shows them."""
        sampling = {k: v for k, v in asdict(self.sampling).items() if k != "seed"}
        return {"system": self.system, **sampling, "max_tokens": self.max_tokens,
                "think": self.thinking.think, "reasoning_budget": self.thinking.budget}

    @classmethod
    def from_flat(cls, values: dict) -> ChatSettings:
        """The settings that flat() gave; missing names take their defaults. Raises NibbleError
        (a bad sampling value) or TypeError (a value of the wrong type)."""
        names = {f.name for f in fields(SamplerSettings)} - {"seed"}
        sampling = SamplerSettings(**{k: v for k, v in values.items() if k in names})
        return cls(values.get("system", ""), sampling, values.get("max_tokens", MAX_TOKENS),
                   _thinking(values.get("think"), values.get("reasoning_budget")))

    @classmethod
    def from_json(cls, text: str | None, default: ChatSettings | None = None) -> ChatSettings:
        """Stored settings over `default`; unknown keys (a newer nibble's) are ignored, and a
        record that cannot be read (hand-edited, broken) gives `default`."""
        default = default or cls()
        try:
            stored = json.loads(text or "{}")
        except ValueError:
            return default
        if not isinstance(stored, dict):
            return default
        base = default.flat()
        try:
            return cls.from_flat({**base, **{k: v for k, v in stored.items() if k in base}})
        except (TypeError, NibbleError):
            return default

    def to_json(self) -> str:
        return json.dumps(self.flat())


def _thinking(think, budget) -> ThinkingOptions:
    """A chat's thinking options, checked as the command line's flags are."""
    if think is not None and type(think) is not bool:
        raise TypeError(f"think must be true, false or null, not {think!r}")
    if budget is not None and (type(budget) is not int or budget < -1):
        raise TypeError(f"reasoning_budget must be a whole number from -1, not {budget!r}")
    return ThinkingOptions(think, budget)


@dataclass
class Chat:
    id: int
    title: str
    model: str
    settings: ChatSettings
    created: float
    updated: float


@dataclass
class Message:
    id: int | None
    role: str
    content: str
    finish: str | None = None
    stats: dict = field(default_factory=dict)
    writer: str | None = None   # a reply being written: by this process or another nibble chat
    thinking: str = ""          # a reply's thinking, kept apart from its answer (content)
    images: list[Picture] = field(default_factory=list)   # a user's attached images, in order


class Store:
    """The history database. Methods raise sqlite3.Error; the app turns it into a notification."""

    def __init__(self, db: sqlite3.Connection, path: Path | None):
        self.db = db
        self.path = path            # None: in memory only
        self.writer = process_tag(os.getpid())

    @classmethod
    def open(cls, path: Path | None = None) -> tuple[Store, str | None]:
        """-> (store, a warning to show or None). Never raises: the app must start."""
        path = path or data_home() / "history.db"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return cls(_connect(path), path), None
        except sqlite3.OperationalError as e:
            if _is_locked(e):
                return cls.memory(), (f"{path} is locked by another program (another nibble chat?): "
                                      "this session's chats are kept in memory only. Close the other "
                                      "program and restart to keep them.")
            why = e
        except sqlite3.DatabaseError as e:   # not a database, malformed, ...
            why = e
        except OSError as e:
            return cls.memory(), (f"cannot create {path.parent} ({e.strerror}): this session's chats "
                                  "are kept in memory only; set NIBBLE_HOME to a writable folder.")
        aside = _move_aside(path)
        if aside is None:
            return cls.memory(), (f"{path} cannot be read ({why}) nor moved aside: this session's "
                                  "chats are kept in memory only.")
        try:
            return cls(_connect(path), path), (f"{path.name} could not be read ({why}): it was kept "
                                               f"as {aside.name} and a new history was started.")
        except sqlite3.Error as e:
            return cls.memory(), f"cannot create {path} ({e}): chats are kept in memory only."

    @classmethod
    def memory(cls) -> Store:
        return cls(_connect(":memory:"), None)

    def close(self):
        self.db.close()

    # Chats

    def chats(self) -> list[Chat]:
        rows = self.db.execute("SELECT id, title, model, settings, created, updated FROM chats "
                               "ORDER BY updated DESC, id DESC").fetchall()
        return [self._chat(r) for r in rows]

    def chat(self, chat_id: int) -> Chat | None:
        row = self.db.execute("SELECT id, title, model, settings, created, updated FROM chats "
                              "WHERE id = ?", (chat_id,)).fetchone()
        return self._chat(row) if row else None

    def create_chat(self, title: str, model: str, settings: ChatSettings) -> Chat:
        now = time.time()
        with self.db:
            cur = self.db.execute("INSERT INTO chats (title, model, settings, created, updated) "
                                  "VALUES (?, ?, ?, ?, ?)", (title, model, settings.to_json(), now, now))
        return Chat(cur.lastrowid, title, model, settings, now, now)

    def rename_chat(self, chat_id: int, title: str):
        with self.db:
            self.db.execute("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))

    def update_settings(self, chat_id: int, settings: ChatSettings):
        with self.db:
            self.db.execute("UPDATE chats SET settings = ? WHERE id = ?", (settings.to_json(), chat_id))

    def delete_chat(self, chat_id: int):
        with self.db:
            self.db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    # Messages

    def messages(self, chat_id: int) -> list[Message]:
        _settle(self.db, chat_id)
        rows = self.db.execute("SELECT id, role, content, finish, stats, writer, thinking FROM messages "
                               "WHERE chat_id = ? ORDER BY id", (chat_id,)).fetchall()
        images: dict[int, list[Picture]] = {}
        for message_id, name, data in self.db.execute(
                "SELECT message_id, name, data FROM images JOIN messages ON messages.id = message_id "
                "WHERE chat_id = ? ORDER BY message_id, position", (chat_id,)):
            try:
                images.setdefault(message_id, []).append(open_image(data, name))
            except ImageError:   # a file Pillow no longer reads: the message stands without it
                pass
        return [Message(i, role, content, finish, json.loads(stats) if stats else {}, writer, thinking,
                        images.get(i, [])) for i, role, content, finish, stats, writer, thinking in rows]

    def add_message(self, chat_id: int, message: Message) -> int:
        """Store `message` at the end of the chat; sets and returns its id."""
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO messages (chat_id, role, content, thinking, finish, stats, created, writer) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (chat_id, message.role, message.content, message.thinking, message.finish,
                 json.dumps(message.stats) if message.stats else None, now, message.writer))
            self.db.executemany("INSERT INTO images (message_id, position, name, data) VALUES (?, ?, ?, ?)",
                                [(cur.lastrowid, k, p.name, p.data) for k, p in enumerate(message.images)])
            self.db.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
        message.id = cur.lastrowid
        return message.id

    def reply_stream(self, message_id: int) -> ReplyStream | None:
        """A writer of the reply's text as it grows, for the generation thread (None in memory:
        nothing to keep across a kill)."""
        return ReplyStream(self.path, message_id, self.writer) if self.path else None

    def end_reply(self, message: Message):
        """Store the reply's final text, thinking, stats and finish; it is nobody's to write any more."""
        message.writer = None
        with self.db:
            self.db.execute("UPDATE messages SET content = ?, thinking = ?, finish = ?, stats = ?, writer = NULL "
                            "WHERE id = ?", (message.content, message.thinking, message.finish,
                                             json.dumps(message.stats) if message.stats else None,
                                             message.id))
            self.db.execute("UPDATE chats SET updated = ? WHERE id = (SELECT chat_id FROM messages "
                            "WHERE id = ?)", (time.time(), message.id))

    def delete_messages_from(self, chat_id: int, message_id: int):
        """Delete the message and every later one of the chat (regenerate, edit and resend)."""
        with self.db:
            self.db.execute("DELETE FROM messages WHERE chat_id = ? AND id >= ?", (chat_id, message_id))

    @staticmethod
    def _chat(row) -> Chat:
        i, title, model, settings, created, updated = row
        return Chat(i, title, model, ChatSettings.from_json(settings), created, updated)


class ReplyStream:
    """A reply's text, thinking and stats written as they grow, each time in one transaction, from the
    generation thread on a connection of its own: the UI thread never waits for the disk."""

    def __init__(self, path: Path, message_id: int, writer: str):
        self.path, self.message_id, self.writer = path, message_id, writer
        self.db: sqlite3.Connection | None = None   # opened by the thread that writes

    def write(self, text: str, stats: dict, thinking: str = ""):
        try:
            if self.db is None:
                self.db = _open(self.path)
            with self.db:
                # Only while the reply is still this process's: the app may have ended it (quit)
                # or deleted its chat meanwhile.
                self.db.execute("UPDATE messages SET content = ?, thinking = ?, stats = ? "
                                "WHERE id = ? AND writer = ?",
                                (text, thinking, json.dumps(stats), self.message_id, self.writer))
        except sqlite3.Error:
            pass   # a busy or full disk: the next write, or the app's at the reply's end, tries again

    def close(self):
        if self.db is not None:
            self.db.close()


def process_tag(pid: int) -> str | None:
    """`pid` and its start time, "<pid>:<ticks since boot>": a name that another process reusing
    the pid later does not share (where there is no /proc, the pid alone). None: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return f"{pid}:{stat.rsplit(')', 1)[1].split()[19]}"   # field 22, starttime
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:   # another user's: alive
        pass
    return str(pid)


def is_alive(writer: str) -> bool:
    """Whether the process a reply names as its writer still runs."""
    pid = writer.split(":")[0]
    return pid.isdigit() and process_tag(int(pid)) == writer


def _open(path: Path | str) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT, check_same_thread=False)
    db.execute("PRAGMA foreign_keys = ON")
    # Commits reach the OS at once (a killed process loses nothing) but are not fsynced until a
    # checkpoint: a streaming reply's few writes a second cost microseconds, not a disk flush
    # each. A power cut may lose the last second.
    db.execute("PRAGMA synchronous = NORMAL")
    return db


def _connect(path: Path | str) -> sqlite3.Connection:
    """Open, check and create or migrate the schema; raises sqlite3 errors for a bad or locked file."""
    db = _open(path)
    try:
        ok = db.execute("PRAGMA quick_check").fetchone()[0]
        if ok != "ok":
            raise sqlite3.DatabaseError(f"integrity check: {ok}")
        if path != ":memory:":
            # WAL: a second nibble chat can read while this one writes.
            db.execute("PRAGMA journal_mode = WAL")
        if db.execute("PRAGMA user_version").fetchone()[0] < VERSION:
            _migrate(db)
        db.execute("SELECT id, title, model, settings, created, updated FROM chats LIMIT 1").fetchall()
        db.execute("SELECT id, chat_id, role, content, thinking, finish, stats, writer FROM messages "
                   "LIMIT 1").fetchall()
        _settle(db)
    except BaseException:
        db.close()
        raise
    return db


def _migrate(db: sqlite3.Connection):
    """Bring the schema to VERSION in one transaction. IMMEDIATE: of two apps opening an old file
    at once, one migrates and the other then finds it done."""
    db.execute("BEGIN IMMEDIATE")
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            steps = SCHEMA
        else:
            steps = [step for v in range(version, VERSION) for step in MIGRATIONS[v]]
        for step in steps:
            db.execute(step)
        db.execute(f"PRAGMA user_version = {max(version, VERSION)}")
        db.commit()
    except BaseException:
        db.rollback()
        raise


def _settle(db: sqlite3.Connection, chat_id: int | None = None):
    """Mark the replies (of one chat, or all) whose writer died as interrupted, as far as
    they were written; one that had no text yet (nor thinking) is dropped, as a reply stopped
    before its first word is. A live writer's (another nibble chat's) are left to it."""
    one_chat = (" AND chat_id = ?", (chat_id,)) if chat_id is not None else ("", ())
    rows = db.execute("SELECT id, content != '' OR thinking != '', writer FROM messages "
                      "WHERE writer IS NOT NULL" + one_chat[0], one_chat[1]).fetchall()
    dead = [(i, written) for i, written, writer in rows if not is_alive(writer)]
    if dead:
        with db:
            db.executemany("UPDATE messages SET finish = 'interrupted', writer = NULL WHERE id = ?",
                           [(i,) for i, written in dead if written])
            db.executemany("DELETE FROM messages WHERE id = ?", [(i,) for i, written in dead if not written])


def _is_locked(e: sqlite3.OperationalError) -> bool:
    return "locked" in str(e) or "busy" in str(e)


def _move_aside(path: Path) -> Path | None:
    """Rename a bad database (and its WAL files) to <name>.corrupt-<time>; None if impossible."""
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.corrupt-{stamp}-{n}"), n + 1
    try:
        os.rename(path, aside)
        for suffix in ("-wal", "-shm"):
            side = path.with_name(path.name + suffix)
            if side.exists():
                os.rename(side, aside.with_name(aside.name + suffix))
    except OSError:
        return None
    return aside
