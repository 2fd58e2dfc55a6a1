"""`nibble bench` on the tiny model: figures present and consistent (speed is not asserted)."""
import json
import math

import numpy as np
import pytest

from nibble.runner.measure import synthetic
from nibble.runner.measure.bench import memory_bandwidth, peak_gops, prefill_ops, weight_bytes_per_token
from nibble.runner.kernels import prefill_int8
from nibble.runner.loader import from_model_dir
from tests.test_cli import assert_one_line_error, invoke
from tests.tiny import tiny_model_dir


def test_bench_json(tiny_dir):
    r = invoke("bench", "-m", tiny_dir, "-p", 16, "-n", 8, "-r", 1, "--json")
    assert r.exit_code == 0, r.output
    f = json.loads(r.stdout)
    assert f["prompt_tokens"] == 16 and f["gen_tokens"] == 8
    assert f["prefill_tps"] > 0 and f["decode_tps"] > 0 and f["bandwidth_gbs"] > 0
    want = f["decode_tps"] * f["weight_bytes_per_token"] / (f["bandwidth_gbs"] * 1e9)
    assert abs(f["decode_fraction"] - want) < 1e-9
    model, _ = from_model_dir(tiny_model_dir())
    assert f["prefill_gops"] == pytest.approx(prefill_ops(model, 16) * f["prefill_tps"] / 16 / 1e9)
    assert f["peak_gops"] is None   # a float model: its prefill runs float tiles


def test_prefill_ops_count_each_product_once():
    """Every matrix for each token, attention's two products over the T (T + 1) / 2 pairs of
    positions of each head, the head for the last token; a multiply and an add each."""
    model, _ = from_model_dir(tiny_model_dir())
    c = model.config
    D, F, H, Hkv, hd, L, T = (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                              c.head_dim, c.num_hidden_layers, 16)
    per_layer = (H + 2 * Hkv) * hd * D + H * hd * D + 3 * D * F
    assert prefill_ops(model, T) == 2 * (T * L * per_layer + L * H * hd * T * (T + 1) + c.vocab_size * D)


def test_prefill_ops_of_a_mixture_count_its_routed_experts():
    moe = dict(SMALL, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    model = synthetic.random_model(moe, bits=4, group_size=32)
    dense = (4 + 2 * 2) * 16 * 64 + 4 * 16 * 64         # q, k, v and o: hd 16
    routed = 8 * 64 + 2 * 3 * 64 * 64                    # the router, 2 of 8 experts' 3 matrices
    assert prefill_ops(model, 1) == 2 * (2 * (dense + routed) + 2 * 4 * 16 * 1 * 2 + 96 * 64)


def test_peak_of_the_byte_dot_products_is_measured():
    peak = peak_gops(steps=10_000, repeats=1)
    assert (peak is None) if prefill_int8.DOT is None else peak > 0


def test_weight_bytes_count_every_matrix_once():
    model, _ = from_model_dir(tiny_model_dir())
    c = model.config
    D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
    per_layer = (2 * D + (c.num_attention_heads + 2 * c.num_key_value_heads) * hd * (D + 1)
                 + c.num_attention_heads * hd * D + 3 * D * F)
    assert weight_bytes_per_token(model) == 4 * (c.num_hidden_layers * per_layer + c.vocab_size * D + 2 * D)


def test_memory_bandwidth_is_measured():
    assert memory_bandwidth(1 << 24, repeats=1) > 0


def test_bench_too_long_for_the_context(tiny_dir):
    assert_one_line_error(invoke("bench", "-m", tiny_dir, "-p", 200, "-n", 100), match="do not fit")


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)


def test_random_model_has_the_shapes_and_quantization():
    model = synthetic.random_model(SMALL, bits=4)
    c = model.config
    assert (c.num_hidden_layers, c.vocab_size, c.quantization["bits"]) == (2, 96, 4)
    assert model.layers[0].w_gate.weight.nbytes * 8 / (128 * 64) == 4          # bits a weight
    assert model.layers[0].w_gate.weight is not model.layers[1].w_gate.weight
    logits = model.forward([1, 2, 3], model.new_cache(8))
    assert logits.shape == (1, 96) and np.isfinite(logits).all() and logits.std() > 0


@pytest.mark.parametrize("name, billions", [("llama-3.2-1b", 1.24), ("llama-3.2-3b", 3.21),
                                            ("llama-2-7b", 6.74), ("qwen3-8b", 8.19), ("qwen3-30b-a3b", 30.53)])
def test_shapes_have_the_models_parameter_count(name, billions):
    """Each entry of SHAPES holds as many parameters as the model card says (qwen3's q/k norms,
    a few thousand, aside): the synthetic model reads the bytes the real one would."""
    shapes = synthetic.weight_shapes(synthetic._config(name)).values()
    assert sum(math.prod(s) for s in shapes) / 1e9 == pytest.approx(billions, abs=0.005)


