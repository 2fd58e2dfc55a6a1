"""GGUF import of gemma3, phi3, smollm3 and the mixtures of experts (qwen3moe, qwen2moe, Mixtral
as llama, olmoe, granitemoe, gpt-oss with its MXFP4 experts) against llama.cpp's own converter: the transformers fixtures
converted by convert_hf_to_gguf.py (tests/fixtures/make_gguf_fixtures.py), and the logits
transformers computes for them as llama.cpp reads the file."""
import math
import re
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
from nibble.runner.models.granitemoe import MULTIPLIERS
from tests import reference
from tests.test_gguf import permute

DATA = Path(__file__).parent / "data"
NAMES = ["gemma3-text", "phi3-longrope", "smollm3", "qwen3-moe", "qwen2-moe", "mixtral", "olmoe",
         "granitemoe", "granitemoeshared"]
QUANTIZED = ["qwen3-moe-q8_0", "granitemoeshared-q8_0"]   # the same weights, Q8_0
STORED_QUANTIZED = ["gpt-oss-mxfp4"]   # converted from a checkpoint whose experts are MXFP4
EACH = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}   # Mixtral's names of an expert's matrices


def imported(name: str, repack_blocks: bool = True):
    return import_gguf(DATA / "gguf" / f"{name}.gguf", repack_blocks).model


def test_every_gguf_fixture_is_tested():
    assert sorted(p.name.removesuffix(".gguf") for p in (DATA / "gguf").glob("*.gguf")) == sorted(
        NAMES + QUANTIZED + STORED_QUANTIZED)


def as_converted(name: str) -> dict:
    """The transformers fixture's tensors as the GGUF fixture holds them: experts stacked as MLX's
    switch_mlp (granite's fused gate and up split); qwen3-moe's dense layer 1 with layer 0's router
    and experts (llama.cpp has experts in every layer); olmoe's 2 key/value heads repeated for the
    query heads that share them (llama.cpp's olmoe has as many as query heads)."""
    t = {k: np.asarray(v, np.float32) for k, v in read_checkpoint(DATA / "transformers" / name).items()}
    if name == "qwen3-moe":
        t = {k: v for k, v in t.items() if not k.startswith("model.layers.1.mlp.")}
        t |= {k.replace("layers.0.", "layers.1.", 1): v for k, v in t.items() if k.startswith("model.layers.0.mlp.")}
    if name == "olmoe":
        t |= {k: np.repeat(v.reshape(2, -1, *v.shape[1:]), 2, axis=0).reshape(-1, *v.shape[1:])
              for k, v in t.items() if k.endswith(("k_proj.weight", "v_proj.weight", "k_norm.weight"))}
    out, experts = {}, {}
    for k, v in t.items():
        if m := re.fullmatch(r"(.+)\.experts\.(\d+)\.(\w+)\.weight", k):
            experts.setdefault(f"{m[1]}.switch_mlp.{EACH.get(m[3], m[3])}.weight", {})[int(m[2])] = v
        elif k.endswith("block_sparse_moe.input_linear.weight"):   # gate's rows, then up's
            p, F = k.removesuffix("input_linear.weight") + "switch_mlp.", v.shape[1] // 2
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = v[:, :F], v[:, F:]
        else:
            out[k.replace("block_sparse_moe.output_linear", "block_sparse_moe.switch_mlp.down_proj")] = v
    return out | {k: np.stack([each[e] for e in sorted(each)]) for k, each in experts.items()}


