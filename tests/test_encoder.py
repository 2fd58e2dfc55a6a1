"""Encoders (BERT's): the block's kernels against their numpy twins, texts packed into one pass as
each alone, and the configs and calls refused in one line. test_transformers.py checks the whole
model against transformers' hidden states."""
import json

import numpy as np
import pytest

from nibble.formats.config import ModelConfig
from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.safetensors import read_checkpoint
from nibble.runner.embedding.encoder import Encoder
from nibble.runner.kernels import cpu
from nibble.runner.model import Model
from tests import reference
from tests.test_transformers import DATA, load_encoder

RNG = np.random.default_rng(0)


def test_layernorm_and_gelu_match_their_twins():
    x, y = ((RNG.standard_normal((5, 48)) * 3 + 1).astype(np.float32) for _ in range(2))
    w, b, add = (RNG.standard_normal(48).astype(np.float32) for _ in range(3))
    out = np.empty_like(x)
    cpu.layernorm(x, w, b, 1e-5, out)
    np.testing.assert_allclose(out, reference.layernorm(x, w, b, 1e-5), rtol=1e-5, atol=1e-5)
    residual = x.copy()
    cpu.add_layernorm(residual, y, add, w, b, 1e-5)
    np.testing.assert_allclose(residual, reference.layernorm(x + y + add, w, b, 1e-5), rtol=1e-5, atol=1e-5)
    g = x.copy()
    cpu.gelu(g, add, False)
    np.testing.assert_allclose(g, reference.gelu(x + add), rtol=1e-6, atol=1e-6)
    g = x.copy()
    cpu.gelu(g, add, True)
    np.testing.assert_allclose(g, reference.gelu_tanh(x + add), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def bert():
    config, tensors, tokens, types, _ = load_encoder("bert")
    return Encoder(config, tensors), config, tensors


def test_texts_in_one_pass_are_as_each_alone(bert):
    encoder, config, tensors = bert
    texts = [RNG.integers(0, 128, n) for n in (1, 17, 5, 32)]   # 17: past a block of 16 positions
    types = [np.arange(len(t)) % 2 for t in texts]
    together = encoder.encode(texts, types)
    for text, kinds, got in zip(texts, types, together):
        [alone] = encoder.encode([text], [kinds])
        # the matrix kernels block a pass's rows by its size: the same sums, in another order
        np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5 * np.abs(alone).max())
        want = reference.encode(config, tensors, text, kinds)
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_a_text_past_the_positions_is_refused(bert):
    encoder = bert[0]
    for texts in ([np.zeros(33, np.int64)], [np.zeros(0, np.int64)]):
        with pytest.raises(NibbleError, match="must take 1 to 32 tokens"):
            encoder.encode(texts)


def raw_config() -> dict:
    return json.loads((DATA / "bert" / "config.json").read_text())


@pytest.mark.parametrize("change, message", [
    ({"position_embedding_type": "relative_key"}, "absolute position embeddings"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"layer_norm_eps": 0}, "layer_norm_eps"),
    ({"type_vocab_size": "two"}, "type_vocab_size"),
])
def test_configs_it_cannot_run_are_one_line(change, message):
    with pytest.raises(FormatError, match=message) as e:
        ModelConfig.from_dict(raw_config() | change)
    assert "\n" not in str(e.value)


def test_an_encoder_does_not_generate():
    with pytest.raises(NibbleError, match="bert is an encoder, an embedding model"):
        Model(ModelConfig.from_dict(raw_config()), read_checkpoint(DATA / "bert"))
