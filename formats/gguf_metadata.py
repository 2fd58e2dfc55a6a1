"""The kinds of value the GGUF metadata keys nibble reads must hold, checked before any is used.

GGUF stores each value's type beside it, so a damaged type byte decodes to a value of another kind
(a token id as a float, a head count of 0, the vocabulary as a list of numbers); llama.cpp refuses
a key of the wrong type, and so does nibble, naming the key.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from .errors import FormatError


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _count(v) -> bool:
    return _int(v) and v > 0


def _float(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _list_of(kind: Callable) -> Callable:
    return lambda v: isinstance(v, list) and all(kind(x) for x in v)


def _str(v) -> bool:
    return isinstance(v, str)


def _bool(v) -> bool:
    return isinstance(v, bool)


# key after "<architecture>." -> (what it must be, as the message says it)
_MODEL_KEYS = {
    **{k: (_count, "a positive integer") for k in (
        "block_count", "context_length", "embedding_length", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length",
        "rope.dimension_count")},
    **{k: (_float, "a finite number") for k in (
        "rope.freq_base", "rope.freq_base_swa", "attention.layer_norm_rms_epsilon",
        "rope.scaling.factor", "rope.scaling.attn_factor")},
    "rope.scaling.type": (_str, "a string"),
    "rope.scaling.original_context_length": (_count, "a positive integer"),
    "attention.sliding_window": (_int, "an integer"),
    "attention.sliding_window_pattern": (lambda v: _int(v) or _list_of(_bool)(v),
                                         "an integer or a list of booleans"),
}
_KEYS = {
    "general.architecture": (_str, "a string"),
    "tokenizer.ggml.model": (_str, "a string"),
    "tokenizer.ggml.pre": (_str, "a string"),
    "tokenizer.chat_template": (_str, "a string"),
    "tokenizer.ggml.tokens": (_list_of(_str), "a list of strings"),
    "tokenizer.ggml.merges": (_list_of(_str), "a list of strings"),
    "tokenizer.ggml.token_type": (_list_of(_int), "a list of integers"),
    "tokenizer.ggml.scores": (_list_of(_float), "a list of finite numbers"),
    **{f"tokenizer.ggml.{k}": (_bool, "a boolean")
       for k in ("add_bos_token", "add_eos_token", "add_space_prefix")},
    **{f"tokenizer.ggml.{k}_token_id": (_int, "an integer")
       for k in ("bos", "eos", "eot", "eom", "unknown", "padding")},
}


def check_metadata(meta: dict, arch: str) -> None:
    """FormatError naming the first key nibble reads whose value is not of its kind, or a
    tokenizer list (types, scores) whose length is not the vocabulary's."""
    keys = _KEYS | {f"{arch}.{k}": kind for k, kind in _MODEL_KEYS.items()}
    for key, (valid, kind) in keys.items():
        if key in meta and not valid(meta[key]):
            raise FormatError(f"GGUF metadata {key} is {_short(meta[key])}, not {kind}")
    tokens = meta.get("tokenizer.ggml.tokens", [])
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in meta and len(meta[key]) != len(tokens):
            raise FormatError(f"GGUF metadata {key} has {len(meta[key])} entries for "
                              f"{len(tokens)} tokens")
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    if unknown is not None and unknown >= len(tokens):
        raise FormatError(f"GGUF metadata tokenizer.ggml.unknown_token_id {unknown} is not a "
                          f"token id (the vocabulary has {len(tokens)})")

def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
