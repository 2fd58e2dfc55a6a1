"""The chat history database: where it lives, what it keeps, and what it does with a bad file."""
import json
import os
import sqlite3

import pytest

from nibble.runner.text.reasoning import ThinkingOptions
from nibble.runner.settings import SamplerSettings
from nibble.tui import store as store_module
from nibble.tui.store import ChatSettings, Message, Store
from tests.tui_helpers import dead_writer


def test_the_history_is_kept_in_nibbles_data_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path / "home"))
    store, warning = Store.open()
    store.close()
    assert warning is None and store.path == tmp_path / "home" / "history.db" and store.path.is_file()


def test_chats_and_messages_round_trip(tmp_path):
    path = tmp_path / "sub" / "history.db"
    store, warning = Store.open(path)
    assert warning is None and path.exists()
    settings = ChatSettings(system="Be brief.", sampling=SamplerSettings(temperature=0.2), max_tokens=64)
    a = store.create_chat("first", "smollm2", settings)
    b = store.create_chat("second", "smollm2", ChatSettings())
    store.add_message(a.id, Message(None, "user", "Hi"))
    reply = Message(None, "assistant", "Hello!", "stopped", {"generation_tokens": 3})
    store.add_message(a.id, reply)
    assert reply.id is not None
    store.rename_chat(b.id, "renamed")
    store.close()

    store, _ = Store.open(path)
    assert [c.title for c in store.chats()] == ["first", "renamed"]   # the latest message first
    chat = store.chat(a.id)
    assert chat.settings == settings and chat.model == "smollm2"
    assert [(m.role, m.content, m.finish, m.stats) for m in store.messages(a.id)] == [
        ("user", "Hi", None, {}), ("assistant", "Hello!", "stopped", {"generation_tokens": 3})]
    store.update_settings(b.id, ChatSettings(sampling=SamplerSettings(top_k=5)))
    assert store.chat(b.id).settings.sampling.top_k == 5


def test_deleting_messages_and_chats(tmp_path):
    store, _ = Store.open(tmp_path / "h.db")
    chat = store.create_chat("c", "m", ChatSettings())
    ids = [store.add_message(chat.id, Message(None, role, text))
           for role, text in [("user", "1"), ("assistant", "2"), ("user", "3"), ("assistant", "4")]]
    store.delete_messages_from(chat.id, ids[2])
    assert [m.content for m in store.messages(chat.id)] == ["1", "2"]
    store.delete_chat(chat.id)
    assert store.chats() == [] and store.messages(chat.id) == []
    assert store.db.execute("SELECT count(*) FROM messages").fetchone() == (0,)


def test_settings_from_a_newer_or_broken_record():
    assert (ChatSettings.from_json('{"temperature": 0.1, "future_knob": 3}')
            == ChatSettings(sampling=SamplerSettings(temperature=0.1)))
    assert ChatSettings.from_json("not json") == ChatSettings()
    assert ChatSettings.from_json('{"top_p": 2}') == ChatSettings()            # a bad value
    assert ChatSettings.from_json('{"top_k": "many"}') == ChatSettings()       # a bad type
    assert ChatSettings.from_json("[1]") == ChatSettings()


def test_settings_round_trip_under_flat_names(tmp_path):
    store, _ = Store.open(tmp_path / "h.db")
    sampling = SamplerSettings(temperature=0.3, top_k=7, top_p=0.5, min_p=0.1, repetition_penalty=1.2,
                               repeat_last_n=32)
    settings = ChatSettings("Be brief.", sampling, max_tokens=99)
    chat = store.create_chat("c", "m", settings)
    assert store.chat(chat.id).settings == settings
    # One level of SamplerSettings' names, as nibble has always stored them; the seed is the app's.
    stored = json.loads(store.db.execute("SELECT settings FROM chats").fetchone()[0])
    assert stored == {"system": "Be brief.", "temperature": 0.3, "top_k": 7, "top_p": 0.5, "min_p": 0.1,
                      "repetition_penalty": 1.2, "repeat_last_n": 32, "presence_penalty": 0.0,
                      "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
                      "dry_penalty_last_n": -1, "max_tokens": 99, "think": None, "reasoning_budget": None}


