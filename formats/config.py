"""The model configuration, with Hugging Face's field names so config.json flows in untouched."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import FormatError

# model_type -> the architecture that runs it (mlx-lm's alias table).
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "llama"}


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
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    quantization: dict | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type == "qwen2":
            self.attention_bias = True  # Qwen2 always has q/k/v biases; its config does not say so
        if self.num_attention_heads % self.num_key_value_heads:
            raise FormatError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from a config.json dict; unknown keys are kept in `extra`, missing ones named."""
        model_type = d.get("model_type")
        if model_type not in ARCHITECTURES:
            known = ", ".join(sorted(ARCHITECTURES))
            raise FormatError(f"unsupported architecture {model_type!r}: nibble runs {known}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise FormatError(f"config.json is missing {', '.join(missing)}")
        try:
            return cls(**{k: v for k, v in d.items() if k in names},
                       extra={k: v for k, v in d.items() if k not in names})
        except TypeError as e:
            raise FormatError(f"config.json: {e}") from None

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra" and v is not None}
        return {**self.extra, **d}

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)
