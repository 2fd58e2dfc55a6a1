"""The model picker: models already on disk (nibble's cache and Hugging Face's) and presets, or any
reference."""
from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.content import Content
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from nibble.formats import catalog, presets
from nibble.tui.widgets.status import format_bytes


class ModelPicker(ModalScreen[str | None]):
    """Pick a cached model with Enter, or type a path, alias or org/name; Esc cancels."""

    BINDINGS = [("escape", "dismiss(None)", "Cancel")]

    def __init__(self, current: str | None):
        super().__init__(classes="dialog")
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Pick a model", classes="dialog-title")
            yield OptionList(Option("looking for models…", disabled=True), id="models")
            yield Input(placeholder="or type a model directory, .gguf file, org/name or alias", id="ref")
            yield Label("Enter loads it, Esc cancels.", classes="hint")

    def on_mount(self):
        self.query_one(OptionList).focus()
        self._scan()

    @work(thread=True, exit_on_error=False)
    def _scan(self):
        # huggingface_hub's import and cache scan take a moment: off the UI thread.
        try:
            found, error = catalog.list_cached_models(), None
        except Exception as e:   # an unreadable cache must not break the picker
            found, error = [], f"cannot list cached models: {e}"
        made = []
        for name in presets.names():
            try:
                made.append((name, presets.read(name).source))
            except Exception:   # a damaged Presetfile: the others still show
                continue
        self.app.call_from_thread(self._show, found, error, made)

    def _show(self, found, error: str | None, made: list[tuple[str, str]] = ()):
        if not self.is_attached:
            return   # dismissed before the scan ended
        options = self.query_one(OptionList)
        options.clear_options()
        for m in found:
            mark = "  (loaded)" if m.ref == self.current else ""
            label = Content.assemble(m.ref, (f"  {format_bytes(m.size_bytes)}{mark}", "dim"))
            options.add_option(Option(label, id=m.ref))
        for name, source in made:
            mark = "  (loaded)" if name == self.current else ""
            options.add_option(Option(Content.assemble(name, (f"  preset of {source}{mark}", "dim")), id=name))
        names = [m.ref for m in found] + [name for name, _ in made]
        if not names:
            options.add_option(Option(error or "no models in the caches yet: type one below", disabled=True))
        else:
            options.highlighted = names.index(self.current) if self.current in names else 0

    def on_option_list_option_selected(self, event: OptionList.OptionSelected):
        if event.option.id:
            self.dismiss(event.option.id)

    def on_input_submitted(self, event: Input.Submitted):
        if ref := event.value.strip():
            self.dismiss(ref)
