"""config.json as transformers 4 and 5 write it, read into one ModelConfig."""
import pytest

from nibble.formats.config import ModelConfig
from nibble.formats.errors import FormatError

BASE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 256}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def config(**fields) -> ModelConfig:
    return ModelConfig.from_dict(BASE | fields)


def test_both_spellings_give_the_same_config():
    old = config(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3}, torch_dtype="float32")
    new = config(rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", **LLAMA3}, dtype="float32")
    assert (new.rope_theta, new.rope_scaling) == (500000.0, {"rope_type": "llama3", **LLAMA3})
    assert (old.rope_theta, old.rope_scaling) == (new.rope_theta, new.rope_scaling)
    assert new.extra == {"dtype": "float32"} and "rope_parameters" not in new.to_dict()
    assert ModelConfig.from_dict(new.to_dict()) == new


def test_plain_rope_and_the_old_type_key():
    assert config(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}).rope_scaling is None
    assert config(rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling == {
        "rope_type": "linear", "factor": 2.0}
    # transformers: rope_scaling over rope_parameters, the block's theta over the top-level one
    c = config(rope_theta=1.0, rope_parameters={"rope_theta": 2.0, "rope_type": "default"},
               rope_scaling={"rope_type": "linear", "factor": 3.0})
    assert (c.rope_theta, c.rope_scaling) == (1.0, {"rope_type": "linear", "factor": 3.0})


def test_scaled_types_default_their_original_context():
    c = config(rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert c.rope_scaling["original_max_position_embeddings"] == 256


def test_rope_per_layer_type():
    block = {"rope_theta": 1e6, "rope_type": "default"}
    same = config(rope_parameters={"full_attention": block, "sliding_attention": block})
    assert (same.rope_theta, same.rope_scaling) == (1e6, None)
    with pytest.raises(FormatError, match="rope_parameters differ between layer types"):
        config(rope_parameters={"full_attention": block,
                                "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}})


@pytest.mark.parametrize("fields, message", [
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}},
     "unsupported rope_type 'su': nibble runs default, dynamic, linear, llama3, yarn, longrope"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
     "rope_type 'llama3' needs low_freq_factor, high_freq_factor in rope_parameters"),
    ({"rope_scaling": {"type": "yarn"}}, "rope_type 'yarn' needs factor"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 3}},
     "rope_parameters.long_factor has 3 values, the 16 rotated dims of a head need 8"),
    # transformers rotates whole heads but in phi3, whatever the config says
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "nibble cannot run partial_rotary_factor=0.5 for llama \\(transformers' llama rotates whole heads\\)"),
    ({"model_type": "smollm3", "partial_rotary_factor": 0.25}, "partial_rotary_factor=0.25 for smollm3"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.1}, "partial_rotary_factor=0.1 rotates 1 of 16 dims"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "llama3", **LLAMA3}},
     "phi3 runs default or longrope RoPE, not 'llama3'"),
    ({"model_type": "smollm3", "no_rope_layers": [1, 1, 0]}, "no_rope_layers has 3 entries for 4 layers"),
    ({"model_type": "smollm3", "attention_bias": True}, "attention_bias=True for smollm3"),
    ({"attention_bias": True}, "attention_bias=True for llama \\(transformers gives its o_proj a bias too\\)"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=True for qwen3"),
    ({"hidden_act": "gelu"}, "nibble cannot run hidden_act='gelu' \\(it runs 'silu' or 'swish'\\)"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"rope_parameters": [10000.0]}, "rope_parameters is \\[10000.0\\], not an object"),
    ({"model_type": "mistral3", "text_config": {"model_type": "mistral"}},
     "unsupported architecture 'mistral3' \\(a wrapper around a 'mistral' text model in text_config\\): "
     "nibble runs bert, gemma3_text, gpt_oss, granitemoe, granitemoeshared, llama, mistral, mixtral, olmoe, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, roberta, smollm3, xlm-roberta"),
])
def test_fields_that_would_change_the_numbers_are_named(fields, message):
    with pytest.raises(FormatError, match=message):
        config(**fields)


def test_harmless_fields_are_kept():
    fields = {"hidden_act": "silu", "mlp_bias": False, "attention_dropout": 0.1, "pretraining_tp": 2,
              "use_cache": True, "transformers_version": "5.0.0", "architectures": ["LlamaForCausalLM"]}
    assert config(**fields).extra == fields


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_windows_follow_layer_types_and_use_sliding_window(model_type):
    qwen2 = {"model_type": model_type, "sliding_window": 8}
    assert config(**qwen2).windows == [0, 0, 0, 0]   # use_sliding_window defaults to false
    no_size = {"model_type": model_type, "use_sliding_window": True, "max_window_layers": 3}
    assert config(**no_size).windows == [0, 0, 0, 4096]   # the config class's default window
    assert config(**qwen2, use_sliding_window=True, max_window_layers=2).windows == [0, 0, 8, 8]
    assert config(**qwen2, use_sliding_window=True,
                  layer_types=["sliding_attention", "full_attention"] * 2).windows == [8, 0, 8, 0]
    assert config(**qwen2, use_sliding_window=False,
                  layer_types=["sliding_attention"] * 4).windows == [0, 0, 0, 0]


