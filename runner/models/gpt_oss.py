"""gpt-oss (gpt-oss-20b, gpt-oss-120b): Llama's attention with biases on q, k, v and o and a
learned attention sink per head (a logit in every row's softmax with no value to weigh), sliding
(128) and full layers alternating, YaRN; in every layer a mixture of experts whose router has a
bias and takes the top k logits, then a softmax over them. Its experts have biases and gate with
a clamped SwiGLU (moe.py). transformers saves each layer's experts as two 3-D tensors with the
matrices [in, out]: gate_up_proj [E, D, 2F], gate's and up's columns interleaved, and down_proj
[E, F, D]; they are turned into [out, in] stacks at load (a copy). OpenAI's checkpoints store them
in MXFP4 (formats.mxfp4), [out, in] already, which run as stored, through a table of levels."""
import numpy as np

from nibble.formats import mxfp4
from nibble.formats.config import ModelConfig, sliding_where_typed
from nibble.formats.errors import FormatError
from nibble.formats.families import GGUFArch
from nibble.formats.gguf_metadata import expert_counts
from nibble.formats.values import COUNT, number
from . import switch_layers
from .base import Transformer


def _mxfp4(get, name: str, shape: tuple[int, int, int], rows=slice(None)):
    """Experts' matrices [E, out, in] stored in MXFP4 (`name`_blocks and _scales, rows [out, in]
    already), those `rows` of each, as stacked 4-bit weights through MXFP4's table of levels. Gate's
    and up's rows alternate in gate_up_proj: each is copied apart (down stays in the file's map)."""
    from nibble.quant.affine import QuantizedTensor   # here: the CLI's help imports the families, not numba
    from ..kernels.linear import prepare
    E, N, K = shape
    blocks = get.stored(name + "_blocks", (E, N, K // 32, 16))
    e = get.stored(name + "_scales", (E, N, K // 32))
    if blocks is None or e is None:
        return None
    if blocks.dtype != np.uint8:
        raise FormatError(f"{name}_blocks should hold MXFP4's codes as uint8, got {blocks.dtype}")
    scales, biases = mxfp4.scales_biases(e[:, rows], name + "_scales")
    return prepare(QuantizedTensor(mxfp4.words(blocks[:, rows]), scales, biases, 4, 32, values=mxfp4.LEVELS))


def _gguf(meta: dict, a: str, layers: int, width: int, head_dim: int) -> dict:
    """llama.cpp's gpt-oss: attention biases, a window of attention.sliding_window in every other
    layer from the first, experts as wide as feed_forward_length (the converter writes it
    for expert_feed_forward_length); its SwiGLU's limit and alpha are llama.cpp's constants, 7 and 1.702."""
    E, k = expert_counts(meta, a)
    F, window = meta.get(a + "expert_feed_forward_length"), meta.get(a + "attention.sliding_window")
    if F != meta.get(a + "feed_forward_length"):
        raise FormatError(f"GGUF metadata {a}expert_feed_forward_length {F} differs from feed_forward_length "
                          f"{meta.get(a + 'feed_forward_length')}: nibble's gpt-oss takes one width for its experts")
    COUNT.check(f"GGUF metadata {a}attention.sliding_window", window)
    return dict(attention_bias=True, sliding_window=window,
                num_local_experts=E, num_experts_per_tok=k, swiglu_limit=7.0, swiglu_alpha=1.702)


class GptOss(Transformer):
    # GptOssConfig's defaults
    model_types = {"gpt_oss": dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
        num_experts_per_tok=4, sliding_window=128, rope_theta=150000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)}
    gguf = {"gpt-oss": GGUFArch("gpt_oss", fields=_gguf, block_names={
        "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
        **{f"ffn_{p}_exps": f"mlp.switch_mlp.{p}_proj" for p in ("gate", "up", "down")}})}
    # its clamped SwiGLU's limit and alpha
    fields = switch_layers.FIELDS | {"swiglu_limit": number(above=0), "swiglu_alpha": number(above=0)}

    def windows(self, c: ModelConfig) -> list[int]:
        return sliding_where_typed(c.layer_types or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(c.num_hidden_layers)],
            c.sliding_window or 0)

    def layer_weights(self, get, c: ModelConfig, i: int):
        from ..kernels.layer import MoELayerWeights
        D, E, F, H = c.hidden_size, switch_layers.experts(c), c.intermediate_size, c.num_attention_heads
        p = f"model.layers.{i}."
        m = p + "mlp."
        if m + "switch_mlp.gate_proj.bias" in get.tensors:   # a GGUF's: one stack of biases a matrix
            b_gate, b_up, b_down = (get(m + f"switch_mlp.{n}_proj.bias", (E, k)) for n, k in (("gate", F), ("up", F), ("down", D)))
        else:
            b, b_down = get(m + "experts.gate_up_proj_bias", (E, 2 * F)), get(m + "experts.down_proj_bias", (E, D))
            b_gate, b_up = (None, None) if b is None else (np.ascontiguousarray(b[:, ::2]), np.ascontiguousarray(b[:, 1::2]))
        if m + "switch_mlp.gate_proj.weight" in get.tensors:   # as quantize writes them, or a GGUF holds them
            w = switch_layers.stacked(get, m[:-1], c, F)
        elif m + "experts.gate_up_proj_blocks" in get.tensors:   # OpenAI's checkpoints: MXFP4
            w = (_mxfp4(get, m + "experts.gate_up_proj", (E, 2 * F, D), slice(0, None, 2)),
                 _mxfp4(get, m + "experts.gate_up_proj", (E, 2 * F, D), slice(1, None, 2)),
                 _mxfp4(get, m + "experts.down_proj", (E, D, F)))
        else:
            gate_up, down = get(m + "experts.gate_up_proj", (E, D, 2 * F)), get(m + "experts.down_proj", (E, F, D))
            rows = lambda w: None if w is None else np.ascontiguousarray(w.transpose(0, 2, 1))   # [E, out, in]
            w = (None, None, None) if gate_up is None or down is None else (
                rows(gate_up[:, :, ::2]), rows(gate_up[:, :, 1::2]), rows(down))
        moe = switch_layers.routed(get, m[:-1], c, "router", w, router_bias=get(m + "router.bias", (E,)),
                               top_k_first=True, b_gate=b_gate, b_up=b_up, b_down=b_down,
                               swiglu_limit=np.float32(c.swiglu_limit),
                               swiglu_alpha=np.float32(c.swiglu_alpha))
        sinks = p + "self_attn.sinks"   # a GGUF's: self_attn.sinks.weight
        attention = self.attention(get, c, i) | dict(bo=get(p + "self_attn.o_proj.bias", (D,)), sinks=get(
            sinks if sinks in get.tensors or sinks + ".weight" not in get.tensors else sinks + ".weight", (H,)))
        return MoELayerWeights(**attention, moe=moe)

    def act_shape(self, c: ModelConfig, i: int) -> tuple[int, int]:
        return switch_layers.moe_act_shape(self, c)

    def importances(self, c: ModelConfig, i: int, sums, tokens: int) -> dict:
        return switch_layers.expert_importances(self, c, i, sums, tokens, "mlp", c.intermediate_size)

    def stacks(self, c: ModelConfig, tensors: dict) -> dict:
        """The experts as quantize writes them: MLX's switch_mlp stacks [E, out, in], gate's and up's
        from gate_up_proj's interleaved columns (or from float stacks already so named); their biases
        stay as stored."""
        from nibble.quant.convert import ExpertStack
        D, E, F = c.hidden_size, switch_layers.experts(c), c.intermediate_size
        out = {}
        for i in range(c.num_hidden_layers):
            m = f"model.layers.{i}.mlp."
            gate_up, down = m + "experts.gate_up_proj", m + "experts.down_proj"
            if gate_up not in tensors or down not in tensors:   # stacked already
                out |= switch_layers.expert_stacks(c, tensors, m[:-1], F)
                continue
            columns = lambda t, cols, s=gate_up: (x[:, cols].T for x in np.asarray(t[s], np.float32))
            out |= {m + "switch_mlp.gate_proj.weight": ExpertStack((gate_up,), (E, F, D), lambda t, k=columns: k(t, slice(0, None, 2))),
                    m + "switch_mlp.up_proj.weight": ExpertStack((gate_up,), (E, F, D), lambda t, k=columns: k(t, slice(1, None, 2))),
                    m + "switch_mlp.down_proj.weight": ExpertStack(
                        (down,), (E, D, F), lambda t, s=down: (x.T for x in np.asarray(t[s], np.float32)))}
        return out

    def block_shapes(self, c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
        """Block i's tensors by name, its experts stacked as quantize writes them."""
        D, E, F, H = c.hidden_size, switch_layers.experts(c), c.intermediate_size, c.num_attention_heads
        p = f"model.layers.{i}."
        m = p + "mlp."
        q_dim, kv_dim = H * c.head_dim, c.num_key_value_heads * c.head_dim
        return self.attention_shapes(c, i) | {
            p + "self_attn.q_proj.bias": (q_dim,), p + "self_attn.k_proj.bias": (kv_dim,),
            p + "self_attn.v_proj.bias": (kv_dim,), p + "self_attn.o_proj.bias": (D,), p + "self_attn.sinks": (H,),
            m + "router.weight": (E, D), m + "router.bias": (E,),
            m + "switch_mlp.gate_proj.weight": (E, F, D), m + "switch_mlp.up_proj.weight": (E, F, D),
            m + "switch_mlp.down_proj.weight": (E, D, F),
            m + "experts.gate_up_proj_bias": (E, 2 * F), m + "experts.down_proj_bias": (E, D)}

    def configure(self, c: ModelConfig) -> None:
        if not c.attention_bias:
            raise FormatError("config.json: nibble runs gpt_oss with attention_bias=true (its q, k, v and o biases)")
        switch_layers.check_experts(c)
