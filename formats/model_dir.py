"""A Hugging Face model directory: config.json, generation_config.json, tokenizer files, weights."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tokenizers

from .config import ModelConfig


@dataclass
class ModelDir:
    """Everything a model reference resolves to, whatever file format it came from."""
    path: Path | None                 # where it was read from (None: built in memory)
    config: ModelConfig
    tensors: dict[str, np.ndarray]    # Hugging Face names -> read-only arrays (memmap views when possible)
    tokenizer: tokenizers.Tokenizer
    tokenizer_config: dict = field(default_factory=dict)    # chat_template, bos_token, eos_token, add_bos_token
    generation_config: dict = field(default_factory=dict)   # eos_token_id, sampling defaults
