"""Tiny models stored in bf16 and f16: run from the file's memory map (no float32 copy of a
matrix) and match the numpy reference on the widened weights."""
import numpy as np
import pytest

from nibble.formats.half import HalfTensor
from nibble.formats.safetensors import read_safetensors, write_safetensors
from nibble.runner.model import Model
from tests import reference
from tests.hand_safetensors import memmap_backed, write_safetensors_by_hand
from tests.tiny import tiny_config, tiny_tensors


def half_checkpoint(tmp_path, config, dtype: str) -> dict:
    """The tiny model's tensors written in `dtype` ("bf16" or "f16") and read back."""
    path = tmp_path / "model.safetensors"
    tensors = tiny_tensors(config)
    if dtype == "bf16":
        write_safetensors_by_hand(tensors, path, bf16=lambda name: True)
    else:
        write_safetensors({k: t.astype(np.float16) for k, t in tensors.items()}, path)
    return read_safetensors(path)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
# tied, untied with biases, gemma3's embedding scale rounded to the checkpoint's 16 bits, phi3's
# fused matrices
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "phi3"])
def test_prefill_then_decode_match_reference(tmp_path, dtype, model_type):
    config = tiny_config(model_type)
    tensors = half_checkpoint(tmp_path, config, dtype)
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, 16)
    want = reference.forward(config, tensors, tokens)   # widened there, knowing they were 16-bit
    model = Model(config, tensors)
    cache = model.new_cache(32)
    got = [*model.forward(tokens[:9], cache, all_logits=True)]
    for t in tokens[9:]:
        got.append(model.forward([t], cache)[0])
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("model_type", ["qwen2", "phi3"])   # phi3: views of its fused matrices
def test_matrices_stay_in_the_memory_map(tmp_path, dtype, model_type):
    config = tiny_config(model_type, hidden_size=256, intermediate_size=512, vocab_size=1024,
                         num_attention_heads=16, num_key_value_heads=8)
    model = Model(config, half_checkpoint(tmp_path, config, dtype))
    layer = model.layers[0]
    matrices = [model.embed, model.lm_head, layer.wq, layer.wk, layer.wv, layer.wo,
                layer.w_gate, layer.w_up, layer.w_down]
    for w in matrices:
        assert isinstance(w, HalfTensor) and w.bf16 == (dtype == "bf16")
        assert memmap_backed(w.bits)   # a view of the file, not a copy
    # what was widened at load: the norms and biases, a small share of the model
    widened = sum(a.nbytes for l in model.layers for a in (l.input_norm, l.post_norm, l.bq, l.bk, l.bv))
    assert widened < 0.01 * sum(l.nbytes for l in model.layers)
