"""The chat app, driven headless with Textual pilots on the tiny seeded model."""
import threading
from pathlib import Path
import types

import pytest
from textual.worker import get_current_worker

from nibble.formats import catalog, presets
from nibble.formats.errors import NibbleError
from nibble.runner.generation import session as session_module
from nibble.runner.loader import load
from nibble.runner.text.reasoning import ThinkingOptions
from nibble.runner.settings import SamplerSettings
from nibble.tui.screens.keys import KeysScreen
from nibble.tui.screens.models import ModelPicker
from nibble.tui.screens.settings import SettingsScreen
from nibble.tui import turn as turn_module
from nibble.tui.store import ChatSettings, Message, Store
from tests.tui_helpers import (GREEDY, db_rows, dead_writer, idle, make_app, notes, ready, send,
                               stored_messages, wait_for)

SIZE = (100, 30)
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"   # Textual runs on asyncio


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model, tok = load(str(tiny_dir))
    tok.eos_ids = frozenset()   # replies run to max_tokens: their length is known
    return model, tok


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))
    return tmp_path


HELD = 40   # the responses of a reply before `held` holds it: a few words on the screen and on disk


class Held(list):
    """The responses generated, one entry each; `reached` is set once the first reply is held."""

    def __init__(self):
        super().__init__()
        self.reached = threading.Event()


@pytest.fixture
def held(monkeypatch):
    """Generation that holds the first reply at HELD responses until its turn is stopped (Esc, a
    quit): a test that waits for `reached` stops the reply halfway however fast or slow the
    machine, never after it ended. Every response is shown and stored as it comes (turn.FRAME and
    SAVE 0): the screen and the disk have all of the held reply so far."""
    real = session_module.stream_generate
    responses, first = Held(), [True]

    def held_reply(*args, **kwargs):
        worker, hold = get_current_worker(), first.pop() if first else False
        for n, r in enumerate(real(*args, **kwargs)):
            if hold and n == HELD:
                stopped, cancel = threading.Event(), worker.cancel
                worker.cancel = lambda: (cancel(), stopped.set())
                responses.reached.set()
                if not worker.is_cancelled:
                    stopped.wait(60)   # a turn never stopped: let it end, and the test fail
            responses.append(r)
            yield r
    monkeypatch.setattr(session_module, "stream_generate", held_reply)
    monkeypatch.setattr(turn_module, "FRAME", 0)
    monkeypatch.setattr(turn_module, "SAVE", 0)
    return responses


def views(app):
    return app.chat_screen.chat_view.views()


async def test_the_line_that_says_which_model_runs_instead_of_the_default_is_shown(home, tiny):
    """`nibble chat` without -m, offline: the app says that the fallback runs, and why (stderr is
    under the app's screen)."""
    app = make_app(tiny, note="nibble: running smollm2 (...): the default, qwen3-1.7b, is not downloaded ...")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert "running smollm2 (...): the default, qwen3-1.7b, is not downloaded ..." in notes(app)