def test_qwen3_head_dim_defaults_to_128():
    """Qwen3Config's default, not hidden_size / num_attention_heads as for the others."""
    assert config(model_type="qwen3").head_dim == 128
    assert config(model_type="qwen3", head_dim=32).head_dim == 32
    assert config(model_type="qwen2").head_dim == config(model_type="qwen2").hidden_size // 4


def test_mistral_slides_everywhere_and_llama_nowhere():
    assert config(model_type="mistral", sliding_window=8).windows == [8] * 4
    assert config(model_type="mistral", sliding_window=None).windows == [0] * 4
    assert config(model_type="mistral").windows == [4096] * 4   # MistralConfig's default
    assert not config(model_type="mistral", attention_bias=True).attention_bias   # never biases
    assert config(model_type="llama", sliding_window=8).windows == [0] * 4
    with pytest.raises(FormatError, match="layer_types asks for full attention in some layers, but "
                                          "transformers runs mistral with sliding_window in every layer"):
        config(model_type="mistral", sliding_window=8, layer_types=["full_attention", "sliding_attention"] * 2)
    with pytest.raises(FormatError, match="layer_types asks for sliding attention"):
        config(layer_types=["sliding_attention"] * 4)


@pytest.mark.parametrize("layer_types, message", [
    (["full_attention"] * 3, "layer_types has 3 entries for 4 layers"),
    (["full_attention", "chunked_attention"] * 2, "layer_types 'chunked_attention' are not run"),
])
def test_bad_layer_types_are_named(layer_types, message):
    with pytest.raises(FormatError, match=message):
        config(layer_types=layer_types)


GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128,
          "sliding_window": 8}


