"""GGUF's IQ4_NL, IQ4_XS and MXFP4 imported exactly, at 4 bits: their integers through a table of
levels (QuantizedTensor.values), each weight gguf's dequantization bit for bit; a model of them
runs as its float import."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from nibble.formats import gguf_blocks
from nibble.formats.gguf import import_gguf
from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import read_model_dir
from nibble.quant.affine import QuantizedTensor, dequantize
from nibble.quant.convert import read_linear
from nibble.quant.gguf_import import TypeOutcome, import_gguf_model
from nibble.runner.kernels import linear
from nibble.runner.kernels.cpu import SMALL
from nibble.runner.loader import from_model_dir
from tests.test_cli import invoke
from tests.test_gguf import (TOKENS, granite_meta, llama_cpp_tensors, moe_meta, moe_tensors, random_blocks,
                             write_gguf)
from tests.tiny import tiny_config, tiny_tensors

# ggml-common.h's kvalues_iq4nl, and kvalues_mxfp4 (E2M1's values doubled), written out here
IQ4_NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])
LEVELS = {QType.IQ4_NL: IQ4_NL + 128, QType.IQ4_XS: IQ4_NL + 128, QType.MXFP4: MXFP4 + 12}


def mxfp4_blocks(rng, rows, cols, exponents) -> np.ndarray:
    """Random MXFP4 blocks [rows, row bytes]: random nibbles, each block's E8M0 exponent byte one
    of `exponents` (the scale 2^(e-128))."""
    raw = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.choice(exponents, raw.shape[:2])
    return raw.reshape(rows, -1)


# (type, random blocks [rows, cols], how scales and biases are stored): float16 where it holds
# them, bfloat16 where that does, else float32; MXFP4's always bfloat16, as a checkpoint's
SCALES = {"iq4_nl-usual": (QType.IQ4_NL, lambda rng, r, c: random_blocks(rng, r, c, QType.IQ4_NL), "float16"),
          # d past 512: -128 d overflows float16, and d's 11 bits are no bfloat16
          "iq4_nl-wide": (QType.IQ4_NL, lambda rng, r, c: random_blocks(rng, r, c, QType.IQ4_NL, (-7, 4.5)), "float32"),
          # IQ4_XS's scales and biases in two levels, their integers ls - 32 signed (int8)
          "iq4_xs-usual": (QType.IQ4_XS, lambda rng, r, c: random_blocks(rng, r, c, QType.IQ4_XS), "int8"),
          "mxfp4-usual": (QType.MXFP4, lambda rng, r, c: mxfp4_blocks(rng, r, c, range(118, 131)), "bfloat16"),
          "mxfp4-sane": (QType.MXFP4, lambda rng, r, c: mxfp4_blocks(rng, r, c, range(100, 141)), "bfloat16"),
          # float32's subnormal scales, and the largest whose top level (24 times) is finite
          "mxfp4-extremes": (QType.MXFP4, lambda rng, r, c: mxfp4_blocks(rng, r, c, [0, 1, 2, 127, 250, 251]),
                             "bfloat16")}


def stored_as(a) -> str:
    return ("bfloat16" if a.bf16 else "float16") if isinstance(a, HalfTensor) else str(a.dtype)


def dequantized(qt: QuantizedTensor) -> np.ndarray:
    """dequantize(qt) with 16-bit scales and biases widened first (exact): it slices them as
    arrays, which a bfloat16 HalfTensor is not."""
    widened = lambda a: np.asarray(a, np.float32) if isinstance(a, HalfTensor) else a
    return dequantize(qt._replace(scales=widened(qt.scales), biases=widened(qt.biases)))


@pytest.mark.parametrize("case", SCALES)
def test_repack_with_levels_is_exact(tmp_path, monkeypatch, case):
    """The repacked matrix, dequantized through its levels, is gguf's dequantization bit for bit;
    scales and biases in 16 bits wherever one of float16 and bfloat16 holds them all."""
    qtype, blocks, dtype = SCALES[case]
    monkeypatch.setattr(gguf_blocks, "_STEP", 5 * 512)   # several steps, the last one short
    raw = blocks(np.random.default_rng(2), 24, 512)
    imported = import_gguf(write_gguf(tmp_path / "r.gguf", {"blk.0.ffn_up.weight": (raw, qtype)}))
    md = imported.model
    qt = read_linear(md.tensors, md.config.quantization, "model.layers.0.mlp.up_proj")
    assert (qt.bits, qt.group_size, qt.shape) == (4, 32, (24, 512))
    assert qt.values.dtype == np.uint8 and np.array_equal(qt.values, LEVELS[qtype])
    assert stored_as(qt.scales) == stored_as(qt.biases) == dtype
    expected = gguf.quants.dequantize(raw, qtype)
    assert np.isfinite(expected).all()
    assert np.array_equal(dequantized(qt), expected)
    assert imported.types == {"model.layers.0.mlp.up_proj.weight": qtype} and not imported.dequantized


@pytest.mark.parametrize("case", ["iq4_nl-usual", "mxfp4-sane"])
def test_stacked_experts_with_levels_are_exact(tmp_path, monkeypatch, case):
    """A mixture's stacks [E, N, K] repacked with the expert axis on weight, scales and biases and
    one table of levels: each expert's matrix gguf's dequantization bit for bit."""
    qtype, blocks, dtype = SCALES[case]
    monkeypatch.setattr(gguf_blocks, "_STEP", 3 * 256)   # steps that cross from expert to expert
    config = tiny_config("qwen3", vocab_size=len(TOKENS), hidden_size=256, num_hidden_layers=1)
    rng = np.random.default_rng(4)
    stack = lambda name, w: (blocks(rng, w.shape[0] * w.shape[1], w.shape[2]).reshape(*w.shape[:2], -1), qtype)
    raw = moe_tensors(config, 3, 256, stack)
    imported = import_gguf(write_gguf(tmp_path / "moe.gguf", raw, "qwen3moe", config, moe_meta(3, 2, 256)))
    md, p = imported.model, "model.layers.0.mlp.switch_mlp."
    assert imported.dequantized == []
    for kind in ("gate", "up", "down"):
        path, (data, _) = f"{p}{kind}_proj", raw[f"blk.0.ffn_{kind}_exps.weight"]
        qt = read_linear(md.tensors, md.config.quantization, path)
        assert qt.weight.shape == (3, 256, 32) and qt.scales.shape == qt.biases.shape == (3, 256, 8)
        assert np.array_equal(qt.values, LEVELS[qtype]) and stored_as(qt.scales) == dtype
        want = gguf.quants.dequantize(data, qtype)   # [3, 256, 256]
        for e in range(3):
            one = qt._replace(weight=qt.weight[e], scales=np.asarray(qt.scales, np.float32)[e],
                              biases=np.asarray(qt.biases, np.float32)[e])
            np.testing.assert_array_equal(dequantize(one), want[e], err_msg=f"{path} expert {e}")


def test_iq4_xs_past_float16_biases_is_dequantized(tmp_path):
    """A super-block scale d past 512 makes the biases' -128 d infinite in float16, their first
    level: such a matrix is dequantized, as gguf does it."""
    raw = random_blocks(np.random.default_rng(7), 4, 512, QType.IQ4_XS)
    raw[2, 136:138] = np.array([600.0], "<f2").view(np.uint8)   # row 2's second super-block's d
    assert gguf_blocks.repack(raw, QType.IQ4_XS) is None
    imported = import_gguf(write_gguf(tmp_path / "big.gguf", {"blk.0.ffn_up.weight": (raw, QType.IQ4_XS)}))
    w = imported.model.tensors["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == np.float32 and imported.dequantized == ["model.layers.0.mlp.up_proj"]
    np.testing.assert_array_equal(w, gguf.quants.dequantize(raw, QType.IQ4_XS))


def test_mxfp4_past_float32_with_its_levels_is_dequantized(tmp_path):
    """An exponent of 252 makes the top level, 24 times the scale, infinite in float32, where
    gguf's largest weight (12 times) is not: such a matrix is dequantized, as gguf does it."""
    raw = mxfp4_blocks(np.random.default_rng(6), 4, 64, [120])
    raw[1, 17] = 252   # row 1's second block
    assert gguf_blocks.repack(raw, QType.MXFP4) is None
    imported = import_gguf(write_gguf(tmp_path / "big.gguf", {"blk.0.ffn_up.weight": (raw, QType.MXFP4)}))
    w = imported.model.tensors["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == np.float32 and imported.dequantized == ["model.layers.0.mlp.up_proj"]
    np.testing.assert_array_equal(w, gguf.quants.dequantize(raw, QType.MXFP4))


@pytest.mark.parametrize("gate, up, joined", [("iq4_nl-usual", "iq4_nl-usual", True),
                                              ("mxfp4-sane", "mxfp4-extremes", True),
                                              ("iq4_nl-usual", "iq4_nl-wide", False),   # float16, float32
                                              ("iq4_nl-usual", "q4_0", False)])       # a table, none
def test_a_split_matrix_with_levels_is_joined(tmp_path, gate, up, joined):
    """granitemoeshared's shared gate and up one matrix again: repacked where both have one table
    of levels and their scales one type, else float32."""
    rng = np.random.default_rng(5)
    kinds = SCALES | {"q4_0": (QType.Q4_0, lambda rng, r, c: random_blocks(rng, r, c, QType.Q4_0), "float16")}
    tensors, values = {}, {}
    for kind, case in (("up", up), ("gate", gate)):
        qtype, blocks, _ = kinds[case]
        tensors[f"blk.0.ffn_{kind}_shexp.weight"] = t = (blocks(rng, 64, 256), qtype)
        values[kind] = gguf.quants.dequantize(*t)
    imported = import_gguf(write_gguf(tmp_path / "g.gguf", tensors, "granitemoe", meta=granite_meta()))
    md, path = imported.model, "model.layers.0.shared_mlp.input_linear"
    want = np.concatenate([values["gate"], values["up"]])
    if joined:
        qt = read_linear(md.tensors, md.config.quantization, path)
        assert qt.values is not None and imported.dequantized == []
        np.testing.assert_array_equal(dequantized(qt), want)
    else:
        assert md.tensors[f"{path}.weight"].dtype == np.float32 and imported.dequantized == [path]
        assert f"{path}.values" not in md.tensors
        np.testing.assert_array_equal(md.tensors[f"{path}.weight"], want)


CONFIG = tiny_config(vocab_size=len(TOKENS))


def iq4_nl_quantize(w: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks [N, K/32 * 18] for w [N, K]: each block's d its largest |weight| / 127 (as
    float16), each weight the nearest of d * kvalues (gguf cannot quantize IQ4_NL)."""
    x = w.reshape(-1, 32)
    d = (np.abs(x).max(axis=1) / 127).astype(np.float16)
    q = np.abs(d.astype(np.float32)[:, None, None] * IQ4_NL - x[..., None]).argmin(-1).astype(np.uint8)
    nibbles = q[:, :16] | (q[:, 16:] << 4)   # weights 0..15 low, 16..31 high
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), nibbles], axis=1).reshape(len(w), -1)


@pytest.fixture(scope="module")
def levels_gguf(tmp_path_factory):
    """A tiny llama of IQ4_NL attention and embedding (tied: the output head too) and an MXFP4
    MLP (bfloat16 scales), one MXFP4 matrix with a row of scales below float16's least; F32 norms."""
    tensors = {}
    for name, w in llama_cpp_tensors(tiny_tensors(CONFIG), CONFIG).items():
        if w.ndim == 1:
            tensors[name] = w
        elif "ffn" in name:
            if name == "blk.1.ffn_down.weight":
                w = w.copy()
                w[0] *= 2.0 ** -24   # exponents near 101: scales below float16's least
            tensors[name] = (gguf.quants.quantize(w, QType.MXFP4), QType.MXFP4)
        else:
            tensors[name] = (iq4_nl_quantize(w), QType.IQ4_NL)
    return write_gguf(tmp_path_factory.mktemp("levels") / "levels.gguf", tensors, config=CONFIG), tensors


def weights_of(raw: dict, qtype: QType) -> int:
    """How many weights the file's tensors of `qtype` hold."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return sum(t[0].size // type_size * block_size for t in raw.values() if isinstance(t, tuple) and t[1] == qtype)


def test_a_model_with_levels_runs_as_its_float_import(levels_gguf):
    """Imported at 4 bits with tables of levels: 5 bits a weight (the float16 or bfloat16 scale
    and bias a block of 32, and the table's 16 bytes a matrix), where requantizing to int8 took 9;
    each matrix its float import's exactly. A pass of SMALL tokens (the decode kernels) gives the
    float import's logits: close to exact on x rounded to 16 bits, within int8 rounding where the
    CPU multiplies bytes (x rounded to int8 blocks)."""
    path, raw = levels_gguf
    report = import_gguf_model(path)
    floats = import_gguf_model(path, keep_float=True).model
    md = report.model
    outcomes = {o.gguf_type: o for o in report.outcomes}
    for qtype, tensors, bits_before in ((QType.IQ4_NL, 9, 4.5), (QType.MXFP4, 6, 4.25)):
        n = weights_of(raw, qtype)
        assert outcomes[qtype.name] == TypeOutcome(qtype.name, "int4 g32 levels (exact)", tensors, bits_before,
                                                   pytest.approx(5 + 16 * 8 * tensors / n))
    down = read_linear(md.tensors, md.config.quantization, "model.layers.1.mlp.down_proj")
    assert stored_as(down.scales) == "bfloat16"
    assert stored_as(read_linear(md.tensors, md.config.quantization, "model.layers.0.self_attn.q_proj").scales) == "float16"
    for name in md.tensors:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{module}.scales" in md.tensors:
            qt = read_linear(md.tensors, md.config.quantization, module)
            np.testing.assert_array_equal(dequantized(qt), floats.tensors[name], err_msg=name)
    quantized, _ = from_model_dir(md)
    reference, _ = from_model_dir(floats)
    ids = ([5, 17, 42, 99, 7, 3] * 3)[:SMALL]
    got = quantized.forward(ids, quantized.new_cache(32), all_logits=True)
    want = reference.forward(ids, reference.new_cache(32), all_logits=True)
    tol = 1e-1 if linear.int8_activations() else 2e-3
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_import_command_keeps_the_levels(levels_gguf, tmp_path):
    """`nibble import` says what each type became, and writes the tables of levels (U8) and the
    bfloat16 scales that read back as they were."""
    path, raw = levels_gguf
    r = invoke("import", path, "-o", tmp_path / "q")
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    for qtype, tensors, before in ((QType.IQ4_NL, 9, 4.5), (QType.MXFP4, 6, 4.25)):
        after = 5 + 16 * 8 * tensors / weights_of(raw, qtype)   # the tables: 0.02 bits at this size
        assert (f"{qtype.name}: {tensors} tensors -> int4 g32 levels (exact), {after:.2f} bits per weight "
                f"(the file's {before:.2f})") in lines
    back, imported = read_model_dir(tmp_path / "q"), import_gguf_model(path).model
    assert back.tensors.keys() == imported.tensors.keys()
    for name, t in imported.tensors.items():
        assert stored_as(back.tensors[name]) == stored_as(t) and np.array_equal(back.tensors[name], t), name
    assert stored_as(back.tensors["model.layers.1.mlp.down_proj.scales"]) == "bfloat16"
