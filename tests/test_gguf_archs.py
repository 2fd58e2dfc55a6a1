"""GGUF import of gemma3, phi3, smollm3 and qwen3moe against llama.cpp's own converter: the
transformers fixtures converted by convert_hf_to_gguf.py (tests/fixtures/make_gguf_fixtures.py), and
the logits transformers computes for them as llama.cpp reads the file."""
from pathlib import Path

import gguf
import numpy as np
import pytest

import nibble.formats.gguf as fg
from nibble.formats import families
from nibble.formats.catalog import Details, describe
from nibble.formats.gguf import import_gguf
from nibble.formats.safetensors import read_checkpoint
from nibble.quant.affine import dequantize
from nibble.quant.convert import read_linear
from nibble.runner.model import Model

DATA = Path(__file__).parent / "data"
NAMES = ["gemma3-text", "phi3-longrope", "smollm3", "qwen3-moe"]
QUANTIZED = ["qwen3-moe-q8_0"]   # the same weights as qwen3-moe, Q8_0


def imported(name: str, repack_blocks: bool = True):
    return import_gguf(DATA / "gguf" / f"{name}.gguf", repack_blocks).model


def test_every_gguf_fixture_is_tested():
    assert sorted(p.name.removesuffix(".gguf") for p in (DATA / "gguf").glob("*.gguf")) == sorted(NAMES + QUANTIZED)


def as_converted(name: str) -> dict:
    """The transformers fixture's tensors as the GGUF fixture holds them: qwen3-moe's experts
    stacked as MLX's switch_mlp, and its dense layer 1 with layer 0's router and experts (llama.cpp
    has experts in every layer)."""
    t = read_checkpoint(DATA / "transformers" / name)
    if name != "qwen3-moe":
        return t
    out = {k: v for k, v in t.items() if ".mlp." not in k}
    for i in range(3):
        p = f"model.layers.{0 if i == 1 else i}.mlp."
        out[f"model.layers.{i}.mlp.gate.weight"] = t[p + "gate.weight"]
        for k in ("gate_proj", "up_proj", "down_proj"):
            out[f"model.layers.{i}.mlp.switch_mlp.{k}.weight"] = np.stack(
                [np.asarray(t[f"{p}experts.{e}.{k}.weight"], np.float32) for e in range(8)])
    return out


@pytest.mark.parametrize("name", NAMES)
def test_tensors_are_the_hugging_face_ones(name):
    """Every tensor back under its Hugging Face name with its values: gemma3's norms without the
    1 the converter added, phi3's qkv and gate_up still fused, smollm3's q/k unpermuted,
    qwen3moe's experts stacked."""
    want = as_converted(name)
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
    gemma3, phi3, smollm3 = (imported(n).config for n in ("gemma3-text", "phi3-longrope", "smollm3"))
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


def test_qwen3moe_as_llama_cpp_runs_it():
    """Experts in every layer (the fixture's mlp_only_layers is not in the file), the top 2 of 8
    renormalised whatever the Hugging Face config said (llama.cpp's build_moe_ffn for qwen3moe)."""
    c = imported("qwen3-moe").config
    assert (c.model_type, c.extra["num_experts"], c.extra["num_experts_per_tok"]) == ("qwen3_moe", 8, 2)
    assert c.extra["moe_intermediate_size"] == 32 and c.extra["norm_topk_prob"]
    assert c.extra["mlp_only_layers"] == [] and c.extra["decoder_sparse_step"] == 1
    assert (c.head_dim, c.intermediate_size, c.windows) == (32, 128, [0, 0, 0])
    # the expert width where the file has none: feed_forward_length / expert_used_count
    fields = families.gguf_arch("qwen3moe").fields
    meta = {"qwen3moe.expert_count": 128, "qwen3moe.expert_used_count": 8, "qwen3moe.feed_forward_length": 6144}
    assert fields(meta, "qwen3moe.", 48, 64, 128)["extra"]["moe_intermediate_size"] == 768


def test_quantized_experts_are_the_dequantized_ones():
    """The Q8_0 file's matrices (the experts stacked) repacked exactly: each, dequantized, is
    gguf's dequantization, as the float import holds it; and the model runs as that float import
    (x rounded to int8 blocks, where the CPU multiplies bytes, moves the logits by 3% of their
    scale on this random model)."""
    path = DATA / "gguf" / "qwen3-moe-q8_0.gguf"
    md, floats = imported("qwen3-moe-q8_0"), imported("qwen3-moe-q8_0", repack_blocks=False)
    raw = {fg._hf_name(t.name, families.gguf_arch("qwen3moe")): t for t in gguf.GGUFReader(path).tensors}
    assert md.config.quantization == {"group_size": 32, "bits": 8, "mode": "affine"}
    for name, w in floats.tensors.items():
        path_ = name.removesuffix(".weight")
        if f"{path_}.scales" not in md.tensors:
            assert raw[name].tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(md.tensors[name], w, err_msg=name)
            continue
        np.testing.assert_array_equal(w, gguf.quants.dequantize(raw[name].data, raw[name].tensor_type), err_msg=name)
        qt = read_linear(md.tensors, md.config.quantization, path_)
        experts = [qt] if w.ndim == 2 else [qt._replace(weight=qt.weight[e], scales=qt.scales[e],
                                                        biases=qt.biases[e]) for e in range(len(w))]
        np.testing.assert_array_equal(np.stack([dequantize(x) for x in experts]).reshape(w.shape), w, err_msg=name)
    tokens = np.load(DATA / "transformers" / "qwen3-moe" / "tokens.npy")
    got, want = (Model(m.config, m.tensors) for m in (md, floats))
    got, want = (m.forward(tokens, m.new_cache(), all_logits=True) for m in (got, want))
    assert np.abs(got - want).max() / np.abs(want).max() < 5e-2
    assert (got.argmax(1) == want.argmax(1)).all()


def test_describe_a_mixture_of_experts():
    """nibble ls's columns from the header alone: every expert counted."""
    path = DATA / "gguf" / "qwen3-moe-q8_0.gguf"
    weights = sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(path).tensors)
    assert describe(path) == Details("gguf", "qwen3moe", weights, "Q8_0")
    assert weights > 3 * 3 * 8 * 32 * 64   # the experts alone
