"""Qwen's mixtures of experts: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B: Qwen3's attention,
q/k norms) and Qwen2-MoE (Qwen2's attention, q/k/v biases, and a shared expert beside the routed
ones, its output through a sigmoid gate). In the sparse layers the MLP is a mixture of experts:
softmax over the router's logits, the top num_experts_per_tok experts, their probabilities
renormalised if norm_topk_prob. Every decoder_sparse_step-th layer is sparse, except those in
mlp_only_layers (a dense MLP)."""
import numpy as np

from nibble.formats.config import ModelConfig, one_window, sliding_where_typed
from nibble.formats.errors import FormatError
from nibble.formats.families import GGUFArch
from nibble.formats.gguf_metadata import expert_counts
from nibble.formats.values import BOOL, COUNT, integer, list_of, optional
from .llama import Llama
from .switch_layers import (FIELDS, GGUF_EXPERTS, check_experts, expert_importances, expert_stacks, experts,
                            moe_act_shape, routed, stacked)


def _qwen3moe_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp's qwen3moe: experts in every layer, the k probabilities always renormalised; an
    expert's width, where the file has none, feed_forward_length / expert_used_count."""
    E, k = expert_counts(meta, a)
    F = meta.get(a + "expert_feed_forward_length", meta.get(a + "feed_forward_length", 0) // k)
    COUNT.check(f"GGUF metadata {a}expert_feed_forward_length", F)
    return dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=F, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[])


def _qwen2moe_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp's qwen2moe: qwen3moe's, but the k probabilities never renormalised, and a shared
    expert, feed_forward_length wide where the file gives no width."""
    fields = _qwen3moe_gguf(meta, a, layers, width, head_dim)
    S = meta.get(a + "expert_shared_feed_forward_length", meta.get(a + "feed_forward_length"))
    COUNT.check(f"GGUF metadata {a}expert_shared_feed_forward_length", S)
    return fields | dict(shared_expert_intermediate_size=S, norm_topk_prob=False)


class Qwen3Moe(Llama):
    # Qwen3MoeConfig's and Qwen2MoeConfig's defaults
    model_types = {"qwen3_moe": dict(sliding_window=4096, num_experts_per_tok=8,
                                     moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1,
                                     mlp_only_layers=[]),
                   "qwen2_moe": dict(sliding_window=4096, num_experts_per_tok=4,
                                     moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                     norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])}
    gguf = {"qwen3moe": GGUFArch("qwen3_moe", fields=_qwen3moe_gguf, block_names=GGUF_EXPERTS),
            "qwen2moe": GGUFArch("qwen2_moe", fields=_qwen2moe_gguf, block_names=GGUF_EXPERTS | {
                "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                **{f"ffn_{p}_shexp": f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")}})}
    fields = Llama.fields | FIELDS | {
        "moe_intermediate_size": COUNT, "shared_expert_intermediate_size": optional(COUNT),
        "norm_topk_prob": BOOL, "decoder_sparse_step": COUNT,
        "mlp_only_layers": optional(list_of(integer(), "layer indexes")),   # null: none
        "qkv_bias": optional(BOOL)}   # qwen2_moe: its q/k/v biases

    def qk_norm(self, c: ModelConfig) -> str | None:
        return "head" if c.model_type == "qwen3_moe" else None

    def sparse(self, c: ModelConfig, i: int) -> bool:
        """Whether layer i's MLP is the mixture of experts (Qwen3MoeDecoderLayer's rule)."""
        return i not in c.mlp_only_layers and experts(c) > 0 and (i + 1) % c.decoder_sparse_step == 0

    def layer_weights(self, get, c: ModelConfig, i: int):
        from ..kernels.layer import MoELayerWeights
        from ..kernels.moe import SharedExpert
        if not self.sparse(c, i):
            return super().layer_weights(get, c, i)
        p = f"model.layers.{i}.mlp"
        shared = None
        if c.model_type == "qwen2_moe":
            D, S = c.hidden_size, c.shared_expert_intermediate_size
            gate = get.dense(p + ".shared_expert_gate", (1, D))
            shared = SharedExpert(get.linear(p + ".shared_expert.gate_proj", (S, D)),
                                  get.linear(p + ".shared_expert.up_proj", (S, D)),
                                  get.linear(p + ".shared_expert.down_proj", (D, S)),
                                  None if gate is None else gate[0])
        moe = routed(get, p, c, "gate", stacked(get, p, c, c.moe_intermediate_size),
                     renormalize=c.norm_topk_prob, shared=shared)
        return MoELayerWeights(**self.attention(get, c, i), moe=moe)

    def act_shape(self, c: ModelConfig, i: int) -> tuple[int, int]:
        return moe_act_shape(self, c) if self.sparse(c, i) else super().act_shape(c, i)

    def importances(self, c: ModelConfig, i: int, sums: np.ndarray, tokens: int) -> dict[str, np.ndarray]:
        if not self.sparse(c, i):
            return super().importances(c, i, sums, tokens)
        shared = ((("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), ("mlp.shared_expert.down_proj",),
                   c.shared_expert_intermediate_size) if c.model_type == "qwen2_moe" else None)
        return expert_importances(self, c, i, sums, tokens, "mlp", c.moe_intermediate_size, shared)

    def stacks(self, c: ModelConfig, tensors: dict) -> dict:
        F = c.moe_intermediate_size
        return {name: s for i in range(c.num_hidden_layers) if self.sparse(c, i)
                for name, s in expert_stacks(c, tensors, f"model.layers.{i}.mlp", F).items()}

    def block_shapes(self, c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
        """As llama's; a sparse layer's MLP: the router [E, D] and the experts stacked, as MLX's
        switch_mlp holds them."""
        if not self.sparse(c, i):
            return super().block_shapes(c, i)
        if c.model_type != "qwen3_moe":
            raise FormatError(f"nibble makes random models of qwen3_moe's shapes, not {c.model_type}'s")
        D, E, F = c.hidden_size, experts(c), c.moe_intermediate_size
        p = f"model.layers.{i}.mlp."
        return self.attention_shapes(c, i) | {
            p + "gate.weight": (E, D), p + "switch_mlp.gate_proj.weight": (E, F, D),
            p + "switch_mlp.up_proj.weight": (E, F, D), p + "switch_mlp.down_proj.weight": (E, D, F)}

    def configure(self, c: ModelConfig) -> None:
        if c.model_type == "qwen2_moe":
            c.attention_bias = True if c.qkv_bias is None else c.qkv_bias   # q/k/v biases (transformers 4: always)
        else:
            super().configure(c)   # qwen3's rule: no attention bias
        if c.mlp_only_layers is None:   # null in a config.json: none
            c.mlp_only_layers = []
        if experts(c) is None:   # Qwen3MoeConfig's and Qwen2MoeConfig's default
            c.num_experts = {"qwen3_moe": 128, "qwen2_moe": 60}[c.model_type]
        check_experts(c)

    def windows(self, c: ModelConfig) -> list[int]:
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
