"""A GGUF file imported to run: exact repacks, the rest requantized to int8, the report, the CLI."""
from dataclasses import replace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from nibble.formats.model_dir import read_model_dir
from nibble.quant.affine import dequantize, group_values, reconstruction_error
from nibble.quant.convert import read_linear
from nibble.quant.gguf_import import TypeOutcome, import_gguf_model
from nibble.runner.kernels import linear, moe
from nibble.runner.kernels.cpu import SMALL
from nibble.runner.loader import from_model_dir, load
from tests.test_cli import invoke
from tests.test_gguf import (TOKENS, gguf_name, llama_cpp_tensors, moe_meta, moe_tensors, random_blocks,
                             random_stack, write_gguf)
from tests.tiny import tiny_config, tiny_tensors

# down_proj's rows (F = 256) take whole IQ3_S super-blocks.
CONFIG = tiny_config(vocab_size=len(TOKENS), intermediate_size=256)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A tiny llama as llama.cpp mixes types: F16 embedding, F32 norms, Q4_0 attention and
    gate/up, IQ3_S down_proj (a type nibble cannot repack)."""
    rng = np.random.default_rng(0)
    tensors = {}
    for name, w in llama_cpp_tensors(tiny_tensors(CONFIG), CONFIG).items():
        if w.ndim == 1:
            tensors[name] = w
        elif name == "token_embd.weight":
            tensors[name] = w.astype(np.float16)
        elif "ffn_down" in name:
            tensors[name] = (random_blocks(rng, *w.shape, QType.IQ3_S, (-3, -2.5)), QType.IQ3_S)
        else:
            tensors[name] = (gguf.quants.quantize(w, QType.Q4_0), QType.Q4_0)
    path = write_gguf(tmp_path_factory.mktemp("mixed") / "mixed.gguf", tensors, config=CONFIG)
    return path, tensors


def test_requantizes_only_what_cannot_be_repacked(mixed_gguf):
    path, raw = mixed_gguf
    report = import_gguf_model(path)
    # the bits a weight: a float16 scale and bias a group of 32, 8-bit integers of IQ3_S's 110 bytes
    # a super-block of 256
    assert report.outcomes == [TypeOutcome("F16", "float16", 1, 16, 16), TypeOutcome("F32", "float32", 5, 32, 32),
                               TypeOutcome("Q4_0", "int4 g32 (exact)", 12, 4.5, 5),
                               TypeOutcome("IQ3_S", "int8 g32 (requantized)", 2, 110 * 8 / 256, 9)]
    md = report.model
    downs = [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert md.config.quantization == {"group_size": 32, "bits": 4, "mode": "affine",
                                      **{p: {"group_size": 32, "bits": 8} for p in downs}}
    assert md.tensors["model.embed_tokens.weight"].dtype == np.float16
    for path_ in downs:   # rounded to nearest at 8 bits: close to the IQ3_S weights
        data, qtype = raw[gguf_name(f"{path_}.weight")]
        qt = read_linear(md.tensors, md.config.quantization, path_)
        assert reconstruction_error(gguf.quants.dequantize(data, qtype), qt) < 0.005
    q = read_linear(md.tensors, md.config.quantization, "model.layers.1.mlp.up_proj")
    np.testing.assert_array_equal(dequantize(q), gguf.quants.dequantize(*raw["blk.1.ffn_up.weight"]))
    assert report.kept_float == {}
    params = sum(np.prod(t.shape) for t in gguf.GGUFReader(path).tensors)
    assert report.params == params
    assert report.bits_per_weight == report.nbytes * 8 / params


def test_keep_float(mixed_gguf):
    path, _ = mixed_gguf
    report = import_gguf_model(path, keep_float=True)
    assert report.outcomes == [TypeOutcome("F16", "float16", 1, 16, 16), TypeOutcome("F32", "float32", 5, 32, 32),
                               TypeOutcome("Q4_0", "float32 (dequantized)", 12, 4.5, 32),
                               TypeOutcome("IQ3_S", "float32 (dequantized)", 2, 110 * 8 / 256, 32)]
    assert report.model.config.quantization is None


def test_runs_as_its_dequantized_weights(mixed_gguf):
    # A pass of SMALL tokens (the decode kernels) gives the logits of a float model holding the
    # dequantized weights: close to exact on x rounded to 16 bits; where the CPU multiplies bytes,
    # x rounded to int8 blocks moves them by 4% of their scale on this tiny random model (a wrong
    # import: all of it).
    check_runs_as_dequantized(import_gguf_model(mixed_gguf[0]).model)


def k_quant_llama(tmp_path, types: dict) -> tuple:
    """A one-layer llama (hidden and FFN 256: whole super-blocks) whose matrices are random blocks
    of types[kind] ("attn_q", ...): (its import report, the file's tensors)."""
    config = tiny_config(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=256, num_hidden_layers=1)
    rng = np.random.default_rng(8)
    tensors = {}
    for name, w in llama_cpp_tensors(tiny_tensors(config), config).items():
        qtype = types.get(name.split(".")[-2])
        tensors[name] = w if qtype is None else (random_blocks(rng, *w.shape, qtype, (-3, -2)), qtype)
    return import_gguf_model(write_gguf(tmp_path / "k.gguf", tensors, config=config)), tensors


def test_k_quants_and_iq4_xs_import_at_their_bits(tmp_path):
    """The Q5 types (4-bit words and a plane of fifth bits), Q6_K (two planes, groups of 16), Q2_K
    and Q3_K (groups of 16) and IQ4_XS (a table of levels, signed two-level scales): each matrix
    the file's exactly, at its bits."""
    report, tensors = k_quant_llama(tmp_path, {
        "attn_q": QType.Q5_0, "attn_k": QType.Q5_1, "attn_v": QType.Q6_K, "attn_output": QType.Q2_K,
        "ffn_gate": QType.Q5_K, "ffn_up": QType.IQ4_XS, "ffn_down": QType.Q3_K})
    became = {o.gguf_type: (o.became, round(o.bits_after, 3)) for o in report.outcomes}
    assert became == {"F32": ("float32", 32), "Q5_0": ("int5 g32 (exact)", 6), "Q5_1": ("int5 g32 (exact)", 6),
                      "Q6_K": ("int6 g16 (exact)", 7.125), "Q2_K": ("int4 g16 (exact)", 5.125),
                      "Q5_K": ("int5 g32 (exact)", 5.625), "Q3_K": ("int4 g16 (exact)", 5.125),
                      "IQ4_XS": ("int4 g32 levels (exact)", round(4.625 + 16 * 8 / (256 * 256), 3))}
    md = report.model
    for name in md.tensors:   # q and k: rows in llama.cpp's order in the file
        if name.endswith(".weight") and isinstance(tensors[gguf_name(name)], tuple) \
                and not name.endswith(("q_proj.weight", "k_proj.weight")):
            qt = read_linear(md.tensors, md.config.quantization, name.removesuffix(".weight"))
            np.testing.assert_array_equal(dequantize(qt), gguf.quants.dequantize(*tensors[gguf_name(name)]), name)


def test_a_q4_k_m_mix_runs_as_its_dequantized_weights(tmp_path):
    """Q4_K and Q6_K (v and down), as llama.cpp's Q4_K_M mixes them: the model runs as its
    dequantized weights (each kind's kernels are tested alone in test_quant_kernels)."""
    k, six = QType.Q4_K, QType.Q6_K
    report, _ = k_quant_llama(tmp_path, {"attn_q": k, "attn_k": k, "attn_v": six, "attn_output": k,
                                         "ffn_gate": k, "ffn_up": k, "ffn_down": six})
    check_runs_as_dequantized(report.model)


def check_runs_as_dequantized(md):
    """SMALL tokens through the imported model give the logits of a float model of its weights as
    dequantize gives them, within int8 rounding where the CPU multiplies bytes."""
    floats = {}
    for name, t in md.tensors.items():
        path = name.removesuffix(".weight")
        if f"{path}.scales" in md.tensors:
            floats[name] = dequantize(read_linear(md.tensors, md.config.quantization, path))
        elif not name.endswith((".scales", ".biases", ".values", ".high")):
            floats[name] = t
    quantized, _ = from_model_dir(md)
    reference, _ = from_model_dir(replace(md, tensors=floats, config=replace(md.config, quantization=None)))
    ids = ([5, 17, 42, 99, 7, 3] * 3)[:SMALL]
    got = quantized.forward(ids, quantized.new_cache(32), all_logits=True)
    want = reference.forward(ids, reference.new_cache(32), all_logits=True)
    tol = 1e-1 if linear.int8_activations() else 2e-3
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_a_k_quant_mixture_of_experts(tmp_path):
    """qwen3moe as llama.cpp's Q4_K_M mixes it: Q4_K gate and up experts kept in their two levels
    with the expert axis, Q6_K down experts too (6-bit integers in groups of 16), each expert's
    matrix the file's exactly. Its mixtures run (decode and prefill rows) bit for bit as the same
    experts with Q4_K's scales and biases in float32: the kernels read each expert's two levels as
    a dense K-quant's. (Against float weights, x rounded to int8 blocks routes a row or two of
    this random model to another expert.)"""
    config = tiny_config("qwen3", vocab_size=len(TOKENS), hidden_size=256)
    rng = np.random.default_rng(5)
    raw = moe_tensors(config, 4, 256, lambda name, w: random_stack(
        rng, w, QType.Q6_K if "down" in name else QType.Q4_K))
    path = write_gguf(tmp_path / "moe.gguf", raw, "qwen3moe", config, moe_meta(4, 2, 256))
    report = import_gguf_model(path)
    assert report.outcomes == [TypeOutcome("F32", "float32", 21, 32, 32),
                               TypeOutcome("Q4_K", "int4 g32 (exact)", 4, 4.5, 4.625),
                               TypeOutcome("Q6_K", "int6 g16 (exact)", 2, 210 * 8 / 256, 7.125)]
    assert report.params == sum(np.prod(t.shape) for t in gguf.GGUFReader(path).tensors)
    md = report.model
    for i in range(2):
        down = read_linear(md.tensors, md.config.quantization, f"model.layers.{i}.mlp.switch_mlp.down_proj")
        assert (down.bits, down.weight.shape, down.scales.shape) == (4, (4, 256, 32), (4, 256, 1, 18))
        want = gguf.quants.dequantize(*raw[f"blk.{i}.ffn_down_exps.weight"])
        for e in range(4):
            one = down._replace(weight=down.weight[e], scales=down.scales[e], biases=down.biases[e],
                                high=down.high[e])
            np.testing.assert_array_equal(dequantize(one), want[e])
    one_level = dict(md.tensors)
    for name, a in md.tensors.items():
        if name.endswith((".scales", ".biases")) and a.dtype == np.uint8:   # [E, N, K/256, 10]
            one_level[name] = group_values(a.reshape(-1, *a.shape[2:])).reshape(*a.shape[:2], -1)
    two, _ = from_model_dir(md)
    one, _ = from_model_dir(replace(md, tensors=one_level))
    h = rng.standard_normal((24, 256)).astype(np.float32)
    for x in h[:SMALL], h:   # the mixture alone: the rest of the block is a dense model's
        got, want = np.empty_like(x), np.empty_like(x)
        moe.moe_mlp(x, two.layers[0].moe, got, np.zeros((0, 0)))
        moe.moe_mlp(x, one.layers[0].moe, want, np.zeros((0, 0)))
        assert np.array_equal(got, want)


def test_load_runs_a_gguf_quantized(mixed_gguf):
    model, _ = load(str(mixed_gguf[0]))
    assert model.layers[0].w_down.bits == 8 and model.layers[0].wq.bits == 4


def test_import_command(mixed_gguf, tmp_path):
    path, _ = mixed_gguf
    r = invoke("import", path, "-o", tmp_path / "q")
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert lines[:4] == ["F16: 1 tensor -> float16, 16.00 bits per weight (the file's 16.00)",
                         "F32: 5 tensors -> float32, 32.00 bits per weight (the file's 32.00)",
                         "Q4_0: 12 tensors -> int4 g32 (exact), 5.00 bits per weight (the file's 4.50)",
                         "IQ3_S: 2 tensors -> int8 g32 (requantized), 9.00 bits per weight (the file's 3.44)"]
    assert lines[4].startswith(f"wrote {tmp_path / 'q'} (") and "bits per weight)" in lines[4]
    back = read_model_dir(tmp_path / "q")
    report = import_gguf_model(path)
    assert back.config.quantization == report.model.config.quantization
    assert back.tensors.keys() == report.model.tensors.keys()
    for name, t in report.model.tensors.items():
        assert back.tensors[name].dtype == t.dtype and np.array_equal(back.tensors[name], t), name

    r = invoke("import", path, "-o", tmp_path / "f", "--float")
    assert r.exit_code == 0, r.output
    assert "Q4_0: 12 tensors -> float32 (dequantized), 32.00 bits per weight (the file's 4.50)" in r.stderr.splitlines()
    assert "F16: 1 tensor -> float16, 16.00 bits per weight (the file's 16.00)" in r.stderr.splitlines()
    assert "32.00 bits per weight)" not in r.stderr   # the whole: the F16 embedding stays 16-bit
    assert read_model_dir(tmp_path / "f").config.quantization is None


def test_k_quants_keep_their_two_levels(tmp_path):
    """Q4_K and Q5_K imported exactly, their scales and biases in the file's two levels and Q5_K's
    fifth bits in a plane: 4.625 and 5.625 bits a weight (the file's 4.5 and 5.5), where float32
    scales and a byte a weight took 6 and 10."""
    config = tiny_config(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=256)
    rng = np.random.default_rng(3)
    hf = tiny_tensors(config)
    tensors = {}
    for name, w in llama_cpp_tensors(hf, config).items():
        qtype = QType.Q5_K if "ffn_down" in name else QType.Q4_K
        tensors[name] = w if w.ndim == 1 else (random_blocks(rng, *w.shape, qtype, (-3, -2)), qtype)
    report = import_gguf_model(write_gguf(tmp_path / "k.gguf", tensors, config=config))
    assert report.outcomes == [TypeOutcome("Q4_K", "int4 g32 (exact)", 13, 4.5, 4.625),
                               TypeOutcome("F32", "float32", 5, 32, 32),
                               TypeOutcome("Q5_K", "int5 g32 (exact)", 2, 5.5, 5.625)]
    md = report.model
    for name in hf:   # q and k: rows in llama.cpp's order in the file
        path = name.removesuffix(".weight")
        if f"{path}.scales" in md.tensors and not name.endswith(("q_proj.weight", "k_proj.weight")):
            qt = read_linear(md.tensors, md.config.quantization, path)
            assert qt.scales.shape == (qt.shape[0], qt.shape[1] // 256, 10)
            want = gguf.quants.dequantize(*tensors[gguf_name(name)])
            np.testing.assert_array_equal(dequantize(qt), want)
