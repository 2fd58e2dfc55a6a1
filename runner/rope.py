"""Rotary position embedding tables, with the `rope_scaling` variants HF configs use."""
import math

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.errors import FormatError


def inv_frequencies(config: ModelConfig) -> np.ndarray:
    """[hd/2] float64 inverse frequencies, after scaling."""
    hd = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    raise FormatError(f"unsupported rope_scaling type {kind!r}: nibble supports linear and llama3")


def rope_tables(config: ModelConfig, max_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [max_ctx, hd/2] float32."""
    angles = np.outer(np.arange(max_ctx, dtype=np.float64), inv_frequencies(config))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
