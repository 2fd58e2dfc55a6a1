"""Mixtral: Mistral's attention (a sliding window in every layer, if any) and in every layer a
mixture of experts for the MLP: softmax over the router's logits, the top num_experts_per_tok
experts (2 of 8), their probabilities always renormalised. Its checkpoints name the experts'
gate, down and up matrices w1, w2 and w3 (MLX's: switch_mlp's gate_proj, down_proj, up_proj)."""
from nibble.formats.config import ModelConfig, one_window
from . import switch_layers
from .llama import Llama

MOE = "block_sparse_moe"


class Mixtral(Llama):
    # MixtralConfig's defaults
    model_types = {"mixtral": dict(rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2)}
    fields = Llama.fields | switch_layers.FIELDS

    def layer_weights(self, get, c: ModelConfig, i: int):
        from ..kernels.layer import MoELayerWeights
        p = f"model.layers.{i}.{MOE}"
        w = switch_layers.stacked(get, p, c, c.intermediate_size, ("w1", "w3", "w2"))
        moe = switch_layers.routed(get, p, c, "gate", w, renormalize=True)
        return MoELayerWeights(**self.attention(get, c, i), moe=moe)

    def act_shape(self, c: ModelConfig, i: int) -> tuple[int, int]:
        return switch_layers.moe_act_shape(self, c)

    def importances(self, c: ModelConfig, i: int, sums, tokens: int) -> dict:
        return switch_layers.expert_importances(self, c, i, sums, tokens, MOE, c.intermediate_size)

    def stacks(self, c: ModelConfig, tensors: dict) -> dict:
        return {name: s for i in range(c.num_hidden_layers) for name, s in switch_layers.expert_stacks(
            c, tensors, f"model.layers.{i}.{MOE}", c.intermediate_size, ("w1", "w3", "w2")).items()}

    def configure(self, c: ModelConfig) -> None:
        c.attention_bias = False   # transformers' mixtral has no biases, whatever it says
        switch_layers.check_experts(c)

    def windows(self, c: ModelConfig) -> list[int]:
        return one_window(c, c.sliding_window or 0)