def test_a_chats_thinking_settings_round_trip_and_bad_ones_are_refused(tmp_path):
    store, _ = Store.open(tmp_path / "h.db")
    settings = ChatSettings(thinking=ThinkingOptions(think=False, budget=64))
    chat = store.create_chat("c", "m", settings)
    assert store.chat(chat.id).settings == settings
    stored = json.loads(store.db.execute("SELECT settings FROM chats").fetchone()[0])
    assert (stored["think"], stored["reasoning_budget"]) == (False, 64)
    # unsaid in a record of an older nibble: the app's and the model's way
    assert ChatSettings.from_json('{"temperature": 0.1}').thinking == ThinkingOptions()
    for bad in ('{"think": "yes"}', '{"think": 1}', '{"reasoning_budget": -2}', '{"reasoning_budget": 1.5}'):
        assert ChatSettings.from_json(bad) == ChatSettings()


@pytest.mark.parametrize("content", [b"garbage " * 200, b"SQLite format 3\x00" + b"\xff" * 4000])
def test_a_corrupt_file_is_moved_aside_not_overwritten(tmp_path, content):
    path = tmp_path / "history.db"
    path.write_bytes(content)
    store, warning = Store.open(path)
    aside = list(tmp_path.glob("history.db.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content
    assert "could not be read" in warning and aside[0].name in warning
    store.create_chat("fresh", "m", ChatSettings())
    assert [c.title for c in Store.open(path)[0].chats()] == ["fresh"]


def test_a_locked_file_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT", 0.05)
    path = tmp_path / "history.db"
    first, _ = Store.open(path)
    first.create_chat("kept", "m", ChatSettings())
    first.close()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("PRAGMA locking_mode = EXCLUSIVE")
    other.execute("BEGIN EXCLUSIVE")
    try:
        store, warning = Store.open(path)
        assert "locked" in warning and store.path is None
        store.create_chat("in memory", "m", ChatSettings())
    finally:
        other.rollback()
        other.close()
    assert [c.title for c in Store.open(path)[0].chats()] == ["kept"]
    assert not list(tmp_path.glob("history.db.corrupt-*"))


def test_an_unwritable_data_dir_keeps_chats_in_memory(tmp_path):
    (tmp_path / "file").write_text("")
    store, warning = Store.open(tmp_path / "file" / "history.db")
    assert store.path is None and "in memory" in warning


# The schema nibble 0.1 created (user_version 1): no writer column, nor thinking.
SCHEMA_1 = """
CREATE TABLE chats (id INTEGER PRIMARY KEY, title TEXT NOT NULL, model TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY, chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, finish TEXT, stats TEXT, created REAL NOT NULL);
CREATE INDEX messages_by_chat ON messages(chat_id, id);
INSERT INTO chats VALUES (1, 'old chat', 'smollm2', '{}', 1.0, 2.0);
INSERT INTO messages VALUES (1, 1, 'user', 'Hi', NULL, NULL, 1.0), (2, 1, 'assistant', 'Hello!', 'stop', NULL, 2.0);
PRAGMA user_version = 1;
"""


def start_reply(store, chat_id) -> Message:
    """An empty reply, stored as this process's to write (as the app stores one when it starts)."""
    reply = Message(None, "assistant", "", writer=store.writer)
    store.add_message(chat_id, reply)
    return reply


def test_a_version_1_history_is_migrated_and_kept(tmp_path):
    path = tmp_path / "history.db"
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA_1)
    store, warning = Store.open(path)
    assert warning is None
    assert store.db.execute("PRAGMA user_version").fetchone() == (store_module.VERSION,)
    assert [(m.role, m.content, m.finish, m.writer, m.thinking) for m in store.messages(1)] == [
        ("user", "Hi", None, None, ""), ("assistant", "Hello!", "stop", None, "")]
    reply = start_reply(store, 1)
    assert store.messages(1)[-1].writer == store.writer   # the new columns work
    reply.content, reply.thinking, reply.finish = "Bye.", "They are leaving.", "stop"
    store.end_reply(reply)
    assert store.messages(1)[-1].thinking == "They are leaving."
    store.close()
    again, _ = Store.open(path)   # opened again: migrated once only
    assert [m.id for m in again.messages(1)] == [1, 2, reply.id]


def test_a_reply_is_stored_as_it_grows_and_ends_with_its_finish(tmp_path):
    store, _ = Store.open(tmp_path / "h.db")
    chat = store.create_chat("c", "m", ChatSettings())
    reply = start_reply(store, chat.id)
    stream = store.reply_stream(reply.id)
    for text in ["Once", "Once upon", "Once upon a time"]:
        stream.write(text, {"generation_tokens": len(text.split())})
        other, _ = Store.open(tmp_path / "h.db")   # what another process (or a restart) reads
        assert [(m.content, m.finish, m.writer) for m in other.messages(chat.id)] == [(text, None, store.writer)]
        other.close()
    reply.content, reply.finish, reply.stats = "Once upon a time.", "stopped", {"generation_tokens": 5}
    store.end_reply(reply)
    stream.write("Once upon a time. The", {})   # a last token after the app ended it: not stored
    stream.close()
    assert [(m.content, m.finish, m.stats, m.writer) for m in Store.open(tmp_path / "h.db")[0].messages(chat.id)] == [
        ("Once upon a time.", "stopped", {"generation_tokens": 5}, None)]


def test_a_reply_whose_writer_died_is_marked_interrupted_a_live_ones_is_not(tmp_path):
    path = tmp_path / "h.db"
    store, _ = Store.open(path)
    chat = store.create_chat("c", "m", ChatSettings())
    dead, live, empty = (start_reply(store, chat.id) for _ in range(3))
    store.db.execute("UPDATE messages SET content = 'half a rep', writer = ? WHERE id = ?", (dead_writer(), dead.id))
    store.db.execute("UPDATE messages SET content = 'still going' WHERE id = ?", (live.id,))
    store.db.execute("UPDATE messages SET writer = ? WHERE id = ?", (dead_writer(), empty.id))
    store.db.commit()
    # Another nibble chat starts on the same history while this one (live) still writes.
    other, _ = Store.open(path)
    assert [(m.id, m.content, m.finish, m.writer is not None) for m in other.messages(chat.id)] == [
        (dead.id, "half a rep", "interrupted", False), (live.id, "still going", None, True)]
    assert db_count(path, "SELECT count(*) FROM messages WHERE finish = 'interrupted'") == 1


def test_a_writer_tag_names_one_process_not_its_pid():
    tag = store_module.process_tag(os.getpid())
    assert store_module.is_alive(tag)
    pid, start = tag.split(":")
    assert not store_module.is_alive(f"{pid}:{int(start) + 1}")   # the pid, reused by a later process
    assert not store_module.is_alive("garbage")


def db_count(path, sql) -> int:
    with sqlite3.connect(path) as db:
        return db.execute(sql).fetchone()[0]


# The schema of user_version 2: a writer, no thinking.
SCHEMA_2 = """
CREATE TABLE chats (id INTEGER PRIMARY KEY, title TEXT NOT NULL, model TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY, chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, finish TEXT, stats TEXT, created REAL NOT NULL, writer TEXT);
CREATE INDEX messages_by_chat ON messages(chat_id, id);
CREATE INDEX messages_being_written ON messages(writer) WHERE writer IS NOT NULL;
INSERT INTO chats VALUES (1, 'old chat', 'smollm2', '{"temperature": 0.2}', 1.0, 2.0);
INSERT INTO messages VALUES (1, 1, 'user', 'Hi', NULL, NULL, 1.0, NULL), (2, 1, 'assistant', 'Hello!', 'stop', NULL, 2.0, NULL);
PRAGMA user_version = 2;
"""


def test_a_version_2_history_gets_a_column_for_thinking(tmp_path):
    path = tmp_path / "history.db"
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA_2)
    store, warning = Store.open(path)
    assert warning is None and store.db.execute("PRAGMA user_version").fetchone() == (store_module.VERSION,)
    assert [(m.content, m.thinking) for m in store.messages(1)] == [("Hi", ""), ("Hello!", "")]
    assert store.chat(1).settings.sampling.temperature == 0.2   # the settings are kept too
    store.add_message(1, Message(None, "assistant", "Bye.", "stop", thinking="They are leaving."))
    store.close()
    again, _ = Store.open(path)
    assert [m.thinking for m in again.messages(1)] == ["", "", "They are leaving."]


def test_a_replys_thinking_is_stored_as_it_grows_and_kept_if_its_writer_dies(tmp_path):
    path = tmp_path / "h.db"
    store, _ = Store.open(path)
    chat = store.create_chat("c", "m", ChatSettings())
    reply = start_reply(store, chat.id)
    stream = store.reply_stream(reply.id)
    stream.write("", {"generation_tokens": 3}, thinking="The user says hi")   # thinking, no answer yet
    stream.close()
    other, _ = Store.open(path)
    assert [(m.content, m.thinking, m.writer) for m in other.messages(chat.id)] == [
        ("", "The user says hi", store.writer)]
    # Its writer killed while it thought: kept, interrupted, as a reply cut off mid-answer is.
    store.db.execute("UPDATE messages SET writer = ? WHERE id = ?", (dead_writer(), reply.id))
    store.db.commit()
    other, _ = Store.open(path)
    assert [(m.content, m.thinking, m.finish) for m in other.messages(chat.id)] == [
        ("", "The user says hi", "interrupted")]
