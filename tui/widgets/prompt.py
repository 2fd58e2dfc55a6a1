"""The message box: Enter sends, Shift+Enter or Ctrl+J starts a new line."""
from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    """A multi-line input whose Enter sends. Up in an empty box asks to edit the last prompt."""

    @dataclass
    class Submitted(Message):
        text: str

    class EditLast(Message):
        pass

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, tab_behavior="focus", show_line_numbers=False,
                         highlight_cursor_line=False, compact=True,
                         placeholder="Message (Enter sends, Shift+Enter or Ctrl+J: new line, F1: keys)",
                         **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            self._take(event)
            self.post_message(self.Submitted(self.text))
        elif event.key in ("shift+enter", "ctrl+j"):
            self._take(event)
            self.insert("\n")
        elif event.key == "up" and not self.text:
            self._take(event)
            self.post_message(self.EditLast())
        else:
            await super()._on_key(event)

    @staticmethod
    def _take(event: events.Key):
        event.stop()
        event.prevent_default()
