"""LoRA adapters as llama.cpp's convert_lora_to_gguf.py writes them (formats/lora.py's GGUF files):
tests/fixtures/make_lora_gguf.py's conversions of tests/data/lora/llama3-r4 (f32 and q8_0) read
against the PEFT folder and run against PEFT's logits; what nibble cannot apply refused in a line."""
import dataclasses

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from nibble.formats.errors import FormatError
from nibble.formats.lora import read_lora
from nibble.formats.model_dir import read_model_dir, write_model_dir
from nibble.runner.convert.merge import merged
from nibble.runner.model import Model
from tests.test_cli import assert_one_line_error, invoke
from tests.test_gguf import written
from tests.test_lora import LORA, base, logits
from tests.test_transformers import DATA as TRANSFORMERS, load, relative_error

PEFT = LORA / "llama3-r4"
GGUF = LORA / "llama3-r4.gguf"
Q8_0 = LORA / "llama3-r4-q8_0.gguf"   # lora_a Q8_0, lora_b float16 (4 wide: no block of 32)
MODEL = TRANSFORMERS.parent / "gguf" / "mixtral.gguf"   # a model's GGUF, general.type "model"
META = {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 8.0}
V = "blk.0.attn_v.weight"   # [32, 64] in the tiny Llama: not permuted


def write_adapter(path, tensors: dict, meta: dict = META, arch: str = "llama"):
    """A GGUF adapter: `tensors` maps names to float32 arrays or (raw data, type) pairs; a `meta`
    value of None leaves its key out."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif value is not None:
            w.add_array(key, value)
    return written(w, tensors, path)


def v_pair(r_a=4, r_b=4) -> dict:
    """A random pair for blk.0's v_proj, A of rank r_a and B of r_b."""
    rng = np.random.default_rng(0)
    return {f"{V}.lora_a": rng.standard_normal((r_a, 64)).astype(np.float32),
            f"{V}.lora_b": rng.standard_normal((32, r_b)).astype(np.float32)}


def test_the_pairs_are_the_peft_folder_s():
    """Same modules, A the same, B times alpha / r the same once for_model has put a llama file's
    q and k rows back in Hugging Face's order (the file holds no head counts)."""
    peft, read = read_lora(PEFT), read_lora(GGUF, 0.5)
    assert read.scale == 0.5
    assert sorted(read.rope_rows) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qk")
    q = "model.layers.0.self_attn.q_proj"
    assert np.abs(read.pairs[q][1] - peft.pairs[q][1]).max() > 0.1   # llama.cpp's row order
    with pytest.raises(ValueError, match="for_model"):
        read.delta(q)
    got = read.for_model(base().config)
    assert got.for_model(base().config) is got and not got.rope_rows
    assert got.pairs.keys() == peft.pairs.keys()
    for module, (a, b) in peft.pairs.items():
        assert got.pairs[module][0].dtype == got.pairs[module][1].dtype == np.float32
        np.testing.assert_allclose(got.pairs[module][0], a, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got.pairs[module][1], b, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got.delta(q), 0.5 * peft.delta(q), rtol=1e-6, atol=1e-7)


def test_bf16_reads_as_f32(tmp_path):
    """The fixture's values are bfloat16's (make_lora_fixtures.py): written BF16 they read the same."""
    reader = gguf.GGUFReader(GGUF)
    tensors = {t.name: (gguf.quants.quantize(np.array(t.data), QType.BF16), QType.BF16) for t in reader.tensors}
    bf16 = read_lora(write_adapter(tmp_path / "bf16.gguf", tensors))
    f32 = read_lora(GGUF)
    for module, (a, b) in f32.pairs.items():
        np.testing.assert_array_equal(bf16.pairs[module][0], a)
        np.testing.assert_array_equal(bf16.pairs[module][1], b)


@pytest.mark.parametrize("alpha, own", [(8.0, 8 / 4), (2.0, 2 / 4), (0.0, 1), (None, 1)])
def test_b_carries_alpha_over_r_as_llama_cpp_scales(tmp_path, alpha, own):
    """llama.cpp: alpha / r, r each pair's (lora_b's width); no alpha, or 0: B as stored."""
    pair = v_pair()
    lora = read_lora(write_adapter(tmp_path / "a.gguf", pair, META | {"adapter.lora.alpha": alpha}))
    a, b = lora.pairs["model.layers.0.self_attn.v_proj"]
    np.testing.assert_array_equal(a, pair[f"{V}.lora_a"])
    np.testing.assert_allclose(b, own * pair[f"{V}.lora_b"], rtol=1e-6)
    assert not lora.rope_rows and lora.scale == 1


