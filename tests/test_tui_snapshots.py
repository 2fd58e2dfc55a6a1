"""Snapshots of the chat app's main screens (pytest-textual-snapshot; `--snapshot-update` redraws).

Deterministic by construction: the conversation comes from the database rather than the model,
memory is a fixed figure, and the cursor does not blink. The code block's colours come from
Pygments: the conversation snapshot is drawn with the version `.ci/run` installs (2.21).
"""
import threading

import pytest

pytest.importorskip("pytest_textual_snapshot")

from nibble.formats import catalog  # noqa: E402
from nibble.runner.loader import load  # noqa: E402
from tests.tui_helpers import dead_writer, make_app, ready, wait_for  # noqa: E402
from nibble.tui.store import ChatSettings, Message, Store  # noqa: E402

SIZE = (100, 30)
REPLY = """Here is a function that checks whether a number is prime:

```python
def is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, int(n**0.5) + 1))
```

It tries every divisor up to the square root of `n`."""


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(str(tiny_dir))


@pytest.fixture(autouse=True)
def fixed(monkeypatch, tmp_path):
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))
    monkeypatch.setattr("nibble.tui.widgets.status.process_memory", lambda: 512 << 20)
    monkeypatch.setattr(catalog, "list_cached_models", lambda: [
        catalog.CachedModel("smollm2", tmp_path, 538 << 20),
        catalog.CachedModel("HuggingFaceTB/SmolLM2-360M-Instruct", tmp_path, 1448 << 20)])
    store, _ = Store.open()
    store.create_chat("Capital of France", "smollm2", ChatSettings())
    chat = store.create_chat("Is it prime?", "smollm2", ChatSettings(system="Be brief."))
    store.add_message(chat.id, Message(None, "user", "Write a Python function that checks whether a number is prime."))
    store.add_message(chat.id, Message(None, "assistant", REPLY, "stop", {
        "generation_tokens": 71, "generation_tps": 41.5, "prefilled": 27, "reused": 44}))
    store.close()


async def open_prime_chat(pilot):
    await ready(pilot)
    await pilot.app.chat_screen.open_chat(2)
    pilot.app.chat_screen.prompt.cursor_blink = False
    await pilot.pause()


def test_conversation(snap_compare, tiny):
    assert snap_compare(make_app(tiny), terminal_size=SIZE, run_before=open_prime_chat)


def test_interrupted_reply(snap_compare, tiny):
    store, _ = Store.open()
    chat = store.create_chat("A story", "smollm2", ChatSettings())
    store.add_message(chat.id, Message(None, "user", "Tell me a story about a lighthouse."))
    store.add_message(chat.id, Message(None, "assistant", "The lighthouse keeper had not seen a ship in",
                                       stats={"generation_tokens": 11, "generation_tps": 38.2, "prefilled": 24},
                                       writer=dead_writer()))   # as an app killed mid-reply leaves it
    store.close()

    async def open_story(pilot):
        await ready(pilot)
        await pilot.app.chat_screen.open_chat(chat.id)
        pilot.app.chat_screen.prompt.cursor_blink = False
        await pilot.pause()
    assert snap_compare(make_app(tiny), terminal_size=SIZE, run_before=open_story)


def test_thinking_folded_above_the_answer(snap_compare, tiny):
    store, _ = Store.open()
    chat = store.create_chat("Boiling point", "qwen3", ChatSettings())
    store.add_message(chat.id, Message(None, "user", "At what temperature does water boil on Everest?"))
    store.add_message(chat.id, Message(
        None, "assistant", "About **70 °C**: the air pressure at the summit is about a third of sea level's.",
        "stop", {"generation_tokens": 96, "generation_tps": 35.1, "prefilled": 21, "thinking_tokens": 74},
        thinking="The user asks about the boiling point at altitude. Lower pressure, lower boiling point..."))
    store.add_message(chat.id, Message(None, "user", "And on Mont Blanc?"))
    store.add_message(chat.id, Message(
        None, "assistant", "About **85 °C**.", "stop",
        {"generation_tokens": 40, "generation_tps": 36.0, "prefilled": 12, "reused": 80, "thinking_tokens": 31},
        thinking="Mont Blanc is 4,808 m high.\n\nThe pressure there is a little over half of sea level's."))
    store.close()

    async def open_and_unfold_the_last(pilot):
        await ready(pilot)
        await pilot.app.chat_screen.open_chat(chat.id)
        pilot.app.chat_screen.prompt.cursor_blink = False
        await pilot.press("f3")
        await pilot.pause()
    assert snap_compare(make_app(tiny), terminal_size=SIZE, run_before=open_and_unfold_the_last)


def test_new_chat_while_the_model_loads(snap_compare, tiny):
    release = threading.Event()

    def slow_load(ref, quant):
        release.wait(30)
        return tiny

    async def typing(pilot):
        pilot.app.chat_screen.prompt.cursor_blink = False
        await wait_for(pilot, lambda: "reading" in str(
            pilot.app.chat_screen.status.query_one("#status-state").render()))
        await pilot.press(*"Hello")
    try:
        assert snap_compare(make_app(tiny, model="smollm2", load=slow_load), terminal_size=SIZE,
                            run_before=typing)
    finally:
        release.set()


def test_settings(snap_compare, tiny):
    async def settings(pilot):
        await open_prime_chat(pilot)
        await pilot.press("ctrl+s")
    assert snap_compare(make_app(tiny), terminal_size=SIZE, run_before=settings)


def test_model_picker(snap_compare, tiny):
    async def picker(pilot):
        await ready(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: pilot.app.screen.query_one("#models").option_count == 2)
    assert snap_compare(make_app(tiny, model="smollm2"), terminal_size=SIZE, run_before=picker)


def test_keys(snap_compare, tiny):
    assert snap_compare(make_app(tiny), terminal_size=(100, 40), press=["f1"])
