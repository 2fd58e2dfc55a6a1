"""Llama and the families that share its block: Mistral (a sliding window), Qwen2 (q/k/v biases),
Qwen3 (an RMSNorm over each query and key head before RoPE) and SmolLM3 (no RoPE in some layers)."""
import numpy as np

from nibble.formats.config import ModelConfig
from ..kernels.layer import LayerWeights, decoder_layer
from ..rope import rope_tables

block = decoder_layer
# the projections whose input each of decoder_layer's four act_sq rows collects (calibrate.py)
INPUTS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def layer(get, c: ModelConfig, i: int) -> LayerWeights:
    D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
    p = f"model.layers.{i}."
    bias = get if c.attention_bias else lambda name, shape: np.zeros(shape, np.float32)
    # empty for the models without q/k norms: decoder_layer skips them
    qk_norm = get if c.model_type == "qwen3" else lambda name, shape: np.zeros(0, np.float32)
    return LayerWeights(
        input_norm=get(p + "input_layernorm.weight", (D,)),
        wq=get.linear(p + "self_attn.q_proj", (q_dim, D)),
        wk=get.linear(p + "self_attn.k_proj", (kv_dim, D)),
        wv=get.linear(p + "self_attn.v_proj", (kv_dim, D)),
        bq=bias(p + "self_attn.q_proj.bias", (q_dim,)),
        bk=bias(p + "self_attn.k_proj.bias", (kv_dim,)),
        bv=bias(p + "self_attn.v_proj.bias", (kv_dim,)),
        q_norm=qk_norm(p + "self_attn.q_norm.weight", (hd,)),
        k_norm=qk_norm(p + "self_attn.k_norm.weight", (hd,)),
        wo=get.linear(p + "self_attn.o_proj", (D, q_dim)),
        post_norm=get(p + "post_attention_layernorm.weight", (D,)),
        w_gate=get.linear(p + "mlp.gate_proj", (F, D)),
        w_up=get.linear(p + "mlp.up_proj", (F, D)),
        w_down=get.linear(p + "mlp.down_proj", (D, F)),
    )


def norm(get, name: str, shape: tuple) -> np.ndarray | None:
    """An RMSNorm's weight, as the kernels multiply by it."""
    return get(name, shape)


def embed_scale(c: ModelConfig, embed) -> float:
    """The factor on the embedded rows: none."""
    return 1.0


def ropes(c: ModelConfig, ctx: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """One table for every layer; zero-width tables where a layer has no RoPE (smollm3)."""
    table = rope_tables(c, ctx)
    none = (np.zeros((ctx, 0), np.float32),) * 2
    return [table if rope else none for rope in c.rope_layers]
