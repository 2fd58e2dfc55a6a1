"""`nibble quantize` on the tiny model: what it writes, and one clean line for bad input."""
import json
import shutil
from pathlib import Path

import pytest

from nibble.formats.model_dir import read_model_dir, write_model_dir
from tests.test_cli import GREEDY, assert_one_line_error, invoke
from tests.tiny import tiny_model_dir, tiny_tokenizer


@pytest.fixture(scope="module")
def int4_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "int4"
    r = invoke("quantize", tiny_dir, "-o", out, "--bits", 4, "--group-size", 32)
    assert r.exit_code == 0, r.output
    assert "bits per weight" in r.stderr and "layer " in r.stderr
    return out


def test_writes_an_mlx_style_directory(int4_dir):
    config = json.loads((int4_dir / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine",
                                      "model.embed_tokens": {"group_size": 32, "bits": 8}}
    md = read_model_dir(int4_dir)
    w = md.tensors["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype.name == "uint32" and w.shape == (128, 64 * 4 // 32)
    assert md.tensors["model.layers.0.mlp.up_proj.scales"].shape == (128, 64 // 32)


def test_phi3_calibrates_and_quantizes_its_fused_matrices(tmp_path):
    """The importance of each input is measured under phi3's own names (qkv_proj, gate_up_proj),
    which are quantized as they are stored, and the result runs."""
    out = tmp_path / "int8"
    r = invoke("quantize", write_model_dir(tiny_model_dir("phi3"), tmp_path / "phi3"), "-o", out, "--bits", 8)
    assert r.exit_code == 0, r.output
    assert "layer " in r.stderr   # calibrated and quantized layer by layer
    assert read_model_dir(out).tensors["model.layers.1.self_attn.qkv_proj.weight"].dtype.name == "uint32"
    r = invoke("run", "-m", out, *GREEDY, "Hello")
    assert r.exit_code == 0 and r.stdout.strip(), r.output


def test_refuses_existing_output_and_requantizing(tiny_dir, int4_dir, tmp_path):
    assert_one_line_error(invoke("quantize", tiny_dir, "-o", int4_dir, "--bits", 8), match="already exists")
    assert_one_line_error(invoke("quantize", int4_dir, "-o", tmp_path / "x", "--bits", 8),
                          match="already quantized")
    assert not (tmp_path / "x").exists()


def test_mxfp4_experts_are_run_as_stored_not_requantized(tmp_path):
    model = tmp_path / "gpt-oss-mxfp4"
    shutil.copytree(Path(__file__).parent / "data" / "transformers" / "gpt-oss-mxfp4", model)
    tiny_tokenizer().save(str(model / "tokenizer.json"))
    assert_one_line_error(invoke("quantize", model, "-o", tmp_path / "x", "--bits", 4), match="already quantized")
    assert_one_line_error(invoke("quantize", model, "-o", tmp_path / "x", "--bits", 4, "--allow-requantize"),
                          match="MXFP4 experts, which nibble runs as stored")
    assert not (tmp_path / "x").exists()


def test_unsupported_bits_and_group_size(tiny_dir, tmp_path):
    assert invoke("quantize", tiny_dir, "-o", tmp_path / "x", "--bits", 3).exit_code == 2
    assert invoke("quantize", tiny_dir, "-o", tmp_path / "x", "--bits", 4, "--group-size", 48).exit_code == 2


@pytest.mark.parametrize("content,match", [(b"", "is empty"), (b"\xff\xfe\x00\x01binary", "not UTF-8 text"),
                                           (b"   \n", "is empty")])
def test_bad_calibration_file(tiny_dir, tmp_path, content, match):
    calib = tmp_path / "calib.txt"
    calib.write_bytes(content)
    assert_one_line_error(invoke("quantize", tiny_dir, "-o", tmp_path / "x", "--bits", 8, "--calib", calib),
                          match=match)


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_full_disk_or_interrupt_leaves_nothing(tiny_dir, tmp_path, monkeypatch, error):
    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr("nibble.formats.model_dir.write_safetensors", fail)
    r = invoke("quantize", tiny_dir, "-o", tmp_path / "out", "--bits", 8)
    assert r.exit_code == (1 if isinstance(error, OSError) else 130)
    assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []   # neither OUT nor a temporary directory
