"""IBM's Granite mixtures of experts: GraniteMoe (granite-3.x-1b-a400m, -3b-a800m) and
GraniteMoeShared (with a shared expert beside the routed ones, ungated). Llama's attention with
scores times attention_multiplier (not 1/sqrt(head_dim)), the attention's and the MLP's outputs
times residual_multiplier, the embeddings times embedding_multiplier, the logits divided by
logits_scaling; in every layer a mixture of experts whose router takes the k largest logits and
a softmax over those. Its checkpoints hold each layer's experts as two fused tensors:
input_linear [E, 2F, D] (gate's rows, then up's) and output_linear [E, D, F]."""
import numpy as np

from nibble.formats.config import ModelConfig, one_window
from nibble.formats.errors import FormatError
from nibble.formats.families import Family
from nibble.formats.values import integer, number
from . import llama, qwen3_moe
from .phi3 import split_rows

block, ropes, norm = llama.block, llama.ropes, llama.norm
INPUTS = llama.INPUTS


def embed_scale(c: ModelConfig, embed) -> np.float32:
    return np.float32(c.extra["embedding_multiplier"])


def logits_scale(c: ModelConfig) -> float:
    return 1 / c.extra["logits_scaling"]


def layer(get, c: ModelConfig, i: int):
    from ..kernels.layer import MoELayerWeights
    from ..kernels.moe import SharedExpert
    D, F = c.hidden_size, c.intermediate_size
    p = f"model.layers.{i}."
    moe = p + "block_sparse_moe"
    shared = None
    S = c.extra.get("shared_intermediate_size", 0)
    if S:
        shared = SharedExpert(*split_rows(get.linear(p + "shared_mlp.input_linear", (2 * S, D)), (S, S)),
                              get.linear(p + "shared_mlp.output_linear", (D, S)), np.zeros(0, np.float32))
    weights = routed_experts(get, moe, c, F)
    attention = llama.attention(get, c, i) | dict(attention_scale=np.float32(c.extra["attention_multiplier"]),
                                                  residual_scale=np.float32(c.extra["residual_multiplier"]))
    return MoELayerWeights(**attention, moe=qwen3_moe.routed(get, moe, c, "router.layer", weights,
                                                             top_k_first=True, shared=shared))


def routed_experts(get, path: str, c: ModelConfig, F: int) -> tuple:
    """The experts' gate, up and down matrices: stacked as MLX stores them, or from the fused
    input_linear (split into copies of its halves) and output_linear, widened to float32."""
    if f"{path}.switch_mlp.gate_proj.weight" in get.tensors:
        return qwen3_moe.stacked(get, path, c, F)
    D, E = c.hidden_size, qwen3_moe.experts(c)
    fused = get(f"{path}.input_linear.weight", (E, 2 * F, D))
    gate, up = (None, None) if fused is None else (np.ascontiguousarray(fused[:, :F]), np.ascontiguousarray(fused[:, F:]))
    return gate, up, get(f"{path}.output_linear.weight", (E, D, F))


# ---- the config and the files -------------------------------------------------------------------

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _configure(c: ModelConfig) -> None:
    if c.attention_bias:
        raise FormatError(f"config.json: nibble cannot run attention_bias=True for {c.model_type} "
                          f"(transformers gives its o_proj a bias too)")
    for name in MULTIPLIERS:
        number(above=0).check(f"config.json: {name}", c.extra[name])
    integer().check("config.json: shared_intermediate_size", c.extra.get("shared_intermediate_size", 0))
    qwen3_moe.check_experts(c)


FAMILY = Family(
    "granitemoe",
    # GraniteMoeConfig's and GraniteMoeSharedConfig's defaults
    model_types={t: dict(dict.fromkeys(MULTIPLIERS, 1.0), num_local_experts=8, num_experts_per_tok=2)
                 for t in ("granitemoe", "granitemoeshared")},
    windows=lambda c: one_window(c, 0), configure=_configure,   # transformers' granite never slides
)
