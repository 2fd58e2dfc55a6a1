"""Qwen's mixtures of experts: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B: Qwen3's attention,
q/k norms) and Qwen2-MoE (Qwen2's attention, q/k/v biases, and a shared expert beside the routed
ones, its output through a sigmoid gate). In the sparse layers the MLP is a mixture of experts:
softmax over the router's logits, the top num_experts_per_tok experts, their probabilities
renormalised if norm_topk_prob. Every decoder_sparse_step-th layer is sparse, except those in
mlp_only_layers (a dense MLP).

The MoE pieces the other MoE families build on (their config fields checked, the routed experts
read) live here too, as llama.py's attention does for theirs."""
import numpy as np

from nibble.formats.config import ModelConfig, one_window, sliding_where_typed
from nibble.formats.errors import FormatError
from nibble.formats.families import Family, GGUFArch
from nibble.formats.values import BOOL, COUNT, integer, list_of
from . import llama

block, ropes, norm, embed_scale, logits_scale = llama.block, llama.ropes, llama.norm, llama.embed_scale, llama.logits_scale
INPUTS = llama.INPUTS


def experts(c: ModelConfig) -> int | None:
    """num_experts, or num_local_experts as transformers 5 and Mixtral write it."""
    return c.extra.get("num_experts", c.extra.get("num_local_experts"))


def sparse(c: ModelConfig, i: int) -> bool:
    """Whether layer i's MLP is the mixture of experts (Qwen3MoeDecoderLayer's rule)."""
    step = c.extra["decoder_sparse_step"]
    return i not in c.extra["mlp_only_layers"] and experts(c) > 0 and (i + 1) % step == 0


def stacked(get, path: str, c: ModelConfig, F: int, each=("gate_proj", "up_proj", "down_proj")) -> tuple:
    """The experts' gate [E, F, D], up [E, F, D] and down [E, D, F] matrices of the MoE module
    `path`: stacked as MLX stores them (switch_mlp's gate_proj, up_proj, down_proj), or one tensor
    an expert (`path.experts.N.<each>`)."""
    D, E = c.hidden_size, experts(c)
    names, shapes = ("gate_proj", "up_proj", "down_proj"), ((F, D), (F, D), (D, F))
    return tuple(get.experts(path, n, E, shape, e) for n, e, shape in zip(names, each, shapes))


def routed(get, path: str, c: ModelConfig, router: str, w: tuple, **routing):
    """The MoEWeights of the MoE module `path`: its router [E, D] (`path.<router>.weight`), its
    experts' gate, up and down matrices w, top num_experts_per_tok; `routing`: MoEWeights' other
    fields (by default softmax first, not renormalised, no router bias, no shared expert)."""
    from ..kernels.moe import MoEWeights
    D, E = c.hidden_size, experts(c)
    fields = dict(router_bias=np.zeros(0, np.float32), top_k_first=False, renormalize=False, shared=None)
    return MoEWeights(router=get(f"{path}.{router}.weight", (E, D)), w_gate=w[0], w_up=w[1], w_down=w[2],
                      top_k=c.extra["num_experts_per_tok"], **(fields | routing))


def layer(get, c: ModelConfig, i: int):
    from ..kernels.layer import MoELayerWeights
    from ..kernels.moe import SharedExpert
    if not sparse(c, i):
        return llama.layer(get, c, i)
    p = f"model.layers.{i}.mlp"
    shared = None
    if c.model_type == "qwen2_moe":
        D, S = c.hidden_size, c.extra["shared_expert_intermediate_size"]
        gate = get(p + ".shared_expert_gate.weight", (1, D))
        shared = SharedExpert(get.linear(p + ".shared_expert.gate_proj", (S, D)),
                              get.linear(p + ".shared_expert.up_proj", (S, D)),
                              get.linear(p + ".shared_expert.down_proj", (D, S)),
                              None if gate is None else gate[0])
    moe = routed(get, p, c, "gate", stacked(get, p, c, c.extra["moe_intermediate_size"]),
                 renormalize=c.extra["norm_topk_prob"], shared=shared)
    return MoELayerWeights(**llama.attention(get, c, i), moe=moe)


