"""The machinery every mixture of experts shares, as mlx-lm's switch_layers.py (not a family):
its config fields checked, the number of experts, the routed experts' stacked matrices and router
read into MoEWeights, and what calibration measures of a sparse block and quantize writes of its
experts."""
import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.errors import FormatError
from nibble.formats.values import COUNT, optional
from .base import Transformer

# Fewer calibration rows than this routed to an expert, and the means of its squared inputs are
# mostly noise: it is quantized with plain weighting instead (quantize says how many were).
MIN_ROUTED = 16
# the widths of a mixture's matrices beyond llama's, in the families' config fields
_SIZES = ("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size")


def experts(c: ModelConfig) -> int | None:
    """num_experts, or num_local_experts as transformers 5 and Mixtral write it."""
    return c.num_experts if c.num_experts is not None else c.num_local_experts


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
                      top_k=c.num_experts_per_tok, **(fields | routing))


def moe_act_shape(family, c: ModelConfig) -> tuple[int, int]:
    """The shape of a sparse block's act_sq: a dense block's four rows (base.Transformer's), two
    for each expert and one of counts (moe.moe_mlp), as wide as the widest input or the number of
    experts."""
    E = experts(c)
    return 5 + 2 * E, max(Transformer.act_shape(family, c, 0)[1], E, *(getattr(c, k, None) or 0 for k in _SIZES))


def expert_importances(family, c: ModelConfig, i: int, sums: np.ndarray, tokens: int, path: str, F: int,
                       shared: tuple | None = None) -> dict[str, np.ndarray]:
    """Block i's importance entries when its MLP is the mixture `path` (act_sq's rows as
    moe.moe_mlp fills them): the attention's as a dense block's; the stacked experts' [E, K], each
    expert's row the mean over the rows routed to it (zeros, plain weighting, for one that fewer
    than MIN_ROUTED reached); shared = (gate/up names, down names, width), the shared expert's,
    over every token."""
    D, E = c.hidden_size, experts(c)
    counts = sums[4 + 2 * E, :E]
    per_row = np.where(counts >= MIN_ROUTED, 1 / np.maximum(counts, 1), 0)[:, None]
    inputs, downs = sums[4:4 + 2 * E:2, :D] * per_row, sums[5:5 + 2 * E:2, :F] * per_row
    p = f"model.layers.{i}.{path}.switch_mlp."
    entries = Transformer.importances(family, c, i, sums, tokens, Transformer.INPUTS[:2]) | {
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


# the config fields every mixture has (a family's Family.fields)
FIELDS = {"num_experts": optional(COUNT), "num_local_experts": optional(COUNT), "num_experts_per_tok": COUNT}


def check_experts(c: ModelConfig) -> None:
    """The number of experts given, and at least the number a token is routed to."""
    E = experts(c)
    if E is None:
        raise FormatError(f"config.json: {c.model_type} needs num_experts or num_local_experts")
    if c.num_experts_per_tok > E:
        raise FormatError(f"config.json: num_experts_per_tok ({c.num_experts_per_tok}) is more "
                          f"than the {E} experts")


# llama.cpp's names of a mixture's router and stacked experts, as Qwen's checkpoints and MLX's
# switch_mlp name them
GGUF_EXPERTS = {"ffn_gate_inp": "mlp.gate",
                **{f"ffn_{p}_exps": f"mlp.switch_mlp.{p}_proj" for p in ("gate", "up", "down")}}
