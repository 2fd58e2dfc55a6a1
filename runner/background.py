"""A model's full kernels compiled in the background while a first answer runs on kernels that
compile in a fraction of the time (quant_decode.FIRST_KINDS: one row of x a pass, no prefill
tiles).

The background is a process of its own (runner/warmup.py), at the lowest priority: it takes the
cores the answer leaves idle, and it outlives the command that started it (`nibble run` ends
after its answer), so that the next run finds the full kernels in the cache. A long-lived
command (`nibble chat`, `nibble serve`) takes them up as soon as the process has ended
(CPUStage.kernels). One such process at a time compiles into a cache folder (a lock there).

The library's models never start one (tests, `nibble bench`): only the commands that answer
people ask for it (loader.load's `background`), and NIBBLE_BACKGROUND_COMPILE=0 turns it off (the
kernels then compile in full before the first answer, as a model's kernels do elsewhere).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def enabled() -> bool:
    """Whether NIBBLE_BACKGROUND_COMPILE allows a background compile (unset: it does)."""
    return os.environ.get("NIBBLE_BACKGROUND_COMPILE", "1") != "0"


class Background:
    """The background compile of one model's kernels: `path` the model as it runs (a directory
    or a GGUF file), `as_stored` whether it runs float as stored; None: none (the default)."""

    def __init__(self, path: Path | None = None, as_stored: bool = False):
        self.path, self.as_stored = path, as_stored
        self.process: subprocess.Popen | None = None

    def wanted(self) -> bool:
        """Whether a first run should take the quick kernels and start the background: a model
        that allows it, not started yet."""
        return self.path is not None and self.process is None and enabled()

    def start(self, kv_type: str):
        """Start the process that compiles the full kernels for a KV cache of `kv_type`; what it
        prints goes nowhere (the person waits on the answer, not on it)."""
        args = [sys.executable, "-m", "nibble.runner.warmup", str(self.path), "--kv-cache", kv_type]
        self.process = subprocess.Popen(args + (["--float"] if self.as_stored else []), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def finished(self) -> bool:
        """Whether the process has ended, its kernels compiled (a non-zero exit: it failed, and the
        first run's kernels stay)."""
        return self.process is not None and self.process.poll() == 0