def test_gemma3_both_spellings_give_the_same_config():
    """transformers 4: rope_theta and rope_scaling (the global layers'), rope_local_base_freq and
    sliding_window_pattern; transformers 5: a rope_parameters block per layer type, layer_types."""
    old = ModelConfig.from_dict(GEMMA3 | {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                          "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                          "sliding_window_pattern": 2})
    new = ModelConfig.from_dict(GEMMA3 | {
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    for c in old, new:
        assert (c.rope_theta, c.rope_scaling, c.rope_local_base_freq) == (
            1e6, {"rope_type": "linear", "factor": 8.0}, 1e4)
        assert c.layer_types == ["sliding_attention", "full_attention"] * 2
        assert c.windows == [8, 0, 8, 0]
        assert ModelConfig.from_dict(c.to_dict()) == c


def test_gemma3_fields_left_out_take_gemma3_text_config_defaults():
    """Hub configs saved by transformers 4 leave out what equals Gemma3TextConfig's defaults."""
    c = ModelConfig.from_dict({"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1})
    assert (c.head_dim, c.vocab_size, c.tie_word_embeddings, c.query_pre_attn_scalar) == (256, 262208, True, 256)
    assert (c.rope_theta, c.rope_local_base_freq, c.rope_scaling) == (1e6, 1e4, None)
    assert c.windows == [4096] * 5 + [0, 4096]   # every 6th layer global
    assert (c.max_position_embeddings, c.rms_norm_eps, c.eos_ids) == (131072, 1e-6, [1])


@pytest.mark.parametrize("fields, message", [
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention is .*: nibble runs gemma3_text's sliding layers with plain RoPE"),
    ({"attention_bias": True}, "attention_bias=True for gemma3"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu' \\(it runs 'gelu_pytorch_tanh'\\)"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
])
def test_gemma3_fields_nibble_does_not_run_are_named(fields, message):
    with pytest.raises(FormatError, match=message):
        ModelConfig.from_dict(GEMMA3 | fields)


WRAPPER = {"model_type": "gemma3", "text_config": GEMMA3, "eos_token_id": [1, 106],
           "quantization": {"group_size": 64, "bits": 4}, "vision_config": {"model_type": "siglip_vision_model"}}


def test_a_gemma3_wrapper_is_read_as_its_text_model():
    c = ModelConfig.from_dict(WRAPPER)
    assert c.model_type == "gemma3_text" and c.hidden_size == 64
    # the outer config's eos and mlx-lm's quantization hold where text_config says nothing
    assert c.eos_ids == [1, 106] and c.quantization == {"group_size": 64, "bits": 4}
    assert "vision_config" not in c.extra
    # transformers 5 ties the head by the outer flag, tied when absent (Gemma3Config's default)
    assert c.tie_word_embeddings
    text_untied = WRAPPER | {"text_config": GEMMA3 | {"tie_word_embeddings": False}}
    assert ModelConfig.from_dict(text_untied).tie_word_embeddings
    assert not ModelConfig.from_dict(WRAPPER | {"tie_word_embeddings": False}).tie_word_embeddings


def test_a_gemma3_wrapper_around_another_text_model_is_refused():
    with pytest.raises(FormatError, match="a 'gemma3' wrapper around a 'llama' text model in text_config: "
                                          "nibble runs the 'gemma3_text' in 'gemma3'"):
        ModelConfig.from_dict(WRAPPER | {"text_config": BASE})


LONGROPE = {"short_factor": [1.0] * 6, "long_factor": [2.0] * 6}   # 12 rotated dims of 16


def test_phi3_partial_rotary():
    """Phi-4-mini's top-level partial_rotary_factor; transformers 5 writes it in rope_parameters
    too, and that one wins."""
    c = config(model_type="phi3", partial_rotary_factor=0.75)
    assert (c.rotary_dim, c.head_dim) == (12, 16)
    c = config(model_type="phi3", partial_rotary_factor=0.75,
               rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5})
    assert c.rotary_dim == 8
    assert ModelConfig.from_dict(c.to_dict()) == c
    assert config().rotary_dim == config(partial_rotary_factor=1.0).rotary_dim == 16


def test_phi3_longrope_as_phi3config_reads_it():
    """"su" and "yarn" are Phi3Config's old names for longrope; a longrope block's context is the
    top-level original_max_position_embeddings (Phi3Config's default: 4096), whatever it says."""
    phi3 = {"model_type": "phi3", "partial_rotary_factor": 0.75, "max_position_embeddings": 8192}
    c = config(**phi3, rope_scaling={"type": "longrope", **LONGROPE})
    assert c.rope_scaling == {"rope_type": "longrope", "original_max_position_embeddings": 4096, **LONGROPE}
    c = config(**phi3, original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "original_max_position_embeddings": 32, **LONGROPE})
    assert c.rope_scaling["original_max_position_embeddings"] == 64
    assert ModelConfig.from_dict(c.to_dict()) == c
    for old in ("su", "yarn"):
        c = config(**phi3, rope_scaling={"type": old, "original_max_position_embeddings": 32, **LONGROPE})
        assert c.rope_scaling == {"rope_type": "longrope", "original_max_position_embeddings": 32, **LONGROPE}
    with pytest.raises(FormatError, match="short_factor has 8 values, the 12 rotated dims of a head need 6"):
        config(**phi3, rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 6})


def test_phi3_slides_in_every_layer():
    assert config(model_type="phi3", sliding_window=8).windows == [8] * 4
    assert config(model_type="phi3").windows == [0] * 4


def test_defaults_of_the_config_classes():
    """A field left out means what transformers' class for that model_type says."""
    assert config(model_type="phi3").rms_norm_eps == 1e-5
    assert config().rms_norm_eps == 1e-6
    fields = {k: v for k, v in BASE.items() if k not in ("num_key_value_heads", "max_position_embeddings")}
    c = ModelConfig.from_dict(fields | {"model_type": "smollm3"})
    assert (c.rope_theta, c.num_key_value_heads, c.max_position_embeddings, c.tie_word_embeddings) == (
        2000000.0, 4, 32768, True)


def test_smollm3_rope_and_windows_per_layer():
    """no_rope_layers (1: RoPE), by default every no_rope_layer_interval-th layer without; the
    layers without it slide by default, with use_sliding_window; layer_types says otherwise."""
    smol = {"model_type": "smollm3", "num_hidden_layers": 8, "sliding_window": 6}
    c = config(**smol)
    assert c.rope_layers == [True, True, True, False] * 2 and c.windows == [0] * 8
    c = config(**smol, no_rope_layer_interval=2, use_sliding_window=True)
    assert c.rope_layers == [True, False] * 4 and c.windows == [0, 6] * 4
    c = config(**smol, no_rope_layers=[1, 0, 0, 1, 1, 1, 1, 1, 0], use_sliding_window=True)
    assert c.rope_layers == [True, False, False, True, True, True, True, True]
    assert c.windows == [0, 6, 6, 0, 0, 0, 0, 0]
    c = config(**smol, layer_types=["sliding_attention"] + ["full_attention"] * 7)
    assert c.windows == [6] + [0] * 7   # transformers' mask slides there, use_sliding_window or not
    assert config(model_type="llama", no_rope_layers=[0] * 4).rope_layers == [True] * 4
