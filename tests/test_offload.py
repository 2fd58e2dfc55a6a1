"""GPU offload (-ngl) against the CPU path, in numba's CUDA simulator (conftest.py).

The simulator runs each CUDA thread as a Python thread (about 1 ms each): these tests use a model
narrower than tiny.py's (D=32, 2 layers, vocabulary 64) and a handful of tokens.
"""
import dataclasses
import json

import numpy as np
import pytest
from numba import config, cuda

from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import write_model_dir
from nibble.runner import offload
from nibble.runner.kernels import cuda as gpu
from nibble.runner.loader import from_model_dir
from tests.test_cli import assert_one_line_error, invoke
from tests.tiny import tiny_config, tiny_model_dir, tiny_tensors

pytestmark = [pytest.mark.skipif(not cuda.is_available(), reason="no CUDA GPU (NUMBA_ENABLE_CUDASIM=1 simulates one)"),
              pytest.mark.filterwarnings("ignore:Simulator timings are bogus"), pytest.mark.usefixtures("simulated_gpu")]

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


@pytest.mark.parametrize("gpu_layers,head", [(1, False), pytest.param(-1, True, marks=pytest.mark.slow)])
def test_greedy_tokens_and_logits_match_the_cpu(narrow, gpu_layers, head):
    (cpu_model, cpu_cache), (gpu_model, gpu_cache) = pair(narrow, gpu_layers)
    assert (gpu_model.gpu_stage.head is not None) == head and gpu_model.gpu_stage.first == (1 if not head else 0)
    tokens, step = [], PROMPT
    for _ in range(3):   # prefill, then 2 decode steps
        want, got = cpu_model.forward(step, cpu_cache), gpu_model.forward(step, gpu_cache)
        assert_close(got, want)
        step = [int(np.argmax(got[-1]))]
        assert step[0] == int(np.argmax(want[-1]))
        tokens += step
    assert gpu_cache.ran == cpu_cache.ran == PROMPT + tokens[:-1]


class FrozenLaunches:
    """What a CUDA graph does with the launches, for the simulator (which has no graphs): they
    are recorded once with the argument values of that moment and replayed as they are."""

    def __init__(self, issue, stream):
        self.launches = []
        issue(lambda *launch: self.launches.append(launch))

    def __call__(self):
        for kernel, grid, block, *args in self.launches:
            kernel[grid, block](*args)


def decode_and_compare(cpu_pair, gpu_pair, steps=2):
    """Prefill, then `steps` tokens decoded (the simulator takes about 2 s a step): logits alike."""
    (cpu_model, cpu_cache), (gpu_model, gpu_cache) = cpu_pair, gpu_pair
    step = PROMPT
    for _ in range(steps + 1):
        want, got = cpu_model.forward(step, cpu_cache), gpu_model.forward(step, gpu_cache)
        assert_close(got, want)
        step = [int(np.argmax(want[-1]))]


@pytest.mark.slow
def test_decode_replays_one_recording_per_kv_cache(narrow, monkeypatch):
    """Decode reads the hidden state and position from device memory: the launches recorded at
    the first token give every later token's logits. A new cache gets a new recording."""
    monkeypatch.setattr(gpu, "Replay", FrozenLaunches)
    (cpu_model, cpu_cache), (gpu_model, gpu_cache) = pair(narrow, -1)
    off = gpu_model.gpu_stage
    off.graph_error = ""                      # as on a GPU
    decode_and_compare((cpu_model, cpu_cache), (gpu_model, gpu_cache))
    assert off.replay_kv is gpu_cache.parts[-1]
    assert len(off.replay.launches) == 5 * len(off.layers) + 1   # 5 a layer, and the head
    first = off.replay
    cache = gpu_model.new_cache(16)
    decode_and_compare((cpu_model, cpu_model.new_cache(16)), (gpu_model, cache), steps=1)
    assert off.replay is not first and off.replay_kv is cache.parts[-1]


@pytest.mark.slow
def test_without_graphs_decode_launches_kernel_by_kernel(narrow, monkeypatch):
    def refuse(issue, stream):
        raise RuntimeError("no graphs here")
    monkeypatch.setattr(gpu, "Replay", refuse)
    cpu_pair, gpu_pair = pair(narrow, 1)
    gpu_pair[0].gpu_stage.graph_error = ""
    decode_and_compare(cpu_pair, gpu_pair)
    assert gpu_pair[0].gpu_stage.graph_error == "CUDA graphs unavailable (RuntimeError: no graphs here)"


def as_bf16(model_dir):
    """The model with every tensor truncated to bfloat16, as the safetensors reader gives them."""
    bf16 = {k: HalfTensor((t.view(np.uint32) >> 16).astype(np.uint16), True) for k, t in model_dir.tensors.items()}
    return dataclasses.replace(model_dir, tensors=bf16)


