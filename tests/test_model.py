"""The whole forward pass of tiny random models against the numpy reference."""
import numpy as np
import pytest

from nibble.formats.errors import NibbleError
from nibble.runner.model import ContextFull, Model
from tests import reference
from tests.tiny import tiny_config, tiny_tensors

TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "smollm3"]


@pytest.mark.parametrize("model_type", TYPES)
def test_prefill_matches_reference(model_type):
    config = tiny_config(model_type)
    tensors = tiny_tensors(config)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 20)
    model = Model(config, tensors)
    got = model.forward(tokens, model.new_cache(64), all_logits=True)
    want = reference.forward(config, tensors, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", TYPES)
def test_prefill_then_decode_matches_reference(model_type):
    """A prompt prefilled as a batch, then one token at a time through the cache."""
    config = tiny_config(model_type)
    tensors = tiny_tensors(config)
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, 16)
    want = reference.forward(config, tensors, tokens)
    model = Model(config, tensors)
    cache = model.new_cache(32)
    got = [model.forward(tokens[:5], cache)[-1]]
    for t in tokens[5:]:
        got.append(model.forward([t], cache)[0])
    np.testing.assert_allclose(np.array(got), want[4:], rtol=1e-4, atol=1e-4)
    assert cache.pos == 16 and cache.ids == list(tokens)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16,
     "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
    # 40 tokens: the short factors below position 16, the long ones from there on
    {"rope_type": "longrope", "original_max_position_embeddings": 16,
     "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0], "long_factor": [1, 2, 3, 4, 5, 6, 7, 8]},
])
def test_rope_scaling_matches_reference(scaling):
    config = tiny_config("llama", rope_scaling=scaling)
    tensors = tiny_tensors(config)
    tokens = np.arange(40) % config.vocab_size
    model = Model(config, tensors)
    got = model.forward(tokens, model.new_cache(), all_logits=True)
    np.testing.assert_allclose(got, reference.forward(config, tensors, tokens), rtol=1e-4, atol=1e-4)


def test_sliding_and_full_layers_match_reference():
    """qwen2 with a window of 4 in its second layer only, as layer_types says."""
    config = tiny_config("qwen2", sliding_window=4, use_sliding_window=True,
                         layer_types=["full_attention", "sliding_attention"])
    assert config.windows == [0, 4]
    tensors = tiny_tensors(config)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, 20)
    model = Model(config, tensors)
    cache = model.new_cache(32)
    got = [model.forward(tokens[:12], cache, all_logits=True)]
    got += [model.forward([t], cache) for t in tokens[12:]]
    np.testing.assert_allclose(np.concatenate(got), reference.forward(config, tensors, tokens),
                               rtol=1e-4, atol=1e-4)


def test_phi3_splits_its_fused_matrices_into_views():
    """q/k/v and gate/up are blocks of rows of the stored matrices, not copies."""
    config = tiny_config("phi3")
    tensors = tiny_tensors(config)
    layer = Model(config, tensors).layers[1]
    qkv, gate_up = (tensors[f"model.layers.1.{n}.weight"] for n in ("self_attn.qkv_proj", "mlp.gate_up_proj"))
    np.testing.assert_array_equal(np.concatenate([layer.wq, layer.wk, layer.wv]), qkv)
    np.testing.assert_array_equal(np.concatenate([layer.w_gate, layer.w_up]), gate_up)
    assert all(np.shares_memory(w, qkv) for w in (layer.wq, layer.wk, layer.wv))
    assert all(np.shares_memory(w, gate_up) for w in (layer.w_gate, layer.w_up))


def test_phi3_missing_fused_matrix_is_named():
    config = tiny_config("phi3")
    tensors = tiny_tensors(config)
    del tensors["model.layers.0.self_attn.qkv_proj.weight"]
    with pytest.raises(NibbleError, match="missing for the config: model.layers.0.self_attn.qkv_proj.weight"):
        Model(config, tensors)


def test_context_full_names_both_numbers():
    config = tiny_config()
    model = Model(config, tiny_tensors(config))
    with pytest.raises(ContextFull, match="12 tokens do not fit in the context of 8"):
        model.forward(np.zeros(12, int), model.new_cache(8))


def test_missing_and_misshapen_tensors_are_named():
    from nibble.formats.errors import FormatError
    config = tiny_config()
    tensors = tiny_tensors(config)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(FormatError, match="missing for the config: model.layers.1.mlp.up_proj.weight"):
        Model(config, tensors)
    tensors = tiny_tensors(config)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10]
    with pytest.raises(FormatError, match=r"model.norm.weight has shape \[10\]"):
        Model(config, tensors)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3", "smollm3"])
def test_int8_kv_cache_stays_close(model_type):
    config = tiny_config(model_type)
    tensors = tiny_tensors(config)
    tokens = np.random.default_rng(4).integers(0, config.vocab_size, 12)
    model = Model(config, tensors)
    f32 = model.forward(tokens, model.new_cache(16), all_logits=True)
    int8 = model.forward(tokens, model.new_cache(16, "int8"), all_logits=True)
    assert np.abs(int8 - f32).max() < 0.05 * np.abs(f32).max()
    assert (int8.argmax(-1) == f32.argmax(-1)).mean() > 0.9


def test_unknown_kv_cache_type():
    from nibble.formats.errors import NibbleError
    config = tiny_config()
    with pytest.raises(NibbleError, match="unknown KV cache type 'fp8': choose f32 or int8"):
        Model(config, tiny_tensors(config)).new_cache(8, "fp8")


def test_a_cache_made_before_the_layers_moved_is_refused():
    model = Model(tiny_config(), tiny_tensors(tiny_config()))
    cache = model.new_cache(8)
    model.offload_layers(0)   # the stages are laid out anew (all on the CPU here)
    with pytest.raises(NibbleError, match="new_cache"):
        model.forward([1, 2], cache)
    model.forward([1, 2], model.new_cache(8))


def test_gemma3_embedding_scale_is_in_the_checkpoints_dtype():
    """transformers multiplies by sqrt(hidden_size) cast to the weights' dtype: sqrt(128) =
    11.3137 is 11.3125 in bf16 and f16; a quantized embedding takes the dtype config.json names."""
    from nibble.formats.half import HalfTensor
    from nibble.quant.affine import AffineScheme, quantize
    from nibble.runner.models.gemma3 import Gemma3
    gemma3 = Gemma3()
    config = tiny_config("gemma3_text")
    bits = np.zeros((2, 64), np.uint16)
    assert gemma3.embed_scale(config, np.zeros((2, 64), np.float32)) == np.float32(np.sqrt(128))
    assert gemma3.embed_scale(config, HalfTensor(bits, bf16=True)) == 11.3125
    assert gemma3.embed_scale(config, HalfTensor(bits, bf16=False)) == 11.3125
    quantized = quantize(np.ones((2, 64), np.float32), AffineScheme(8, 64))
    assert gemma3.embed_scale(config, quantized) == np.float32(np.sqrt(128))
    bf16_config = tiny_config("gemma3_text", torch_dtype="bfloat16")
    assert gemma3.embed_scale(bf16_config, quantized) == 11.3125
