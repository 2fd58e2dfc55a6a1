"""compressed-tensors' pack-quantized layout: what llm-compressor writes and vLLM and SGLang load.

A quantized linear `P` is `P.weight_packed` (int32, a row's integers packed along it: integer k at
bit (k * bits) % 32 of word k * bits // 32, MLX's own order, each stored as q itself where the
library reads q - 2^(bits-1) and subtracts the zero point likewise), `P.weight_scale` (a scale a
group), `P.weight_zero_point` (integers z a group, packed along the rows' axis) and
`P.weight_shape`; w = s * (q - z). config.json's `quantization_config` names the scheme
(asymmetric integers in groups: vLLM's W4A16 and W8A16). An affine weight w = s q + b is in this
form exactly when each bias is -s z for an integer z in [0, 2^bits).
"""
from __future__ import annotations

import numpy as np

FORMAT = "pack-quantized"


def zero_points(scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray | None:
    """The integers z with biases = -scales * z exactly (float32 [N, K/G] each), uint8; None
    where a bias is no such multiple."""
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.rint(np.where(scales != 0, -biases / scales, 0))
    if not ((z >= 0) & (z < 1 << bits)).all():
        return None
    z = z.astype(np.uint8)
    return z if np.array_equal(-scales * z.astype(np.float32), biases) else None


def module_tensors(path: str, weight: np.ndarray, scales: np.ndarray, zeros: np.ndarray,
                   bits: int) -> dict[str, np.ndarray]:
    """A linear's tensors in this layout, from MLX's packed words [N, K*bits/32], scales [N, K/G]
    (float16 or float32) and zero points uint8 [N, K/G]."""
    n, words = weight.shape
    per_word = 32 // bits
    rows = -(-n // per_word) * per_word   # zero points pack whole words of rows
    z = np.zeros((rows, zeros.shape[1]), np.uint32)
    z[:n] = zeros
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).reshape(1, per_word, 1)
    packed_zeros = (z.reshape(-1, per_word, zeros.shape[1]) << shifts).sum(axis=1, dtype=np.uint32)
    return {f"{path}.weight_packed": np.ascontiguousarray(weight, np.uint32).view(np.int32),
            f"{path}.weight_scale": np.ascontiguousarray(scales),
            f"{path}.weight_zero_point": packed_zeros.view(np.int32),
            f"{path}.weight_shape": np.array([n, words * 32 // bits], np.int64)}


def quantization_config(bits: int, group_size: int, ignore: list[str]) -> dict:
    """config.json's quantization_config: every Linear but `ignore`'s (module names) asymmetric
    `bits`-bit integers in groups of `group_size`, compressed as this layout."""
    weights = {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group",
               "group_size": group_size, "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": FORMAT}},
            "ignore": ignore, "kv_cache_scheme": None}
