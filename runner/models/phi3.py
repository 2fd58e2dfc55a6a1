"""Phi-3 (Phi-3.5-mini, Phi-4-mini): Llama's block, with q/k/v stored as one matrix (qkv_proj)
and gate/up as another (gate_up_proj), split here into views of their rows; no biases. Partial
rotary (Phi-4-mini's partial_rotary_factor) is in the RoPE tables: they are as wide as the dims
they rotate (rope.py)."""
import math

import numpy as np

from nibble.formats.config import ORIGINAL_CONTEXT, ModelConfig, one_window
from nibble.formats.errors import FormatError
from nibble.formats.families import GGUFArch
from nibble.formats.values import optional
from .base import Transformer


def split_rows(w, sizes: tuple[int, ...]) -> list:
    """Consecutive blocks of rows of w (a Weight), `sizes` rows each, as views (None where w is
    missing: Model names the missing tensors after reading every layer)."""
    from ..kernels.linear import row_block
    ends = np.cumsum(sizes)
    return [None if w is None else row_block(w, end - n, end) for n, end in zip(sizes, ends)]


def _gguf_fields(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp disables phi3's sliding window: full attention everywhere."""
    return dict(original_max_position_embeddings=meta.get(a + "rope.scaling.original_context_length"))


class Phi3(Transformer):
    model_types = {"phi3": dict(rms_norm_eps=1e-5, max_position_embeddings=4096,
                                original_max_position_embeddings=4096)}
    gguf = {"phi3": GGUFArch("phi3", block_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                             fields=_gguf_fields)}   # kept fused
    partial_rotary = True
    # longrope's, over rope_parameters'
    fields = {"original_max_position_embeddings": optional(ORIGINAL_CONTEXT)}
    INPUTS = (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",))

    def windows(self, c: ModelConfig) -> list[int]:
        return one_window(c, c.sliding_window or 0)   # every layer slides

    def layer_weights(self, get, c: ModelConfig, i: int):
        from ..kernels.layer import LayerWeights
        D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
        q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
        p = f"model.layers.{i}."
        wq, wk, wv = split_rows(get.linear(p + "self_attn.qkv_proj", (q_dim + 2 * kv_dim, D)),
                                (q_dim, kv_dim, kv_dim))
        w_gate, w_up = split_rows(get.linear(p + "mlp.gate_up_proj", (2 * F, D)), (F, F))
        no_norm = np.zeros(0, np.float32)   # no q/k norms, o bias or sinks
        return LayerWeights(
            input_norm=get(p + "input_layernorm.weight", (D,)),
            wq=wq, wk=wk, wv=wv,
            bq=np.zeros(q_dim, np.float32), bk=np.zeros(kv_dim, np.float32),
            bv=np.zeros(kv_dim, np.float32),
            q_norm=no_norm, k_norm=no_norm,
            wo=get.linear(p + "self_attn.o_proj", (D, q_dim)), bo=no_norm, sinks=no_norm,
            post_norm=get(p + "post_attention_layernorm.weight", (D,)),
            attention_scale=np.float32(1 / math.sqrt(hd)), residual_scale=np.float32(1),
            w_gate=w_gate, w_up=w_up,
            w_down=get.linear(p + "mlp.down_proj", (D, F)),
        )

    def rope(self, c: ModelConfig, s: dict) -> str:
        """Phi3Config's RoPE (in place on s): "su" and "yarn" are its old names for longrope, and a
        longrope block takes the top-level original_max_position_embeddings over its own."""
        kind = s["rope_type"]
        if kind == "longrope":
            s["original_max_position_embeddings"] = c.original_max_position_embeddings
        elif kind in ("su", "yarn"):
            kind = s["rope_type"] = "longrope"
        elif kind != "default":
            raise FormatError(f"config.json: phi3 runs default or longrope RoPE, not {kind!r}")
        return kind
