"""A checkpoint laid out by hand from MLX's format description runs unchanged, and so does one
mlx-lm itself converted.

Nothing of nibble writes it: the packing, the bfloat16 scales, the safetensors bytes and the
config.json keys are produced here from the spec, as mlx-lm would write them for a llama model.
"""
import json
from pathlib import Path

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import write_model_dir
from nibble.formats.safetensors import read_checkpoint
from nibble.runner.kernels import linear
from nibble.runner.kernels.cpu import SMALL
from nibble.runner.kernels.prefill import dequantize
from nibble.runner.loader import load
from nibble.runner.model import Model
from tests import reference
from tests.hand_safetensors import write_safetensors_by_hand
from tests.test_quant_kernels import twin_dequantize
from tests.tiny import tiny_model_dir

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def mlx_quantize(w, bits, group):
    """MLX affine quantization of w [N, K]: (uint32 words low bits first, scales, biases, w as
    the checkpoint represents it)."""
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    lo, hi = g.min(-1), g.max(-1)
    scales = _bf16((hi - lo) / (2 ** bits - 1))
    biases = _bf16(lo)
    q = np.clip(np.rint((g - biases[..., None]) / scales[..., None]), 0, 2 ** bits - 1).astype(np.uint32)
    per_word = 32 // bits
    lanes = q.reshape(N, K // per_word, per_word) << (bits * np.arange(per_word, dtype=np.uint32))
    words = np.bitwise_or.reduce(lanes, axis=-1).astype(np.uint32)
    represented = (scales[..., None] * q + biases[..., None]).reshape(N, K).astype(np.float32)
    return words, scales, biases, represented


def _bf16(x):
    """x rounded to bfloat16 (round to nearest even), kept as float32."""
    u = np.asarray(x, np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.view(np.float32)


def test_hand_made_mlx_checkpoint_runs(tmp_path):
    base = tiny_model_dir()            # tokenizer, template and float weights to start from
    out = write_model_dir(base, tmp_path / "mlx")
    tensors, floats = {}, {}
    for name, w in base.tensors.items():
        module = name.removesuffix(".weight")
        if module.endswith(LINEARS) or module == "model.embed_tokens":
            bits, group = (8, 32) if module == "model.embed_tokens" else (4, 64)
            words, scales, biases, floats[name] = mlx_quantize(w, bits, group)
            tensors |= {name: words, module + ".scales": scales, module + ".biases": biases}
        else:
            tensors[name] = floats[name] = w
    write_safetensors_by_hand(tensors, out / "model.safetensors", bf16=lambda name: name.endswith((".scales", ".biases")))
    config = json.loads((out / "config.json").read_text())
    quantization = {"group_size": 64, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    config |= {"quantization": quantization, "quantization_config": quantization}
    (out / "config.json").write_text(json.dumps(config))

    model, tokenizer = load(str(out))
    tokens = tokenizer.prompt("the quick brown fox")
    want = reference.forward(model.config, floats, tokens)[-1]
    cache = model.new_cache(64)
    for i in range(0, len(tokens), SMALL):   # the decode kernels
        got = model.forward(tokens[i:i + SMALL], cache)[-1]
    # x rounded to int8 blocks where the CPU multiplies bytes: 1.6e-2 of the logits' scale on this
    # tiny random model (a wrong reading of the checkpoint: all of it); else to int16 per group: 1.2e-4
    assert np.abs(got - want).max() < (5e-2 if linear.int8_activations() else 3e-4) * np.abs(want).max()
    assert model.layers[0].w_up.bits == 4 and model.embed.bits == 8 and model.embed.group_size == 32


def test_mlx_lms_own_conversion_of_a_mixture_of_experts():
    """mlx-lm's own 4-bit conversion of the qwen3-moe fixture (tests/fixtures/make_mlx_fixtures.py):
    experts stacked as switch_mlp, routers quantized to 8 bits, the experts' down projections (32
    wide, narrower than a group of 64) left in bfloat16. Every stack and router is what the twin
    dequantizes from MLX's words; the logits are MLX's own, but for what rounding the activations
    to int8 moves this tiny random mixture (about 2%: a row routed elsewhere moves far)."""
    folder = Path(__file__).parent / "data" / "mlx" / "qwen3-moe-4bit"
    raw = json.loads((folder / "config.json").read_text())
    config, tensors = ModelConfig.from_dict(raw), read_checkpoint(folder)
    model = Model(config, tensors)
    moe, p = model.layers[0].moe, "model.layers.0.mlp."
    twin = lambda path, bits: twin_dequantize(tensors[path + ".weight"], HalfTensor(tensors[path + ".scales"].bits, True).widen(),
                                              HalfTensor(tensors[path + ".biases"].bits, True).widen(), bits, 64)
    np.testing.assert_allclose(moe.router, twin(p + "gate", 8), rtol=1e-6, atol=1e-7)
    assert moe.w_gate.bits == 4 and isinstance(moe.w_down, np.ndarray)
    for e in range(moe.w_up.weight.shape[0]):
        w = tensors[p + "switch_mlp.up_proj.weight"][e]
        s, b = (HalfTensor(tensors[p + f"switch_mlp.up_proj.{k}"].bits[e], True).widen() for k in ("scales", "biases"))
        expert = moe.w_up._replace(weight=moe.w_up.weight[e], scales=moe.w_up.scales[e], biases=moe.w_up.biases[e])
        np.testing.assert_allclose(dequantize(expert), twin_dequantize(w, s, b, 4, 64), rtol=1e-6, atol=1e-7)
    tokens = np.load(Path(__file__).parent / "data" / "transformers" / "qwen3-moe" / "tokens.npy")
    want = np.load(folder / "logits.npy")
    got = model.forward(tokens, model.new_cache(), all_logits=True)
    assert np.abs(got - want).max() / np.abs(want).max() < 3e-2
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
