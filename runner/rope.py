"""Rotary position embedding tables for every rope_type formats/config.py accepts, computed as
transformers' modeling_rope_utils.py does, once for the whole context."""
import math

import numpy as np

from nibble.formats.config import ModelConfig


def inv_frequencies(config: ModelConfig, long: bool = False) -> tuple[np.ndarray, float]:
    """[dim/2] float64 inverse frequencies after scaling (dim: the dims of a head RoPE rotates,
    fewer than head_dim with partial rotary), and the factor transformers multiplies cos and sin
    by (yarn and longrope; 1 for the others). `long`: longrope's long factors."""
    dim, theta = config.rotary_dim, config.rope_theta
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    s = config.rope_scaling or {"rope_type": "default"}
    kind = s["rope_type"]
    if kind in ("default", "dynamic"):
        # dynamic NTK changes the frequencies only past max_position_embeddings, beyond any
        # context nibble runs (Model.new_cache caps it there)
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / s["factor"], 1.0
    factor, old_ctx = s.get("factor"), s["original_max_position_embeddings"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
        low, high = s["low_freq_factor"], s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0
    if kind == "yarn":
        return _yarn(s, inv_freq, dim, theta)
    # longrope: a factor per frequency; Phi-3 leaves `factor` out, meaning the context's growth
    if factor is None:
        factor = config.max_position_embeddings / old_ctx
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    per_freq = np.asarray(s["long_factor" if long else "short_factor"], np.float64)   # [dim/2]
    return inv_freq / per_freq, attention


def _yarn(s: dict, inv_freq: np.ndarray, hd: int, theta: float) -> tuple[np.ndarray, float]:
    """YaRN: frequencies that turn fewer than beta_slow times in the original context are slowed
    by `factor`, those turning more than beta_fast times kept, a linear ramp between; cos and sin
    grow by 0.1 ln(factor) + 1 (or attention_factor, or DeepSeek's mscale ratio)."""
    factor, old_ctx = s["factor"], s["original_max_position_embeddings"]

    def mscale(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale(1)

    def dim_turning(turns):   # the (fractional) dimension that turns `turns` times in old_ctx
        return hd * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(s.get("beta_fast") or 32), dim_turning(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001   # as transformers: no division by zero
    interpolated = np.clip((np.arange(hd // 2) - low) / (high - low), 0.0, 1.0)   # [hd/2] 0..1
    return inv_freq / factor * interpolated + inv_freq * (1 - interpolated), attention


def rope_tables(config: ModelConfig, max_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [max_ctx, dim/2] float32, already multiplied by the attention factor (cpu.rope
    rotates the first config.rotary_dim dims of each head with them).

    longrope: transformers takes the long factors for every position once the sequence is longer
    than original_max_position_embeddings, the short ones before; a table made once cannot follow
    a choice that changes with the sequence, so positions below that length get the short
    factors and the later ones the long: exactly what transformers computes for a sequence that
    fits, and what its cached generation does when a shorter prompt grows past it.
    """
    positions = np.arange(max_ctx, dtype=np.float64)
    inv_freq, attention = inv_frequencies(config)
    angles = np.outer(positions, inv_freq)                     # [ctx, dim/2]
    s = config.rope_scaling
    if s and s["rope_type"] == "longrope":
        old_ctx = s["original_max_position_embeddings"]
        angles[old_ctx:] = np.outer(positions[old_ctx:], inv_frequencies(config, long=True)[0])
    return ((np.cos(angles) * attention).astype(np.float32),
            (np.sin(angles) * attention).astype(np.float32))
