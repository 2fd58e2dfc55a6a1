"""nibble export: to GGUF, nibble's int4 written exactly as Q4_1, what no type holds rounded again
and measured, a GGUF back byte for byte, what llama.cpp reads of the files; to compressed-tensors,
integer zero points (nibble quantize --for vllm) exactly, what transformers reads of them."""

import dataclasses
import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
from click.testing import CliRunner

from nibble.formats import gguf_tokenizer
from nibble.formats.errors import NibbleError
from nibble.formats.gguf import import_gguf
from nibble.formats.model_dir import read_model_dir, write_model_dir
from nibble.quant.affine import QuantizedTensor, dequantize
from nibble.quant.convert import quantize_model, read_linear
from nibble.tui.cli.main import main
from nibble.runner.export import export_compressed, export_gguf
from nibble.runner.loader import load
from tests import reference
from tests.test_quantized_model import dequantized
from tests.tiny import TEXT, tiny_model_dir

DATA = Path(__file__).parent / "data" / "export"
IDS = [1, 259, 78, 78, 81, 223, 89, 81, 84, 78, 70, 223, 19, 20, 21, 40, 50, 60, 70, 80]
# the exports llama.cpp ran (tests/fixtures/make_export_fixtures.py): model type, bits, group size
LLAMA_CPP = [("llama", 4, 32), ("qwen2", 4, 64)]
# and the compressed-tensors exports transformers ran, quantized with integer zero points
COMPRESSED = [("llama", 4, 32), ("qwen2", 4, 64), ("qwen2", 8, 64)]


def quantized(folder: Path, model_type: str, bits: int, group_size: int, integer_zeros: bool = False,
              **config) -> Path:
    """A tiny model of `model_type` quantized by rounding to nearest (numpy's, the same bits on
    any CPU), written in `folder`."""
    model = tiny_model_dir(model_type)
    if config:
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, **config))
    q = quantize_model(model, bits, group_size, method="rtn", integer_zeros=integer_zeros).model
    return write_model_dir(q, folder / f"{model_type}-int{bits}-g{group_size}{'-zeros' * integer_zeros}")


def values(model) -> dict[str, np.ndarray]:
    """Every weight of a ModelDir as the float32 values it stands for."""
    out = {}
    for name in model.tensors:
        path, kind = name.rsplit(".", 1)
        if kind in ("scales", "biases"):
            continue
        w = read_linear(model.tensors, model.config.quantization, path) if kind == "weight" else model.tensors[name]
        out[name] = dequantize(w) if isinstance(w, QuantizedTensor) else np.asarray(w, np.float32)
    return out


@pytest.mark.parametrize("model_type, group_size", [("llama", 32), ("qwen2", 64), ("qwen3", 128)])
def test_int4_is_written_as_q4_1_exactly_and_reads_back(tmp_path, model_type, group_size):
    folder = quantized(tmp_path, model_type, 4, group_size)
    exported = export_gguf(str(folder), tmp_path / "out.gguf")
    assert exported.again == {} and "every weight as nibble runs it" in str(exported)
    reader = gguf.GGUFReader(exported.path)
    assert reader.fields["general.architecture"].contents() == model_type
    ours, back = read_model_dir(folder), import_gguf(exported.path).model
    quantized_here = sum(name.endswith(".scales") for name in ours.tensors)
    assert quantized_here > 0 and [t.tensor_type.name for t in reader.tensors].count("Q4_1") == quantized_here
    assert back.config.model_type == model_type
    for field in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "rope_theta",
                  "tie_word_embeddings", "attention_bias"):
        assert getattr(back.config, field) == getattr(ours.config, field), field
    ours_values, back_values = values(ours), values(back)
    assert ours_values.keys() == back_values.keys()
    for name, v in ours_values.items():
        assert np.array_equal(back_values[name], v), name
    assert back.tokenizer.encode(TEXT).ids == ours.tokenizer.encode(TEXT).ids
    assert back.tokenizer_config["chat_template"] == ours.tokenizer_config["chat_template"]


def test_groups_of_32_read_back_byte_for_byte(tmp_path):
    folder = quantized(tmp_path, "llama", 4, 32)
    back = import_gguf(export_gguf(str(folder), tmp_path / "out.gguf").path).model
    ours = read_model_dir(folder)
    for name, t in ours.tensors.items():
        assert np.asarray(back.tensors[name]).tobytes() == np.asarray(t).tobytes(), name


