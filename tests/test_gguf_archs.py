"""GGUF import of gemma3, phi3 and smollm3 against llama.cpp's own converter: the transformers
fixtures converted by convert_hf_to_gguf.py (tests/fixtures/make_gguf_fixtures.py), and the logits
transformers computes for them as llama.cpp reads the file."""
from pathlib import Path

import numpy as np
import pytest

import nibble.formats.gguf as fg
from nibble.formats import families
from nibble.formats.gguf import import_gguf
from nibble.formats.safetensors import read_checkpoint
from nibble.runner.model import Model

DATA = Path(__file__).parent / "data"
NAMES = ["gemma3-text", "phi3-longrope", "smollm3"]


def imported(name: str):
    return import_gguf(DATA / "gguf" / f"{name}.gguf").model


def test_every_gguf_fixture_is_tested():
    assert sorted(p.name.removesuffix(".gguf") for p in (DATA / "gguf").glob("*.gguf")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_tensors_are_the_hugging_face_ones(name):
    """Every tensor back under its Hugging Face name with its values: gemma3's norms without the
    1 the converter added, phi3's qkv and gate_up still fused, smollm3's q/k unpermuted."""
    want = read_checkpoint(DATA / "transformers" / name)
    got = imported(name).tensors
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32),
                                   rtol=0, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    model = imported(name)
    tokens = np.load(DATA / "transformers" / name / "tokens.npy")
    want = np.load(DATA / "gguf" / f"{name}.logits.npy")
    m = Model(model.config, model.tensors)
    got = m.forward(tokens, m.new_cache(), all_logits=True)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_llama_cpp_settings_where_the_file_has_none():
    """What llama.cpp runs, not what the Hugging Face config said: gemma3 global every 6th layer
    and scores by 1/sqrt(head_dim); phi3 without its window; smollm3 NoPE every 4th layer."""
    gemma3, phi3, smollm3 = (imported(n).config for n in NAMES)
    assert gemma3.model_type == "gemma3_text"
    assert gemma3.windows == [6, 6, 6] and gemma3.query_pre_attn_scalar == 16
    assert gemma3.rope_local_base_freq == 10000.0 and gemma3.rope_theta == 1000000.0
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert phi3.windows == [0, 0] and phi3.partial_rotary_factor == 0.75
    assert phi3.rope_scaling["rope_type"] == "longrope"
    assert phi3.rope_scaling["original_max_position_embeddings"] == 16
    assert smollm3.rope_layers == [True, True, True] and smollm3.windows == [0, 0, 0]


def test_gemma3_and_smollm3_layers_beyond_the_fixtures():
    """The 3-layer fixtures hold no global gemma3 layer and no NoPE smollm3 layer: llama.cpp's
    defaults at more layers, and a per-layer pattern where the file has one."""
    meta = {"gemma3.attention.sliding_window": 512}
    layers = families.gguf_arch("gemma3").fields(meta, "gemma3.", 7, 16, 16)["layer_types"]
    assert [t[0] for t in layers] == list("sssssfs")   # every 6th layer global
    meta["gemma3.attention.sliding_window_pattern"] = [True, False, True]
    layers = families.gguf_arch("gemma3").fields(meta, "gemma3.", 3, 16, 16)["layer_types"]
    assert [t[0] for t in layers] == list("sfs")
    assert families.gguf_arch("gemma3").fields(meta, "gemma3.", 62, 168, 128)["query_pre_attn_scalar"] == 168   # 27B
    assert families.gguf_arch("smollm3").fields({}, "smollm3.", 8, 16, 16)["no_rope_layers"] == [1, 1, 1, 0, 1, 1, 1, 0]
