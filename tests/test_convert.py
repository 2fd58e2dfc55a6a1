"""quantize_model on the tiny model: the MLX layout on disk, config.json, and reading it back."""
from dataclasses import replace

import numpy as np
import pytest

from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.model_dir import read_model_dir, write_model_dir
from nibble.quant.affine import AffineScheme, QuantizedTensor, dequantize, quantize, reconstruction_error
from nibble.quant.convert import (count_params, default_calibration_text, is_quantized, quantize_linears,
                                  quantize_model, read_linear)
from tests.tiny import tiny_model_dir

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def linear_paths(model):
    c = model.config
    paths = [f"model.layers.{i}.{p}" for i in range(c.num_hidden_layers) for p in LINEARS]
    return ["model.embed_tokens", *paths] + ([] if c.tie_word_embeddings else ["lm_head"])


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    """The tiny llama (tied embeddings) quantized to 4 bits, group 32, written and read back."""
    model = tiny_model_dir()
    report = quantize_model(model, bits=4, group_size=32)
    path = write_model_dir(report.model, tmp_path_factory.mktemp("q") / "q4")
    return model, report, read_model_dir(path)


def test_quantized_model_has_the_mlx_layout(q4):
    model, report, back = q4
    assert back.config.quantization == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert back.config.extra["quantization_config"] == back.config.quantization
    assert is_quantized(back.config) and not is_quantized(model.config)
    for path in linear_paths(model):
        out, n = model.tensors[f"{path}.weight"].shape
        assert back.tensors[f"{path}.weight"].dtype == np.uint32
        assert back.tensors[f"{path}.weight"].shape == (out, n // 8)
        assert back.tensors[f"{path}.scales"].shape == (out, n // 32)
        assert back.tensors[f"{path}.biases"].dtype == np.float16
    assert "lm_head.weight" not in back.tensors  # tied: the quantized embedding is the head
    for name in ("model.norm.weight", "model.layers.1.input_layernorm.weight"):
        np.testing.assert_array_equal(back.tensors[name], model.tensors[name])


def test_read_back_weights_are_close(q4):
    model, report, back = q4
    for path in linear_paths(model):
        qt = read_linear(back.tensors, back.config.quantization, path)
        assert qt.scheme == AffineScheme(4, 32)
        w = model.tensors[f"{path}.weight"]
        err = np.linalg.norm(dequantize(qt) - w) / np.linalg.norm(w)
        assert err == pytest.approx(report.errors[f"{path}.weight"], rel=1e-4)
        assert err < 0.1
    assert read_linear(back.tensors, back.config.quantization, "model.norm") is back.tensors[
        "model.norm.weight"]


def test_report_sizes(q4):
    model, report, _ = q4
    assert len(report.errors) == len(linear_paths(model)) and not report.kept_float
    assert report.bytes_before == sum(t.nbytes for t in model.tensors.values())
    assert report.bytes_after < report.bytes_before / 6
    # 4 bits plus a float16 scale and bias per 32 weights = 5 bits; norms add a little.
    assert 5.0 < report.bits_per_weight < 5.2


def test_embed_bits_overrides_the_embedding_and_head():
    model = tiny_model_dir("qwen2")  # untied: has an lm_head
    calls = []
    report = quantize_model(model, 4, 64, embed_bits=8, progress=lambda *a: calls.append(a))
    q = report.model.config.quantization
    assert q == {"group_size": 64, "bits": 4, "mode": "affine",
                 "model.embed_tokens": {"group_size": 64, "bits": 8},
                 "lm_head": {"group_size": 64, "bits": 8}}
    up = "model.layers.0.mlp.up_proj"
    assert read_linear(report.model.tensors, q, "lm_head").scheme == AffineScheme(8, 64)
    assert read_linear(report.model.tensors, q, up).scheme == AffineScheme(4, 64)
    assert report.errors["lm_head.weight"] < 0.01 < report.errors[f"{up}.weight"]
    total = len(linear_paths(model))
    assert [c[1:] for c in calls] == [(i, total) for i in range(1, total + 1)]
    assert model.config.quantization is None and "lm_head.scales" not in model.tensors


def test_rows_not_divisible_by_the_group_stay_float():
    model = tiny_model_dir()  # hidden 64: only down_proj (input 128) fills groups of 128
    report = quantize_model(model, 8, 128)
    assert set(report.errors) == {f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)}
    reason = report.kept_float["model.layers.0.self_attn.q_proj.weight"]
    assert reason == "row length 64 is not a multiple of the group size 128"
    tensors, q = report.model.tensors, report.model.config.quantization
    assert isinstance(read_linear(tensors, q, "model.layers.0.self_attn.q_proj"), np.ndarray)
    assert isinstance(read_linear(tensors, q, "model.layers.0.mlp.down_proj"), QuantizedTensor)


def test_quantize_linears_leaves_the_rest_alone(q4):
    # A 4-bit model with two matrices back in float (as a GGUF import's Q6_K ones arrive), plus
    # the count of its weights, a quantized matrix counted as the float one it stands for.
    model, report, _ = q4
    q = report.model.config.quantization
    tensors = dict(report.model.tensors)
    down = [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    for path in down:
        tensors[f"{path}.weight"] = dequantize(read_linear(tensors, q, path))
        del tensors[f"{path}.scales"], tensors[f"{path}.biases"]
    partial = replace(report.model, tensors=tensors)
    assert count_params(tensors, q) == sum(t.size for t in model.tensors.values())
    done = quantize_linears(partial, down, AffineScheme(8, 32))
    assert done.model.config.quantization == {**q, **{p: {"group_size": 32, "bits": 8} for p in down}}
    assert set(done.errors) == {f"{p}.weight" for p in down} and max(done.errors.values()) < 0.01
    for name, t in tensors.items():
        if name.removesuffix(".weight") not in down:
            assert done.model.tensors[name] is t
    assert done.params == count_params(done.model.tensors, done.model.config.quantization)
    with pytest.raises(NibbleError, match="no float matrix to quantize at model.layers.0.mlp.up_proj"):
        quantize_linears(partial, ["model.layers.0.mlp.up_proj"], AffineScheme(8, 32))


def test_quantize_linears_keeps_short_rows_float():
    model = tiny_model_dir()   # float: the scheme becomes the default; rows of 64 miss groups of 128
    done = quantize_linears(model, ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"],
                            AffineScheme(8, 128))
    assert done.model.config.quantization == {"group_size": 128, "bits": 8, "mode": "affine"}
    assert done.kept_float == {"model.layers.0.mlp.up_proj.weight":
                               "row length 64 is not a multiple of the group size 128"}
    assert set(done.errors) == {"model.layers.0.mlp.down_proj.weight"}


def test_imatrix_is_used_by_weight_name():
    model = tiny_model_dir()
    name = "model.layers.0.mlp.down_proj.weight"
    imatrix = {name: np.random.default_rng(0).gamma(0.5, size=128).astype(np.float32)}
    report = quantize_model(model, 4, 32, imatrix=imatrix)
    qt = read_linear(report.model.tensors, report.model.config.quantization, name[:-7])
    w = model.tensors[name]
    blind = quantize(w, qt.scheme)
    assert report.errors[name] == pytest.approx(reconstruction_error(w, qt, imatrix[name]))
    assert report.errors[name] < reconstruction_error(w, blind, imatrix[name])
    with pytest.raises(NibbleError, match="model.layers.0.mlp.down_proj does not"):
        quantize_model(model, 4, 32, imatrix={"model.layers.0.mlp.down_proj does not": w[0]})
    with pytest.raises(NibbleError, match=f"{name}: importance matrix has shape"):
        quantize_model(model, 4, 32, imatrix={name: np.ones(3, np.float32)})


def test_bad_settings_and_requantizing(q4):
    model, report, back = q4
    with pytest.raises(NibbleError, match="bits must be 4 or 8"):
        quantize_model(model, 5, 64)
    with pytest.raises(NibbleError, match="group size must be 32, 64 or 128"):
        quantize_model(model, 4, 100)
    with pytest.raises(NibbleError, match="already quantized"):
        quantize_model(back, 8, 64)
    again = quantize_model(back, 8, 64, allow_requantize=True)
    assert again.model.config.quantization == {"group_size": 64, "bits": 8, "mode": "affine"}
    qt = read_linear(again.model.tensors, again.model.config.quantization,
                             "model.layers.0.mlp.up_proj")
    w = model.tensors["model.layers.0.mlp.up_proj.weight"]
    assert np.linalg.norm(dequantize(qt) - w) / np.linalg.norm(w) < 0.1


def test_read_linear_rejects_broken_layouts(q4):
    _, _, back = q4
    q = back.config.quantization
    path = "model.layers.0.mlp.up_proj"
    bad = dict(back.tensors, **{f"{path}.scales": back.tensors[f"{path}.scales"][:, :1]})
    with pytest.raises(FormatError, match=f"{path}.scales has shape"):
        read_linear(bad, q, path)
    missing = {k: v for k, v in back.tensors.items() if k != f"{path}.biases"}
    with pytest.raises(FormatError, match=f"missing {path}.biases"):
        read_linear(missing, q, path)
    with pytest.raises(FormatError, match="only MLX's affine"):
        read_linear(back.tensors, {**q, "mode": "mxfp4"}, path)
    with pytest.raises(FormatError, match="bits must be 4 or 8"):
        read_linear(back.tensors, {**q, path: {"group_size": 32, "bits": 6}}, path)
    # A per-path false keeps a module float even when scales exist, as in mlx-lm.
    float_model = {**back.tensors, f"{path}.weight": np.zeros((128, 64), np.float32)}
    assert read_linear(float_model, {**q, path: False}, path).dtype == np.float32


def test_default_calibration_text():
    text = default_calibration_text()
    assert 20_000 < len(text.encode()) < 40_000
    assert "def " in text and "SELECT" in text and '"' in text and "1,024" in text


@pytest.mark.slow
def test_smollm2_embedding(smollm2_gguf):
    from nibble.formats.gguf import import_gguf
    w = import_gguf(smollm2_gguf, repack_blocks=False).model.tensors["model.embed_tokens.weight"]  # [49152, 576]
    s8 = AffineScheme(8, 64)
    assert reconstruction_error(w, quantize(w, s8)) < 0.01
    part, s4 = w[:8192], AffineScheme(4, 64)
    rtn = reconstruction_error(part, quantize(part, s4, method="rtn"))
    found = reconstruction_error(part, quantize(part, s4))
    assert found < 0.95 * rtn < 0.15