@pytest.mark.slow
def test_16_bit_weights_run_widened_on_the_gpu(narrow):
    """The GPU kernels take float32 or quantized weights: bf16 ones are uploaded widened."""
    cpu_pair, gpu_pair = pair(as_bf16(narrow), -1)
    assert isinstance(gpu_pair[0].lm_head, HalfTensor)
    decode_and_compare(cpu_pair, gpu_pair, steps=1)


@pytest.mark.slow
def test_truncate_reuses_the_device_kv(narrow):
    """Positions past a truncation are overwritten on the device as on the CPU."""
    (cpu_model, cpu_cache), (gpu_model, gpu_cache) = pair(narrow, 1)
    gpu_model.forward(PROMPT + [9], gpu_cache)
    gpu_cache.truncate(2)
    got = gpu_model.forward([33, 21], gpu_cache, all_logits=True)
    assert_close(got, cpu_model.forward(PROMPT[:2] + [33, 21], cpu_cache, all_logits=True)[2:])


@pytest.mark.parametrize("bf16", [False, True])
def test_offloads_what_fits(narrow, monkeypatch, bf16):
    model, _ = from_model_dir(as_bf16(narrow) if bf16 else narrow)
    # float32 on the device, bf16 weights too (uploaded widened)
    layer_bytes = 4 * sum(w.size for w in model.layers[-1]) + 2 * 16 * 16 * 4   # + k, v
    free = int((1.5 * layer_bytes + 215_000) / offload.HEADROOM)   # rope tables, workspace, x: 213 kB
    monkeypatch.setattr(offload, "free_memory", lambda cuda: free)
    note = model.offload_layers(-1, 16)
    assert model.gpu_stage.first == 1 and model.gpu_stage.head is None
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


def test_qk_norms_are_refused_and_run_on_the_cpu():
    model, _ = from_model_dir(tiny_model_dir("qwen3"))
    note = model.offload_layers(-1, 16)
    assert note == ("no GPU: running on the CPU (the GPU kernels do not run qwen3's per-head q/k "
                    "norms: run it on the CPU)")
    assert model.gpu_stage is None


def test_gemma3_is_refused_and_runs_on_the_cpu():
    model, _ = from_model_dir(tiny_model_dir("gemma3_text"))
    note = model.offload_layers(1, 16)
    assert note == ("no GPU: running on the CPU (the GPU kernels run Llama's block, not "
                    "Gemma3Weights: run the model on the CPU)")
    assert model.gpu_stage is None


@pytest.mark.parametrize("model_type", ["phi3", "smollm3"])   # partial rotary; layers without RoPE
def test_rope_the_gpu_kernels_cannot_run_is_refused_and_runs_on_the_cpu(model_type):
    model, _ = from_model_dir(tiny_model_dir(model_type))
    note = model.offload_layers(-1, 16)
    assert note.startswith("no GPU: running on the CPU (the GPU kernels rotate whole heads with one "
                           "RoPE table")
    assert model.gpu_stage is None


@pytest.mark.slow
def test_phi3_with_whole_heads_rotated_runs_on_the_gpu():
    """Phi-3.5-mini's RoPE: its q/k/v and gate/up views are joined again on the device."""
    md = tiny_model_dir("phi3")
    config = tiny_config("phi3", vocab_size=64, partial_rotary_factor=None, rope_scaling=None, **NARROW)
    md = dataclasses.replace(md, config=config, tensors=tiny_tensors(config))
    decode_and_compare(*pair(md, -1), steps=1)


def no_gpu():
    raise offload.NoGPU("numba.cuda cannot be imported: test")


@pytest.mark.slow
def test_bench_json_has_the_gpu_figures(tmp_path):
    model_dir = write_model_dir(narrow_model_dir(), tmp_path / "narrow")   # the tokenizer's vocabulary
    r = invoke("bench", "-m", model_dir, "-p", 3, "-n", 2, "-r", 1, "-ngl", 1, "--json")
    assert r.exit_code == 0, r.output
    f = json.loads(r.stdout)
    assert f["gpu_layers"] == 1 and f["gpu_bandwidth_gbs"] > 0
    if config.ENABLE_CUDASIM:   # the simulator's events time nothing (0 or -1 a pair, by version)
        assert f["graph_error"] == "numba's CUDA simulator has no graphs"
    else:
        assert 0 < f["kernel_utilization"] <= 1 and f["graph_error"] == ""
    assert 0 < f["gpu_weight_bytes_per_token"] < f["weight_bytes_per_token"]
    want = f["decode_tps"] * f["gpu_weight_bytes_per_token"] / (f["gpu_bandwidth_gbs"] * 1e9)
    assert abs(f["gpu_decode_fraction"] - want) < 1e-9
