"""What every family's transformer shares, as mlx-lm's models/base.py: `Transformer`, a family as
the runner builds it, whose defaults are Llama's pre-norm block (RMSNorms, attention with
optional q/k/v biases and q/k norms, a SwiGLU MLP). A family subclasses it, or another family,
and overrides what differs; formats.families.Family, its base, is what the file readers know."""
import math

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.families import Family
from ..rope import rope_tables


class Transformer(Family):
    """A family's blocks: their kernel, their weights read from a checkpoint, their RoPE tables,
    and what calibration and quantize need of them. `get(name, shape)` reads a vector,
    `get.linear(path, shape)` a matrix (runner/model.py's reader)."""
    # the projections whose input each of the block's four act_sq rows collects (calibrate.py)
    INPUTS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))

    def kernel(self):
        """The block's kernel, (x, weights, kv, rows, cos, sin, eps, window, act_sq) (imported with
        numba when a model is built, not when a config is read)."""
        from ..kernels.layer import decoder_layer
        return decoder_layer

    def layer_weights(self, get, c: ModelConfig, i: int):
        """Block i's weights: the NamedTuple the block kernel takes."""
        from ..kernels.layer import LayerWeights
        D, F = c.hidden_size, c.intermediate_size
        p = f"model.layers.{i}."
        return LayerWeights(
            **self.attention(get, c, i),
            w_gate=get.linear(p + "mlp.gate_proj", (F, D)),
            w_up=get.linear(p + "mlp.up_proj", (F, D)),
            w_down=get.linear(p + "mlp.down_proj", (D, F)),
        )

    def qk_norm(self, c: ModelConfig) -> str | None:
        """Where q and k are RMSNormed before RoPE: "head", over each head (Qwen3's); "row", over
        each row's whole projection (OLMoE's); None: nowhere."""
        return None

    def attention(self, get, c: ModelConfig, i: int) -> dict:
        """Block i's weights up to its MLP (the attention half and its norms), as LayerWeights and
        MoELayerWeights name them."""
        D, hd = c.hidden_size, c.head_dim
        q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
        p = f"model.layers.{i}."
        bias = get if c.attention_bias else lambda name, shape: np.zeros(shape, np.float32)
        norms = self.qk_norm_shapes(c)
        # empty for the models without q/k norms: the block skips them
        none = np.zeros(0, np.float32)
        return dict(
            input_norm=get(p + "input_layernorm.weight", (D,)),
            wq=get.linear(p + "self_attn.q_proj", (q_dim, D)),
            wk=get.linear(p + "self_attn.k_proj", (kv_dim, D)),
            wv=get.linear(p + "self_attn.v_proj", (kv_dim, D)),
            bq=bias(p + "self_attn.q_proj.bias", (q_dim,)),
            bk=bias(p + "self_attn.k_proj.bias", (kv_dim,)),
            bv=bias(p + "self_attn.v_proj.bias", (kv_dim,)),
            q_norm=get(p + "self_attn.q_norm.weight", norms[0]) if norms else none,
            k_norm=get(p + "self_attn.k_norm.weight", norms[1]) if norms else none,
            wo=get.linear(p + "self_attn.o_proj", (D, q_dim)),
            bo=none, sinks=none,
            post_norm=get(p + "post_attention_layernorm.weight", (D,)),
            attention_scale=np.float32(1 / math.sqrt(hd)),
            residual_scale=np.float32(1),
        )

    def qk_norm_shapes(self, c: ModelConfig) -> tuple[tuple[int], tuple[int]] | None:
        """The shapes of q_norm and k_norm, as `qk_norm` says; None: none."""
        kind, hd = self.qk_norm(c), c.head_dim
        if kind == "head":
            return (hd,), (hd,)
        if kind == "row":
            return (c.num_attention_heads * hd,), (c.num_key_value_heads * hd,)
        return None

    def block_shapes(self, c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
        """Block i's tensors by Hugging Face name, in a checkpoint's order (no biases): matrices
        [out, in], norms [D] (runner/measure/synthetic.py makes random models of them)."""
        D, F = c.hidden_size, c.intermediate_size
        p = f"model.layers.{i}."
        return self.attention_shapes(c, i) | {p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                                              p + "mlp.down_proj.weight": (D, F)}

    def attention_shapes(self, c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
        D, hd = c.hidden_size, c.head_dim
        q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
        p = f"model.layers.{i}."
        shapes = self.qk_norm_shapes(c)
        norms = {p + "self_attn.q_norm.weight": shapes[0], p + "self_attn.k_norm.weight": shapes[1]} if shapes else {}
        return {p + "input_layernorm.weight": (D,), p + "self_attn.q_proj.weight": (q_dim, D),
                p + "self_attn.k_proj.weight": (kv_dim, D), p + "self_attn.v_proj.weight": (kv_dim, D),
                **norms, p + "self_attn.o_proj.weight": (D, q_dim), p + "post_attention_layernorm.weight": (D,)}

    def act_shape(self, c: ModelConfig, i: int) -> tuple[int, int]:
        """The shape of block i's act_sq, the sums of its projections' squared inputs that the
        block kernel adds to when calibrating: a row for each of INPUTS' groups, as wide as the
        widest input."""
        return 4, max(c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size)

    def importances(self, c: ModelConfig, i: int, sums: np.ndarray, tokens: int,
                    inputs: tuple | None = None) -> dict[str, np.ndarray]:
        """Block i's entries of the importance matrix, by the weight names quantize writes: each
        projection's mean squared input per channel, from the rows of act_sq `sums` over `tokens`
        tokens that `inputs` (by default INPUTS) names."""
        widths = (c.hidden_size, c.num_attention_heads * c.head_dim, c.hidden_size, c.intermediate_size)
        return {f"model.layers.{i}.{name}.weight": sums[slot, :widths[slot]] / tokens
                for slot, names in enumerate(inputs or self.INPUTS) for name in names}

    def stacks(self, c: ModelConfig, tensors: dict) -> dict:
        """{weight name: quant.convert.ExpertStack}: a mixture's experts, which quantize writes
        stacked (none for the dense families)."""
        return {}

    def norm(self, get, name: str, shape: tuple) -> np.ndarray | None:
        """An RMSNorm's weight, as the kernels multiply by it (the final norm's too)."""
        return get(name, shape)

    def embed_scale(self, c: ModelConfig, embed) -> float:
        """The factor on the embedded rows (embed: the embedding as loaded): none."""
        return 1.0

    def logits_scale(self, c: ModelConfig) -> float:
        """The factor on the logits (made part of the final norm's weight): none."""
        return 1.0

    def ropes(self, c: ModelConfig, ctx: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's (cos, sin), [ctx, rotated dims / 2] each: one table for every layer;
        zero-width tables where a layer has no RoPE."""
        table = rope_tables(c, ctx)
        none = (np.zeros((ctx, 0), np.float32),) * 2
        return [table if rope else none for rope in c.rope_layers]