async def test_a_message_gets_a_streamed_reply_and_both_are_stored(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Hello there")
        screen = app.chat_screen
        assert [m.role for m in screen.history] == ["user", "assistant"]
        reply = screen.history[1]
        assert reply.content and reply.finish == "length" and reply.stats["generation_tokens"] == 8
        assert views(app)[1].source == reply.content
        assert "8 tokens" in str(views(app)[1].query_one(".meta").render())
        assert screen.prompt.text == ""
    assert stored_messages(home) == [(1, "user", "Hello there", None), (1, "assistant", reply.content, "length")]
    assert db_rows(home, "SELECT title FROM chats") == [("Hello there",)]


async def test_a_draft_model_drafts_the_chats_replies(home, tiny, tiny_dir):
    """nibble chat --draft-model: the session drafts by it (here the model itself), the reply the
    same as without."""
    plain = make_app(tiny, draft=0)
    async with plain.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Hello there")
        want = plain.chat_screen.history[1].content
    app = make_app(tiny, draft_model=str(tiny_dir))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.session.draft_model is not None
        await send(pilot, "Hello there")
        assert app.chat_screen.history[1].content == want


async def test_enter_sends_shift_enter_and_ctrl_j_insert_new_lines(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("a", "shift+enter", "b", "ctrl+j", "c")
        assert app.chat_screen.prompt.text == "a\nb\nc" and not app.chat_screen.history
        await pilot.press("enter")
        await idle(pilot)
        assert app.chat_screen.history[0].content == "a\nb\nc"


async def test_an_empty_prompt_does_nothing(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("enter")
        await send(pilot, "  \n  ")
        assert app.chat_screen.history == [] and app.chat_screen.chat is None
        assert app.store.chats() == []


async def test_escape_stops_the_reply_at_once_and_keeps_it(home, tiny, held, monkeypatch):
    from nibble.tui.screens.chat import ChatScreen
    tokens = {}   # how many had been generated when Esc was handled, and when the turn ended
    stop, end = ChatScreen.action_stop, ChatScreen._end_turn
    monkeypatch.setattr(ChatScreen, "action_stop", lambda self: (tokens.setdefault("esc", len(held)),
                                                                 stop(self)))

    async def end_turn(self, turn, finish):
        tokens.setdefault("end", len(held))
        await end(self, turn, finish)
    monkeypatch.setattr(ChatScreen, "_end_turn", end_turn)
    app = make_app(tiny, max_tokens=200)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Tell me a long story", wait=False)
        screen = app.chat_screen
        await wait_for(pilot, lambda: held.reached.is_set() and len(screen.turn.text) > 5, what="text")
        await pilot.press("escape")
        await idle(pilot)
        assert tokens["end"] - tokens["esc"] <= 1   # Esc stops before the next token
        reply = screen.history[-1]
        assert reply.finish == "stopped" and 0 < reply.stats["generation_tokens"] < 200
        assert views(app)[-1].source == reply.content
        assert "stopped" in str(views(app)[-1].query_one(".meta").render())
    assert stored_messages(home)[-1] == (1, "assistant", reply.content, "stopped")


async def test_a_reply_is_stored_as_it_is_written(home, tiny, held):
    app = make_app(tiny, max_tokens=200)
    replies = lambda: db_rows(home, "SELECT content, finish, writer FROM messages WHERE role = 'assistant'")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Tell me a long story", wait=False)
        await wait_for(pilot, lambda: held.reached.is_set() and replies() and len(replies()[0][0]) > 5,
                       what="the reply on disk")
        [(partial, finish, writer)] = replies()
        assert finish is None and writer == app.store.writer   # being written, by this app
        await pilot.press("escape")
        await idle(pilot)
        reply = app.chat_screen.history[-1]
    assert replies() == [(reply.content, "stopped", None)] and reply.content.startswith(partial)


async def test_a_reply_whose_app_was_killed_shows_as_interrupted_and_the_chat_goes_on(home, tiny):
    store, _ = Store.open()
    chat = store.create_chat("Story", "tiny", GREEDY)
    store.add_message(chat.id, Message(None, "user", "Tell me a story"))
    store.add_message(chat.id, Message(None, "assistant", "Once upon a", writer=dead_writer()))
    store.close()
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await app.chat_screen.open_chat(chat.id)
        reply = views(app)[-1]
        assert reply.has_class("interrupted") and reply.source == "Once upon a"
        assert str(reply.query_one(".meta").render()) == "interrupted"
        await send(pilot, "Go on")
        # The model sees the interrupted reply as its turn, as far as it was written.
        assert app.chat_screen.conversation()[:3] == [
            {"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon a"},
            {"role": "user", "content": "Go on"}]
    assert [r[1:] for r in stored_messages(home)][:3] == [
        ("user", "Tell me a story", None), ("assistant", "Once upon a", "interrupted"), ("user", "Go on", None)]


async def test_a_message_sent_right_after_esc_goes_after_the_stopped_reply(home, tiny, held):
    app = make_app(tiny, max_tokens=100)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Tell me a long story", wait=False)
        screen = app.chat_screen
        await wait_for(pilot, lambda: held.reached.is_set() and len(screen.turn.text) > 5, what="text")
        screen.action_stop()
        await send(pilot, "Shorter, please", wait=False)   # before the stopped reply is stored
        await wait_for(pilot, lambda: len(screen.history) == 4 and screen.turn is None, what="two replies")
        assert [m.role for m in screen.history] == ["user", "assistant", "user", "assistant"]
        assert screen.history[1].finish == "stopped"
    assert [r[1:] for r in stored_messages(home)][2] == ("user", "Shorter, please", None)
    assert [r[1] for r in stored_messages(home)] == ["user", "assistant", "user", "assistant"]


async def test_regenerate_replaces_the_last_reply_and_reuses_the_prompt(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Hello there")
        first = app.chat_screen.history[-1]
        await pilot.press("ctrl+r")
        await idle(pilot)
        history = app.chat_screen.history
        assert [m.role for m in history] == ["user", "assistant"] and history[-1] is not first
        assert history[-1].content == first.content   # greedy: the same reply again
        assert history[-1].stats["prefilled"] == 1    # everything but the last prompt token reused
        assert len(views(app)) == 2
    assert [r[1] for r in stored_messages(home)] == ["user", "assistant"]


@pytest.mark.parametrize("key", ["ctrl+l", "up"])
async def test_edit_and_resend_the_last_prompt(home, tiny, key):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "The quick brown fox")
        await send(pilot, "jumps")
        await pilot.press(key)
        screen = app.chat_screen
        assert screen.prompt.text == "jumps" and screen.editing is screen.history[2]
        assert views(app)[2].has_class("editing")
        await pilot.press("escape")   # Esc cancels the edit
        assert screen.editing is None and screen.prompt.text == ""
        await pilot.press(key)
        await pilot.press("space", "o", "v", "e", "r")
        await pilot.press("enter")
        await idle(pilot)
        assert [m.content for m in screen.history if m.role == "user"] == ["The quick brown fox", "jumps over"]
        assert len(screen.history) == 4 and len(views(app)) == 4
    assert [r[2] for r in stored_messages(home) if r[1] == "user"] == ["The quick brown fox", "jumps over"]


async def test_copy_the_last_reply_or_a_code_block(home, tiny):
    store, _ = Store.open()
    chat = store.create_chat("code", "tiny", GREEDY)
    store.add_message(chat.id, Message(None, "user", "a function?"))
    reply = "Here:\n\n```python\ndef f(x):\n    return x**2\n```\n\nand\n\n```sh\nls\n```\n"
    store.add_message(chat.id, Message(None, "assistant", reply, "stop"))
    store.close()
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await app.chat_screen.open_chat(chat.id)
        await pilot.press("ctrl+t")
        assert app.clipboard == reply
        await pilot.press("ctrl+f")
        assert app.clipboard == "ls"
        await pilot.press("ctrl+f")   # again: the block before
        assert app.clipboard == "def f(x):\n    return x**2"
        await pilot.press("ctrl+f")
        assert app.clipboard == "ls"


async def test_turn_two_prefills_only_the_new_tokens_and_says_so(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "The quick brown fox")
        await send(pilot, "jumps over the lazy dog")
        one, two = app.chat_screen.history[1].stats, app.chat_screen.history[3].stats
        assert two["reused"] >= one["prompt_tokens"] and two["prefilled"] < two["prompt_tokens"]
        meta = str(views(app)[3].query_one(".meta").render())
        assert f"prefill {two['prefilled']} tokens, {two['reused']} reused" in meta
        status = app.chat_screen.status
        assert f"ctx {two['ctx_used']}/256" in str(status.query_one("#status-ctx").render())


async def test_a_chat_survives_a_restart(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Remember me")
        before = [(m.role, m.content) for m in app.chat_screen.history]
        await pilot.press("ctrl+q")
    assert not app.is_running
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        chats = app.chat_screen.query_one("#chats")
        assert [item.chat.title for item in chats.children] == ["Remember me"]
        await pilot.press("tab", "enter")   # into the chat list, open the newest chat
        await wait_for(pilot, lambda: app.chat_screen.chat is not None)
        assert [(m.role, m.content) for m in app.chat_screen.history] == before
        assert [v.message.content for v in views(app)] == [c for _, c in before]
        await ready(pilot)
        await send(pilot, "and again")   # the resumed chat goes on
        assert len(app.chat_screen.history) == 4
    assert len(stored_messages(home)) == 4


@pytest.mark.parametrize("key", ["ctrl+q", "ctrl+c"])
async def test_quitting_during_a_reply_keeps_what_was_written(home, tiny, held, key):
    app = make_app(tiny, max_tokens=200)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Tell me a long story", wait=False)
        screen = app.chat_screen
        await wait_for(pilot, lambda: held.reached.is_set() and len(screen.turn.text) > 5, what="text")
        partial = screen.turn.text
        await pilot.press(key)
    assert not app.is_running
    rows = stored_messages(home)
    assert rows[0] == (1, "user", "Tell me a long story", None)
    assert rows[1][1:] == ("assistant", rows[1][2], "stopped") and rows[1][2].startswith(partial)


async def test_quitting_while_idle_or_in_a_dialog(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        await pilot.press("ctrl+c")
    assert not app.is_running


async def test_sidebar_new_rename_delete_and_resume(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await send(pilot, "first chat")
        await pilot.press("ctrl+n")
        assert screen.chat is None and screen.history == [] and views(app) == []
        await send(pilot, "second chat")
        titles = lambda: [item.chat.title for item in screen.query_one("#chats").children]
        assert titles() == ["second chat", "first chat"]
        await pilot.press("f2")
        await pilot.press("ctrl+u", *"renamed", "enter")   # ctrl+u clears the input
        assert titles() == ["renamed", "first chat"]
        await screen.open_chat(1)
        assert [m.content for m in screen.history][0] == "first chat"
        await pilot.press("f8")
        await pilot.press("y")
        await pilot.pause()
        assert titles() == ["renamed"] and screen.chat is None
        # In the list: Delete asks too, and "n" keeps the chat.
        screen.query_one("#chats").focus()
        await pilot.press("down", "delete", "n")
        assert titles() == ["renamed"]
        await pilot.press("enter")
        await pilot.pause()
        assert screen.chat.title == "renamed" and screen.history[0].content == "second chat"
    assert db_rows(home, "SELECT id, title FROM chats") == [(2, "renamed")]
    assert {r[0] for r in stored_messages(home)} == {2}


async def test_settings_are_edited_and_stored_with_the_chat(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Hi")
        await pilot.press("ctrl+s")
        dialog = app.screen
        assert isinstance(dialog, SettingsScreen)
        dialog.query_one("#system").text = "Answer in French."
        dialog.query_one("#max_tokens").value = "5"
        dialog.query_one("#top_p").value = "2"
        await pilot.press("ctrl+s")
        assert app.screen is dialog and "top_p must be in (0, 1]" in str(dialog.query_one("#error").render())
        dialog.query_one("#top_p").value = "0.9"
        await pilot.press("ctrl+s")
        assert app.screen is app.chat_screen
        assert app.chat_screen.conversation()[0] == {"role": "system", "content": "Answer in French."}
        await send(pilot, "Again")
        assert app.chat_screen.history[-1].stats["generation_tokens"] == 5
    stored = Store.open()[0].chats()[0].settings
    assert (stored.system, stored.max_tokens, stored.sampling.top_p, stored.sampling.temperature) == ("Answer in French.", 5, 0.9, 0)


async def test_new_chats_take_the_model_s_sampling_under_the_flags(home, sampled_dir):
    """Even a chat sent while the model loads: its settings were placeholders, not anyone's choice."""
    from nibble.tui.app import ChatApp
    gate = threading.Event()

    def slow_load(ref, quant):
        gate.wait()
        return load(ref, quant)
    app = ChatApp(str(sampled_dir), sampling={"min_p": 0.2}, max_tokens=4, load=slow_load)
    want = SamplerSettings(temperature=0.3, top_k=5, top_p=0.7, min_p=0.2)   # tiny.SAMPLING and the flag
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Hi", wait=False)
        assert app.chat_screen.settings.sampling == SamplerSettings(min_p=0.2)   # nibble's, until the model is read
        gate.set()
        await ready(pilot)
        await idle(pilot)
        assert app.chat_screen.settings.sampling == want and app.defaults.sampling == want
        await pilot.press("ctrl+n", "ctrl+s")
        shown = {name: app.screen.query_one(f"#{name}").value for name in ("temperature", "top_k", "top_p", "min_p")}
        assert shown == {"temperature": "0.3", "top_k": "5", "top_p": "0.7", "min_p": "0.2"}
    assert Store.open()[0].chats()[0].settings.sampling == want


async def test_edited_settings_of_a_waiting_chat_are_kept_when_the_model_arrives(home, sampled_dir):
    from nibble.tui.app import ChatApp
    gate = threading.Event()

    def slow_load(ref, quant):
        gate.wait()
        return load(ref, quant)
    app = ChatApp(str(sampled_dir), max_tokens=4, load=slow_load)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+s")
        app.screen.query_one("#temperature").value = "0"
        await pilot.press("ctrl+s")
        gate.set()
        await ready(pilot)
        assert app.chat_screen.settings.sampling == SamplerSettings(temperature=0)
        assert app.defaults.sampling == SamplerSettings(temperature=0.3, top_k=5, top_p=0.7)


async def test_status_bar_shows_model_speed_context_and_memory(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        status = app.chat_screen.status
        text = lambda part: str(status.query_one(f"#status-{part}").render())
        await ready(pilot)
        assert text("model") == "tiny · f32" and text("state") == "ready"
        assert text("ctx") == "ctx 0/256" and text("mem").startswith("mem ") and text("mem").endswith(("MB", "GB"))
        await send(pilot, "Hello")
        assert text("speed").endswith("tok/s") and text("ctx") != "ctx 0/256"


async def test_overflow_drops_the_oldest_turns_and_says_so(home, tiny):
    app = make_app(tiny, ctx_size=80, system="Be brief.", max_tokens=16)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for q in ["The quick brown fox", "jumps over the lazy dog", "Numba compiles Python"]:
            await send(pilot, q)
        notices = [str(n.render()) for n in app.chat_screen.chat_view.query(".notice")]
        assert any("oldest messages are left out" in n and "system prompt is kept" in n for n in notices)
        last = app.chat_screen.history[-1].stats
        assert last["dropped"] >= 2 and last["prompt_tokens"] + 16 <= 80
        assert "oldest messages left out" in str(views(app)[-1].query_one(".meta").render())


async def test_model_picker_lists_cached_models_and_loads_the_choice(home, tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(catalog, "list_cached_models", lambda: [
        catalog.CachedModel("tiny", tmp_path, 1 << 20), catalog.CachedModel("other/model", tmp_path, 3 << 30)])
    loaded = []
    app = make_app(tiny, load=lambda ref, quant: loaded.append(ref) or tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+o")
        picker = app.screen
        assert isinstance(picker, ModelPicker)
        options = picker.query_one("#models")
        await wait_for(pilot, lambda: options.option_count == 2 and options.get_option_at_index(0).id)
        assert "(loaded)" in str(options.get_option_at_index(0).prompt)
        await pilot.press("down", "enter")
        assert app.screen is app.chat_screen
        await wait_for(pilot, lambda: app.model_ref == "other/model", what="the new model")
        assert app.session is not None and loaded == ["tiny", "other/model"]


async def test_model_picker_lists_presets_after_the_models(home, tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(catalog, "list_cached_models", lambda: [catalog.CachedModel("tiny", tmp_path, 1 << 20)])
    presets.save("french", presets.Preset("tiny", "Réponds en français."))
    loaded = []
    app = make_app(tiny, load=lambda ref, quant: loaded.append(ref) or tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+o")
        options = app.screen.query_one("#models")
        await wait_for(pilot, lambda: options.option_count == 2 and options.get_option_at_index(1).id == "french")
        assert "preset of tiny" in str(options.get_option_at_index(1).prompt)
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.model_ref == "french", what="the preset")
        assert loaded == ["tiny", "french"]


async def test_f1_lists_every_binding(home, tiny):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        assert isinstance(app.screen, KeysScreen)
        actions = {row[1] for row in app.screen.rows}
        for binding in app.chat_screen.BINDINGS + app.BINDINGS:
            assert binding.tooltip in actions
        assert {"Send the message", "New line in the message"} <= actions
        await pilot.press("escape")
        assert app.screen is app.chat_screen


async def test_keys_work_while_the_model_loads_and_the_message_waits(home, tiny):
    release = threading.Event()

    def slow_load(ref, quant):
        release.wait(10)
        return tiny
    app = make_app(tiny, load=slow_load)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("h", "i")
        status = app.chat_screen.status
        assert app.chat_screen.prompt.text == "hi"
        assert str(status.query_one("#status-state").render()).startswith("loading")
        assert status.query_one("#status-progress").display
        await pilot.press("enter")
        assert [m.content for m in app.chat_screen.history] == ["hi"] and app.chat_screen.want_reply
        assert stored_messages(home) == [(1, "user", "hi", None)]   # stored at once
        release.set()
        await ready(pilot)
        await idle(pilot)
        assert app.chat_screen.history[-1].role == "assistant"
        assert not status.query_one("#status-progress").display


async def test_a_model_that_fails_to_load_is_named_and_another_can_be_picked(home, tiny, monkeypatch, tmp_path):
    def load_or_fail(ref, quant):
        if ref == "broken":
            raise NibbleError("config.json is missing hidden_size")
        return tiny
    monkeypatch.setattr(catalog, "list_cached_models", lambda: [catalog.CachedModel("tiny", tmp_path, 1)])
    app = make_app(tiny, model="broken", load=load_or_fail)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loading is None, what="the failure")
        assert any("Could not load broken: config.json is missing hidden_size" in n for n in notes(app))
        assert str(app.chat_screen.status.query_one("#status-model").render()) == "no model"
        await send(pilot, "anyone there?", wait=False)
        # The box is cleared before the message is shown and the reply is looked for.
        await wait_for(pilot, lambda: any("No model is loaded" in n for n in notes(app)),
                       what="the note that no model is loaded")
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: app.screen.query_one("#models").get_option_at_index(0).id == "tiny")
        await pilot.press("enter")
        await ready(pilot)
        await idle(pilot)   # the waiting message is answered once a model is ready
        assert [m.role for m in app.chat_screen.history] == ["user", "assistant"]


async def test_the_real_loader_shows_progress_and_reports_a_bad_path(home, tiny_dir, tmp_path, monkeypatch):
    from nibble.tui.app import ChatApp
    from nibble.tui.widgets.status import StatusBar
    seen = []
    set_state = StatusBar.set_state
    monkeypatch.setattr(StatusBar, "set_state", lambda self, text, progress=None: (
        seen.append((text, progress)), set_state(self, text, progress)))
    app = ChatApp(str(tiny_dir), sampling={"temperature": 0}, max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        # but a first run's compile progress (the kernels this test is the first to run)
        seen[:] = [(t, p) for t, p in seen if not t.startswith(("loading: compiling", "loading: compiled"))]
        assert [t for t, _ in seen] == ["loading: starting", "loading: starting the runner",
                                        "loading: reading the model", "loading: preparing the kernels",
                                        "ready"]
        assert [p for _, p in seen] == [(0, 3), (0, 3), (1, 3), (2, 3), None]
        assert str(app.chat_screen.status.query_one("#status-model").render()) == "llama · f32"
        app.load_model(str(tmp_path / "nowhere"))
        await wait_for(pilot, lambda: app.loading is None)
        assert app.session is None and any("no model at" in n for n in notes(app))


async def test_a_corrupt_history_is_kept_aside(home, tiny):
    (home / "history.db").write_bytes(b"this is not a database" * 100)
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert any("could not be read" in n and "history.db.corrupt-" in n for n in notes(app))
        await send(pilot, "still works")
    aside = list(home.glob("history.db.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == b"this is not a database" * 100
    assert stored_messages(home)[0][2] == "still works"


async def test_a_locked_history_is_left_alone(home, tiny, monkeypatch):
    monkeypatch.setattr("nibble.tui.store.BUSY_TIMEOUT", 0.1)
    Store.open()[0].close()
    import sqlite3
    other = sqlite3.connect(home / "history.db", isolation_level=None)
    other.execute("PRAGMA locking_mode = EXCLUSIVE")
    other.execute("BEGIN EXCLUSIVE")
    try:
        app = make_app(tiny)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert any("is locked by another program" in n for n in notes(app))
            await send(pilot, "kept in memory")
            assert len(app.chat_screen.history) == 2
    finally:
        other.rollback()
        other.close()
    assert stored_messages(home) == [] and not list(home.glob("history.db.corrupt-*"))


@pytest.mark.slow
async def test_the_real_model_answers(home, smollm2_dir):
    from nibble.tui.app import ChatApp
    # greedy and nothing else: the alias's DRY and repetition penalty steer an answer away from
    # the question's own words ("A CPU cache (Caching) is ...")
    plain = {"temperature": 0, "dry_multiplier": 0, "repetition_penalty": 1.0}
    app = ChatApp(str(smollm2_dir), ctx_size=512, sampling=plain, max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.session is not None, timeout=120, what="SmolLM2")
        # a question whose answer begins the same with activations float or rounded to 8 bits
        # (llama.cpp's F32, Q8_0 and Q4_1 greedy runs; on the capital of France those differ)
        await send(pilot, "Explain what a CPU cache is in one sentence.")
        reply = app.chat_screen.history[-1]
        assert reply.role == "assistant" and reply.content.startswith("A CPU cache is")


def test_the_chat_command_passes_its_flags_and_checks_them_first(monkeypatch, tiny_dir):
    from click.testing import CliRunner

    from nibble.tui.cli import main as cli
    from nibble.tui.cli.main import main
    from nibble.tui.app import ChatApp
    started = []
    monkeypatch.setattr(ChatApp, "run", lambda self: started.append(self))
    r = CliRunner().invoke(main, ["chat", "-m", str(tiny_dir)])   # stdin and stdout are not a terminal
    assert r.exit_code == 2 and "use nibble run" in r.stderr and not started
    monkeypatch.setattr(cli, "_in_terminal", lambda: True)
    r = CliRunner().invoke(main, ["chat", "-m", str(tiny_dir), "--top-p", "2"])
    assert r.exit_code == 1 and "top_p must be in (0, 1]" in r.stderr and not started
    r = CliRunner().invoke(main, ["chat", "-m", str(tiny_dir)])
    assert r.exit_code == 0, r.output
    assert started[0].defaults == ChatSettings() and started[0].seed is None   # the same defaults
    assert started[0].sampling == {}   # no flags: each model's own sampling defaults apply
    assert started[0].thinking == ThinkingOptions()   # as each model thinks
    r = CliRunner().invoke(main, ["chat", "-m", str(tiny_dir), "--temp", "0.3", "-s", "Be brief.",
                                  "-n", "64", "-c", "128", "--kv-cache", "int8", "--seed", "7", "-ngl", "0"])
    assert r.exit_code == 0, r.output
    app = started[1]
    assert app.requested_model == str(tiny_dir) and (app.ctx_size, app.kv_cache, app.seed) == (128, "int8", 7)
    assert (app.gpu_layers, app.require_gpu) == (0, False)
    assert app.defaults == ChatSettings(system="Be brief.", sampling=SamplerSettings(temperature=0.3), max_tokens=64)
    assert app.sampling == {"temperature": 0.3}   # laid over the model's defaults once it is loaded
    r = CliRunner().invoke(main, ["chat", "-m", str(tiny_dir), "--no-think", "--reasoning-budget", "64"])
    assert r.exit_code == 0, r.output
    assert started[2].thinking == ThinkingOptions(think=False, budget=64)


def test_nibble_help_does_not_import_the_app():
    import subprocess
    import sys
    code = ("import sys; from click.testing import CliRunner; from nibble.tui.cli.main import main; "
            "CliRunner().invoke(main, ['--help']); CliRunner().invoke(main, ['chat', '--help']); "
            "print(sorted({m for m in sys.modules if m.split('.')[0] in ('textual', 'numba')} "
            "| {m for m in sys.modules if m.startswith('nibble.tui.') and not m.startswith('nibble.tui.cli')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_reply_stopped_in_the_prefill_ends_stopped_at_a_chunk(tiny):
    """The worker's loop stops iterating once its worker is cancelled: here between two prefill chunks."""
    from nibble.runner.generation.session import ChatSession
    from nibble.tui.turn import Turn, run_turn
    session = ChatSession(*tiny, ctx=256, prefill_chunk=8)
    turn = Turn(1, view=None, worker=types.SimpleNamespace(is_cancelled=False))
    updates = []

    def post(update):
        updates.append(update)
        if len(updates) == 2:   # the first prefill chunk has run: Esc
            turn.worker.is_cancelled = True
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 3}]
    run_turn(post, turn, session, messages, GREEDY.sampling, 8)
    last = updates[-1].stats
    assert len(updates) == 3 and updates[-1].text == ""
    assert (last.finish_reason, last.generation_tokens, last.ctx_used) == ("stopped", 0, 16)
    assert session.cache.pos == 16 < last.prefilled


def test_updates_are_spaced_by_what_drawing_costs(monkeypatch):
    from nibble.tui import turn
    now = {"cpu": 0.0, "wall": 0.0}   # the UI thread's CPU time and the wall clock, set by hand
    clock = types.SimpleNamespace(pthread_getcpuclockid=lambda ident: 0, clock_gettime=lambda c: now["cpu"],
                                  monotonic=lambda: now["wall"])
    monkeypatch.setattr(turn, "time", clock)
    ui = turn.UIClock()
    now.update(cpu=0.1, wall=0.1)   # the UI thread busy all the time
    busy = ui.next_frame(turn.FRAME)
    now.update(wall=0.2)            # then idle
    assert busy > 2 * turn.FRAME and ui.next_frame(turn.FRAME_MAX) < turn.FRAME_MAX


async def test_a_chat_template_that_fails_is_named_and_the_chat_goes_on(home, tiny_dir):
    from nibble.runner.text.template import ChatTemplate
    from nibble.runner.text.sandbox import Limits
    from tests.tiny import CHATML
    model, tok = load(str(tiny_dir))
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    tok.chat_template = ChatTemplate(f"{{% if messages[-1].content == 'loop' %}}{endless}{{% endif %}}{CHATML}",
                                     limits=Limits(steps=20_000))
    app = make_app((model, tok))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "loop")
        assert any("The reply failed: the model's chat template took more than 20,000 steps" in n
                   for n in notes(app))
        await send(pilot, "hi")
        assert [m.role for m in app.chat_screen.history][-2:] == ["user", "assistant"]


# A model that thinks: the tiny model under DeepSeek-R1's template, whose prompt opens the reply's
# <think> block. A budget of 4 ends its thinking; the forced end ("\n</think>\n\n") takes the tiny
# tokenizer 10 tokens, and the answer follows in a reply of 20.
THINKS = dict(thinking=ThinkingOptions(budget=4), max_tokens=20)


@pytest.fixture(scope="module")
def r1(r1_dir):
    model, tok = load(str(r1_dir))
    tok.eos_ids = frozenset()
    return model, tok


@pytest.fixture
def gated(monkeypatch):
    """Generation that waits, after its first thinking, until the gate is set."""
    real, gate = session_module.stream_generate, threading.Event()

    def waiting(*args, **kwargs):
        for r in real(*args, **kwargs):
            yield r
            if r.thinking:
                gate.wait(60)
    monkeypatch.setattr(session_module, "stream_generate", waiting)
    yield gate
    gate.set()


def title(view) -> str:
    return str(view.thinking.query_one("CollapsibleTitle").render())


async def test_thinking_streams_open_then_folds_above_the_answer_and_is_stored_apart(home, r1, gated):
    app = make_app(r1, **THINKS)
    replies = lambda: db_rows(home, "SELECT content, thinking, writer FROM messages WHERE role = 'assistant'")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Hello there", wait=False)
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.turn is not None and screen.turn.view.thinking is not None
                       and screen.turn.view.thinking.query("CollapsibleTitle"), what="the thinking")
        view = screen.turn.view
        await wait_for(pilot, lambda: replies() and replies()[0][1], what="the thinking on disk")
        assert not view.thinking.collapsed and title(view).endswith("Thinking…") and view.source == ""
        assert replies() == [("", screen.turn.thinking, app.store.writer)]   # a kill would keep it
        gated.set()
        await idle(pilot)
        reply = screen.history[-1]
        assert reply.thinking and reply.content and reply.thinking not in reply.content
        assert reply.stats["thinking_tokens"] == 4 and reply.stats["generation_tokens"] == 20
        assert view.thinking.collapsed and title(view).endswith("Thought for 4 tokens")
        assert view.source == reply.content and view.thinking.body.source == reply.thinking
        parts = [w for w in view.children if w in (view.thinking, view.body)]
        assert parts == [view.thinking, view.body]   # the thinking above the answer
    assert replies() == [(reply.content, reply.thinking, None)]


async def test_stored_thinking_reloads_folded_opens_by_click_or_key_and_goes_back_as_reasoning_content(
        home, r1):
    app = make_app(r1, **THINKS)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Hello there")
        first = app.chat_screen.history[-1]
    app = make_app(r1, **THINKS)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await screen.open_chat(1)
        await pilot.pause()   # laid out: the title is where a click lands
        view = views(app)[-1]
        assert view.thinking.collapsed and title(view).endswith("Thought for 4 tokens")
        assert view.thinking.body.source == first.thinking and view.source == first.content
        assert await pilot.click(view.thinking.query_one("CollapsibleTitle"))
        await pilot.pause()
        assert not view.thinking.collapsed and screen.prompt.has_focus   # still typing there
        await pilot.press("f3")   # the last reply's, from the message box
        assert view.thinking.collapsed
        view.thinking.query_one("CollapsibleTitle").focus()   # as Tab reaches it
        await pilot.press("enter")
        assert not view.thinking.collapsed
        screen.prompt.focus()
        sent = []
        reply = app.session.reply
        app.session.reply = lambda messages, *args: (sent.append(messages), reply(messages, *args))[1]
        await send(pilot, "And then?")
        assert sent[0][:2] == [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": first.content, "reasoning_content": first.thinking}]
        prompt = app.session.tokenizer.decode(app.session.last_prompt_ids)
        assert first.content in prompt and first.thinking not in prompt   # R1's template drops it
        assert views(app)[-1].thinking is not None


async def test_no_thinking_with_no_think_or_the_chats_setting(home, r1):
    app = make_app(r1, max_tokens=20, thinking=ThinkingOptions(think=False))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Hello there")
        reply = app.chat_screen.history[-1]
        assert reply.content and reply.thinking == "" and views(app)[-1].thinking is None
        assert "thinking_tokens" not in reply.stats
    app = make_app(r1, **THINKS)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+s")
        dialog = app.screen
        dialog.query_one("#think").value = "off"
        await pilot.press("ctrl+s")
        assert app.screen is app.chat_screen
        assert app.chat_screen.settings.thinking == ThinkingOptions(think=False)
        await send(pilot, "Hello there")
        assert app.chat_screen.history[-1].thinking == "" and views(app)[-1].thinking is None
        await pilot.press("ctrl+s")
        dialog = app.screen
        dialog.query_one("#think").value = "default"
        dialog.query_one("#reasoning_budget").value = "-5"
        await pilot.press("ctrl+s")
        assert app.screen is dialog and "Thinking budget: '-5'" in str(dialog.query_one("#error").render())
        dialog.query_one("#reasoning_budget").value = "2"
        await pilot.press("ctrl+s")
        await pilot.press("ctrl+r")
        await idle(pilot)
        reply = app.chat_screen.history[-1]
        assert reply.thinking and reply.stats["thinking_tokens"] == 2   # the chat's budget over the app's
    stored = Store.open()[0].chats()[0].settings.thinking
    assert stored == ThinkingOptions(None, 2)


async def test_a_reply_stopped_while_it_thinks_keeps_its_thinking(home, r1, gated):
    app = make_app(r1, **THINKS)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Hello there", wait=False)
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.turn is not None and screen.turn.thinking, what="the thinking")
        view = screen.turn.view
        await pilot.press("escape")
        gated.set()
        await idle(pilot)
        reply = screen.history[-1]
        assert reply.finish == "stopped" and reply.thinking and reply.content == ""
        assert not view.thinking.collapsed and "Thought for" in title(view)   # all there is: left open
    assert db_rows(home, "SELECT thinking, finish FROM messages WHERE role = 'assistant'") == [
        (reply.thinking, "stopped")]


@pytest.fixture(scope="module")
def seeing(vision_dir):
    """The tiny random Gemma 3, which reads images."""
    model, tok = load(str(vision_dir), quant="float")
    tok.eos_ids = frozenset()
    return model, tok


IMAGE = Path(__file__).parent / "data" / "vision" / "gemma3" / "image.png"


async def test_an_image_attached_goes_with_the_next_message_and_stays_with_the_chat(home, seeing):
    app = make_app(seeing)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        screen.prompt.text = f"/image '{IMAGE}'"   # quoted, as a path dropped into a terminal is
        await pilot.press("enter")
        attached = str(screen.query_one("#attached").render())
        assert "image.png (80 x 60, 12 KB, 4 tokens)" in attached and screen.prompt.text == ""
        await send(pilot, "What is in it?")
        user = screen.history[0]
        assert [p.name for p in user.images] == [str(IMAGE)] and not screen.attached
        assert "🖼 image.png (80 x 60, 12 KB, 4 tokens)" in str(views(app)[0].query_one(".image").render())
        reply = screen.history[1]
        assert reply.stats["prompt_tokens"] > 4   # the image's tokens and the text's
        await send(pilot, "And its colours?")   # the image is in the kept prefix
        assert screen.history[3].stats["reused"] >= reply.stats["prompt_tokens"]
        digest = user.images[0].digest
        await pilot.press("ctrl+q")
    app = make_app(seeing)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("tab", "enter")   # the chat again, from the history
        await wait_for(pilot, lambda: app.chat_screen.chat is not None)
        assert [p.digest for p in app.chat_screen.history[0].images] == [digest]


async def test_an_image_is_refused_in_one_note_by_a_text_model_or_when_unreadable(home, tiny, seeing):
    app = make_app(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.chat_screen.prompt.text = f"/image {IMAGE}"
        await pilot.press("enter")
        assert "reads no images" in notes(app)[-1] and not app.chat_screen.attached
    app = make_app(seeing)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for path, why in ((Path(__file__), "is not an image"), (IMAGE.parent / "nothing.png", "no such file")):
            app.chat_screen.prompt.text = f"/image {path}"
            await pilot.press("enter")
            assert why in notes(app)[-1] and not app.chat_screen.attached
            assert app.chat_screen.prompt.text == f"/image {path}"   # kept, to be corrected


async def test_f4_asks_for_the_image_s_path(home, seeing):
    app = make_app(seeing)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f4")
        await pilot.pause()
        app.screen.query_one("#path").value = str(IMAGE)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.chat_screen.attached) == 1)
