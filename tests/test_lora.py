"""LoRA adapters as PEFT saves them (formats/lora.py) merged into a model (runner/convert/merge.py,
`nibble merge`): against PEFT's own model with the adapter, on tests/data/transformers/llama3 and
the adapters tests/fixtures/make_lora_fixtures.py made (every A and B random; rank 4 over the
seven projections, and rank 8 rsLoRA over three)."""
import dataclasses
import json
import shutil

import numpy as np
import pytest

from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.half import HalfTensor
from nibble.formats.lora import PREFIX, parse_ref, read_lora
from nibble.formats.model_dir import ModelDir, read_model_dir, write_model_dir
from nibble.formats.safetensors import read_safetensors
from nibble.quant.convert import quantize_model
from nibble.runner.convert.merge import merged
from nibble.runner.model import Model
from tests.test_cli import assert_one_line_error, invoke
from tests.test_transformers import DATA as TRANSFORMERS, load, relative_error
from tests.tiny import tiny_tokenizer

LORA = TRANSFORMERS.parent / "lora"
ADAPTERS = ["llama3-r4", "llama3-r8-rslora"]


def base() -> ModelDir:
    config, tensors, _, _ = load("llama3")
    return ModelDir(None, config, tensors, tiny_tokenizer())


def widened(t) -> np.ndarray:
    return t.widen() if isinstance(t, HalfTensor) else np.asarray(t, np.float32)


def logits(model_dir: ModelDir) -> np.ndarray:
    model = Model(model_dir.config, model_dir.tensors)
    return model.forward(np.load(TRANSFORMERS / "llama3" / "tokens.npy"), model.new_cache(), all_logits=True)


@pytest.mark.parametrize("name", ADAPTERS)
def test_a_merged_adapter_gives_pefts_logits(name):
    want = np.load(LORA / name / "logits.npy")
    assert relative_error(logits(merged(base(), [read_lora(LORA / name)])), want) < 1e-4
    assert relative_error(np.load(LORA / name / "merged.npy"), want) < 1e-5   # PEFT merged alike
    assert relative_error(logits(base()), want) > 1e-2   # the adapter changes them: the check is sensitive


def test_the_scales_are_peft_s():
    """B carries the adapter's own scale (lora_alpha / r, rsLoRA's / sqrt(r)); `scale` is the user's."""
    plain, rs = read_lora(LORA / "llama3-r4"), read_lora(LORA / "llama3-r8-rslora", 0.5)
    assert plain.scale == 1 and rs.scale == 0.5
    assert len(plain.pairs) == 2 * 7 and len(rs.pairs) == 2 * 3
    for lora, own in ((plain, 8 / 4), (rs, 4 / 8 ** 0.5)):
        stored = read_safetensors(lora.path / "adapter_model.safetensors")
        module = next(iter(lora.pairs))
        a, b = lora.pairs[module]
        np.testing.assert_array_equal(a, widened(stored[f"{PREFIX}{module}.lora_A.weight"]))
        np.testing.assert_allclose(b, own * widened(stored[f"{PREFIX}{module}.lora_B.weight"]), rtol=1e-6)
    a, b = plain.pairs["model.layers.1.mlp.down_proj"]
    assert a.shape == (4, 128) and b.shape == (64, 4)
    assert parse_ref("/a/b:0.5") == ("/a/b", 0.5) and parse_ref("/a/b") == ("/a/b", 1.0) and parse_ref("c:d") == ("c:d", 1.0)
    for scale in ("1e9", "nan", "-101"):
        with pytest.raises(FormatError, match="a number from -100 to 100"):
            parse_ref(f"/a/b:{scale}")


def test_two_adapters_add_up_and_a_scale_scales():
    both = merged(base(), [read_lora(LORA / "llama3-r4"), read_lora(LORA / "llama3-r8-rslora", 0.5)])
    name = "model.layers.0.self_attn.q_proj"
    want = base().tensors[name + ".weight"].widen() + read_lora(LORA / "llama3-r4").delta(name) \
        + 0.5 * read_lora(LORA / "llama3-r8-rslora").delta(name)
    np.testing.assert_allclose(both.tensors[name + ".weight"], want, rtol=1e-6, atol=1e-6)