def test_an_export_runs_as_the_model_it_came_from(tmp_path):
    folder = quantized(tmp_path, "llama", 4, 32)
    out = export_gguf(str(folder), tmp_path / "out.gguf").path
    logits = []
    for ref in (folder, out):
        model, _ = load(str(ref))
        logits.append(model.forward(np.array(IDS), model.new_cache(64), all_logits=True))
    assert np.array_equal(logits[0], logits[1])


def test_int8_is_rounded_again_and_says_by_how_much(tmp_path):
    folder = quantized(tmp_path, "llama", 8, 64)
    exported = export_gguf(str(folder), tmp_path / "out.gguf")
    assert set(exported.again.values()) == {"int8 g64 -> Q8_0"} and len(exported.again) == 15   # 7 a layer, the embedding
    assert 0 < exported.kl < 0.01
    assert "rounded again: 15 int8 g64 -> Q8_0;" in str(exported) and "KL against nibble's model" in str(exported)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(exported.path).tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["output_norm.weight"] == "F32"


def test_llama3_rope_scaling_goes_as_rope_freqs(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    folder = quantized(tmp_path, "llama", 4, 32, rope_theta=500000.0, rope_scaling=scaling)
    back = import_gguf(export_gguf(str(folder), tmp_path / "out.gguf").path).model
    assert back.config.rope_scaling == scaling


def test_a_gguf_goes_back_byte_for_byte(tmp_path):
    source = Path(__file__).parent / "data" / "gguf" / "smollm3.gguf"
    out = export_gguf(str(source), tmp_path / "out.gguf").path
    a, b = gguf.GGUFReader(source), gguf.GGUFReader(out)
    skip = ("GGUF.", "general.alignment")
    assert ({k: f.contents() for k, f in a.fields.items() if not k.startswith(skip)}
            == {k: f.contents() for k, f in b.fields.items() if not k.startswith(skip)})
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in a.tensors] == \
           [(t.name, t.tensor_type, t.data.tobytes()) for t in b.tensors]


@pytest.mark.parametrize("model_type, bits, group_size", LLAMA_CPP)
def test_llama_cpp_runs_the_export(tmp_path, model_type, bits, group_size):
    """llama.cpp's logits of these exports (recorded with llama-cpp-python) against nibble's run
    of the same files: each position's next token alike, the logits within llama.cpp's rounding
    of the activations (to 8 bits, as nibble's own) apart."""
    name = f"{model_type}-int{bits}-g{group_size}"
    recorded = json.loads((DATA / f"{name}.json").read_text())
    out = export_gguf(str(quantized(tmp_path, model_type, bits, group_size)), tmp_path / f"{name}.gguf").path
    assert hashlib.sha256(out.read_bytes()).hexdigest() == recorded["sha256"], \
        "the export changed: run tests/fixtures/make_export_fixtures.py to record llama.cpp's logits again"
    theirs = np.array(recorded["logits"], np.float32)
    model, _ = load(str(out))
    ours = model.forward(np.array(recorded["ids"]), model.new_cache(64), all_logits=True)
    assert np.abs(ours - theirs).max() < 0.05 * np.abs(theirs).max()
    p, q = (np.exp(x - x.max(-1, keepdims=True)) for x in (theirs, ours))
    p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
    assert (p * np.log(p / q)).sum(-1).mean() < 1e-3


def test_what_cannot_be_exported_is_one_line(tmp_path):
    gemma = write_model_dir(tiny_model_dir("gemma3_text"), tmp_path / "gemma")
    with pytest.raises(NibbleError, match="nibble writes GGUF files of llama, mistral, qwen2, qwen3 models, not gemma3_text"):
        export_gguf(str(gemma), tmp_path / "out.gguf")
    smollm3 = write_model_dir(tiny_model_dir("smollm3"), tmp_path / "smollm3")   # layers without RoPE
    with pytest.raises(NibbleError, match="not smollm3"):
        export_gguf(str(smollm3), tmp_path / "out.gguf")
    mistral = write_model_dir(tiny_model_dir("mistral"), tmp_path / "mistral")
    with pytest.raises(NibbleError, match="sliding window"):
        export_gguf(str(mistral), tmp_path / "out.gguf")
    folder = quantized(tmp_path, "llama", 4, 32)
    with pytest.raises(NibbleError, match="ends in .gguf"):
        export_gguf(str(folder), tmp_path / "out.bin")
    (tmp_path / "there.gguf").write_bytes(b"mine")
    result = CliRunner().invoke(main, ["export", str(folder), "--to", "gguf", "-o", str(tmp_path / "there.gguf")])
    assert result.exit_code == 1 and "already exists" in result.output
    assert (tmp_path / "there.gguf").read_bytes() == b"mine"   # nothing lost
    assert list(tmp_path.glob(".*tmp*")) == []


