"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention (q/k norms) and, in its
sparse layers, a mixture of experts for the MLP: softmax over the router's logits, the top
num_experts_per_tok experts, their probabilities renormalised if norm_topk_prob. Every
decoder_sparse_step-th layer is sparse, except those in mlp_only_layers (a dense MLP)."""

from nibble.formats.config import ModelConfig, one_window
from nibble.formats.errors import FormatError
from nibble.formats.families import Family, GGUFArch
from nibble.formats.values import BOOL, COUNT, integer, list_of
from . import llama

block, ropes, norm, embed_scale = llama.block, llama.ropes, llama.norm, llama.embed_scale
INPUTS = llama.INPUTS


def experts(c: ModelConfig) -> int:
    """num_experts, or num_local_experts as transformers 5 writes it (128 if neither)."""
    return c.extra.get("num_experts", c.extra.get("num_local_experts", 128))


def sparse(c: ModelConfig, i: int) -> bool:
    """Whether layer i's MLP is the mixture of experts (Qwen3MoeDecoderLayer's rule)."""
    step = c.extra["decoder_sparse_step"]
    return i not in c.extra["mlp_only_layers"] and experts(c) > 0 and (i + 1) % step == 0


def layer(get, c: ModelConfig, i: int):
    from ..kernels.layer import MoELayerWeights
    from ..kernels.moe import MoEWeights
    if not sparse(c, i):
        return llama.layer(get, c, i)
    D, E, F = c.hidden_size, experts(c), c.extra["moe_intermediate_size"]
    p = f"model.layers.{i}.mlp"
    moe = MoEWeights(get(p + ".gate.weight", (E, D)),
                     get.experts(p, "gate_proj", E, (F, D)), get.experts(p, "up_proj", E, (F, D)),
                     get.experts(p, "down_proj", E, (D, F)),
                     c.extra["num_experts_per_tok"], c.extra["norm_topk_prob"])
    return MoELayerWeights(**llama.attention(get, c, i), moe=moe)


def block_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """As llama's; a sparse layer's MLP: the router [E, D] and the experts stacked, as MLX's
    switch_mlp holds them."""
    if not sparse(c, i):
        return llama.block_shapes(c, i)
    D, E, F = c.hidden_size, experts(c), c.extra["moe_intermediate_size"]
    p = f"model.layers.{i}.mlp."
    return llama.attention_shapes(c, i) | {
        p + "gate.weight": (E, D), p + "switch_mlp.gate_proj.weight": (E, F, D),
        p + "switch_mlp.up_proj.weight": (E, F, D), p + "switch_mlp.down_proj.weight": (E, D, F)}


# ---- the config and the files -------------------------------------------------------------------

FIELDS = {"num_experts": COUNT, "num_local_experts": COUNT, "num_experts_per_tok": COUNT,
          "moe_intermediate_size": COUNT, "norm_topk_prob": BOOL, "decoder_sparse_step": COUNT,
          "mlp_only_layers": list_of(integer(), "layer indexes")}


def _configure(c: ModelConfig) -> None:
    llama.FAMILY.configure(c)   # qwen3's rule: no attention bias
    if c.extra.get("mlp_only_layers") is None:   # null in a config.json: none
        c.extra["mlp_only_layers"] = []
    for name, kind in FIELDS.items():
        if name in c.extra:
            kind.check(f"config.json: {name}", c.extra[name])
    E = experts(c)
    if c.extra["num_experts_per_tok"] > E:
        raise FormatError(f"config.json: num_experts_per_tok ({c.extra['num_experts_per_tok']}) is more "
                          f"than the {E} experts")


def _windows(c: ModelConfig) -> list[int]:
    """Qwen3MoeConfig keeps sliding_window only with use_sliding_window, and its attention then
    slides in every layer."""
    return one_window(c, (c.sliding_window or 0) if c.use_sliding_window else 0)


def _qwen3moe_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp's qwen3moe: experts in every layer, the k probabilities always renormalised; an
    expert's width, where the file has none, feed_forward_length / expert_used_count."""
    # absent, they read as 0, as llama.cpp reads them (and refuses the file)
    E, k = meta.get(a + "expert_count", 0), meta.get(a + "expert_used_count", 0)
    for key, value in (("expert_count", E), ("expert_used_count", k)):
        COUNT.check(f"GGUF metadata {a}{key}", value)
    if k > E:
        raise FormatError(f"GGUF metadata {a}expert_used_count {k} is more than the {E} experts")
    F = meta.get(a + "expert_feed_forward_length", meta.get(a + "feed_forward_length", 0) // k)
    COUNT.check(f"GGUF metadata {a}expert_feed_forward_length", F)
    return dict(extra=dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=F,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]))


FAMILY = Family(
    "qwen3_moe",
    # Qwen3MoeConfig's defaults
    model_types={"qwen3_moe": dict(sliding_window=4096, num_experts_per_tok=8, moe_intermediate_size=768,
                                   norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])},
    windows=_windows, configure=_configure,
    gguf={"qwen3moe": GGUFArch(
        "qwen3_moe", fields=_qwen3moe_gguf,
        block_names={"ffn_gate_inp": "mlp.gate",
                     **{f"ffn_{p}_exps": f"mlp.switch_mlp.{p}_proj" for p in ("gate", "up", "down")}})},
)
