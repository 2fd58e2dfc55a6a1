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

# Fewer calibration rows than this routed to an expert, and the means of its squared inputs are
# mostly noise: it is quantized with plain weighting instead (quantize says how many were).
MIN_ROUTED = 16
# the widths of a mixture's matrices beyond llama's, in the families' config fields
_SIZES = ("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size")


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
    none = np.zeros((0, 0), np.float32)
    fields = dict(router_bias=np.zeros(0, np.float32), top_k_first=False, renormalize=False, shared=None,
                  b_gate=none, b_up=none, b_down=none, swiglu_limit=np.float32(0), swiglu_alpha=np.float32(0))
    return MoEWeights(router=get.dense(f"{path}.{router}", (E, D)), w_gate=w[0], w_up=w[1], w_down=w[2],
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
        gate = get.dense(p + ".shared_expert_gate", (1, D))
        shared = SharedExpert(get.linear(p + ".shared_expert.gate_proj", (S, D)),
                              get.linear(p + ".shared_expert.up_proj", (S, D)),
                              get.linear(p + ".shared_expert.down_proj", (D, S)),
                              None if gate is None else gate[0])
    moe = routed(get, p, c, "gate", stacked(get, p, c, c.extra["moe_intermediate_size"]),
                 renormalize=c.extra["norm_topk_prob"], shared=shared)
    return MoELayerWeights(**llama.attention(get, c, i), moe=moe)


def act_shape(c: ModelConfig, i: int) -> tuple[int, int]:
    return moe_act_shape(c) if sparse(c, i) else llama.act_shape(c, i)


def importances(c: ModelConfig, i: int, sums: np.ndarray, tokens: int) -> dict[str, np.ndarray]:
    if not sparse(c, i):
        return llama.importances(c, i, sums, tokens)
    shared = ((("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), ("mlp.shared_expert.down_proj",),
               c.extra["shared_expert_intermediate_size"]) if c.model_type == "qwen2_moe" else None)
    return expert_importances(c, i, sums, tokens, "mlp", c.extra["moe_intermediate_size"], shared)


def stacks(c: ModelConfig, tensors: dict) -> dict:
    F = c.extra["moe_intermediate_size"]
    return {name: s for i in range(c.num_hidden_layers) if sparse(c, i)
            for name, s in expert_stacks(c, tensors, f"model.layers.{i}.mlp", F).items()}


def moe_act_shape(c: ModelConfig) -> tuple[int, int]:
    """The shape of a sparse block's act_sq: llama's four rows, two for each expert and one of
    counts (moe.moe_mlp), as wide as the widest input or the number of experts."""
    E = experts(c)
    return 5 + 2 * E, max(llama.act_shape(c, 0)[1], E, *(c.extra.get(k) or 0 for k in _SIZES))


def expert_importances(c: ModelConfig, i: int, sums: np.ndarray, tokens: int, path: str, F: int,
                       shared: tuple | None = None) -> dict[str, np.ndarray]:
    """Block i's importance entries when its MLP is the mixture `path` (act_sq's rows as
    moe.moe_mlp fills them): the attention's as llama's; the stacked experts' [E, K], each
    expert's row the mean over the rows routed to it (zeros, plain weighting, for one that fewer
    than MIN_ROUTED reached); shared = (gate/up names, down names, width), the shared expert's,
    over every token."""
    D, E = c.hidden_size, experts(c)
    counts = sums[4 + 2 * E, :E]
    per_row = np.where(counts >= MIN_ROUTED, 1 / np.maximum(counts, 1), 0)[:, None]
    inputs, downs = sums[4:4 + 2 * E:2, :D] * per_row, sums[5:5 + 2 * E:2, :F] * per_row
    p = f"model.layers.{i}.{path}.switch_mlp."
    entries = llama.importances(c, i, sums, tokens, llama.INPUTS[:2]) | {
        p + "gate_proj.weight": inputs, p + "up_proj.weight": inputs, p + "down_proj.weight": downs}
    if shared:
        gate_up, down, S = shared
        entries |= {f"model.layers.{i}.{n}.weight": sums[2, :D] / tokens for n in gate_up}
        entries |= {f"model.layers.{i}.{n}.weight": sums[3, :S] / tokens for n in down}
    return entries


def expert_stacks(c: ModelConfig, tensors: dict, path: str, F: int,
                  each=("gate_proj", "up_proj", "down_proj")) -> dict:
    """The experts of the mixture `path` as quantize writes them (quant.convert.ExpertStack):
    MLX's switch_mlp.{gate,up,down}_proj, from one tensor an expert (`path.experts.N.<each>`),
    or from a float stack already so named."""
    from nibble.quant.convert import ExpertStack
    D, E = c.hidden_size, experts(c)
    out = {}
    for name, one, shape in zip(("gate_proj", "up_proj", "down_proj"), each, ((F, D), (F, D), (D, F))):
        stacked = f"{path}.switch_mlp.{name}.weight"
        sources = (stacked,) if stacked in tensors else tuple(f"{path}.experts.{e}.{one}.weight" for e in range(E))
        if all(s in tensors for s in sources):
            out[stacked] = ExpertStack(sources, (E, *shape), (
                (lambda t, s=stacked: iter(np.asarray(t[s], np.float32))) if len(sources) == 1 else
                (lambda t, ss=sources: (np.asarray(t[s], np.float32) for s in ss))))
    return out


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


def gguf_experts(meta: dict, a: str) -> tuple[int, int]:
    """A GGUF's expert_count and expert_used_count, checked: absent, they read as 0, as llama.cpp
    reads them (and refuses the file)."""
    E, k = meta.get(a + "expert_count", 0), meta.get(a + "expert_used_count", 0)
    for key, value in (("expert_count", E), ("expert_used_count", k)):
        COUNT.check(f"GGUF metadata {a}{key}", value)
    if k > E:
        raise FormatError(f"GGUF metadata {a}expert_used_count {k} is more than the {E} experts")
    return E, k


def _qwen3moe_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp's qwen3moe: experts in every layer, the k probabilities always renormalised; an
    expert's width, where the file has none, feed_forward_length / expert_used_count."""
    E, k = gguf_experts(meta, a)
    F = meta.get(a + "expert_feed_forward_length", meta.get(a + "feed_forward_length", 0) // k)
    COUNT.check(f"GGUF metadata {a}expert_feed_forward_length", F)
    return dict(extra=dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=F,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]))


def _qwen2moe_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp's qwen2moe: qwen3moe's, but the k probabilities never renormalised, and a shared
    expert, feed_forward_length wide where the file gives no width."""
    fields = _qwen3moe_gguf(meta, a, layers, width, head_dim)
    S = meta.get(a + "expert_shared_feed_forward_length", meta.get(a + "feed_forward_length"))
    COUNT.check(f"GGUF metadata {a}expert_shared_feed_forward_length", S)
    fields["extra"] |= dict(shared_expert_intermediate_size=S, norm_topk_prob=False)
    return fields


# llama.cpp's names of a mixture's router and stacked experts, as Qwen's checkpoints and MLX's
# switch_mlp name them
GGUF_EXPERTS = {"ffn_gate_inp": "mlp.gate",
                **{f"ffn_{p}_exps": f"mlp.switch_mlp.{p}_proj" for p in ("gate", "up", "down")}}


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
    gguf={"qwen3moe": GGUFArch("qwen3_moe", fields=_qwen3moe_gguf, block_names=GGUF_EXPERTS),
          "qwen2moe": GGUFArch("qwen2_moe", fields=_qwen2moe_gguf, block_names=GGUF_EXPERTS | {
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
              **{f"ffn_{p}_shexp": f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")}})},
)
