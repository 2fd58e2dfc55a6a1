"""Every key of the app in one list (F1), built from the bindings so it cannot drift from them."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

# Keys handled by widgets rather than bindings.
WIDGET_KEYS = [
    ("enter", "Send the message"),
    ("shift+enter, ctrl+j", "New line in the message"),
    ("up (empty message box)", "Edit the last message"),
    ("tab, shift+tab", "Move between the chat list and the message box"),
    ("enter (chat list)", "Resume the chat"),
    ("delete (chat list)", "Delete the chat"),
    ("enter (thinking)", "Show or hide a reply's thinking (a click does too)"),
]


def key_rows(*binding_lists) -> list[tuple[str, str]]:
    rows = list(WIDGET_KEYS)
    for bindings in binding_lists:
        for b in bindings:
            b = b if isinstance(b, Binding) else Binding(*b)
            rows.append((b.key.replace(",", ", "), b.tooltip or b.description))
    return rows


class KeysScreen(ModalScreen[None]):
    """The list of keys; Esc, F1 or q closes it."""

    BINDINGS = [("escape,f1,q", "dismiss(None)", "Close")]

    def __init__(self, rows: list[tuple[str, str]]):
        super().__init__(classes="dialog")
        self.rows = rows

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Keys", classes="dialog-title")
            yield DataTable(show_cursor=False, zebra_stripes=True)
            yield Label("Esc closes.", classes="hint")

    def on_mount(self):
        table = self.query_one(DataTable)
        table.add_columns("Key", "Action")
        table.add_rows(self.rows)
