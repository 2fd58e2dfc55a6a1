"""The Llama-family transformer (llama, mistral, qwen2): weights and the forward pass."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from formats.config import ModelConfig
from formats.errors import FormatError, NibbleError
from .cache import KVCache
from .kernels import cpu
from .rope import rope_tables


class ContextFull(NibbleError):
    """The tokens do not fit in what is left of the context."""


@dataclass
class Layer:
    input_norm: np.ndarray   # [D]
    wq: np.ndarray           # [H*hd, D]
    wk: np.ndarray           # [Hkv*hd, D]
    wv: np.ndarray           # [Hkv*hd, D]
    bq: np.ndarray           # [H*hd] (qwen2; zeros for models without biases)
    bk: np.ndarray           # [Hkv*hd]
    bv: np.ndarray           # [Hkv*hd]
    wo: np.ndarray           # [D, H*hd]
    post_norm: np.ndarray    # [D]
    w_gate: np.ndarray       # [F, D]
    w_up: np.ndarray         # [F, D]
    w_down: np.ndarray       # [D, F]

    @property
    def weights(self) -> tuple:
        """In the order cpu.decoder_layer unpacks them."""
        return (self.input_norm, self.wq, self.wk, self.wv, self.bq, self.bk, self.bv, self.wo,
                self.post_norm, self.w_gate, self.w_up, self.w_down)


class Model:
    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray]):
        self.config = config
        c = config
        D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
        q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
        get = _TensorGetter(tensors)
        self.embed = get("model.embed_tokens.weight", (c.vocab_size, D))      # [V, D]
        self.norm = get("model.norm.weight", (D,))                            # [D]
        self.lm_head = (self.embed if c.tie_word_embeddings
                        else get("lm_head.weight", (c.vocab_size, D)))        # [V, D]
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            bias = get if c.attention_bias else lambda name, shape: np.zeros(shape, np.float32)
            self.layers.append(Layer(
                input_norm=get(p + "input_layernorm.weight", (D,)),
                wq=get(p + "self_attn.q_proj.weight", (q_dim, D)),
                wk=get(p + "self_attn.k_proj.weight", (kv_dim, D)),
                wv=get(p + "self_attn.v_proj.weight", (kv_dim, D)),
                bq=bias(p + "self_attn.q_proj.bias", (q_dim,)),
                bk=bias(p + "self_attn.k_proj.bias", (kv_dim,)),
                bv=bias(p + "self_attn.v_proj.bias", (kv_dim,)),
                wo=get(p + "self_attn.o_proj.weight", (D, q_dim)),
                post_norm=get(p + "post_attention_layernorm.weight", (D,)),
                w_gate=get(p + "mlp.gate_proj.weight", (F, D)),
                w_up=get(p + "mlp.up_proj.weight", (F, D)),
                w_down=get(p + "mlp.down_proj.weight", (D, F)),
            ))
        get.raise_if_missing()
        self.cos, self.sin = rope_tables(c, c.max_position_embeddings)     # [ctx, hd/2]

    def new_cache(self, ctx: int | None = None, kv_type: str = "f32") -> KVCache:
        ctx = min(ctx or self.config.max_position_embeddings, self.config.max_position_embeddings)
        return KVCache.allocate(self.config, ctx, kv_type)

    def forward(self, tokens, cache: KVCache, all_logits: bool = False,
                act_sq: np.ndarray | None = None) -> np.ndarray:
        """Run tokens at positions cache.pos.. and return logits [T, V] (all_logits) or [1, V].

        act_sq [layers, 4, max(D, F)] float64, if given, accumulates the squared inputs of each
        layer's projections (see cpu.decoder_layer).
        """
        c = self.config
        T, pos0 = len(tokens), cache.pos
        if pos0 + T > cache.size:
            raise ContextFull(f"{pos0 + T} tokens do not fit in the context of {cache.size}")
        x = np.asarray(self.embed[np.asarray(tokens)], dtype=np.float32)   # [T, D] residual stream
        for i, layer in enumerate(self.layers):
            cpu.decoder_layer(x, layer.weights, cache.layer(i), pos0, self.cos, self.sin,
                              c.rms_norm_eps, c.sliding_window or 0,
                              _NOT_COLLECTING if act_sq is None else act_sq[i])
        cache.advance(tokens)

        if not all_logits:
            x = x[-1:]   # generation needs only the next token's distribution
        cpu.rmsnorm(x, self.norm, c.rms_norm_eps, x)
        logits = np.empty((x.shape[0], c.vocab_size), np.float32)   # [T or 1, V]
        cpu.matmul(x, self.lm_head, logits, False)
        return logits


_NOT_COLLECTING = np.zeros((0, 0))


class _TensorGetter:
    """Fetches float32 weights by HF name, checking shapes and collecting the missing names."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors
        self.missing: list[str] = []

    def __call__(self, name: str, shape: tuple) -> np.ndarray | None:
        t = self.tensors.get(name)
        if t is None:
            self.missing.append(name)
            return None
        if t.shape != shape:
            raise FormatError(f"tensor {name} has shape {list(t.shape)}, the config needs {list(shape)}")
        if t.dtype != np.float32:
            if t.dtype.kind != "f":
                raise FormatError(f"tensor {name} is {t.dtype}: the float path needs float weights")
            t = t.astype(np.float32)   # f16 -> f32, a copy
        return t

    def raise_if_missing(self):
        if self.missing:
            more = f" and {len(self.missing) - 3} more" if len(self.missing) > 3 else ""
            raise FormatError(f"tensors missing for the config: {', '.join(self.missing[:3])}{more}")
