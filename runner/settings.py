"""What a reply is asked for: the sampling settings and the longest reply, with their defaults.

The one home of these defaults: the CLI's flags, the chat app's per-chat settings and the library
take them from here. No numpy and no Numba here, so that `nibble --help` shows them at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nibble.formats.errors import NibbleError

# The most tokens a reply may have, unless asked otherwise (nibble run -n, a chat's max tokens).
MAX_TOKENS = 512


@dataclass(frozen=True)
class SamplerSettings:
    """How to pick the next token. The defaults are llama.cpp's; each filter has an "off" value."""
    temperature: float = 0.8         # 0: greedy (argmax)
    top_k: int = 40                  # 0: off
    top_p: float = 0.95              # 1.0: off
    min_p: float = 0.05              # 0.0: off; keep tokens with p >= min_p * max p
    repetition_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64          # how many recent ids the penalty looks at
    seed: int | None = None          # None: a fresh random seed each run

    def __post_init__(self):
        _check(math.isfinite(self.temperature) and self.temperature >= 0,
               f"temperature must be 0 (greedy) or positive, got {self.temperature}")
        _check(self.top_k >= 0, f"top_k must be 0 (off) or positive, got {self.top_k}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1] (1 is off), got {self.top_p}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0 is off), got {self.min_p}")
        _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be positive (1 is off), got {self.repetition_penalty}")
        _check(self.repeat_last_n >= 0, f"repeat_last_n must be 0 or more, got {self.repeat_last_n}")
        _check(self.seed is None or self.seed >= 0, f"seed must be 0 or more, got {self.seed}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise NibbleError(f"Bad sampler setting: {message}.")
