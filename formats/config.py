"""The model configuration, with Hugging Face's field names so config.json flows in untouched.

config.json comes in two spellings. transformers 4 wrote `rope_theta` and `rope_scaling` at the
top level; transformers 5 writes one `rope_parameters` block ({"rope_theta": ..., "rope_type":
...}), or one per layer type. Both become `rope_theta` + `rope_scaling` here (None for plain
RoPE); a family whose sliding layers have a RoPE of their own (Family.local_rope) reads their
theta as `rope_local_base_freq` (its name in older configs), unscaled. `dtype`
(`torch_dtype` before transformers 5) stays in `extra`: it names the dtype the weights were saved
in, which every tensor carries itself, and nibble computes in float32 whatever it says.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from . import families
from .errors import FormatError
from .values import BOOL, COUNT, OBJECT, STRING, either, integer, list_of, number, optional
from .wrappers import is_wrapper, text_config

# rope_type -> the rope_parameters fields it needs (transformers' _validate_*_rope_parameters).
ROPE_TYPES = {
    "default": (),
    "dynamic": ("factor",),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}

LAYER_TYPES = ("full_attention", "sliding_attention")

# Far past any released model (the deepest have under 200 layers, the longest context is 10M
# positions), and small enough that what is made per layer or per position fits in memory.
MAX_LAYERS = 4096
MAX_CONTEXT = 1 << 24

_CONTEXT = integer(1, MAX_CONTEXT)
ORIGINAL_CONTEXT = integer(2, MAX_CONTEXT)   # longrope divides by its log
_TOKEN_ID = integer()
# The kind of value each field must hold, checked before any is used: a count of 0 would divide
# by zero, a string or a NaN end in an exception deep in the model. None: the field left out. A
# family's own fields (Family.fields) are checked the same way.
FIELDS = {
    **dict.fromkeys(("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"), COUNT),
    "num_hidden_layers": integer(1, MAX_LAYERS),
    "max_position_embeddings": _CONTEXT,
    "num_key_value_heads": optional(COUNT),
    "head_dim": optional(COUNT),
    # the kernels add it in float32 before dividing: one that rounds to 0 there is none
    "rms_norm_eps": number(least=float(np.finfo(np.float32).tiny), most=1),
    "rope_theta": number(above=0),
    "rope_scaling": optional(OBJECT),
    "tie_word_embeddings": BOOL,
    "attention_bias": BOOL,
    "sliding_window": optional(integer()),
    "layer_types": optional(list_of(STRING, "strings")),
    "partial_rotary_factor": optional(number()),
    "bos_token_id": optional(_TOKEN_ID),
    "eos_token_id": optional(either(_TOKEN_ID, list_of(_TOKEN_ID, "token ids"))),
    "quantization": optional(OBJECT),
}
# The same for the rope_parameters (rope_scaling) fields runner/rope.py reads; null: left out.
ROPE_FIELDS = {
    "rope_type": STRING,
    **dict.fromkeys(("factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor",
                     "high_freq_factor"), number(above=0)),
    "original_max_position_embeddings": ORIGINAL_CONTEXT,
    **dict.fromkeys(("short_factor", "long_factor"), list_of(number(above=0), "positive numbers")),
    **dict.fromkeys(("mscale", "mscale_all_dim"), number(least=0)),   # yarn divides by 1 + 0.1 m ln f
    "truncate": BOOL,
}

# Fields transformers' decoder classes read that nibble does not implement: accepted with the
# values that leave the computation as nibble runs it, refused otherwise (a family adds its own:
# Family.fixed). Any
# other unknown key is one those classes ignore too (architectures, transformers_version, dtype,
# use_cache, initializer_range, pretraining_tp, attention_dropout: dropout is off at inference),
# so it cannot change their numbers; it stays in `extra`.
FIXED_FIELDS = {
    "hidden_act": ("silu", "swish"),   # the same function under two names
    "mlp_bias": (False, None),
    # Gemma 2's soft caps: a config that sets them expects them applied
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
}


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None        # with "rope_type"; None for plain RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None    # per layer: "full_attention" or "sliding_attention"
    partial_rotary_factor: float | None = None   # RoPE rotates this share of each head (None: all; Family.partial_rotary)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    quantization: dict | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        family = _family(self.model_type)
        for name, kind in (FIELDS | family.fields).items():
            kind.check(f"config.json: {name}", getattr(self, name))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
            if not self.head_dim:
                raise FormatError(f"config.json: hidden_size ({self.hidden_size}) is smaller than "
                                  f"num_attention_heads ({self.num_attention_heads}): heads of no "
                                  f"dims (set head_dim)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FormatError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        family.configure(self)
        _check_rotary(self, family)
        self.rope_scaling = _checked_rope_scaling(self, family)
        self.rope_layers = family.rope_layers(self)   # [layers]: False where a layer has no RoPE
        _check_layer_types(self)
        self.windows = family.windows(self)   # [layers]: each one's sliding window, 0 for full causal attention, -1 for bidirectional (an encoder's)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from a config.json dict of either spelling; unknown keys are kept in `extra`,
        missing ones named, and fields that would change the numbers unheeded refused."""
        if is_wrapper(d.get("model_type")):
            d = text_config(d)
        model_type = d.get("model_type")
        text = d.get("text_config")   # a multimodal wrapper that wrappers.py does not unwrap
        inner = text.get("model_type") if isinstance(text, dict) else None
        family = _family(model_type, f" (a wrapper around a {inner!r} text model in text_config)" if inner else "")
        d = dict(family.model_types[model_type]) | d
        cls = config_class(model_type)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise FormatError(f"config.json is missing {', '.join(missing)}")
        for key, accepted in (FIXED_FIELDS | family.fixed).items():
            if key in d and d[key] not in accepted:
                raise FormatError(f"config.json: nibble cannot run {key}={d[key]!r} "
                                  f"(it runs {' or '.join(map(repr, accepted))})")
        d = {k: v for k, v in d.items() if k != "rope_parameters"} | _rope_fields(d, family)
        try:
            return cls(**{k: v for k, v in d.items() if k in names},
                       extra={k: v for k, v in d.items() if k not in names})
        except TypeError as e:
            raise FormatError(f"config.json: {e}") from None

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra" and v is not None}
        return {**self.extra, **d}

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates: the first ones (rotate-half within them)."""
        return int(self.head_dim * (self.partial_rotary_factor or 1.0))

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)


def config_class(model_type: str) -> type[ModelConfig]:
    """The configuration of `model_type`'s family: ModelConfig and the family's own fields."""
    return _with_fields(_family(model_type))


@functools.cache
def _with_fields(family: families.Family) -> type[ModelConfig]:
    # each None unless config.json or the model type's defaults set it
    own = [(name, object, field(default=None)) for name in family.fields]
    return dataclasses.make_dataclass(f"{type(family).__name__}Config", own, bases=(ModelConfig,)) if own else ModelConfig


def _family(model_type, wraps: str = "") -> families.Family:
    family = families.of(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise FormatError(f"unsupported architecture {model_type!r}{wraps}: nibble runs "
                          f"{', '.join(families.model_types())}")
    return family


def _rope_fields(d: dict, family: families.Family) -> dict:
    """rope_theta and rope_scaling from either spelling, with transformers' precedence:
    `rope_scaling` over `rope_parameters`, a theta inside the block over a top-level one."""
    block = d.get("rope_scaling") or d.get("rope_parameters") or {}
    OBJECT.check("config.json: rope_parameters", block)
    for key in LAYER_TYPES:
        if key in block:
            OBJECT.check(f"config.json: rope_parameters.{key}", block[key])
    local = {}
    nested = [block[k] for k in LAYER_TYPES if k in block]   # newer configs: one block per layer type
    if nested and family.local_rope and "sliding_attention" in block:
        # the sliding layers' own RoPE (rope_local_base_freq in older configs)
        local = {"rope_local_base_freq": _plain_theta(block["sliding_attention"],
                                                      d.get("rope_local_base_freq"), d["model_type"])}
        nested = [block.get("full_attention") or {}]
    if nested:
        if any(b != nested[0] for b in nested):
            raise FormatError("config.json: rope_parameters differ between layer types; nibble runs "
                              "one RoPE in every layer")
        block = nested[0]
    block = dict(block)
    theta = block.pop("rope_theta", d.get("rope_theta", 10000.0))
    partial = block.pop("partial_rotary_factor", d.get("partial_rotary_factor"))
    return {"rope_theta": theta, "rope_scaling": block or None,
            "partial_rotary_factor": partial} | local


def _plain_theta(block: dict, default: float, model_type: str) -> float:
    """The theta of the sliding_attention rope_parameters, which nibble runs unscaled."""
    if block.get("rope_type", "default") != "default" or set(block) - {"rope_type", "rope_theta"}:
        raise FormatError(f"config.json: rope_parameters.sliding_attention is {block!r}: nibble runs "
                          f"{model_type}'s sliding layers with plain RoPE (rope_type 'default')")
    return block.get("rope_theta", default)


def _check_rotary(c: ModelConfig, family: families.Family):
    """Partial rotary as transformers runs it: for the families whose blocks rotate part of a head
    (the others rotate whole heads whatever the config says, so one that asks for less is
    refused), and in whole pairs of dims."""
    f = c.partial_rotary_factor
    if f in (None, 1.0):
        if c.head_dim % 2:
            raise FormatError(f"config.json: head_dim {c.head_dim} is odd; RoPE rotates pairs of dims")
        return
    if not family.partial_rotary:
        raise FormatError(f"config.json: nibble cannot run partial_rotary_factor={f!r} for "
                          f"{c.model_type} (transformers' {c.model_type} rotates whole heads)")
    if not 0 < f <= 1 or c.rotary_dim % 2 or c.rotary_dim < 2:
        raise FormatError(f"config.json: partial_rotary_factor={f!r} rotates {c.rotary_dim} of "
                          f"{c.head_dim} dims; nibble rotates an even number of them, at least 2")


def _checked_rope_scaling(c: ModelConfig, family: families.Family) -> dict | None:
    """c.rope_scaling with "rope_type" spelled out (older configs say "type"), None for plain
    RoPE; an unknown type or a missing field is a FormatError naming it."""
    s = dict(c.rope_scaling or {})
    kind = s.pop("type", None)
    kind = s.setdefault("rope_type", kind or "default")
    if kind == "mrope":   # Qwen2-VL's first name for default RoPE with mrope_section (runner/vision reads it)
        kind = s["rope_type"] = "default"
    for key, field_kind in ROPE_FIELDS.items():
        if s.get(key) is not None:
            field_kind.check(f"config.json: rope_parameters.{key}", s[key])
    kind = family.rope(c, s)
    if kind not in ROPE_TYPES:
        raise FormatError(f"config.json: unsupported rope_type {kind!r}: nibble runs "
                          f"{', '.join(ROPE_TYPES)}")
    if kind == "default":
        return None
    if kind in ("llama3", "yarn", "longrope"):   # transformers' default for it
        s.setdefault("original_max_position_embeddings", c.max_position_embeddings)
    missing = [k for k in ROPE_TYPES[kind] if s.get(k) is None]
    if missing:
        raise FormatError(f"config.json: rope_type {kind!r} needs {', '.join(missing)} in "
                          f"rope_parameters")
    if kind == "yarn" and c.rope_theta == 1:   # every frequency 1: yarn's ramp divides by ln(theta)
        raise FormatError("config.json: rope_theta 1 gives yarn no frequencies to ramp between")
    if kind == "llama3" and s["high_freq_factor"] <= s["low_freq_factor"]:
        raise FormatError(f"config.json: rope_parameters.high_freq_factor ({s['high_freq_factor']}) "
                          f"must be above low_freq_factor ({s['low_freq_factor']})")
    for key in ("short_factor", "long_factor") if kind == "longrope" else ():
        if len(s[key]) != c.rotary_dim // 2:
            raise FormatError(f"config.json: rope_parameters.{key} has {len(s[key])} values, "
                              f"the {c.rotary_dim} rotated dims of a head need {c.rotary_dim // 2}")
    return s


def _check_layer_types(c: ModelConfig) -> None:
    types = c.layer_types
    if types is None:
        return
    if len(types) != c.num_hidden_layers:
        raise FormatError(f"config.json: layer_types has {len(types)} entries for {c.num_hidden_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise FormatError(f"config.json: layer_types {', '.join(map(repr, unknown))} are not run "
                          f"by nibble (it runs {', '.join(LAYER_TYPES)})")


def sliding_where_typed(types: list[str], window: int) -> list[int]:
    """`window` in the layers `types` says slide, full attention (0) in the others."""
    return [window if t == "sliding_attention" else 0 for t in types]


def one_window(c: ModelConfig, window: int) -> list[int]:
    """`window` in every layer (0: full attention), for the model types transformers runs so:
    a layer_types that asks for anything else is refused."""
    runs = "sliding_attention" if window else "full_attention"
    if c.layer_types is not None and any(t != runs for t in c.layer_types):
        raise FormatError(f"config.json: layer_types asks for {'full' if window else 'sliding'} "
                          f"attention in some layers, but transformers runs {c.model_type} with "
                          f"{'sliding_window in every layer' if window else 'full attention'}")
    return [window] * c.num_hidden_layers