@pytest.mark.parametrize("name", NAMES)
def test_tensors_are_the_hugging_face_ones(name):
    """Every tensor back under its Hugging Face name with its values: gemma3's norms without the
    1 the converter added, phi3's qkv and gate_up still fused, smollm3's, mixtral's and granite's
    q/k unpermuted, the experts stacked, granitemoeshared's shared gate and up fused again."""
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
    assert (c.model_type, c.num_experts, c.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert c.moe_intermediate_size == 32 and c.norm_topk_prob
    assert c.mlp_only_layers == [] and c.decoder_sparse_step == 1
    assert (c.head_dim, c.intermediate_size, c.windows) == (32, 128, [0, 0, 0])
    # the expert width where the file has none: feed_forward_length / expert_used_count
    fields = families.gguf_arch("qwen3moe").fields
    meta = {"qwen3moe.expert_count": 128, "qwen3moe.expert_used_count": 8, "qwen3moe.feed_forward_length": 6144}
    assert fields(meta, "qwen3moe.", 48, 64, 128)["moe_intermediate_size"] == 768


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_experts_are_the_dequantized_ones(name):
    """The Q8_0 file's matrices (the experts stacked, granitemoeshared's shared gate and up
    joined) repacked exactly: each, dequantized, is gguf's dequantization, as the float import
    holds it."""
    path = DATA / "gguf" / f"{name}.gguf"
    md, floats = imported(name), imported(name, repack_blocks=False)
    layout = families.gguf_arch(gguf.GGUFReader(path).fields["general.architecture"].contents())
    raw = {}   # Hugging Face name -> the GGUF tensors it is the rows of
    for t in gguf.GGUFReader(path).tensors:
        raw.setdefault(fg._hf_name(t.name, layout), []).append(t)
    assert md.config.quantization == {"group_size": 32, "bits": 8, "mode": "affine"}
    for hf, w in floats.tensors.items():
        module = hf.removesuffix(".weight")
        if f"{module}.scales" not in md.tensors:
            assert {t.tensor_type for t in raw[hf]} <= set(fg.FLOAT_TYPES)
            np.testing.assert_array_equal(np.asarray(md.tensors[hf], np.float32), np.asarray(w, np.float32), err_msg=hf)
            continue
        parts = sorted(raw[hf], key=lambda t: "ffn_up_shexp" in t.name)   # a fused matrix: gate's rows first
        c, as_stored = md.config, w   # q/k rows as the converter permuted them, for llama.cpp's rope
        if layout.permuted_qk and hf.endswith(("q_proj.weight", "k_proj.weight")):
            as_stored = permute(w, c.num_attention_heads, c.num_key_value_heads if "k_proj" in hf else None)
        np.testing.assert_array_equal(
            as_stored, np.concatenate([gguf.quants.dequantize(t.data, t.tensor_type) for t in parts]), err_msg=hf)
        qt = read_linear(md.tensors, md.config.quantization, module)
        experts = [qt] if w.ndim == 2 else [qt._replace(weight=qt.weight[e], scales=qt.scales[e],
                                                        biases=qt.biases[e]) for e in range(len(w))]
        np.testing.assert_array_equal(np.stack([dequantize(x) for x in experts]).reshape(w.shape), w, err_msg=hf)


def test_a_quantized_mixture_runs_as_its_float_import():
    """granitemoeshared's Q8_0 file (stacked experts, a shared expert) runs as its float import:
    x rounded to int8 blocks, where the CPU multiplies bytes, moves the logits by a few percent
    of their scale on the random model. (One file: qwen3-moe's runs the same kernels.)"""
    name = "granitemoeshared-q8_0"
    md, floats = imported(name), imported(name, repack_blocks=False)
    tokens = np.load(DATA / "transformers" / name.removesuffix("-q8_0") / "tokens.npy")
    got, want = (Model(m.config, m.tensors) for m in (md, floats))
    got, want = (m.forward(tokens, m.new_cache(), all_logits=True) for m in (got, want))
    assert np.abs(got - want).max() / np.abs(want).max() < 5e-2
    assert (got.argmax(1) == want.argmax(1)).all()


def test_gpt_oss_as_llama_cpp_runs_it():
    """gpt-oss as llama.cpp's converter writes it from OpenAI's checkpoint: the MXFP4 experts kept,
    every weight the checkpoint's; sinks, router and expert biases under the names the family
    reads; llama.cpp's SwiGLU limit of 7 whatever the checkpoint said. Its logits are transformers'
    under llama.cpp's reading, within what the int8 activations of quantized weights move these
    tiny random mixtures (about 1%), and every argmax."""
    model = imported("gpt-oss-mxfp4")
    c, t = model.config, model.tensors
    assert (c.model_type, c.windows, c.swiglu_limit, c.num_local_experts, c.attention_bias) == (
        "gpt_oss", [4, 0], 7.0, 4, True)
    ckpt = read_checkpoint(DATA / "transformers" / "gpt-oss-mxfp4")
    m = "model.layers.1.mlp."
    stored = lambda name: reference.mxfp4(ckpt[f"{m}experts.{name}_blocks"], ckpt[f"{m}experts.{name}_scales"])
    gate_up = stored("gate_up_proj")
    for name, want in (("gate_proj", gate_up[:, ::2]), ("up_proj", gate_up[:, 1::2]), ("down_proj", stored("down_proj"))):
        qt = read_linear(t, c.quantization, f"{m}switch_mlp.{name}")
        assert qt.values is not None
        for e in range(len(want)):
            expert = qt._replace(**{f: np.asarray(getattr(qt, f))[e] for f in ("weight", "scales", "biases")})
            np.testing.assert_array_equal(dequantize(expert), want[e])
    bias = np.asarray(ckpt[m + "experts.gate_up_proj_bias"], np.float32)
    np.testing.assert_array_equal(t[m + "switch_mlp.up_proj.bias"], bias[:, 1::2])
    np.testing.assert_array_equal(t["model.layers.1.self_attn.sinks.weight"],
                                  np.asarray(ckpt["model.layers.1.self_attn.sinks"], np.float32))
    tokens = np.load(DATA / "transformers" / "gpt-oss-mxfp4" / "tokens.npy")
    want = np.load(DATA / "gguf" / "gpt-oss-mxfp4.logits.npy")
    run = Model(c, t)
    got = run.forward(tokens, run.new_cache(), all_logits=True)
    assert np.abs(got - want).max() / np.abs(want).max() < 3e-2
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_describe_a_mixture_of_experts():
    """nibble ls's columns from the header alone: every expert counted."""
    path = DATA / "gguf" / "qwen3-moe-q8_0.gguf"
    weights = sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(path).tensors)
    assert describe(path) == Details("gguf", "qwen3moe", weights, "Q8_0")
    assert weights > 3 * 3 * 8 * 32 * 64   # the experts alone


