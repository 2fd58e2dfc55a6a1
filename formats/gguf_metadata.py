"""The kinds of value the GGUF metadata keys nibble reads must hold, checked before any is used.

GGUF stores each value's type beside it, so a damaged type byte decodes to a value of another kind
(a token id as a float, a head count of 0, the vocabulary as a list of numbers); llama.cpp refuses
a key of the wrong type, and so does nibble, naming the key.
"""
from __future__ import annotations

import numpy as np

from .config import MAX_CONTEXT, MAX_LAYERS
from .errors import FormatError
from .values import BOOL, COUNT, STRING, either, integer, list_of, number

# what llama.cpp reads these keys as: a FLOAT64 beyond float32's range is no value to it
_FLOAT32 = number(least=-float(np.finfo(np.float32).max), most=float(np.finfo(np.float32).max))

# key after "<architecture>." -> the kind of value it must hold
_MODEL_KEYS = {
    **{k: COUNT for k in ("embedding_length", "feed_forward_length", "attention.head_count",
                          "attention.head_count_kv", "attention.key_length", "rope.dimension_count")},
    "block_count": integer(1, MAX_LAYERS),
    "context_length": integer(1, MAX_CONTEXT),
    "rope.scaling.original_context_length": integer(1, MAX_CONTEXT),
    **{k: _FLOAT32 for k in ("rope.freq_base", "rope.freq_base_swa", "attention.layer_norm_rms_epsilon",
                             "rope.scaling.factor", "rope.scaling.attn_factor")},
    "rope.scaling.type": STRING,
    "attention.sliding_window": integer(),
    "attention.sliding_window_pattern": either(integer(), list_of(BOOL, "booleans")),
}
_KEYS = {
    "general.architecture": STRING,
    "tokenizer.ggml.model": STRING,
    "tokenizer.ggml.pre": STRING,
    "tokenizer.chat_template": STRING,
    "tokenizer.ggml.tokens": list_of(STRING, "strings"),
    "tokenizer.ggml.merges": list_of(STRING, "strings"),
    "tokenizer.ggml.token_type": list_of(integer(), "integers"),
    "tokenizer.ggml.scores": list_of(number(), "finite numbers"),
    **{f"tokenizer.ggml.{k}": BOOL for k in ("add_bos_token", "add_eos_token", "add_space_prefix")},
    **{f"tokenizer.ggml.{k}_token_id": integer() for k in ("bos", "eos", "eot", "eom", "unknown", "padding")},
}


def float32_decimal(v: float) -> float:
    """A float metadata value as llama.cpp reads it, float32, written as the shortest decimal
    that is that float32: 1e-5 reads back 1e-05, not 9.99e-06."""
    return float(str(np.float32(v)))


def check_metadata(meta: dict, arch: str) -> None:
    """FormatError naming the first key nibble reads whose value is not of its kind, or a
    tokenizer list (types, scores) whose length is not the vocabulary's."""
    keys = _KEYS | {f"{arch}.{k}": kind for k, kind in _MODEL_KEYS.items()}
    for key, kind in keys.items():
        if key in meta:
            kind.check(f"GGUF metadata {key}", meta[key])
    tokens = meta.get("tokenizer.ggml.tokens", [])
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in meta and len(meta[key]) != len(tokens):
            raise FormatError(f"GGUF metadata {key} has {len(meta[key])} entries for "
                              f"{len(tokens)} tokens")
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    if unknown is not None and unknown >= len(tokens):
        raise FormatError(f"GGUF metadata tokenizer.ggml.unknown_token_id {unknown} is not a "
                          f"token id (the vocabulary has {len(tokens)})")


def expert_counts(meta: dict, a: str) -> tuple[int, int]:
    """A mixture of experts' `<arch>.expert_count` and `expert_used_count` (a: "<arch>."), checked:
    absent, they read as 0, as llama.cpp reads them (and refuses the file)."""
    E, k = meta.get(a + "expert_count", 0), meta.get(a + "expert_used_count", 0)
    for key, value in (("expert_count", E), ("expert_used_count", k)):
        COUNT.check(f"GGUF metadata {a}{key}", value)
    if k > E:
        raise FormatError(f"GGUF metadata {a}expert_used_count {k} is more than the {E} experts")
    return E, k