def test_a_mixture_of_experts_reads_its_routed_experts_per_token():
    """A random MoE model (qwen3_moe's block, stacked int4 experts) runs, and the bytes a decoded
    token reads count top_k of the E experts of each layer, not all of them."""
    moe = dict(SMALL, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    model = synthetic.random_model(moe, bits=4, group_size=32)
    layer = model.layers[0]
    experts = sum(w.nbytes for w in (layer.moe.w_gate, layer.moe.w_up, layer.moe.w_down))
    assert layer.moe.w_gate.weight.shape == (8, 64, 64 * 4 // 32)   # [E, F, D / 8 a word]
    assert layer.moe.nbytes == layer.moe.router.nbytes + experts * 2 // 8
    logits = model.forward([1, 2, 3], model.new_cache(8))
    assert logits.shape == (1, 96) and np.isfinite(logits).all() and logits.std() > 0


def test_tied_shapes_have_no_head():
    model = synthetic.random_model(dict(SMALL, tie_word_embeddings=True), bits=4)
    assert "lm_head.weight" not in synthetic.weight_shapes(model.config)
    logits = model.forward([1, 2, 3], model.new_cache(8))
    assert logits.shape == (1, 96) and np.isfinite(logits).all()


def test_bench_with_shapes(monkeypatch):
    monkeypatch.setitem(synthetic.SHAPES, "small", SMALL)
    r = invoke("bench", "--shapes", "small", "--quant", "int8", "-p", 4, "-n", 2, "-r", 1, "--json")
    assert r.exit_code == 0, r.output
    f = json.loads(r.stdout)
    assert f["decode_tps"] > 0
    assert f["weight_bytes_per_token"] == weight_bytes_per_token(synthetic.random_model(SMALL, bits=8))


def test_bench_with_unknown_shapes():
    assert_one_line_error(invoke("bench", "--shapes", "llama-9b"), match="unknown shapes 'llama-9b'")


def test_bench_parallel_json(tiny_dir):
    r = invoke("bench", "-m", tiny_dir, "-p", 20, "-n", 6, "-r", 2, "--parallel", 3, "--json")
    assert r.exit_code == 0, r.output
    f = json.loads(r.stdout)
    assert (f["streams"], f["prompt_tokens"], f["gen_tokens"], f["repeats"]) == (3, 20, 6, 2)
    assert f["single_tps"] > 0 and f["parallel_tps"] > 0
    assert f["speedup"] == f["parallel_tps"] / f["single_tps"]



MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def test_bench_matrices_times_each_kind_of_matrix(monkeypatch):
    """--matrices: every matrix of every layer in exactly one row of its name and kind, and the
    head; the figures each row's own arithmetic (speed is not asserted)."""
    monkeypatch.setitem(synthetic.SHAPES, "small", SMALL)
    r = invoke("bench", "--shapes", "small", "--quant", "int4", "--matrices", "-r", 2, "-t", 1, "--json")
    assert r.exit_code == 0, r.output
    f = json.loads(r.stdout)
    model = synthetic.random_model(SMALL, bits=4)
    rows = {m["name"]: m for m in f["matrices"]}
    assert len(rows) == len(f["matrices"]) == len(MATRICES) + 1   # one kind each here
    for name in MATRICES:
        m, w = rows[name], getattr(model.layers[0], name)
        assert (m["rows"], m["cols"], m["nbytes"], m["layers"]) == (*w.shape, w.nbytes, 2)
        assert m["kind"] == f"int4 g{w.group_size}"
        assert m["memory_s"] > 0 and m["cached_s"] > 0
        assert m["token_s"] == m["layers"] * m["memory_s"]
        assert m["memory_gbs"] == pytest.approx(w.nbytes / m["memory_s"] / 1e9)
        assert m["needed_gws"] == pytest.approx(f["bandwidth_gbs"] * w.shape[0] * w.shape[1] / w.nbytes)
    assert (rows["head"]["rows"], rows["head"]["layers"]) == (96, 1)
    assert f["nbytes"] == sum(w.nbytes for layer in model.layers for w in (getattr(layer, n) for n in MATRICES)) + \
        model.lm_head.nbytes
    assert f["token_s"] == pytest.approx(sum(m["token_s"] for m in f["matrices"]))
    assert f["threads"] == 1


def test_bench_matrices_of_a_float_model_as_a_table(tiny_dir):
    r = invoke("bench", "-m", tiny_dir, "--matrices", "-r", 1)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["matrix", "kind"]
    model, _ = from_model_dir(tiny_model_dir())
    names = [line.split()[0] for line in lines[1:-2]]
    assert names == [n for n in model.layers[0]._fields if getattr(model.layers[0], n).ndim == 2] + ["head"]
    assert all(line.split()[1] == "float32" for line in lines[1:-2])
    assert lines[-2].startswith("the matrices: ") and "median of 1)" in lines[-2]


@pytest.mark.parametrize("flags", [("--parallel", 2), ("--gpu-layers", 1)])
def test_bench_matrices_alone(tiny_dir, flags):
    assert_one_line_error(invoke("bench", "-m", tiny_dir, "--matrices", *flags), code=2, match="--matrices times the CPU")