def block_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """As llama's; a sparse layer's MLP: the router [E, D] and the experts stacked, as MLX's
    switch_mlp holds them."""
    if not sparse(c, i):
        return llama.block_shapes(c, i)
    if c.model_type != "qwen3_moe":
        raise FormatError(f"nibble makes random models of qwen3_moe's shapes, not {c.model_type}'s")
    D, E, F = c.hidden_size, experts(c), c.extra["moe_intermediate_size"]
    p = f"model.layers.{i}.mlp."
    return llama.attention_shapes(c, i) | {
        p + "gate.weight": (E, D), p + "switch_mlp.gate_proj.weight": (E, F, D),
        p + "switch_mlp.up_proj.weight": (E, F, D), p + "switch_mlp.down_proj.weight": (E, D, F)}


# ---- the config and the files -------------------------------------------------------------------

FIELDS = {"num_experts": COUNT, "num_local_experts": COUNT, "num_experts_per_tok": COUNT,
          "moe_intermediate_size": COUNT, "shared_expert_intermediate_size": COUNT,
          "norm_topk_prob": BOOL, "decoder_sparse_step": COUNT,
          "mlp_only_layers": list_of(integer(), "layer indexes")}


def check_experts(c: ModelConfig) -> None:
    """The MoE fields that config.json holds (FIELDS), checked by kind: the number of experts
    given, and at least the number a token is routed to."""
    for name, kind in FIELDS.items():
        if name in c.extra:
            kind.check(f"config.json: {name}", c.extra[name])
    E = experts(c)
    if E is None:
        raise FormatError(f"config.json: {c.model_type} needs num_experts or num_local_experts")
    if c.extra["num_experts_per_tok"] > E:
        raise FormatError(f"config.json: num_experts_per_tok ({c.extra['num_experts_per_tok']}) is more "
                          f"than the {E} experts")


def _configure(c: ModelConfig) -> None:
    if c.model_type == "qwen2_moe":
        c.attention_bias = c.extra.get("qkv_bias", True)   # q/k/v biases (transformers 4: always)
        BOOL.check("config.json: qkv_bias", c.attention_bias)
    else:
        llama.FAMILY.configure(c)   # qwen3's rule: no attention bias
    if c.extra.get("mlp_only_layers") is None:   # null in a config.json: none
        c.extra["mlp_only_layers"] = []
    if experts(c) is None:   # Qwen3MoeConfig's and Qwen2MoeConfig's default
        c.extra["num_experts"] = {"qwen3_moe": 128, "qwen2_moe": 60}[c.model_type]
    check_experts(c)


def _windows(c: ModelConfig) -> list[int]:
    """Qwen3MoeConfig keeps sliding_window only with use_sliding_window, and its attention then
    slides in every layer; Qwen2MoeConfig slides in its "sliding_attention" layers (by default,
    with use_sliding_window, every other layer below max_window_layers)."""
    window = (c.sliding_window or 0) if c.use_sliding_window else 0
    if c.model_type == "qwen3_moe":
        return one_window(c, window)
    types = c.layer_types or [
        "sliding_attention" if (i + 1) % 2 and i < (c.max_window_layers or 28) else "full_attention"
        for i in range(c.num_hidden_layers)]
    return sliding_where_typed(types, window)


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
    # Qwen3MoeConfig's and Qwen2MoeConfig's defaults
    model_types={"qwen3_moe": dict(sliding_window=4096, num_experts_per_tok=8,
                                   moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1,
                                   mlp_only_layers=[]),
                 "qwen2_moe": dict(sliding_window=4096, num_experts_per_tok=4,
                                   moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                   norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])},
    windows=_windows, configure=_configure,
    gguf={"qwen3moe": GGUFArch(
        "qwen3_moe", fields=_qwen3moe_gguf,
        block_names={"ffn_gate_inp": "mlp.gate",
                     **{f"ffn_{p}_exps": f"mlp.switch_mlp.{p}_proj" for p in ("gate", "up", "down")}})},
)
