"""IBM's Granite mixtures of experts: GraniteMoe (granite-3.x-1b-a400m, -3b-a800m) and
GraniteMoeShared (with a shared expert beside the routed ones, ungated). Llama's attention with
scores times attention_multiplier (not 1/sqrt(head_dim)), the attention's and the MLP's outputs
times residual_multiplier, the embeddings times embedding_multiplier, the logits divided by
logits_scaling; in every layer a mixture of experts whose router takes the k largest logits and
a softmax over those. Its checkpoints hold each layer's experts as two fused tensors:
input_linear [E, 2F, D] (gate's rows, then up's) and output_linear [E, D, F]."""
import math

import numpy as np

from nibble.formats.config import ModelConfig, one_window
from nibble.formats.errors import FormatError
from nibble.formats.families import GGUFArch
from nibble.formats.gguf_metadata import expert_counts, float32_decimal
from nibble.formats.values import integer, number, optional
from . import switch_layers
from .base import Transformer
from .phi3 import split_rows

MOE = "block_sparse_moe"


def routed_experts(get, path: str, c: ModelConfig, F: int) -> tuple:
    """The experts' gate, up and down matrices: stacked as MLX stores them, or from the fused
    input_linear (split into copies of its halves) and output_linear, widened to float32."""
    if f"{path}.switch_mlp.gate_proj.weight" in get.tensors:
        return switch_layers.stacked(get, path, c, F)
    D, E = c.hidden_size, switch_layers.experts(c)
    fused = get(f"{path}.input_linear.weight", (E, 2 * F, D))
    gate, up = (None, None) if fused is None else (np.ascontiguousarray(fused[:, :F]), np.ascontiguousarray(fused[:, F:]))
    return gate, up, get(f"{path}.output_linear.weight", (E, D, F))


MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _granitemoe_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp's granitemoe: granitemoeshared where the file gives a shared expert's width; each
    routed expert feed_forward_length wide. A scale the file leaves out (or 0) is llama.cpp's:
    none, and scores by 1/sqrt(head_dim); logit_scale it needs."""
    E, k = expert_counts(meta, a)
    S = meta.get(a + "expert_shared_feed_forward_length", 0)
    integer().check(f"GGUF metadata {a}expert_shared_feed_forward_length", S)
    fields = dict(num_local_experts=E, num_experts_per_tok=k, shared_intermediate_size=S)
    for field, key, default in zip(MULTIPLIERS, ("embedding_scale", "residual_scale", "attention.scale", "logit_scale"),
                                   (1.0, 1.0, 1 / math.sqrt(head_dim), None)):
        value = meta.get(a + key, default)
        if value is None:
            raise FormatError(f"GGUF metadata has no {a}{key}: llama.cpp's granitemoe divides the logits by it")
        if value == 0 and default:   # llama.cpp reads 0 as none
            value = default
        number(above=0).check(f"GGUF metadata {a}{key}", value)
        fields[field] = float32_decimal(value)
    return fields | dict(model_type="granitemoeshared" if S else "granitemoe")


class GraniteMoe(Transformer):
    # GraniteMoeConfig's and GraniteMoeSharedConfig's defaults
    model_types = {t: dict(dict.fromkeys(MULTIPLIERS, 1.0), num_local_experts=8, num_experts_per_tok=2)
                   for t in ("granitemoe", "granitemoeshared")}
    # the converter's GraniteMoeModel is a LlamaModel: q/k permuted
    gguf = {"granitemoe": GGUFArch(
        "granitemoe", permuted_qk=True, fields=_granitemoe_gguf,
        block_names={"ffn_gate_inp": "block_sparse_moe.router.layer", "ffn_down_shexp": "shared_mlp.output_linear",
                     **{f"ffn_{p}_exps": f"block_sparse_moe.switch_mlp.{p}_proj" for p in ("gate", "up", "down")}},
        fused={"shared_mlp.input_linear": ("ffn_gate_shexp", "ffn_up_shexp")})}
    fields = (switch_layers.FIELDS | dict.fromkeys(MULTIPLIERS, number(above=0))
              | {"shared_intermediate_size": optional(integer())})   # granitemoeshared's shared expert

    def windows(self, c: ModelConfig) -> list[int]:
        return one_window(c, 0)   # transformers' granite never slides

    def act_shape(self, c: ModelConfig, i: int) -> tuple[int, int]:
        return switch_layers.moe_act_shape(self, c)

    def importances(self, c: ModelConfig, i: int, sums, tokens: int) -> dict:
        S = c.shared_intermediate_size or 0
        shared = (("shared_mlp.input_linear",), ("shared_mlp.output_linear",), S) if S else None
        return switch_layers.expert_importances(self, c, i, sums, tokens, MOE, c.intermediate_size, shared)

    def stacks(self, c: ModelConfig, tensors: dict) -> dict:
        """The experts as quantize writes them: MLX's switch_mlp stacks, from the fused input_linear
        (gate's rows, then up's) and output_linear, or from float stacks already so named."""
        from nibble.quant.convert import ExpertStack
        D, E, F = c.hidden_size, switch_layers.experts(c), c.intermediate_size
        out = {}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}.{MOE}"
            fused, down = f"{p}.input_linear.weight", f"{p}.output_linear.weight"
            if fused not in tensors or down not in tensors:
                out |= switch_layers.expert_stacks(c, tensors, p, F)
                continue
            halves = lambda t, rows, s=fused: (m[rows] for m in np.asarray(t[s], np.float32))
            out |= {f"{p}.switch_mlp.gate_proj.weight": ExpertStack((fused,), (E, F, D), lambda t, h=halves: h(t, slice(0, F))),
                    f"{p}.switch_mlp.up_proj.weight": ExpertStack((fused,), (E, F, D), lambda t, h=halves: h(t, slice(F, None))),
                    f"{p}.switch_mlp.down_proj.weight": ExpertStack(
                        (down,), (E, D, F), lambda t, s=down: iter(np.asarray(t[s], np.float32)))}
        return out

    def embed_scale(self, c: ModelConfig, embed) -> np.float32:
        return np.float32(c.embedding_multiplier)

    def logits_scale(self, c: ModelConfig) -> float:
        return 1 / c.logits_scaling

    def layer_weights(self, get, c: ModelConfig, i: int):
        from ..kernels.layer import MoELayerWeights
        from ..kernels.moe import SharedExpert
        D, F = c.hidden_size, c.intermediate_size
        p = f"model.layers.{i}."
        moe = p + "block_sparse_moe"
        shared = None
        S = c.shared_intermediate_size or 0
        if S:
            shared = SharedExpert(*split_rows(get.linear(p + "shared_mlp.input_linear", (2 * S, D)), (S, S)),
                                  get.linear(p + "shared_mlp.output_linear", (D, S)), np.zeros(0, np.float32))
        weights = routed_experts(get, moe, c, F)
        attention = self.attention(get, c, i) | dict(attention_scale=np.float32(c.attention_multiplier),
                                                      residual_scale=np.float32(c.residual_multiplier))
        return MoELayerWeights(**attention, moe=switch_layers.routed(get, moe, c, "router.layer", weights,
                                                                 top_k_first=True, shared=shared))

    def configure(self, c: ModelConfig) -> None:
        if c.attention_bias:
            raise FormatError(f"config.json: nibble cannot run attention_bias=True for {c.model_type} "
                              f"(transformers gives its o_proj a bias too)")
        switch_layers.check_experts(c)
