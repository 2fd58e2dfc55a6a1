"""Small modal dialogs: rename a chat, a file's path, confirm a deletion."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label


class RenameDialog(ModalScreen[str | None]):
    """Asks for a chat's new title; Enter saves, Esc cancels."""

    BINDINGS = [("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str):
        super().__init__(classes="dialog")
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Rename chat", classes="dialog-title")
            yield Input(self.title_text, id="title")
            yield Label("Enter saves, Esc cancels.", classes="hint")

    def on_input_submitted(self, event: Input.Submitted):
        title = event.value.strip()
        self.dismiss(title or None)


class PathDialog(ModalScreen[str | None]):
    """Asks for a file's path; Enter takes it, Esc cancels."""

    BINDINGS = [("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, placeholder: str):
        super().__init__(classes="dialog")
        self.title_text, self.placeholder = title, placeholder

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.title_text, classes="dialog-title")
            yield Input(placeholder=self.placeholder, id="path")
            yield Label("Enter attaches, Esc cancels.", classes="hint")

    def on_input_submitted(self, event: Input.Submitted):
        self.dismiss(event.value.strip() or None)


class ConfirmDialog(ModalScreen[bool]):
    """A yes/no question; y or Enter on Yes confirms, n or Esc declines."""

    BINDINGS = [("escape,n", "dismiss(False)", "No"), ("y", "dismiss(True)", "Yes")]

    def __init__(self, question: str):
        super().__init__(classes="dialog")
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, classes="dialog-title", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Yes", variant="error", id="yes")
                yield Button("No", id="no")

    def on_mount(self):
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed):
        self.dismiss(event.button.id == "yes")
