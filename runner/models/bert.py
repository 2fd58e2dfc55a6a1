"""BERT, the encoder most embedding models are (all-MiniLM, bge, e5): bidirectional attention,
learned absolute positions and token types, LayerNorms with biases after each residual add, an
exact-GELU MLP, biases on every projection. runner/embedding/encoder.py runs it."""
import math

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.errors import FormatError
from nibble.formats.values import COUNT, STRING, number
from .base import Transformer


class Embeddings:
    """The rows a token starts from: its word's, its position's and its token type's, summed and
    LayerNormed."""

    def __init__(self, get, c: ModelConfig):
        D = c.hidden_size
        self.words = get.linear("embeddings.word_embeddings", (c.vocab_size, D))
        self.positions = get("embeddings.position_embeddings.weight", (c.max_position_embeddings, D))
        self.types = get("embeddings.token_type_embeddings.weight", (c.type_vocab_size, D))
        self.norm = get("embeddings.LayerNorm.weight", (D,))
        self.norm_bias = get("embeddings.LayerNorm.bias", (D,))


class Bert(Transformer):
    # What BertConfig assumes for the fields a config.json leaves out
    model_types = {"bert": dict(
        vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2,
        layer_norm_eps=1e-12, pad_token_id=0, position_embedding_type="absolute")}
    fields = {"type_vocab_size": COUNT, "position_embedding_type": STRING,
              "layer_norm_eps": number(least=float(np.finfo(np.float32).tiny), most=1)}
    fixed = {"hidden_act": ("gelu",)}
    encoder = True
    # the projections whose input each of encoder_layer's four act_sq rows collects (calibrate.py)
    INPUTS = (("attention.self.query", "attention.self.key", "attention.self.value"), ("attention.output.dense",),
              ("intermediate.dense",), ("output.dense",))
    Embeddings = Embeddings

    def windows(self, c: ModelConfig) -> list[int]:
        return [-1] * c.num_hidden_layers   # every layer bidirectional

    def position_offset(self, c: ModelConfig) -> int:
        """The row of position_embeddings a text's first token takes."""
        return 0

    def rope_layers(self, c: ModelConfig) -> list[bool]:
        return [False] * c.num_hidden_layers

    def kernel(self):
        """The block's kernel (imported with numba when a model is built, not when a config is read)."""
        from ..kernels.encoder import encoder_layer
        return encoder_layer

    def layer_weights(self, get, c: ModelConfig, i: int):
        from ..kernels.encoder import EncoderLayerWeights
        D, F = c.hidden_size, c.intermediate_size
        p = f"encoder.layer.{i}."
        return EncoderLayerWeights(
            wq=get.linear(p + "attention.self.query", (D, D)),
            wk=get.linear(p + "attention.self.key", (D, D)),
            wv=get.linear(p + "attention.self.value", (D, D)),
            bq=get(p + "attention.self.query.bias", (D,)),
            bk=get(p + "attention.self.key.bias", (D,)),
            bv=get(p + "attention.self.value.bias", (D,)),
            wo=get.linear(p + "attention.output.dense", (D, D)),
            bo=get(p + "attention.output.dense.bias", (D,)),
            attention_norm=get(p + "attention.output.LayerNorm.weight", (D,)),
            attention_norm_bias=get(p + "attention.output.LayerNorm.bias", (D,)),
            attention_scale=np.float32(1 / math.sqrt(c.head_dim)),
            w_in=get.linear(p + "intermediate.dense", (F, D)),
            b_in=get(p + "intermediate.dense.bias", (F,)),
            w_out=get.linear(p + "output.dense", (D, F)),
            b_out=get(p + "output.dense.bias", (D,)),
            out_norm=get(p + "output.LayerNorm.weight", (D,)),
            out_norm_bias=get(p + "output.LayerNorm.bias", (D,)),
        )

    def ropes(self, c: ModelConfig, ctx: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """No RoPE (the positions are added to the embedded rows): zero-width tables."""
        return [(np.zeros((ctx, 0), np.float32),) * 2] * c.num_hidden_layers

    def act_shape(self, c: ModelConfig, i: int) -> tuple[int, int]:
        """The shape of block i's act_sq: a row for each of INPUTS' groups, as wide as the widest."""
        return 4, max(c.hidden_size, c.intermediate_size)

    def importances(self, c: ModelConfig, i: int, sums: np.ndarray, tokens: int) -> dict[str, np.ndarray]:
        """Block i's entries of the importance matrix, from act_sq's rows over `tokens` tokens."""
        widths = (c.hidden_size, c.hidden_size, c.hidden_size, c.intermediate_size)
        return {f"encoder.layer.{i}.{name}.weight": sums[slot, :widths[slot]] / tokens
                for slot, names in enumerate(self.INPUTS) for name in names}

    def configure(self, c: ModelConfig) -> None:
        # BertConfig has no head_dim and no key/value heads of its own: whatever a config says
        if c.hidden_size % c.num_attention_heads:
            raise FormatError(f"config.json: hidden_size {c.hidden_size} is not a multiple of "
                              f"num_attention_heads {c.num_attention_heads}")
        c.head_dim = c.hidden_size // c.num_attention_heads
        c.num_key_value_heads = c.num_attention_heads
        if c.position_embedding_type != "absolute":
            raise FormatError(f"config.json: nibble runs BERT with absolute position embeddings, "
                              f"not position_embedding_type={c.position_embedding_type!r}")
        c.rms_norm_eps = c.layer_norm_eps   # the blocks' eps, whatever kind of norm
