"""`nibble quantize` streams tensor by tensor: the file it writes is quantize_model's in-memory
result on the importances calibration measured, made one module at a time, each block's right
after its calibration, with the input's memory-map pages given back as it goes; an error or
Ctrl-C leaves nothing. On random bf16 checkpoints from synthetic.write_random_checkpoint."""
import json
import os
import weakref

import numpy as np
import pytest

from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import read_model_dir
from nibble.formats.safetensors import TensorStream, write_safetensors
from nibble.quant.convert import QuantizePlan, quantize_model
from nibble.runner.measure import synthetic
from nibble.runner.model import Model
from nibble.runner.convert.quantize import calibrated_tensors, calibration_tokens, quantize
from tests.test_calibrate import imatrix
from tests.test_cli import assert_one_line_error, invoke

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
# Matrices of 0.5-1 MiB in bf16, 20 MiB in all: pages are 4 KiB, so what is resident is measurable.
WIDE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=512, max_position_embeddings=64)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return synthetic.write_random_checkpoint(SMALL, tmp_path_factory.mktemp("bf16") / "small")


def test_random_checkpoint_is_bf16_at_init_scale(bf16_dir):
    md = read_model_dir(bf16_dir)
    assert md.tensors.keys() == synthetic.weight_shapes(md.config).keys()
    assert all(isinstance(t, HalfTensor) and t.bf16 for t in md.tensors.values())
    w = np.asarray(md.tensors["model.layers.1.mlp.down_proj.weight"])
    assert w.shape == (64, 128) and abs(w.std() - synthetic.INIT_STD) < 0.05 * synthetic.INIT_STD
    assert (np.asarray(md.tensors["model.norm.weight"]) == 1).all()
    assert md.tokenizer.get_vocab_size() <= md.config.vocab_size
    assert md.generation_config["eos_token_id"] == md.tokenizer.token_to_id("<|im_end|>")


def _bits(t):
    return t.bits if isinstance(t, HalfTensor) else t


@pytest.mark.parametrize("source", ["tiny_dir", "bf16_dir"])   # float32, bf16
def test_streamed_file_is_the_in_memory_result(source, request, tmp_path):
    src = request.getfixturevalue(source)
    report = quantize(str(src), str(tmp_path / "q"), bits=4, group_size=32, embed_bits=8)
    model_dir = read_model_dir(src)
    measured = imatrix(Model(model_dir.config, model_dir.tensors), calibration_tokens(model_dir),
                       min(512, model_dir.config.max_position_embeddings))
    want = quantize_model(model_dir, 4, 32, imatrix=measured, embed_bits=8)
    got = read_model_dir(tmp_path / "q")
    assert got.config.to_dict() == want.model.config.to_dict()
    assert got.tensors.keys() == want.model.tensors.keys()
    for name, t in want.model.tensors.items():
        assert type(got.tensors[name]) is type(t), name
        np.testing.assert_array_equal(_bits(got.tensors[name]), _bits(t), err_msg=name)
    assert report.bytes_after == want.bytes_after
    assert report.bits_per_weight == want.bits_per_weight
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


def test_one_module_at_a_time(bf16_dir, tmp_path):
    plan = QuantizePlan(read_model_dir(bf16_dir), 4, 32, method="rtn")
    made, most = [], 0   # weak references to every array the plan made; the most alive at once

    def watched():
        nonlocal most
        for name, t in plan.tensors():
            if not isinstance(t, HalfTensor):   # bf16 ones are the input's, passed through
                made.append(weakref.ref(t))
            most = max(most, sum(r() is not None for r in made))
            yield name, t
    write_safetensors(TensorStream(plan.specs, watched()), tmp_path / "m.safetensors")
    assert len(made) == 3 * len(plan.schemes) == 3 * (1 + 7 * 2 + 1)
    # the module being made (weight, scales, biases) and the tensor the writer wrote last
    assert most <= 4


def _resident_file_bytes() -> int:
    """This process's resident pages that belong to mapped files (Linux)."""
    with open("/proc/self/status") as f:
        return 1024 * int(f.read().split("RssFile:")[1].split()[0])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_input_pages_are_given_back_as_it_goes(bf16_dir, tmp_path):
    small = read_model_dir(bf16_dir)   # compiles first: the compiler's code pages are files too
    tokens = np.arange(64) % 300
    imatrix(Model(small.config, small.tensors), tokens, ctx=32)
    md = read_model_dir(synthetic.write_random_checkpoint(WIDE, tmp_path / "wide"))
    layer = sum(t.nbytes for name, t in md.tensors.items() if name.startswith("model.layers.0."))
    before, most = _resident_file_bytes(), 0

    def sample(*args):
        nonlocal most
        most = max(most, _resident_file_bytes() - before)

    def sampled(items):
        for item in items:
            sample()
            yield item
    plan = QuantizePlan(md, 4, 64, method="rtn")
    write_safetensors(TensorStream(plan.specs, sampled(calibrated_tensors(plan, md, tokens, sample))),
                      tmp_path / "q.safetensors")
    # one block resident while it is measured and quantized; without giving pages back, a block
    # more would be after each one
    assert most < 2 * layer < sum(t.nbytes for t in md.tensors.values()) / 2


def test_each_block_is_made_right_after_its_calibration(bf16_dir):
    md = read_model_dir(bf16_dir)
    plan = QuantizePlan(md, 4, 32, method="rtn")
    made, at_each_block = [], []
    for name, _ in calibrated_tensors(plan, md, list(range(64)), lambda done, total: at_each_block.append(list(made))):
        made.append(name)
    block = [{n for n in plan.specs if n.startswith(f"model.layers.{i}.")} for i in range(2)]
    assert [set(names) for names in at_each_block] == [block[0], block[0] | block[1]]
    assert set(made) == set(plan.specs) and len(made) == len(plan.specs)   # then the rest, once each


@pytest.mark.parametrize("error, code", [(OSError(28, "No space left on device"), 1), (KeyboardInterrupt(), 130)])
def test_failure_halfway_leaves_nothing(bf16_dir, tmp_path, monkeypatch, error, code):
    from nibble.quant import convert
    calls = []

    def fail_on_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return real(*args, **kwargs)
    real = convert.quantize
    monkeypatch.setattr(convert, "quantize", fail_on_the_third)
    r = invoke("quantize", bf16_dir, "-o", tmp_path / "out", "--bits", 4)
    assert r.exit_code == code and "Traceback" not in r.stderr
    assert len(calls) == 3 and list(tmp_path.iterdir()) == []


def test_bench_writes_a_checkpoint_that_quantizes_and_runs(monkeypatch, tmp_path):
    monkeypatch.setitem(synthetic.SHAPES, "small", SMALL)
    r = invoke("bench", "--shapes", "small", "--write-checkpoint", tmp_path / "bf16")
    assert r.exit_code == 0, r.output
    r = invoke("quantize", tmp_path / "bf16", "-o", tmp_path / "q4", "--bits", 4, "--group-size", 32)
    assert r.exit_code == 0, r.output
    r = invoke("run", "-m", tmp_path / "q4", "--temp", 0, "-n", 8, "--json", "hello")
    assert r.exit_code == 0, r.output
    reply = json.loads(r.stdout)
    assert reply["generation_tokens"] > 0 and reply["finish_reason"] in ("length", "stop")


def test_write_checkpoint_needs_shapes(tmp_path):
    assert invoke("bench", "--write-checkpoint", tmp_path / "x").exit_code == 2
    assert_one_line_error(invoke("bench", "--shapes", "llama-9b", "--write-checkpoint", tmp_path / "x"),
                          match="unknown shapes 'llama-9b'")
