"""What a reply is asked for: the sampling settings and the longest reply, with their defaults.

The one home of these defaults: the CLI's flags, the chat app's per-chat settings and the library
take them from here, under what the model's own generation_config.json sets (model_sampling).
No numpy and no Numba here, so that `nibble --help` shows them at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nibble.formats.errors import NibbleError

# The most tokens a reply may have, unless asked otherwise (nibble run -n, a chat's max tokens).
MAX_TOKENS = 512

# The most tokens a decode pass guesses ahead by prompt lookup (runner/generation/draft.py; nibble run --draft).
# SmolLM2 int4, one thread: 8 decoded a reply quoting 30 lines of code 1.46x as fast (4: 1.43x),
# free text as fast as without (each drafted token costs about half a pass there).
DEFAULT_DRAFT = 8

# Each setting's valid values: a test, and how to say it.
_RULES = {
    "temperature": (lambda v: math.isfinite(v) and v >= 0, "0 (greedy) or positive"),
    "top_k": (lambda v: v >= 0, "0 (off) or positive"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1] (1 is off)"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1] (0 is off)"),
    "repetition_penalty": (lambda v: math.isfinite(v) and v > 0, "positive (1 is off)"),
    "repeat_last_n": (lambda v: v >= 0, "0 or more"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2] (0 is off)"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2] (0 is off)"),
    "dry_multiplier": (lambda v: math.isfinite(v) and v >= 0, "0 (off) or positive"),
    "dry_base": (lambda v: math.isfinite(v) and v >= 1, "1 or more"),
    "dry_allowed_length": (lambda v: v >= 0, "0 or more"),
    "dry_penalty_last_n": (lambda v: v >= -1, "-1 (the whole sequence), 0 (off) or positive"),
    "seed": (lambda v: v is None or v >= 0, "0 or more"),
}

# DRY's sequence breakers, llama.cpp's defaults: a repeat is measured back to the last one at most,
# so a repeat across a line or a quotation does not count.
DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")

# The sampling fields of generation_config.json: transformers' names, which SamplerSettings shares,
# and OpenAI's penalties and DRY's, which nibble writes there for an alias (formats.hub.ALIASES) and
# reads by the same names.
MODEL_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                "repeat_last_n", "seed")   # the last two: a preset's (formats/presets.py)
WHOLE_FIELDS = ("top_k", "dry_allowed_length", "dry_penalty_last_n", "repeat_last_n", "seed")


@dataclass(frozen=True)
class SamplerSettings:
    """How to pick the next token. The defaults are llama.cpp's, for what the model's
    generation_config.json does not set (see model_sampling); each filter has an "off" value."""
    temperature: float = 0.8         # 0: greedy (argmax)
    top_k: int = 40                  # 0: off
    top_p: float = 0.95              # 1.0: off
    min_p: float = 0.05              # 0.0: off; keep tokens with p >= min_p * max p
    repetition_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64          # how many recent ids the penalty looks at
    # OpenAI's: a token's logit minus presence_penalty if it is in the reply so far, minus
    # frequency_penalty times how often; negative values favour repeats
    presence_penalty: float = 0.0    # 0.0: off
    frequency_penalty: float = 0.0   # 0.0: off
    # DRY (llama.cpp's "don't repeat yourself"): a token that would extend a repeat of
    # n >= dry_allowed_length tokens found earlier in the sequence loses
    # dry_multiplier * dry_base ** (n - dry_allowed_length) from its logit
    dry_multiplier: float = 0.0      # 0.0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1     # how many recent ids it looks at; -1: the whole sequence
    seed: int | None = None          # None: a fresh random seed each run

    def __post_init__(self):
        for name, (valid, rule) in _RULES.items():
            value = getattr(self, name)
            if not valid(value):
                raise NibbleError(f"Bad sampler setting: {name} must be {rule}, got {value}.")


def model_sampling(generation_config: dict) -> tuple[SamplerSettings, str]:
    """A model's sampling defaults: the MODEL_FIELDS its generation_config.json sets, nibble's
    defaults for the others; and a line for the user naming the values it ignored ("" if none).

    `"do_sample": false` means greedy whatever the temperature says, as in transformers. A file
    without do_sample is read like one with `"do_sample": true`, as llama.cpp's GGUF converter and
    vLLM read it: a publisher who writes a temperature means it to be used (transformers itself
    warns that such a temperature goes unused). A value nibble cannot use is ignored rather than
    refused: the file is the publisher's, not the user's, and should not keep the model from running.
    """
    values, ignored = {}, []
    for name in MODEL_FIELDS:
        value = generation_config.get(name)
        if value is None:   # unset (transformers writes null for some unset fields)
            continue
        valid, rule = _RULES[name]
        whole = name in WHOLE_FIELDS
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (whole and isinstance(value, float) and not value.is_integer())):
            ignored.append(f"{name} {value!r} is not a {'whole ' if whole else ''}number")
        elif not valid(value):
            ignored.append(f"{name} must be {rule}, got {value}")
        else:
            values[name] = int(value) if whole else float(value)
    if generation_config.get("do_sample") is False:
        values["temperature"] = 0.0   # greedy; a repetition penalty still applies, as in transformers
    note = (f"ignored in the model's generation_config.json (nibble's defaults apply): {'; '.join(ignored)}"
            if ignored else "")
    return SamplerSettings(**values), note
