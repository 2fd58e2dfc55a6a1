"""Llama and the families that share its block: Mistral (a sliding window), Qwen2 (q/k/v biases),
Qwen3 (an RMSNorm over each query and key head before RoPE) and SmolLM3 (no RoPE in some layers)."""
import math

import numpy as np

from nibble.formats.config import ModelConfig, one_window, sliding_where_typed
from nibble.formats.errors import FormatError
from nibble.formats.families import Family, GGUFArch
from nibble.formats.gguf_metadata import expert_counts
from nibble.formats.values import COUNT
from ..rope import rope_tables

# the projections whose input each of decoder_layer's four act_sq rows collects (calibrate.py)
INPUTS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def block():
    """The block's kernel (imported with numba when a model is built, not when a config is read)."""
    from ..kernels.layer import decoder_layer
    return decoder_layer


def layer(get, c: ModelConfig, i: int):
    from ..kernels.layer import LayerWeights
    D, F = c.hidden_size, c.intermediate_size
    p = f"model.layers.{i}."
    return LayerWeights(
        **attention(get, c, i),
        w_gate=get.linear(p + "mlp.gate_proj", (F, D)),
        w_up=get.linear(p + "mlp.up_proj", (F, D)),
        w_down=get.linear(p + "mlp.down_proj", (D, F)),
    )


def attention(get, c: ModelConfig, i: int, qk_norm: str | None = None) -> dict:
    """Block i's weights up to its MLP (the attention half and its norms), as LayerWeights and
    MoELayerWeights name them. qk_norm: where q and k are RMSNormed before RoPE, as
    `qk_norm_shapes` says."""
    D, hd = c.hidden_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
    p = f"model.layers.{i}."
    bias = get if c.attention_bias else lambda name, shape: np.zeros(shape, np.float32)
    norms = qk_norm_shapes(c, qk_norm)
    # empty for the models without q/k norms: the block skips them
    none = np.zeros(0, np.float32)
    return dict(
        input_norm=get(p + "input_layernorm.weight", (D,)),
        wq=get.linear(p + "self_attn.q_proj", (q_dim, D)),
        wk=get.linear(p + "self_attn.k_proj", (kv_dim, D)),
        wv=get.linear(p + "self_attn.v_proj", (kv_dim, D)),
        bq=bias(p + "self_attn.q_proj.bias", (q_dim,)),
        bk=bias(p + "self_attn.k_proj.bias", (kv_dim,)),
        bv=bias(p + "self_attn.v_proj.bias", (kv_dim,)),
        q_norm=get(p + "self_attn.q_norm.weight", norms[0]) if norms else none,
        k_norm=get(p + "self_attn.k_norm.weight", norms[1]) if norms else none,
        wo=get.linear(p + "self_attn.o_proj", (D, q_dim)),
        bo=none, sinks=none,
        post_norm=get(p + "post_attention_layernorm.weight", (D,)),
        attention_scale=np.float32(1 / math.sqrt(hd)),
        residual_scale=np.float32(1),
    )


def qk_norm_shapes(c: ModelConfig, qk_norm: str | None) -> tuple[tuple[int], tuple[int]] | None:
    """The shapes of q_norm and k_norm: "head", an RMSNorm over each head (qwen3's, and qwen3's
    and qwen3_moe's if not said), "row", over each row's whole projection (olmoe's); None: none."""
    hd = c.head_dim
    qk_norm = qk_norm or ("head" if c.model_type in ("qwen3", "qwen3_moe") else None)
    if qk_norm == "head":
        return (hd,), (hd,)
    if qk_norm == "row":
        return (c.num_attention_heads * hd,), (c.num_key_value_heads * hd,)
    return None


def block_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Block i's tensors by Hugging Face name, in a checkpoint's order (no biases): matrices
    [out, in], norms [D] (runner/measure/synthetic.py makes random models of them)."""
    D, F = c.hidden_size, c.intermediate_size
    p = f"model.layers.{i}."
    return attention_shapes(c, i) | {p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                                     p + "mlp.down_proj.weight": (D, F)}


def attention_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    D, hd = c.hidden_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
    p = f"model.layers.{i}."
    shapes = qk_norm_shapes(c, None)
    norms = {p + "self_attn.q_norm.weight": shapes[0], p + "self_attn.k_norm.weight": shapes[1]} if shapes else {}
    return {p + "input_layernorm.weight": (D,), p + "self_attn.q_proj.weight": (q_dim, D),
            p + "self_attn.k_proj.weight": (kv_dim, D), p + "self_attn.v_proj.weight": (kv_dim, D),
            **norms, p + "self_attn.o_proj.weight": (D, q_dim), p + "post_attention_layernorm.weight": (D,)}


def act_shape(c: ModelConfig, i: int) -> tuple[int, int]:
    """The shape of block i's act_sq (the sums of its projections' squared inputs, calibrate.py):
    a row for each of INPUTS' groups, as wide as the widest input."""
    return 4, max(c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size)


