"""Models with a known architecture's shapes and random quantized weights, to measure speed at
sizes no test machine downloads (`nibble bench --shapes llama-2-7b`). What they say is noise;
how fast they say it is what a real model of those shapes would do: the kernels read the same
bytes whatever the values are.
"""
from __future__ import annotations

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.errors import NibbleError
from .model import Model

SHAPES = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
}


def random_model(shapes: str | dict, bits: int, group_size: int = 64, seed: int = 0) -> Model:
    """A llama model of SHAPES[shapes] (or of the config fields given) with random `bits`-bit
    weights in MLX's layout, every matrix its own: nothing is shared that a cache could keep."""
    if isinstance(shapes, str):
        if shapes not in SHAPES:
            raise NibbleError(f"unknown shapes {shapes!r}: choose {', '.join(SHAPES)}")
        shapes = SHAPES[shapes]
    c = ModelConfig(model_type="llama", **shapes, quantization={"bits": bits, "group_size": group_size})
    rng = np.random.default_rng(seed)
    D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
    tensors = {"model.norm.weight": np.ones(D, np.float32)}

    def linear(path: str, n: int, k: int):
        # uniform integers; scale and bias map them to [-sqrt(3/k), sqrt(3/k)]: variance 1/k,
        # so activations keep their size through the layers
        half_range = np.sqrt(3 / k)
        scale = np.float16(2 * half_range / (2 ** bits - 1))
        tensors[f"{path}.weight"] = rng.integers(0, 2 ** 32, (n, k * bits // 32), dtype=np.uint32)
        tensors[f"{path}.scales"] = np.full((n, k // group_size), scale, np.float16)
        tensors[f"{path}.biases"] = np.full((n, k // group_size), -half_range, np.float16)

    linear("model.embed_tokens", c.vocab_size, D)
    linear("lm_head", c.vocab_size, D)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = np.ones(D, np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(D, np.float32)
        for name, n, k in (("self_attn.q_proj", q_dim, D), ("self_attn.k_proj", kv_dim, D),
                           ("self_attn.v_proj", kv_dim, D), ("self_attn.o_proj", D, q_dim),
                           ("mlp.gate_proj", F, D), ("mlp.up_proj", F, D), ("mlp.down_proj", D, F)):
            linear(p + name, n, k)
    return Model(c, tensors)