def test_moe_families_as_llama_cpp_runs_them():
    """What llama.cpp's graphs run: Mixtral is a llama file with experts (no sliding window:
    llama has none); qwen2moe and olmoe never renormalise the top k; qwen2moe's shared expert and
    q/k/v biases; granitemoe's scales, and its shared variant where the file has a shared width."""
    qwen2, mixtral, olmoe, granite, shared = (imported(n).config for n in NAMES[4:])
    assert (mixtral.model_type, mixtral.num_local_experts, mixtral.num_experts_per_tok,
            mixtral.intermediate_size, mixtral.windows) == ("mixtral", 4, 2, 32, [0, 0])
    assert (qwen2.model_type, qwen2.num_experts, qwen2.num_experts_per_tok) == ("qwen2_moe", 8, 4)
    assert qwen2.moe_intermediate_size == 32 and qwen2.shared_expert_intermediate_size == 48
    assert not qwen2.norm_topk_prob and qwen2.attention_bias
    assert (olmoe.model_type, olmoe.num_experts, olmoe.num_key_value_heads) == ("olmoe", 8, 4)
    assert not olmoe.norm_topk_prob
    assert (granite.model_type, shared.model_type) == ("granitemoe", "granitemoeshared")
    for c in (granite, shared):
        assert [getattr(c, k) for k in MULTIPLIERS] == [6.0, 0.5, 0.1, 2.5] and c.num_local_experts == 4
    assert shared.shared_intermediate_size == 48 and granite.shared_intermediate_size == 0


def test_moe_settings_where_the_file_has_none():
    """llama.cpp's values: a llama file without experts is llama; granitemoe with no scales but
    logit_scale (or 0) scores by 1/sqrt(head_dim) and scales nothing else; qwen2moe's shared
    expert feed_forward_length wide."""
    assert families.gguf_arch("llama").fields({}, "llama.", 2, 16, 16) == {}
    meta = {"granitemoe.expert_count": 4, "granitemoe.expert_used_count": 2, "granitemoe.logit_scale": 8.0,
            "granitemoe.residual_scale": 0.0}
    extra = families.gguf_arch("granitemoe").fields(meta, "granitemoe.", 2, 16, 64)
    assert [extra[k] for k in MULTIPLIERS] == [1.0, 1.0, 1 / math.sqrt(64), 8.0]
    meta = {"qwen2moe.expert_count": 60, "qwen2moe.expert_used_count": 4, "qwen2moe.feed_forward_length": 5632}
    extra = families.gguf_arch("qwen2moe").fields(meta, "qwen2moe.", 24, 128, 128)
    assert (extra["shared_expert_intermediate_size"], extra["moe_intermediate_size"]) == (5632, 1408)