def importances(c: ModelConfig, i: int, sums: np.ndarray, tokens: int, inputs=INPUTS) -> dict[str, np.ndarray]:
    """Block i's entries of the importance matrix: each projection's mean squared input per
    channel, from the rows of act_sq `sums` over `tokens` tokens that `inputs` names."""
    widths = (c.hidden_size, c.num_attention_heads * c.head_dim, c.hidden_size, c.intermediate_size)
    return {f"model.layers.{i}.{name}.weight": sums[slot, :widths[slot]] / tokens
            for slot, names in enumerate(inputs) for name in names}


def stacks(c: ModelConfig, tensors: dict) -> dict:
    """The experts' matrices quantize writes stacked (quant.convert.ExpertStack): none."""
    return {}


def norm(get, name: str, shape: tuple) -> np.ndarray | None:
    """An RMSNorm's weight, as the kernels multiply by it."""
    return get(name, shape)


def embed_scale(c: ModelConfig, embed) -> float:
    """The factor on the embedded rows: none."""
    return 1.0


def logits_scale(c: ModelConfig) -> float:
    """The factor on the logits: none."""
    return 1.0


def ropes(c: ModelConfig, ctx: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """One table for every layer; zero-width tables where a layer has no RoPE (smollm3)."""
    table = rope_tables(c, ctx)
    none = (np.zeros((ctx, 0), np.float32),) * 2
    return [table if rope else none for rope in c.rope_layers]


# ---- the config and the files -------------------------------------------------------------------

def _configure(c: ModelConfig) -> None:
    if c.model_type == "qwen2":
        c.attention_bias = True   # Qwen2 always has q/k/v biases; its config does not say so
    elif c.model_type == "mistral":
        c.attention_bias = False   # transformers' mistral has no biases, whatever it says
    elif c.attention_bias:
        raise FormatError(f"config.json: nibble cannot run attention_bias=True for "
                          f"{c.model_type} (transformers gives its o_proj a bias too)")


def _rope_layers(c: ModelConfig) -> list[bool]:
    """smollm3's no_rope_layers (0: a NoPE layer; by default every no_rope_layer_interval-th
    layer); RoPE in every layer of the others."""
    L, flags = c.num_hidden_layers, c.no_rope_layers
    if c.model_type != "smollm3":
        return [True] * L
    if flags is None:
        every = c.extra.get("no_rope_layer_interval", 4)
        COUNT.check("config.json: no_rope_layer_interval", every)
        flags = [int((i + 1) % every != 0) for i in range(L)]
    if len(flags) < L:
        raise FormatError(f"config.json: no_rope_layers has {len(flags)} entries for {L} layers")
    return [bool(f) for f in flags[:L]]


def _windows(c: ModelConfig) -> list[int]:
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


def _llama_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp writes Mixtral as llama with experts (expert_count above 0): a mixtral, each
    expert feed_forward_length wide, the k probabilities renormalised, no sliding window."""
    if not meta.get(a + "expert_count"):
        return {}
    E, k = expert_counts(meta, a)
    return dict(model_type="mixtral", extra=dict(num_local_experts=E, num_experts_per_tok=k))


def _smollm3_gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """Not in the file: llama.cpp has no RoPE in every 4th layer."""
    return dict(no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)])


# a window that config.json leaves out is 4096, not none (qwen2/3: with use_sliding_window)
FAMILY = Family(
    "llama",
    model_types={"llama": {}, "mistral": dict(sliding_window=4096), "qwen2": dict(sliding_window=4096),
                 "qwen3": dict(sliding_window=4096, head_dim=128),   # not hidden_size / heads
                 "smollm3": dict(rope_theta=2000000.0, num_key_value_heads=4, max_position_embeddings=32768,
                                 tie_word_embeddings=True)},
    windows=_windows, configure=_configure, rope_layers=_rope_layers,
    # the converter's LlamaModel and its subclasses permute q/k; Mixtral's router and experts in
    # a llama file with experts
    gguf={"llama": GGUFArch("llama", permuted_qk=True, fields=_llama_gguf, block_names={
              "ffn_gate_inp": "block_sparse_moe.gate",
              **{f"ffn_{p}_exps": f"block_sparse_moe.switch_mlp.{p}_proj" for p in ("gate", "up", "down")}}),
          "qwen2": GGUFArch("qwen2"), "qwen3": GGUFArch("qwen3"),
          "smollm3": GGUFArch("smollm3", permuted_qk=True, fields=_smollm3_gguf)},
)
