"""The status bar: model and quantization, what it is doing, speed, context use and memory."""
from __future__ import annotations

import os
import resource
import sys

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.binding import Binding
from textual.content import Content
from textual.widgets import ProgressBar, Static

# How often the process memory figure is read again (seconds).
MEMORY_INTERVAL = 1.0


def process_memory() -> int | None:
    """Resident memory of this process in bytes (Linux: now; elsewhere: the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


class StatusBar(Horizontal):
    """One line at the bottom. The parts are set by the app; memory refreshes itself."""

    def compose(self) -> ComposeResult:
        yield Static("no model", id="status-model")
        yield Static("", id="status-state")
        yield ProgressBar(total=3, show_eta=False, show_percentage=False, id="status-progress")
        yield Static("", id="status-gap")
        yield Static("", id="status-speed")
        yield Static("", id="status-ctx")
        yield Static("", id="status-mem")

    def on_mount(self):
        self.query_one(ProgressBar).display = False
        self._refresh_memory()
        self.set_interval(MEMORY_INTERVAL, self._refresh_memory)

    def _refresh_memory(self):
        self.query_one("#status-mem", Static).update(f"mem {format_bytes(process_memory())}", layout=False)

    def set_model(self, text: str):
        self.query_one("#status-model", Static).update(text)

    def set_state(self, text: str, progress: tuple[int, int] | None = None):
        """What the app is doing; `progress` (done, total) shows a bar beside it."""
        self.query_one("#status-state", Static).update(text)
        bar = self.query_one(ProgressBar)
        bar.display = progress is not None
        if progress is not None:
            bar.update(progress=progress[0], total=progress[1])

    def set_speed(self, tps: float | None):
        # Fixed-width fields (app.tcss) change without a layout pass: they update while a reply streams.
        self.query_one("#status-speed", Static).update(f"{tps:.1f} tok/s" if tps else "", layout=False)

    def set_context(self, used: int | None, size: int | None):
        text = f"ctx {used}/{size}" if size else ""
        ctx = self.query_one("#status-ctx", Static)
        ctx.update(text, layout=False)
        # Over: the next reply leaves the oldest turns out.
        ctx.set_class(bool(size and used and used > size), "over")


class KeyHints(Static):
    """The keys worth knowing, in one line. A plain Static rather than Textual's Footer, which
    recomposes whenever a widget mounts: every few tokens while a reply streams."""

    def __init__(self, *binding_lists, **kwargs):
        parts = []
        for bindings in binding_lists:
            for b in bindings:
                b = b if isinstance(b, Binding) else Binding(*b)
                if b.show:
                    key = b.key.split(",")[0].replace("ctrl+", "^").replace("escape", "esc")
                    parts.append(Content.assemble((key, "bold $accent"), " ", b.description))
        super().__init__(Content("  ").join(parts), **kwargs)
