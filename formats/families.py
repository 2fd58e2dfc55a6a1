"""The model families nibble runs, as the file readers need to know them: a table the families fill.

formats/ reads config.json and GGUF files of any family but names none. Each family's class
(runner/models/<family>.py) is a `Family`, added here by runner/models' FAMILIES table when
nibble.runner is imported (so reading a model needs that import first):
what its config.json may leave out, what it sets, refuses or spells out, which of its layers slide
and rotate, and how llama.cpp's files name its tensors and fields.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# What the families' rules take: formats.config.ModelConfig, which reads this table while it is
# built, so this module does not import it (not even for type checkers: an import circle).
ModelConfig = Any


@dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp's files of one `general.architecture` hold a model of the family."""
    model_type: str   # the Hugging Face model_type the file becomes, unless its fields say
    # block tensor names (GGUF -> Hugging Face, after blk.N.) where they differ from llama's
    block_names: Mapping[str, str] = field(default_factory=dict)
    permuted_qk: bool = False   # convert_hf_to_gguf.py reordered the q/k rows for llama.cpp's RoPE
    norm_shift: float = 0.0     # what the converter added to every *norm.weight, taken off again
    # (meta, "<arch>.", layers, hidden_size / heads, head_dim) -> the config fields beyond llama's,
    # as llama.cpp's src/models/<arch>.cpp reads them (its own values where the file has none);
    # model_type among them where the metadata decides it (an architecture of several model types)
    fields: Callable[[dict, str, int, int, int], dict] = lambda meta, a, layers, width, head_dim: {}
    # Hugging Face matrices (after model.layers.N.) whose rows the converter split into the GGUF
    # tensors named (after blk.N.), in order: joined again
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


class Family:
    """A model family as config.py and gguf.py read it. Each family is a subclass in runner/models/
    (runner/models/base.py's Transformer, which adds how its blocks run), registered there: its
    class attributes say what it reads, its methods the rules of its configs."""
    # model_type -> the defaults of transformers' config class for the fields a config.json may
    # leave out, where they differ from ModelConfig's (transformers 4 omits every field that
    # equals its class's default). A family's own: a subclass names the model types it runs.
    model_types: Mapping[str, Mapping] = {}
    gguf: Mapping[str, GGUFArch] = {}   # general.architecture -> its layout (the family's own)
    # the config.json fields the family reads beyond ModelConfig's, by the kind of value each holds
    # (formats/values.py): attributes of its configs, None where config.json and the model type's
    # defaults leave one out. A family's own and the family's it inherits from.
    fields: Mapping[str, Any] = {}
    # model_type of a multimodal wrapper -> its text model's, which the family runs (wrappers.py)
    wrappers: Mapping[str, str] = {}
    # config.FIXED_FIELDS' accepted values where the family runs others, and fields of its own it
    # runs with those values only (BERT's "gelu")
    fixed: Mapping[str, tuple] = {}
    partial_rotary = False   # RoPE may rotate part of each head (partial_rotary_factor)
    local_rope = False       # its sliding layers have a RoPE of their own (rope_local_base_freq)
    encoder = False   # an encoder (BERT's): it embeds text (runner/embedding/encoder.py), it does not generate

    def windows(self, c: ModelConfig) -> list[int]:
        """Each layer's sliding window (0: full attention), as transformers runs the model type."""
        raise NotImplementedError

    def configure(self, c: ModelConfig) -> None:
        """The family's own rules, run once every field is checked and before RoPE's: fields it
        sets whatever config.json says, values its block cannot run refused in one line."""

    def rope_layers(self, c: ModelConfig) -> list[bool]:
        """Which layers apply RoPE."""
        return [True] * c.num_hidden_layers

    def rope(self, c: ModelConfig, s: dict) -> str:
        """rope_parameters `s` (in place) as the family's config class reads them -> its rope_type."""
        return s["rope_type"]


_BY_MODEL_TYPE: dict[str, Family] = {}
_BY_GGUF_ARCH: dict[str, GGUFArch] = {}
_WRAPPED: dict[str, str] = {}


def add(family: Family) -> None:
    """Make `family` readable: its model types and GGUF architectures (its class's own, not
    those of the family it inherits from)."""
    own = vars(type(family))
    _BY_MODEL_TYPE.update(dict.fromkeys(own.get("model_types", {}), family))
    _BY_GGUF_ARCH.update(own.get("gguf", {}))
    _WRAPPED.update(own.get("wrappers", {}))


def of(model_type: str) -> Family | None:
    return _BY_MODEL_TYPE.get(model_type)


def wrapped(model_type: str) -> str | None:
    """The text model_type inside a multimodal wrapper's `model_type`; None: not a wrapper."""
    return _WRAPPED.get(model_type)


def model_types() -> list[str]:
    """Every config.json model_type nibble runs, sorted."""
    return sorted(_BY_MODEL_TYPE)


def gguf_arch(arch: str) -> GGUFArch | None:
    return _BY_GGUF_ARCH.get(arch)


def gguf_archs() -> list[str]:
    """Every GGUF general.architecture nibble imports, in the order the families added them."""
    return list(_BY_GGUF_ARCH)
