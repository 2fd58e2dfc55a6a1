"""Gemma 3 (gemma3_text, and the text model of a gemma3 checkpoint: formats/wrappers.py): four
RMSNorms a block, q/k norms, a GELU-gated MLP, embeddings scaled by sqrt(hidden_size), attention
scores divided by sqrt(query_pre_attn_scalar), and sliding layers with a RoPE of their own."""
import dataclasses
import math

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.half import HalfTensor
from ..kernels.gemma3 import Gemma3Weights, gemma3_layer
from ..rope import rope_tables
from . import llama

block = gemma3_layer
INPUTS = llama.INPUTS   # the same projections feed gemma3_layer's four act_sq rows


def norm(get, name: str, shape: tuple) -> np.ndarray | None:
    """An RMSNorm's weight as the kernels multiply by it: Gemma's norms scale by (1 + w). Made in
    float32 as transformers makes it (1.0 + weight.float()): the same numbers, a small copy."""
    w = get(name, shape)
    return None if w is None else 1 + w


def layer(get, c: ModelConfig, i: int) -> Gemma3Weights:
    D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
    p = f"model.layers.{i}."
    q_norm = norm(get, p + "self_attn.q_norm.weight", (hd,))
    if q_norm is not None:
        # the attention kernel divides scores by sqrt(hd), Gemma by sqrt(query_pre_attn_scalar):
        # q scaled by their ratio before RoPE (both linear) makes up the difference
        q_norm *= np.float32(math.sqrt(hd / c.query_pre_attn_scalar))
    return Gemma3Weights(
        input_norm=norm(get, p + "input_layernorm.weight", (D,)),
        wq=get.linear(p + "self_attn.q_proj", (q_dim, D)),
        wk=get.linear(p + "self_attn.k_proj", (kv_dim, D)),
        wv=get.linear(p + "self_attn.v_proj", (kv_dim, D)),
        q_norm=q_norm,
        k_norm=norm(get, p + "self_attn.k_norm.weight", (hd,)),
        wo=get.linear(p + "self_attn.o_proj", (D, q_dim)),
        post_attention_norm=norm(get, p + "post_attention_layernorm.weight", (D,)),
        pre_feedforward_norm=norm(get, p + "pre_feedforward_layernorm.weight", (D,)),
        w_gate=get.linear(p + "mlp.gate_proj", (F, D)),
        w_up=get.linear(p + "mlp.up_proj", (F, D)),
        w_down=get.linear(p + "mlp.down_proj", (D, F)),
        post_feedforward_norm=norm(get, p + "post_feedforward_layernorm.weight", (D,)),
    )


def embed_scale(c: ModelConfig, embed) -> np.float32:
    """sqrt(hidden_size) in the dtype the checkpoint was saved in, as transformers multiplies the
    embeddings by it (embed_scale.to(weight.dtype)) and Gemma was trained: in bf16, sqrt(3072) =
    55.43 is 55.5. The dtype is the embedding's own, or for a quantized one, the config's."""
    scale = np.float32(math.sqrt(c.hidden_size))
    if isinstance(embed, HalfTensor):
        dtype = "bfloat16" if embed.bf16 else "float16"
    elif isinstance(embed, np.ndarray):
        dtype = embed.dtype.name
    else:
        dtype = c.extra.get("dtype", c.extra.get("torch_dtype"))
    if dtype == "float16":
        return np.float32(np.float16(scale))
    if dtype == "bfloat16":   # rounded to nearest even in the top 16 bits of the float32
        bits = np.array([scale]).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)[0]
    return scale


def ropes(c: ModelConfig, ctx: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The global layers' table (rope_theta, rope_scaling) and the sliding layers' (their own
    theta, unscaled), each made once."""
    sliding = dataclasses.replace(c, rope_theta=c.rope_local_base_freq, rope_scaling=None)
    tables = {"full_attention": rope_tables(c, ctx), "sliding_attention": rope_tables(sliding, ctx)}
    return [tables[t] for t in c.layer_types]
