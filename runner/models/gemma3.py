"""Gemma 3 (gemma3_text, and the text model of a gemma3 checkpoint: formats/wrappers.py; its vision
is runner/vision/gemma3.py): four
RMSNorms a block, q/k norms, a GELU-gated MLP, embeddings scaled by sqrt(hidden_size), attention
scores divided by sqrt(query_pre_attn_scalar), and sliding layers with a RoPE of their own."""
import dataclasses
import math

import numpy as np

from nibble.formats.config import ModelConfig, sliding_where_typed
from nibble.formats.errors import FormatError
from nibble.formats.families import GGUFArch
from nibble.formats.gguf_metadata import float32_decimal
from nibble.formats.half import HalfTensor
from nibble.formats.values import COUNT, number, optional
from ..rope import rope_tables
from .base import Transformer


def _gguf_fields(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    if a + "final_logit_softcapping" in meta:
        raise FormatError("GGUF gemma3.final_logit_softcapping is set; nibble's gemma3 has "
                          "no logit soft-capping")
    window = meta.get(a + "attention.sliding_window", 0)
    # a flag per layer, or every n-th layer global (llama.cpp: n = 6 if the file has none)
    pattern = meta.get(a + "attention.sliding_window_pattern", 6)
    slides = (pattern if isinstance(pattern, list) else
              [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)])
    return dict(
        sliding_window=window or None,
        layer_types=["sliding_attention" if window and s else "full_attention" for s in slides],
        rope_local_base_freq=float32_decimal(meta.get(a + "rope.freq_base_swa", 10000.0)),
        # not in the file: llama.cpp scales scores by 1/sqrt(head_dim), by 1/sqrt(hidden /
        # heads) for the 62-layer 27B (Gemma 3's query_pre_attn_scalar)
        query_pre_attn_scalar=width if layers == 62 else head_dim)


class Gemma3(Transformer):
    # What Gemma3TextConfig assumes for the fields a config.json leaves out (and its default_theta
    # for the RoPE bases)
    model_types = {"gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1,
        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
        rope_theta=1e6, rope_local_base_freq=1e4)}
    # Gemma's RMSNorm scales by (1 + w): the converter stored 1 + w
    gguf = {"gemma3": GGUFArch("gemma3_text", norm_shift=1.0,
                               block_names={"ffn_norm": "pre_feedforward_layernorm",
                                            "post_attention_norm": "post_attention_layernorm",
                                            "post_ffw_norm": "post_feedforward_layernorm"},
                               fields=_gguf_fields)}
    local_rope = True
    wrappers = {"gemma3": "gemma3_text"}   # Gemma3ForConditionalGeneration
    fixed = {"hidden_activation": ("gelu_pytorch_tanh",),   # its MLP's
             "use_bidirectional_attention": (False, None)}   # causal attention
    fields = {
        "sliding_window_pattern": optional(COUNT),   # without layer_types: every n-th layer is global
        "rope_local_base_freq": optional(number(above=0)),   # the sliding layers' theta (their RoPE is unscaled)
        "query_pre_attn_scalar": optional(number(above=0)),   # attention scores are divided by its root
    }
    # the same projections feed gemma3_layer's four act_sq rows: Transformer's act_shape and importances

    def windows(self, c: ModelConfig) -> list[int]:
        return sliding_where_typed(c.layer_types, c.sliding_window or 0)   # where layer_types says

    def kernel(self):
        from ..kernels.gemma3 import gemma3_layer
        return gemma3_layer

    def norm(self, get, name: str, shape: tuple) -> np.ndarray | None:
        """An RMSNorm's weight as the kernels multiply by it: Gemma's norms scale by (1 + w). Made in
        float32 as transformers makes it (1.0 + weight.float()): the same numbers, a small copy."""
        w = get(name, shape)
        return None if w is None else 1 + w

    def layer_weights(self, get, c: ModelConfig, i: int):
        from ..kernels.gemma3 import Gemma3Weights
        D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
        q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
        p = f"model.layers.{i}."
        return Gemma3Weights(
            input_norm=self.norm(get, p + "input_layernorm.weight", (D,)),
            wq=get.linear(p + "self_attn.q_proj", (q_dim, D)),
            wk=get.linear(p + "self_attn.k_proj", (kv_dim, D)),
            wv=get.linear(p + "self_attn.v_proj", (kv_dim, D)),
            q_norm=self.norm(get, p + "self_attn.q_norm.weight", (hd,)),
            k_norm=self.norm(get, p + "self_attn.k_norm.weight", (hd,)),
            attention_scale=np.float32(c.query_pre_attn_scalar ** -0.5),
            wo=get.linear(p + "self_attn.o_proj", (D, q_dim)),
            post_attention_norm=self.norm(get, p + "post_attention_layernorm.weight", (D,)),
            pre_feedforward_norm=self.norm(get, p + "pre_feedforward_layernorm.weight", (D,)),
            w_gate=get.linear(p + "mlp.gate_proj", (F, D)),
            w_up=get.linear(p + "mlp.up_proj", (F, D)),
            w_down=get.linear(p + "mlp.down_proj", (D, F)),
            post_feedforward_norm=self.norm(get, p + "post_feedforward_layernorm.weight", (D,)),
        )

    def embed_scale(self, c: ModelConfig, embed) -> np.float32:
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

    def ropes(self, c: ModelConfig, ctx: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The global layers' table (rope_theta, rope_scaling) and the sliding layers' (their own
        theta, unscaled), each made once."""
        sliding = dataclasses.replace(c, rope_theta=c.rope_local_base_freq, rope_scaling=None)
        tables = {"full_attention": rope_tables(c, ctx), "sliding_attention": rope_tables(sliding, ctx)}
        return [tables[t] for t in c.layer_types]

    def configure(self, c: ModelConfig) -> None:
        """Refuses what the block does not run; spells out layer_types from sliding_window_pattern as
        transformers does for older configs."""
        if c.attention_bias:
            raise FormatError("config.json: nibble cannot run attention_bias=True for gemma3 (its block "
                              "has no q/k/v/o biases)")
        for name in ("query_pre_attn_scalar", "rope_local_base_freq"):   # its block's, not optional
            number(above=0).check(f"config.json: {name}", getattr(c, name))
        if c.layer_types is None:   # every sliding_window_pattern-th layer is global
            COUNT.check("config.json: sliding_window_pattern", c.sliding_window_pattern)
            c.layer_types = ["full_attention" if (i + 1) % c.sliding_window_pattern == 0
                             else "sliding_attention" for i in range(c.num_hidden_layers)]