def test_q8_0_reads_as_gguf_rounds_it():
    """The converter's q8_0: each A PEFT's through Q8_0 and back, each B (float16) PEFT's."""
    peft, q8 = read_lora(PEFT), read_lora(Q8_0).for_model(base().config)
    assert q8.pairs.keys() == peft.pairs.keys()
    for module, (a, b) in peft.pairs.items():
        rounded = gguf.quants.dequantize(gguf.quants.quantize(a, QType.Q8_0), QType.Q8_0)
        np.testing.assert_array_equal(q8.pairs[module][0], rounded)
        np.testing.assert_array_equal(q8.pairs[module][1], b)


def test_merged_and_beside_the_weights_it_gives_pefts_logits():
    config, tensors, tokens, _ = load("llama3")
    want = np.load(PEFT / "logits.npy")
    model = Model(config, tensors, loras=[read_lora(GGUF)])
    assert relative_error(model.forward(tokens, model.new_cache(), all_logits=True), want) < 1e-4
    assert relative_error(logits(merged(base(), [read_lora(GGUF)])), want) < 1e-4


@pytest.mark.parametrize("arch, meta, tensors, message", [
    ("controlvector", {"general.type": None}, {"direction.1": np.zeros(64, np.float32)},
     "a control vector, not a LoRA adapter"),
    ("llama", {"adapter.type": "ia3"}, {}, "adapter.type 'ia3': nibble applies LoRA adapters"),
    ("llama", {"adapter.alora.invocation_tokens": [5, 6]}, {}, "nibble applies no activated LoRA"),
    ("llama", {"adapter.lora.alpha": "8"}, {}, "adapter.lora.alpha must be a number"),
    ("nonesuch", {}, {}, "unsupported GGUF architecture 'nonesuch'"),
    ("llama", {}, {f"{V}.lora_b": None}, f"{V} has lora_a without its pair"),
    ("llama", {}, v_pair(4, 3), f"{V}'s lora_a [4, 64] and lora_b [32, 3] are not A [r, in] and B [out, r]"),
    ("llama", {}, {"blk.0.attn_norm.weight": np.ones(64, np.float32)}, "blk.0.attn_norm.weight is no LoRA pair's"),
    ("llama", {}, {"token_embd.weight.lora_a": np.zeros((4, 128), np.float32),
                   "token_embd.weight.lora_b": np.zeros((64, 4), np.float32)}, "no adapter to the token embeddings"),
    ("llama", {}, {"blk.0.attn_nonesuch.weight.lora_a": np.zeros((4, 64), np.float32),
                   "blk.0.attn_nonesuch.weight.lora_b": np.zeros((64, 4), np.float32)},
     "blk.0.attn_nonesuch.weight has no Hugging Face counterpart"),
])
def test_what_nibble_cannot_apply_is_said_in_a_line(tmp_path, arch, meta, tensors, message):
    pairs = {k: v for k, v in (v_pair() | tensors).items() if v is not None}
    path = write_adapter(tmp_path / "bad.gguf", pairs, META | meta, arch)
    with pytest.raises(FormatError) as e:
        read_lora(path)
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_model_s_gguf_or_another_model_s_heads_are_refused():
    with pytest.raises(FormatError, match="general.type 'model', not a LoRA adapter"):
        read_lora(MODEL)
    other = dataclasses.replace(base().config, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(FormatError, match="blk.0.attn_k.weight.lora_b has 32 rows, not a multiple of 2 x 3 heads"):
        read_lora(GGUF).for_model(other)


def test_nibble_run_and_merge_take_a_gguf_adapter_as_the_folder(tmp_path):
    folder = write_model_dir(base(), tmp_path / "base")
    runs = [invoke("run", "-m", folder, "--lora", lora, "--temp", "0", "-n", "8", "--raw", "Hello")
            for lora in (GGUF, PEFT)]
    assert runs[0].exit_code == runs[1].exit_code == 0 and runs[0].stdout == runs[1].stdout != ""
    r = invoke("merge", folder, "--lora", GGUF, "-o", tmp_path / "out")
    assert r.exit_code == 0 and "14 modules merged from 1 adapter" in r.stderr, r.output
    assert relative_error(logits(read_model_dir(tmp_path / "out")), np.load(PEFT / "logits.npy")) < 1e-4
    assert_one_line_error(invoke("run", "-m", folder, "--lora", MODEL, "Hi"), 1, "not a LoRA adapter")
