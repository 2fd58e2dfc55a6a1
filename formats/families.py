"""The model families nibble runs, as the file readers need to know them: a table the families fill.

formats/ reads config.json and GGUF files of any family but names none. Each family's module
(runner/models/<family>.py, imported with runner) describes itself in a `Family` and adds it here:
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


def _every_layer(c: ModelConfig) -> list[bool]:
    return [True] * c.num_hidden_layers


def _nothing(c: ModelConfig) -> None:
    pass


@dataclass(frozen=True)
class Family:
    """A family as config.py and gguf.py read it; `name` is its module in runner/models."""
    name: str
    # model_type -> the defaults of transformers' config class for the fields a config.json may
    # leave out, where they differ from ModelConfig's (transformers 4 omits every field that
    # equals its class's default)
    model_types: Mapping[str, Mapping]
    # each layer's sliding window (0: full attention), as transformers runs the model type
    windows: Callable[[ModelConfig], list[int]]
    # the family's own rules, run once every field is checked and before RoPE's: fields it sets
    # whatever config.json says, values its block cannot run refused in one line
    configure: Callable[[ModelConfig], None] = _nothing
    rope_layers: Callable[[ModelConfig], list[bool]] = _every_layer   # which layers apply RoPE
    # rope_parameters (in place) as the family's config class reads them -> its rope_type
    rope: Callable[[ModelConfig, dict], str] | None = None
    partial_rotary: bool = False   # RoPE may rotate part of each head (partial_rotary_factor)
    local_rope: bool = False       # its sliding layers have a RoPE of their own (rope_local_base_freq)
    gguf: Mapping[str, GGUFArch] = field(default_factory=dict)   # general.architecture -> its layout
    # config.FIXED_FIELDS' accepted values where the family runs others (BERT's "gelu")
    fixed: Mapping[str, tuple] = field(default_factory=dict)
    encoder: bool = False   # an encoder (BERT's): it embeds text (runner/embedding/encoder.py), it does not generate


_BY_MODEL_TYPE: dict[str, Family] = {}
_BY_GGUF_ARCH: dict[str, GGUFArch] = {}


def add(family: Family) -> None:
    """Make `family` readable: its model types and GGUF architectures."""
    _BY_MODEL_TYPE.update(dict.fromkeys(family.model_types, family))
    _BY_GGUF_ARCH.update(family.gguf)


def of(model_type: str) -> Family | None:
    return _BY_MODEL_TYPE.get(model_type)


def model_types() -> list[str]:
    """Every config.json model_type nibble runs, sorted."""
    return sorted(_BY_MODEL_TYPE)


def gguf_arch(arch: str) -> GGUFArch | None:
    return _BY_GGUF_ARCH.get(arch)


def gguf_archs() -> list[str]:
    """Every GGUF general.architecture nibble imports, in the order the families added them."""
    return list(_BY_GGUF_ARCH)
