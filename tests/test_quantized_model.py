"""Quantized tiny models against the numpy reference run on the same weights dequantized."""
import numpy as np
import pytest

from nibble.formats.model_dir import read_model_dir, write_model_dir
from nibble.quant.affine import dequantize
from nibble.quant.convert import quantize_model, read_linear
from nibble.runner.kernels import linear
from nibble.runner.kernels.cpu import SMALL
from nibble.runner.model import Model
from tests import reference
from tests.tiny import tiny_model_dir


def dequantized(tensors, quantization):
    """Every quantized linear replaced by its float32 reconstruction."""
    out = {k: v for k, v in tensors.items() if not k.endswith((".scales", ".biases"))}
    for name in list(out):
        if name.endswith(".weight") and name[:-7] + ".scales" in tensors:
            out[name] = dequantize(read_linear(tensors, quantization, name[:-7]))
    return out


# Every kind on llama, every other family on one kind, each kind on two of them: a layer reads its
# quantized weights through the same products whatever its family, and its family's own steps
# (biases, q/k norms, gemma's layer, fused names, layers without RoPE) whatever the kind; each pair
# would compile the layer once more.
@pytest.mark.parametrize("model_type,bits,group", [
    ("llama", 8, 32), ("llama", 4, 32), ("llama", 4, 64),
    ("qwen2", 4, 32), ("qwen3", 8, 32), ("gemma3_text", 4, 64), ("phi3", 8, 32), ("smollm3", 4, 64)])
def test_quantized_forward_matches_reference(model_type, bits, group, tmp_path):
    q = quantize_model(tiny_model_dir(model_type), bits, group).model
    md = read_model_dir(write_model_dir(q, tmp_path / "q"))   # memory-mapped, as `nibble run` reads it
    floats = dequantized(md.tensors, md.config.quantization)
    n = SMALL + 2   # more tokens than the decode kernels take: the prefill path
    tokens = np.random.default_rng(5).integers(0, md.config.vocab_size, n + 8)
    want = reference.forward(md.config, floats, tokens)
    model = Model(md.config, md.tensors)
    prefill = model.forward(tokens[:n], model.new_cache(32), all_logits=True)
    cache = model.new_cache(32)
    decode = np.array([model.forward([t], cache)[0] for t in tokens])   # the integer decode path
    scale = np.abs(want).max()
    # where the CPU has byte dot products, prefill and decode round activations to int8 blocks: on
    # a tiny random model a few percent of the logits' scale (the real model's KL: test_smollm2);
    # elsewhere prefill's float32 tiles are exact, and decode's 16 bits per group close
    int8 = linear.int8_activations()
    assert np.abs(prefill - want[:n]).max() < (1e-1 if int8 else 1e-4) * scale
    assert np.abs(decode - want).max() < (1e-1 if int8 else 2e-3) * scale


def test_quantized_weights_are_not_copied(tmp_path):
    md = read_model_dir(write_model_dir(quantize_model(tiny_model_dir(), 4, 32).model, tmp_path / "q"))
    model = Model(md.config, md.tensors)
    stored = md.tensors["model.layers.0.mlp.up_proj.weight"]
    assert np.shares_memory(model.layers[0].w_up.weight, stored)


def test_phi3_keeps_its_fused_names_and_splits_them_without_a_copy(tmp_path):
    """qkv_proj and gate_up_proj are quantized as stored (mlx-lm's names); the model reads its
    q/k/v and gate/up as blocks of their packed rows."""
    md = read_model_dir(write_model_dir(quantize_model(tiny_model_dir("phi3"), 8, 32).model, tmp_path / "q"))
    p = "model.layers.0."
    assert {p + "self_attn.qkv_proj.scales", p + "mlp.gate_up_proj.scales"} <= md.tensors.keys()
    layer = Model(md.config, md.tensors).layers[0]
    assert all(np.shares_memory(w.weight, md.tensors[p + "self_attn.qkv_proj.weight"])
               for w in (layer.wq, layer.wk, layer.wv))
    assert np.shares_memory(layer.w_up.weight, md.tensors[p + "mlp.gate_up_proj.weight"])