def test_a_tokenizer_llama_cpp_cannot_split_alike_is_refused():
    tok = tiny_model_dir().tokenizer
    spec = json.loads(tok.to_str())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    with pytest.raises(NibbleError, match="not a byte-level BPE split as one of llama.cpp's pre-tokenizers"):
        gguf_tokenizer.gguf_vocab(tokenizers.Tokenizer.from_str(json.dumps(spec)), {}, 320)


def rounded_to_half(floats: dict[str, np.ndarray], names) -> dict[str, np.ndarray]:
    """The weights `names` rounded to float16, as compressed-tensors' dequantization computes
    them ((q - z) * scale in the scales' float16)."""
    return {k: v.astype(np.float16).astype(np.float32) if k in names else v for k, v in floats.items()}


@pytest.mark.parametrize("model_type, bits, group_size", COMPRESSED)
def test_compressed_tensors_export_is_what_transformers_runs(tmp_path, model_type, bits, group_size):
    """transformers' logits of these exports (recorded with compressed-tensors installed) are the
    numpy reference's of nibble's weights: to float32's rounding once the weights are rounded to
    float16 as the library's dequantization rounds them (so every integer, scale and zero point is
    where transformers reads it), and within 1.5e-3 of the logits' scale of nibble's weights
    themselves (that rounding: 0.7e-3 at 4 bits, 1.04e-3 at 8 bits, where (q - z) has more bits)."""
    name = f"{model_type}-int{bits}-g{group_size}-zeros"
    recorded = json.loads((DATA / f"{name}.json").read_text())
    folder = quantized(tmp_path, model_type, bits, group_size, integer_zeros=True)
    exported = export_compressed(str(folder), tmp_path / f"{name}-ct")
    assert exported.again == {} and "every weight as nibble runs it" in str(exported)
    assert hashlib.sha256((exported.path / "model.safetensors").read_bytes()).hexdigest() == recorded["sha256"], \
        "the export changed: run tests/fixtures/make_export_fixtures.py transformers to record its logits again"
    theirs = np.array(recorded["logits"], np.float32)
    model = read_model_dir(folder)
    floats = dequantized(model.tensors, model.config.quantization)
    blocks = [n for n in floats if ".layers." in n and f"{n[:-7]}.scales" in model.tensors]
    scale = np.abs(theirs).max()
    assert np.abs(reference.forward(model.config, rounded_to_half(floats, blocks), IDS) - theirs).max() < 1e-5 * scale
    assert np.abs(reference.forward(model.config, floats, IDS) - theirs).max() < 1.5e-3 * scale
    config = json.loads((exported.path / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"] == {
        "num_bits": bits, "type": "int", "symmetric": False, "strategy": "group", "group_size": group_size,
        "dynamic": False, "actorder": None, "observer": "minmax"}


def test_integer_zero_points_are_integers(tmp_path):
    free = quantize_model(tiny_model_dir("qwen2"), 4, 64)
    zeros = quantize_model(tiny_model_dir("qwen2"), 4, 64, integer_zeros=True)
    for name, t in zeros.model.tensors.items():
        if name.endswith(".scales"):
            s, b = t, zeros.model.tensors[name.replace(".scales", ".biases")]
            assert s.dtype == b.dtype == np.float32
            assert np.array_equal(s.astype(np.float16).astype(np.float32), s)   # float16 scales' values
            z = -b / np.where(s == 0, 1, s)
            assert np.array_equal(z, np.rint(z)) and z.min() >= 0 and z.max() <= 15
    # the constraint costs a little of the fit, far less than rounding free biases afterwards
    ratio = np.mean(list(zeros.errors.values())) / np.mean(list(free.errors.values()))
    assert 1 <= ratio < 1.3


def test_free_biases_are_rounded_to_integer_zero_points_and_measured(tmp_path):
    exported = export_compressed(str(quantized(tmp_path, "llama", 4, 32)), tmp_path / "ct")
    assert len(exported.again) == 14 and exported.kl > 0   # 7 matrices a layer; the tied embedding stays float
    assert "rounded again: 14 int4 g32 -> integer zero points;" in str(exported)
    config = json.loads((exported.path / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ["lm_head"] and "quantization" not in config


def test_quantize_for_vllm_on_the_command_line(tiny_dir, tmp_path):
    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["quantize", str(tiny_dir), "-o", str(out), "--bits", "4", "--for", "vllm"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["export", str(out), "--to", "compressed-tensors", "-o", str(tmp_path / "ct")])
    assert result.exit_code == 0 and "every weight as nibble runs it" in result.output


def test_float32_scales_go_to_q4_1_with_their_integers(tmp_path):
    # groups of 32, as the test above measures: the KL runs the model on the layer compiled there
    # (float32 scales' other group sizes: test_quant_kernels, and groups of 64 to Q4_1: the first test)
    folder = quantized(tmp_path, "llama", 4, 32, integer_zeros=True)
    exported = export_gguf(str(folder), tmp_path / "out.gguf")
    assert set(exported.again.values()) == {"int4 g32 -> Q4_1 (scales and biases to float16)"}
    assert 0 < exported.kl < 1e-3
    ours, back = read_model_dir(folder), import_gguf(exported.path).model
    for name, v in values(ours).items():
        w = values(back)[name]
        assert np.abs(w - v).max() <= 2e-3 * np.abs(v).max(), name   # float16's rounding of scale and bias


@pytest.mark.slow
def test_smollm2_through_nibble_and_back_is_the_same_file(smollm2_gguf, tmp_path):
    """The real SmolLM2's Q4_1 GGUF imported into nibble's layout (`nibble import`), then exported:
    every tensor the very bytes llama.cpp's converter wrote (q/k rows permuted back), the
    tokenizer's tokens and merges the file's."""
    folder = tmp_path / "smollm2"
    assert CliRunner().invoke(main, ["import", str(smollm2_gguf), "-o", str(folder)]).exit_code == 0
    exported = export_gguf(str(folder), tmp_path / "back.gguf")
    assert exported.again == {}
    a, b = gguf.GGUFReader(smollm2_gguf), gguf.GGUFReader(exported.path)
    theirs = {t.name: (t.tensor_type, t.data.tobytes()) for t in a.tensors}
    ours = {t.name: (t.tensor_type, t.data.tobytes()) for t in b.tensors}
    assert theirs.keys() == ours.keys()
    for name in theirs:
        assert ours[name] == theirs[name], name
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.pre", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id"):
        assert b.fields[key].contents() == a.fields[key].contents(), key


def test_an_imported_k_quant_goes_back_byte_for_byte(tmp_path):
    """A Q4_K_M-like file (Q4_K, Q5_K and Q6_K matrices) through `nibble import` and back: every
    tensor the file's bytes, q/k rows permuted back included."""
    from tests.test_gguf import TOKENS, llama_cpp_tensors, random_blocks, write_gguf
    from tests.tiny import tiny_config, tiny_tensors
    config = tiny_config(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512)
    rng = np.random.default_rng(0)
    types = {"attn_q": gguf.GGMLQuantizationType.Q4_K, "attn_k": gguf.GGMLQuantizationType.Q5_K,
             "attn_v": gguf.GGMLQuantizationType.Q6_K, "attn_output": gguf.GGMLQuantizationType.Q4_K,
             "ffn_gate": gguf.GGMLQuantizationType.Q4_K, "ffn_up": gguf.GGMLQuantizationType.Q5_K,
             "ffn_down": gguf.GGMLQuantizationType.Q6_K}
    tensors = {}
    for name, w in llama_cpp_tensors(tiny_tensors(config), config).items():
        kind = name.split(".")[-2]
        tensors[name] = (random_blocks(rng, w.shape[0], w.shape[1], types[kind]), types[kind]) if kind in types else w
    source = write_gguf(tmp_path / "k.gguf", tensors, config=config)
    folder = tmp_path / "imported"
    assert CliRunner().invoke(main, ["import", str(source), "-o", str(folder)]).exit_code == 0
    exported = export_gguf(str(folder), tmp_path / "back.gguf")
    assert exported.again == {}
    theirs = {t.name: (t.tensor_type, t.data.tobytes()) for t in gguf.GGUFReader(source).tensors}
    ours = {t.name: (t.tensor_type, t.data.tobytes()) for t in gguf.GGUFReader(exported.path).tensors}
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name] == theirs[name], name