def test_a_quantized_base_keeps_its_other_modules_quantized():
    q = quantize_model(base(), 8, 32, method="rtn").model
    out = merged(q, [read_lora(LORA / "llama3-r8-rslora")])
    assert out.config.quantization["model.layers.0.self_attn.q_proj"] is False
    assert "model.layers.0.self_attn.q_proj.scales" not in out.tensors and "model.layers.0.self_attn.k_proj.scales" in out.tensors
    want, got = np.load(LORA / "llama3-r8-rslora" / "logits.npy"), logits(out)
    # the other modules' int8 weights, and activations rounded to int8 where the CPU multiplies bytes
    assert relative_error(got, want) < 5e-2 and (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora: nibble applies no DoRA"),
    ({"bias": "all"}, "nibble applies no biases"),
    ({"modules_to_save": ["lm_head"]}, "whole modules it replaces"),
    ({"peft_type": "IA3"}, "a IA3 adapter"),
    ({"r": 0}, "r must be a positive integer"),
    ({"r": 5}, "are not of rank 5"),
])
def test_what_nibble_cannot_apply_is_said(tmp_path, change, message):
    folder = tmp_path / "a"
    shutil.copytree(LORA / "llama3-r4", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | change))
    with pytest.raises(FormatError, match=message):
        read_lora(folder)


def test_an_adapter_of_another_model_is_refused():
    small = dataclasses.replace(base(), tensors={k: v for k, v in base().tensors.items() if "layers.1." not in k})
    with pytest.raises(FormatError, match="changes model.layers.1.*which the model does not have"):
        merged(small, [read_lora(LORA / "llama3-r4")])


