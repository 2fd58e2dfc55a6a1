"""GPU offload (-ngl) against the CPU path, in numba's CUDA simulator (conftest.py).

The simulator runs each CUDA thread as a Python thread (about 1 ms each): these tests use a model
narrower than tiny.py's (D=32, 2 layers, vocabulary 64) and a handful of tokens.
"""
import dataclasses
import json

import numpy as np
import pytest
from numba import cuda

from formats.model_dir import write_model_dir
from runner import offload
from runner.loader import from_model_dir
from tests.test_cli import assert_one_line_error, invoke
from tests.tiny import tiny_config, tiny_model_dir, tiny_tensors

pytestmark = [pytest.mark.skipif(not cuda.is_available(), reason="no CUDA GPU (NUMBA_ENABLE_CUDASIM=1 simulates one)"),
              pytest.mark.filterwarnings("ignore:Simulator timings are bogus")]

NARROW = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
PROMPT = [5, 17, 40]
# The simulator computes in float64, the CPU kernels in float32 (a real GPU: float32 summed in
# another order): logits agree to ~1e-6 of their largest value; 1e-4 leaves room, and a wrong
# position or a stale KV row moves them by far more (~1e-1).
TOL = 1e-4


def narrow_model_dir(vocab_size=None):
    md = tiny_model_dir()
    config = tiny_config(vocab_size=vocab_size or md.config.vocab_size, **NARROW)
    return dataclasses.replace(md, config=config, tensors=tiny_tensors(config))


@pytest.fixture(scope="module")
def narrow():
    return narrow_model_dir(vocab_size=64)


def pair(model_dir, gpu_layers, ctx=16):
    """(CPU model, its cache), (offloaded model, its cache)."""
    cpu_model, _ = from_model_dir(model_dir)
    gpu_model, _ = from_model_dir(model_dir)
    assert gpu_model.offload_layers(gpu_layers, ctx) == ""
    return (cpu_model, cpu_model.new_cache(ctx)), (gpu_model, gpu_model.new_cache(ctx))


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * np.abs(want).max())


@pytest.mark.parametrize("gpu_layers,head", [(1, False), (-1, True)])
def test_greedy_tokens_and_logits_match_the_cpu(narrow, gpu_layers, head):
    (cpu_model, cpu_cache), (gpu_model, gpu_cache) = pair(narrow, gpu_layers)
    assert (gpu_model.offload.head is not None) == head and gpu_model.offload.first == (1 if not head else 0)
    tokens, step = [], PROMPT
    for _ in range(4):   # prefill, then 3 decode steps
        want, got = cpu_model.forward(step, cpu_cache), gpu_model.forward(step, gpu_cache)
        assert_close(got, want)
        step = [int(np.argmax(got[-1]))]
        assert step[0] == int(np.argmax(want[-1]))
        tokens += step
    assert gpu_cache.tokens == cpu_cache.tokens == PROMPT + tokens[:-1]


def test_truncate_reuses_the_device_kv(narrow):
    """Positions past a truncation are overwritten on the device as on the CPU."""
    (cpu_model, cpu_cache), (gpu_model, gpu_cache) = pair(narrow, 1)
    gpu_model.forward(PROMPT + [9], gpu_cache)
    gpu_cache.truncate(2)
    got = gpu_model.forward([33, 21], gpu_cache, all_logits=True)
    assert_close(got, cpu_model.forward(PROMPT[:2] + [33, 21], cpu_cache, all_logits=True)[2:])


def test_offloads_what_fits(narrow, monkeypatch):
    model, _ = from_model_dir(narrow)
    layer_bytes = sum(offload._nbytes(w) for w in model.layers[-1].weights) + 2 * 16 * 16 * 4   # + k, v
    free = int((1.5 * layer_bytes + 185_000) / offload.HEADROOM)   # rope tables and workspace: 180 kB
    monkeypatch.setattr(offload, "free_memory", lambda cuda: free)
    note = model.offload_layers(-1, 16)
    assert model.offload.first == 1 and model.offload.head is None
    assert note == f"offloading 1 of 2 layers: the others do not fit in {free / 1e6:.0f} MB of free GPU memory"


def test_no_gpu_says_so_and_runs_on_the_cpu(tiny_dir, monkeypatch):
    monkeypatch.setattr(offload, "cuda_api", no_gpu)
    r = invoke("run", "-m", tiny_dir, "--temp", 0, "-n", 4, "-ngl", -1, "Hello")
    assert r.exit_code == 0 and r.stdout.strip(), r.output
    assert r.stderr.splitlines()[0] == "no GPU: running on the CPU (numba.cuda cannot be imported: test)"
    assert r.stdout == invoke("run", "-m", tiny_dir, "--temp", 0, "-n", 4, "Hello").stdout


def test_require_gpu_without_one_is_one_line(tiny_dir, monkeypatch):
    monkeypatch.setattr(offload, "cuda_api", no_gpu)
    assert_one_line_error(invoke("run", "-m", tiny_dir, "-ngl", 1, "--require-gpu", "Hello"), match="no GPU")


def no_gpu():
    raise offload.NoGPU("numba.cuda cannot be imported: test")


def test_bench_json_has_the_gpu_figures(tmp_path):
    model_dir = write_model_dir(narrow_model_dir(), tmp_path / "narrow")   # the tokenizer's vocabulary
    r = invoke("bench", "-m", model_dir, "-p", 3, "-n", 1, "-r", 1, "-ngl", 1, "--json")
    assert r.exit_code == 0, r.output
    f = json.loads(r.stdout)
    assert f["gpu_layers"] == 1 and f["gpu_bandwidth_gbs"] > 0 and 0 <= f["kernel_utilization"] <= 1
    assert 0 < f["gpu_weight_bytes_per_token"] < f["weight_bytes_per_token"]
    want = f["decode_tps"] * f["gpu_weight_bytes_per_token"] / (f["gpu_bandwidth_gbs"] * 1e9)
    assert abs(f["gpu_decode_fraction"] - want) < 1e-9
