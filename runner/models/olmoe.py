"""OLMoE: Llama's attention with an RMSNorm over each row's whole query and key projections (not
each head's, as Qwen3's), and in every layer a mixture of experts for the MLP: softmax over the
router's logits, the top num_experts_per_tok (8 of 64), not renormalised unless norm_topk_prob."""
from nibble.formats.config import ModelConfig, one_window
from nibble.formats.errors import FormatError
from nibble.formats.families import GGUFArch
from nibble.formats.gguf_metadata import expert_counts
from nibble.formats.values import BOOL
from . import switch_layers
from .base import Transformer


def _olmoe_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp's olmoe: each expert feed_forward_length wide, the k probabilities never
    renormalised."""
    E, k = expert_counts(meta, a)
    return dict(num_experts=E, num_experts_per_tok=k, norm_topk_prob=False)


class Olmoe(Transformer):
    # OlmoeConfig's defaults
    model_types = {"olmoe": dict(num_experts_per_tok=8, norm_topk_prob=False)}
    gguf = {"olmoe": GGUFArch("olmoe", fields=_olmoe_gguf, block_names=switch_layers.GGUF_EXPERTS)}
    fields = switch_layers.FIELDS | {"norm_topk_prob": BOOL}

    def qk_norm(self, c: ModelConfig) -> str:
        return "row"

    def layer_weights(self, get, c: ModelConfig, i: int):
        from ..kernels.layer import MoELayerWeights
        p = f"model.layers.{i}.mlp"
        moe = switch_layers.routed(get, p, c, "gate", switch_layers.stacked(get, p, c, c.intermediate_size),
                                   renormalize=c.norm_topk_prob)
        return MoELayerWeights(**self.attention(get, c, i), moe=moe)

    def act_shape(self, c: ModelConfig, i: int) -> tuple[int, int]:
        return switch_layers.moe_act_shape(self, c)

    def importances(self, c: ModelConfig, i: int, sums, tokens: int) -> dict:
        return switch_layers.expert_importances(self, c, i, sums, tokens, "mlp", c.intermediate_size)

    def stacks(self, c: ModelConfig, tensors: dict) -> dict:
        return {name: s for i in range(c.num_hidden_layers) for name, s in switch_layers.expert_stacks(
            c, tensors, f"model.layers.{i}.mlp", c.intermediate_size).items()}

    def configure(self, c: ModelConfig) -> None:
        if c.attention_bias:
            raise FormatError("config.json: nibble cannot run attention_bias=True for olmoe (transformers "
                              "gives its o_proj a bias too)")
        if c.extra.get("clip_qkv") is not None:
            raise FormatError(f"config.json: nibble cannot run clip_qkv={c.extra['clip_qkv']!r} for olmoe "
                              "(its block does not clamp q, k and v)")
        if switch_layers.experts(c) is None:   # OlmoeConfig's default
            c.num_experts = 64
        switch_layers.check_experts(c)

    def windows(self, c: ModelConfig) -> list[int]:
        return one_window(c, 0)   # transformers' olmoe never slides
