"""Llama and the families that share its block: Mistral (a sliding window), Qwen2 (q/k/v biases),
Qwen3 (an RMSNorm over each query and key head before RoPE) and SmolLM3 (no RoPE in some layers)."""
from nibble.formats.config import ModelConfig, one_window, sliding_where_typed
from nibble.formats.errors import FormatError
from nibble.formats.families import GGUFArch
from nibble.formats.gguf_metadata import expert_counts
from nibble.formats.values import BOOL, COUNT, integer, list_of, optional
from .base import Transformer


def _llama_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp writes Mixtral as llama with experts (expert_count above 0): a mixtral, each
    expert feed_forward_length wide, the k probabilities renormalised, no sliding window."""
    if not meta.get(a + "expert_count"):
        return {}
    E, k = expert_counts(meta, a)
    return dict(model_type="mixtral", num_local_experts=E, num_experts_per_tok=k)


def _smollm3_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """Not in the file: llama.cpp has no RoPE in every 4th layer."""
    return dict(no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)])


def _qwen_vl_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp's qwen2vl and qwen3vl: Qwen2's and Qwen3's text models, multimodal RoPE's sections
    in rope.dimension_sections (its fourth, 0, unused), which their vision reads (mrope_section)."""
    sections = meta.get(a + "rope.dimension_sections")
    return {"mrope_section": [int(n) for n in list(sections)[:3]]} if sections is not None else {}


class Llama(Transformer):
    # a window that config.json leaves out is 4096, not none (qwen2/3: with use_sliding_window)
    model_types = {"llama": {}, "mistral": dict(sliding_window=4096), "qwen2": dict(sliding_window=4096),
                   "qwen3": dict(sliding_window=4096, head_dim=128),   # not hidden_size / heads
                   "smollm3": dict(rope_theta=2000000.0, num_key_value_heads=4, max_position_embeddings=32768,
                                   tie_word_embeddings=True)}
    # the converter's LlamaModel and its subclasses permute q/k; Mixtral's router and experts in
    # a llama file with experts
    gguf = {"llama": GGUFArch("llama", permuted_qk=True, fields=_llama_gguf, block_names={
                "ffn_gate_inp": "block_sparse_moe.gate",
                **{f"ffn_{p}_exps": f"block_sparse_moe.switch_mlp.{p}_proj" for p in ("gate", "up", "down")}}),
            "qwen2": GGUFArch("qwen2"), "qwen3": GGUFArch("qwen3"),
            "qwen2vl": GGUFArch("qwen2", fields=_qwen_vl_gguf), "qwen3vl": GGUFArch("qwen3", fields=_qwen_vl_gguf),
            "smollm3": GGUFArch("smollm3", permuted_qk=True, fields=_smollm3_gguf)}
    # Idefics3ForConditionalGeneration (SmolVLM-256M/500M-Instruct) and SmolVLM's: a Llama text
    # model (its vision: runner/vision/idefics3.py); Qwen2.5-VL's and Qwen3-VL's, a Qwen2 and a
    # Qwen3 one whose RoPE turns an image's tokens by their row and column (runner/vision/qwen*_vl.py)
    wrappers = {"idefics3": "llama", "smolvlm": "llama", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
    fields = {
        "use_sliding_window": optional(BOOL),   # qwen2/3, smollm3: false (their default) turns sliding_window off
        "max_window_layers": optional(integer()),   # qwen2/3 without layer_types: the layers from here on slide
        "no_rope_layers": optional(list_of(integer(0, 1), "0s and 1s")),   # smollm3: per layer, 1 = RoPE, 0 = none
        "no_rope_layer_interval": optional(COUNT),   # smollm3 without no_rope_layers: every n-th layer has none
    }

    def qk_norm(self, c: ModelConfig) -> str | None:
        return "head" if c.model_type == "qwen3" else None

    def configure(self, c: ModelConfig) -> None:
        if c.model_type == "qwen2":
            c.attention_bias = True   # Qwen2 always has q/k/v biases; its config does not say so
        elif c.model_type == "mistral":
            c.attention_bias = False   # transformers' mistral has no biases, whatever it says
        elif c.attention_bias:
            raise FormatError(f"config.json: nibble cannot run attention_bias=True for "
                              f"{c.model_type} (transformers gives its o_proj a bias too)")

    def rope_layers(self, c: ModelConfig) -> list[bool]:
        """smollm3's no_rope_layers (0: a NoPE layer; by default every no_rope_layer_interval-th
        layer); RoPE in every layer of the others."""
        L, flags = c.num_hidden_layers, c.no_rope_layers
        if c.model_type != "smollm3":
            return [True] * L
        if flags is None:
            every = c.no_rope_layer_interval or 4
            flags = [int((i + 1) % every != 0) for i in range(L)]
        if len(flags) < L:
            raise FormatError(f"config.json: no_rope_layers has {len(flags)} entries for {L} layers")
        return [bool(f) for f in flags[:L]]

    def windows(self, c: ModelConfig) -> list[int]:
        """qwen2 and qwen3 slide in the "sliding_attention" layers and only with use_sliding_window,
        smollm3 in the "sliding_attention" layers (by default its NoPE layers, with
        use_sliding_window), mistral in every layer, llama in none."""
        types, window = c.layer_types, c.sliding_window or 0
        if c.model_type in ("qwen2", "qwen3"):
            if types is None:
                first = 28 if c.max_window_layers is None else c.max_window_layers   # Qwen2/3Config's default
                types = ["sliding_attention" if i >= first else "full_attention" for i in range(c.num_hidden_layers)]
            return sliding_where_typed(types, window if c.use_sliding_window else 0)
        if c.model_type == "smollm3":
            if types is None:   # by default its NoPE layers slide
                slide = c.use_sliding_window and window
                types = ["sliding_attention" if slide and not rope else "full_attention" for rope in c.rope_layers]
            return sliding_where_typed(types, window)
        # transformers' LlamaModel has no sliding window, whatever the config says
        return one_window(c, 0 if c.model_type == "llama" else window)