def test_nibble_merge_writes_a_model_that_runs_as_peft_s(tmp_path):
    folder = write_model_dir(base(), tmp_path / "base")
    r = invoke("merge", folder, "--lora", f"{LORA / 'llama3-r4'}:1", "-o", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert "14 modules merged from 1 adapter" in r.stderr
    assert relative_error(logits(read_model_dir(tmp_path / "out")), np.load(LORA / "llama3-r4" / "logits.npy")) < 1e-4
    assert_one_line_error(invoke("merge", folder, "--lora", tmp_path, "-o", tmp_path / "x"), 1, "holds no adapter_config.json")
    assert_one_line_error(invoke("merge", folder, "--lora", LORA / "llama3-r4", "-o", tmp_path / "out"), 1, "already exists")


@pytest.mark.parametrize("name", ADAPTERS)
def test_an_adapter_beside_the_weights_gives_pefts_logits(name):
    """Unmerged (kernels/linear.LoRAWeight: x @ W.T + (x @ A.T) @ B.T in the same pass): in one
    pass and a token at a time."""
    config, tensors, tokens, _ = load("llama3")
    want = np.load(LORA / name / "logits.npy")
    model = Model(config, tensors, loras=[read_lora(LORA / name)])
    assert relative_error(model.forward(tokens, model.new_cache(), all_logits=True), want) < 1e-4
    cache = model.new_cache()
    assert relative_error(np.concatenate([model.forward(tokens[i:i + 1], cache) for i in range(len(tokens))]), want) < 1e-4


def test_an_adapter_beside_quantized_weights_adds_its_product_to_theirs():
    """Each projection of an int8 model with an adapter: its twin x @ W.T on the dequantized
    weights plus the adapter's float product at each row's own scale, to the int8 kernels'
    rounding of x (decode and prefill); a row at scale 0 gets exactly the base's output."""
    from nibble.quant.convert import read_linear
    from nibble.quant.affine import dequantize
    from nibble.runner.kernels.linear import LoRAWeight, linear
    from nibble.runner.model import TensorGetter
    q = quantize_model(base(), 8, 32, method="rtn").model
    get = TensorGetter(q.tensors, q.config.quantization, [read_lora(LORA / "llama3-r4")], rows=20)
    for module, shape in [("model.layers.0.self_attn.q_proj", (64, 64)), ("model.layers.1.mlp.down_proj", (64, 128))]:
        w = get.linear(module, shape)
        assert isinstance(w, LoRAWeight)
        W = dequantize(read_linear(q.tensors, q.config.quantization, module))
        for T in (1, 3, 20):
            rng = np.random.default_rng(T)
            x = rng.standard_normal((T, shape[1])).astype(np.float32)
            s = rng.choice(np.float32([0, 1, 0.5, -2]), T)
            s[0] = 1
            get.scales[:T, 0] = s
            out, alone = np.zeros((T, shape[0]), np.float32), np.zeros((T, shape[0]), np.float32)
            linear(x, w, out, False)
            linear(x, w.base, alone, False)
            want = x @ W.T + ((x @ w.a.T) * s[:, None]) @ w.b.T
            assert np.abs(out - want).max() <= 1e-2 * np.abs(want).max()
            np.testing.assert_array_equal(out[s == 0], alone[s == 0])
            get.scales[:T] = 0
            linear(x, w, out, False)
            np.testing.assert_array_equal(out, alone)


def test_nibble_run_with_an_adapter_runs_as_the_merged_model(tmp_path):
    folder = write_model_dir(base(), tmp_path / "base")
    assert invoke("merge", folder, "--lora", LORA / "llama3-r4", "-o", tmp_path / "merged").exit_code == 0
    beside = invoke("run", "-m", folder, "--lora", LORA / "llama3-r4", "--temp", "0", "-n", "8", "--raw", "Hello")
    merged_run = invoke("run", "-m", tmp_path / "merged", "--temp", "0", "-n", "8", "--raw", "Hello")
    assert beside.exit_code == merged_run.exit_code == 0 and beside.stdout == merged_run.stdout != ""
    assert_one_line_error(invoke("run", "-m", folder, "--lora", tmp_path, "Hi"), 1, "holds no adapter_config.json")


def test_each_sequence_of_a_pass_runs_its_own_adapters():
    """Four sequences in one forward_batch, each at its own scales of two adapters (vLLM's punica):
    each gets the logits of the model merged at its scales, and the one with none the base's bits."""
    from nibble.runner.kv.cache import Rows
    config, tensors, tokens, _ = load("llama3")
    loras = [read_lora(LORA / "llama3-r4"), read_lora(LORA / "llama3-r8-rslora")]
    model = Model(config, tensors, loras=loras)
    scales = np.float32([[1, 0], [0, 0], [0, 0.5], [1, 0.5]])
    T, S = len(tokens), len(scales)
    pool = model.new_pool(S * 2)
    rows = Rows.of(np.tile(np.arange(T), S), np.repeat(np.arange(S), T), np.arange(S * 2).reshape(S, 2))
    got = model.forward_batch(np.tile(tokens, S), rows, pool, np.arange(S * T), adapters=scales).reshape(S, T, -1)
    for s, (r4, rs) in zip(got, scales):
        both = [dataclasses.replace(loras[0], scale=float(r4)), dataclasses.replace(loras[1], scale=float(rs))]
        assert relative_error(s, logits(merged(base(), both))) < 1e-4
    plain = Model(config, tensors)
    np.testing.assert_array_equal(got[1], plain.forward(tokens, plain.new_cache(), all_logits=True))
    # one sequence: its scales given, or the model's own (lora_scales, from each adapter's scale)
    alone = model.forward(tokens, model.new_cache(), all_logits=True, adapters=scales[2])
    assert relative_error(alone, got[2]) < 1e-5
    model.lora_scales[:] = scales[3]
    assert relative_error(model.forward(tokens, model.new_cache(), all_logits=True), got[3]) < 1e-5
    with pytest.raises(NibbleError, match="a scale for each of the 2 adapters"):
        model.forward(tokens, model.new_cache(), adapters=[1.0])


def test_an_int8_base_runs_its_fused_projections_with_the_adapters_beside():
    """q/k/v and gate/up of an int8 base share x rounded once (kernels/linear.py's fused paths)
    with the adapters added beside each: prefill and decode agree, the adapter brings the logits
    ten times nearer PEFT's (the int8 base's own rounding left), and a pass at scale 0 is the
    int8 model's bit for bit."""
    tokens, want = np.load(TRANSFORMERS / "llama3" / "tokens.npy"), np.load(LORA / "llama3-r4" / "logits.npy")
    q = quantize_model(base(), 8, 32, method="rtn").model
    model, plain = Model(q.config, q.tensors, loras=[read_lora(LORA / "llama3-r4")]), Model(q.config, q.tensors)
    prefill = model.forward(tokens, model.new_cache(), all_logits=True)
    cache = model.new_cache()
    decode = np.concatenate([model.forward(tokens[i:i + 1], cache) for i in range(len(tokens))])
    alone = plain.forward(tokens, plain.new_cache(), all_logits=True)
    assert relative_error(decode, prefill) < 1e-4
    assert relative_error(prefill, want) < relative_error(alone, want) / 10
    np.testing.assert_array_equal(model.forward(tokens, model.new_cache(), all_logits=True, adapters=[0.0]), alone)
