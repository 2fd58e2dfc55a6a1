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
from nibble.formats.half import HalfTensor
from nibble.quant.affine import dequantize
from nibble.runner.embedding.encoder import Encoder
from nibble.runner.model import Model
from tests import reference

DATA = Path(__file__).parent / "data" / "transformers"
FIXTURES = ["llama3", "mistral-yarn", "qwen2-layer-types", "llama-longrope", "qwen3", "gemma3-text",
            "gemma3", "phi3-longrope", "smollm3", "qwen3-moe", "qwen2-moe", "mixtral", "olmoe",
            "granitemoe", "granitemoeshared", "gpt-oss", "gpt-oss-mxfp4"]
ENCODERS = ["bert"]   # hidden states, not logits
# Fixtures stored quantized. nibble runs their weights exactly (test_mxfp4_experts_are_read_exactly),
# on activations rounded as the quantized kernels round them (to int8 where the CPU multiplies bytes,
# as llama.cpp does), which moves these tiny random mixtures' logits by about 1%.
QUANTIZED = {"gpt-oss-mxfp4"}


def load(name: str):
    folder = DATA / name
    raw = json.loads((folder / "config.json").read_text())
    tensors = text_tensors(raw, read_checkpoint(folder))
    return ModelConfig.from_dict(raw), tensors, np.load(folder / "tokens.npy"), np.load(folder / "logits.npy")


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference relative to the largest |logit|."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_every_fixture_is_tested():
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir()) == sorted(FIXTURES + ENCODERS)


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_match_transformers(name):
    config, tensors, tokens, want = load(name)
    model = Model(config, tensors)
    got = model.forward(tokens, model.new_cache(), all_logits=True)
    assert relative_error(got, want) < (3e-2 if name in QUANTIZED else 1e-4)
    if name in QUANTIZED:
        assert (got.argmax(-1) == want.argmax(-1)).all()


def test_mxfp4_experts_are_read_exactly():
    """OpenAI's MXFP4 experts (gate's and up's rows interleaved in gate_up_proj) become 4-bit
    stacks through a table of levels whose every weight is the checkpoint's, as the twin decodes
    it from the format's definition."""
    config, tensors, _, _ = load("gpt-oss-mxfp4")
    moe = Model(config, tensors).layers[1].moe
    m = "model.layers.1.mlp.experts."
    gate_up = reference.mxfp4(tensors[m + "gate_up_proj_blocks"], tensors[m + "gate_up_proj_scales"])
    down = reference.mxfp4(tensors[m + "down_proj_blocks"], tensors[m + "down_proj_scales"])
    for w, want in ((moe.w_gate, gate_up[:, ::2]), (moe.w_up, gate_up[:, 1::2]), (moe.w_down, down)):
        assert w.values is not None and w.nbytes < want.size   # 4 bits and 16-bit scales and biases
        for e in range(len(want)):
            assert w.bf16   # prepared: bfloat16 scales and biases by their bits
            widen = lambda a: HalfTensor(a[e], True).widen()
            expert = w._replace(weight=w.weight[e], scales=widen(w.scales), biases=widen(w.biases))
            np.testing.assert_array_equal(dequantize(expert), want[e])


@pytest.mark.parametrize("name", FIXTURES)
def test_reference_matches_transformers(name):
    """The numpy oracle reads the same configs the same way."""
    config, tensors, tokens, want = load(name)
    assert relative_error(reference.forward(config, tensors, tokens), want) < 1e-4


def load_encoder(name: str):
    folder = DATA / name
    config = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    return config, read_checkpoint(folder), *(np.load(folder / f) for f in ("tokens.npy", "types.npy", "hidden.npy"))


@pytest.mark.parametrize("name", ENCODERS)
def test_hidden_states_match_transformers(name):
    config, tensors, tokens, types, want = load_encoder(name)
    [got] = Encoder(config, tensors).encode([tokens], [types])
    assert relative_error(got, want) < 1e-4
    assert relative_error(reference.encode(config, tensors, tokens, types), want) < 1e-4


@pytest.mark.parametrize("name", ["qwen3", "llama3", "smollm3"])
def test_a_decoder_saved_without_its_head_embeds_to_transformers_last_hidden_state(name):
    """As Qwen3-Embedding is saved (transformers' Qwen3Model: no `model.`, no lm_head): the
    Encoder's last hidden states, through the head the fixture's model had, are its logits."""
    config, tensors, tokens, want = load(name)
    head = tensors["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    raw = json.loads((DATA / name / "config.json").read_text())
    base = {n.removeprefix("model."): t for n, t in tensors.items() if not n.startswith("lm_head.")}
    [hidden] = Encoder(config, text_tensors(raw, base)).encode([tokens])
    assert relative_error(hidden @ np.asarray(head, np.float32).T, want) < 1e-4
