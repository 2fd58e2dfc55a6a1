"""nibble against transformers, the independent reference: tiny random models that transformers 5
saved (config.json in its spelling, bf16 weights) and the logits it computed for them
(tests/fixtures/make_fixtures.py made both)."""
import json
from pathlib import Path

import numpy as np
import pytest

from nibble.formats.config import ModelConfig
from nibble.formats.safetensors import read_checkpoint
from nibble.formats.wrappers import text_tensors
from nibble.runner.model import Model
from tests import reference

DATA = Path(__file__).parent / "data" / "transformers"
FIXTURES = ["llama3", "mistral-yarn", "qwen2-layer-types", "llama-longrope", "qwen3", "gemma3-text",
            "gemma3", "phi3-longrope", "smollm3", "qwen3-moe", "qwen2-moe", "mixtral", "olmoe",
            "granitemoe", "granitemoeshared", "gpt-oss"]


def load(name: str):
    folder = DATA / name
    raw = json.loads((folder / "config.json").read_text())
    tensors = text_tensors(raw, read_checkpoint(folder))
    return ModelConfig.from_dict(raw), tensors, np.load(folder / "tokens.npy"), np.load(folder / "logits.npy")


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference relative to the largest |logit|."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_every_fixture_is_tested():
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir()) == sorted(FIXTURES)


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_match_transformers(name):
    config, tensors, tokens, want = load(name)
    model = Model(config, tensors)
    got = model.forward(tokens, model.new_cache(), all_logits=True)
    assert relative_error(got, want) < 1e-4


@pytest.mark.parametrize("name", FIXTURES)
def test_reference_matches_transformers(name):
    """The numpy oracle reads the same configs the same way."""
    config, tensors, tokens, want = load(name)
    assert relative_error(reference.forward(config, tensors, tokens), want) < 1e-4
