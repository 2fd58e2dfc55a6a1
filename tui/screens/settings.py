"""Per-chat settings: the system prompt, the sampling settings and thinking, stored with the chat."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, TextArea

from nibble.formats.errors import NibbleError

from ..store import ChatSettings

# ChatSettings.flat() name -> (label, input type, help)
FIELDS = {
    "temperature": ("Temperature", "number", "0 is greedy"),
    "top_p": ("Top-p", "number", "1 is off"),
    "top_k": ("Top-k", "integer", "0 is off"),
    "min_p": ("Min-p", "number", "0 is off"),
    "max_tokens": ("Max tokens", "integer", "per reply"),
    "repetition_penalty": ("Repeat penalty", "number", "1 is off"),
}
# A model that thinks: whether it does (unsaid: as nibble chat was started, else as the model does)
THINK = {"default": None, "on": True, "off": False}


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """Edit a chat's settings. Ctrl+S or Save keeps them, Esc cancels."""

    BINDINGS = [("escape", "dismiss(None)", "Cancel"), ("ctrl+s", "save", "Save")]

    def __init__(self, settings: ChatSettings, chat_title: str):
        super().__init__(classes="dialog")
        self.settings = settings
        self.chat_title = chat_title

    def compose(self) -> ComposeResult:
        values = self.settings.flat()
        with Vertical():
            yield Label(f"Settings of {self.chat_title}", classes="dialog-title", markup=False)
            yield Label("System prompt (empty: the model's own)")
            yield TextArea(self.settings.system, id="system", soft_wrap=True, compact=True)
            with Grid(id="sampling"):
                for name, (label, kind, hint) in FIELDS.items():
                    yield Label(label)
                    yield Input(str(values[name]), type=kind, id=name, compact=True)
                    yield Label(hint, classes="hint")
                yield Label("Thinking")
                yield Select([(k, k) for k in THINK], value=_think_choice(self.settings.thinking.think),
                             allow_blank=False, compact=True, id="think")
                yield Label("models that think", classes="hint")
                yield Label("Thinking budget")
                budget = self.settings.thinking.budget
                yield Input("" if budget is None else str(budget), type="integer", id="reasoning_budget",
                            placeholder="default", compact=True)
                yield Label("tokens (0: off, -1: no bound)", classes="hint")
            yield Label("", id="error", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed):
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted):
        self.action_save()

    def action_save(self):
        try:
            settings = self.read()
        except (ValueError, NibbleError) as e:
            self.query_one("#error", Label).update(str(e))
            return
        self.dismiss(settings)

    def read(self) -> ChatSettings:
        """The settings in the form, checked as the sampler checks them."""
        values = {**self.settings.flat(), "system": self.query_one("#system", TextArea).text.strip()}
        for name, (label, kind, _) in FIELDS.items():
            text = self.query_one(f"#{name}", Input).value.strip()
            try:
                values[name] = int(text) if kind == "integer" else float(text)
            except ValueError:
                raise ValueError(f"{label}: {text!r} is not a {'whole ' if kind == 'integer' else ''}number") from None
        if values["max_tokens"] < 1:
            raise ValueError("Max tokens: give at least 1")
        values["think"] = THINK[self.query_one("#think", Select).value]
        values["reasoning_budget"] = self._budget()
        return ChatSettings.from_flat(values)   # raises NibbleError naming a bad sampling value

    def _budget(self) -> int | None:
        text = self.query_one("#reasoning_budget", Input).value.strip()
        if not text:
            return None
        try:
            budget = int(text)
        except ValueError:
            budget = None
        if budget is None or budget < -1:
            raise ValueError(f"Thinking budget: {text!r} is not a number of tokens "
                             "(0: no thinking, -1: no bound, empty: the default)")
        return budget


def _think_choice(think: bool | None) -> str:
    return next(k for k, v in THINK.items() if v is think)
