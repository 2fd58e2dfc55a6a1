"""nibble serve's embeddings: OpenAI's /v1/embeddings through the official openai client, ollama's
/api/embed and /api/embeddings through the official ollama client, on the bert fixture with
sentence-transformers' files (test_embed.sentence_model) laid out in a Hugging Face cache beside a
tiny chat model; the EmbedEngine's passes held on events; every body fuzzed."""
import base64
import json
import threading

import numpy as np
import ollama
import openai
import pytest
from hypothesis import event, example, given, settings, strategies as st

from nibble.formats.model_dir import read_model_dir
from nibble.runner.embedding.embed import Embedder
from nibble.runner.embedding.engine import EmbedEngine
from nibble.runner.generation.engine import Busy
from nibble.runner.serve import embeddings
from tests.serving import KEY, bodies, read_or_400, serving
from tests.test_embed import decoder_model, sentence_model, text
from tests.test_hub import isolated, lay_out_snapshot  # noqa: F401 (a fixture)
from tests.test_serve_models import A, cache, model_files, serve  # noqa: F401 (fixtures)

BERT = "org/bert"
TEXTS = [text(1, 2, 3), text(9, 9), text(*range(40, 60))]


def files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def bert(tmp_path, isolated):  # noqa: F811
    """A sentence-transformers model in the Hugging Face cache (a text cut at 16 tokens): its
    folder, laid out as `bert.lay_out(**sentence_model's keywords)` says."""
    def lay_out(**kwargs):
        folder = sentence_model(tmp_path, **({"max_length": 16} | kwargs))
        lay_out_snapshot(isolated / "hf-hub", BERT, files(folder))
        return folder
    return lay_out


def embedder(folder) -> Embedder:
    return Embedder(read_model_dir(folder))


def test_the_openai_clients_vectors_are_the_embedders(serve, cache, bert):  # noqa: F811
    folder = bert()
    server = serve(first=BERT, only=[BERT, A])
    want = embedder(folder).embed(TEXTS)
    got = server.client.embeddings.create(model=BERT, input=TEXTS)   # the client asks for base64
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == BERT
    np.testing.assert_allclose([d.embedding for d in got.data], want, atol=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens == 5 + 4 + 16   # the third cut at 16
    floats = server.client.embeddings.create(model=BERT, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, want[0], atol=1e-6)
    status, _, raw = server.post("/v1/embeddings", {"model": BERT, "input": TEXTS[:2], "encoding_format": "base64"})
    data = json.loads(raw)["data"]
    assert status == 200 and all(isinstance(d["embedding"], str) for d in data)
    np.testing.assert_allclose([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data], want[:2],
                               atol=1e-6)


def test_token_ids_are_the_models_and_cut_as_texts_are(serve, cache, bert):  # noqa: F811
    folder = bert()
    server = serve(first=BERT, only=[BERT, A])
    ids = [2, *range(4, 30), 3]
    got = server.client.embeddings.create(model=BERT, input=[ids, [2, 5, 3]], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in got.data], embedder(folder).embed_ids([ids[:16], [2, 5, 3]]),
                               atol=1e-6)
    assert got.usage.prompt_tokens == 16 + 3
    for bad in ([2, 128, 3], [2, -1]):
        with pytest.raises(openai.BadRequestError) as e:
            server.client.embeddings.create(model=BERT, input=[bad])
        assert "input[0] must be token ids from 0 to 127" in e.value.body["message"]


def test_truncate_false_refuses_a_text_past_the_models_length(serve, cache, bert):  # noqa: F811
    bert()
    server = serve(first=BERT, only=[BERT, A])
    with pytest.raises(openai.BadRequestError) as e:
        server.client.embeddings.create(model=BERT, input=TEXTS, extra_body={"truncate": False})
    assert e.value.body["code"] == "context_length_exceeded" and "1 of the inputs take more than the model's 16" \
        in e.value.body["message"]
    assert server.client.embeddings.create(model=BERT, input=TEXTS[:2], extra_body={"truncate": False}).data


def test_dimensions_cut_a_matryoshka_models_vectors_and_no_other_models(serve, cache, bert, tmp_path):  # noqa: F811
    folder = bert()
    server = serve(first=BERT, only=[BERT, A])
    full = server.client.embeddings.create(model=BERT, input=TEXTS[0], dimensions=64)
    np.testing.assert_allclose(full.data[0].embedding, embedder(folder).embed(TEXTS[:1])[0], atol=1e-6)
    for dimensions, why in ((16, "not trained to be cut short"), (65, "dimensions must be 1 to 64")):
        with pytest.raises(openai.BadRequestError) as e:
            server.client.embeddings.create(model=BERT, input=TEXTS[0], dimensions=dimensions)
        assert why in e.value.body["message"] and e.value.body["param"] == "dimensions"


def test_a_matryoshka_models_short_vectors_are_its_first_dimensions_of_unit_length(bert, tmp_path):
    folder = bert()
    (folder / "README.md").write_text("---\ntags:\n- sentence-transformers\n- loss:MatryoshkaLoss\n---\n# a card\n")
    e = embedder(folder)
    assert e.pipeline.matryoshka
    full = e.embed(TEXTS)
    short = e.shorten(full, 16)
    np.testing.assert_allclose(short, full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True), atol=1e-6)
    (folder / "README.md").write_text("---\ntags: [a, [b\n---\n")   # broken YAML: not Matryoshka, no error
    assert not embedder(folder).pipeline.matryoshka


def test_a_chat_model_and_an_embedding_model_each_refuse_the_others_requests(serve, cache, bert):  # noqa: F811
    bert()
    server = serve(only=[A, BERT])
    with pytest.raises(openai.BadRequestError) as e:
        server.ask(BERT)
    assert e.value.body["code"] == "model_not_supported" and f"{BERT} is an embedding model" in e.value.body["message"]
    assert server.loaded() == sorted([A, BERT]) and server.ask(A).model == A   # both loaded, A's replies unharmed
    with pytest.raises(openai.BadRequestError) as e:
        server.client.embeddings.create(model=A, input="hello")
    assert e.value.body["code"] == "model_not_supported" and "generates text" in e.value.body["message"]
    status, _, raw = server.post("/v1/messages/count_tokens", {"model": BERT, "messages": [{"role": "user",
                                                                                          "content": "hi"}]})
    assert status == 400 and json.loads(raw)["error"]["message"].startswith(f"{BERT} is an embedding model")


def test_a_decoder_trained_to_embed_is_served_as_an_embedding_model(serve, cache, isolated, tmp_path):  # noqa: F811
    folder = decoder_model(tmp_path)
    lay_out_snapshot(isolated / "hf-hub", "org/qwen3-embedding", files(folder))
    server = serve(only=[A, "org/qwen3-embedding"])
    got = server.client.embeddings.create(model="org/qwen3-embedding", input=TEXTS[:2],
                                          extra_body={"prompt_name": "query"})
    np.testing.assert_allclose([d.embedding for d in got.data], embedder(folder).embed(TEXTS[:2], "query"), atol=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        server.ask("org/qwen3-embedding")
    assert e.value.body["code"] == "model_not_supported"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.embeddings.create(model="org/qwen3-embedding", input="x", extra_body={"prompt_name": "passage"})
    assert e.value.body["param"] == "prompt_name" and "no prompt named 'passage'" in e.value.body["message"]


def test_the_ollama_clients_embed_show_and_ps(serve, cache, bert):  # noqa: F811
    folder = bert()
    server = serve(first=BERT, only=[BERT, A])
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", headers={"Authorization": f"Bearer {KEY}"})
    want = embedder(folder).embed(TEXTS)
    got = client.embed(model=BERT, input=TEXTS)
    np.testing.assert_allclose(got.embeddings, want, atol=1e-6)
    assert got.model == BERT and got.prompt_eval_count == 25 and got.total_duration >= got.load_duration > 0
    np.testing.assert_allclose(client.embed(model=BERT + ":latest", input=TEXTS[1]).embeddings, want[1:2], atol=1e-6)
    np.testing.assert_allclose(client.embeddings(model=BERT, prompt=TEXTS[1]).embedding, want[1], atol=1e-6)
    assert client.embed(model=BERT, input=[]).embeddings == []   # ollama's way to load a model ahead
    assert client.embeddings(model=BERT, prompt="").embedding == []
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=BERT, input=TEXTS, truncate=False)
    assert e.value.status_code == 400 and "take more than the model's 16 tokens" in e.value.error
    assert client.show(BERT).capabilities == ["embedding"]
    [running] = [m for m in client.ps().models if m.model == BERT]
    assert running.context_length == 16 and running.size > 0 and running.details.family == "bert"


def test_an_embedding_models_show_from_its_files_before_it_loads(serve, cache, bert):  # noqa: F811
    bert()
    server = serve(only=[A, BERT])
    status, _, raw = server.post("/api/show", {"model": BERT})
    assert status == 200 and json.loads(raw)["capabilities"] == ["embedding"]
    assert server.loaded() == [A]


# ---- the engine ----

class Held:
    """An embedder whose passes are recorded and held until `go` is set."""

    def __init__(self, folder):
        self.embedder = embedder(folder)
        self.passes, self.started, self.go = [], threading.Event(), threading.Event()
        real = self.embedder.embed_ids

        def held(ids, skip=0):
            self.passes.append(len(ids))
            self.started.set()
            self.go.wait()
            return real(ids, skip)
        self.embedder.embed_ids = held


def test_the_requests_waiting_run_in_one_pass_with_each_its_own_vectors(bert):
    folder = bert()
    held = Held(folder)
    engine = EmbedEngine(held.embedder, parallel=1, queue=2)
    held.go.set()
    engine.start()   # its first pass, the kernels'
    held.go.clear()
    held.started.clear()
    tokenized = [held.embedder.tokenize([t]) for t in TEXTS]
    first = engine.submit(tokenized[0].ids, [0] * len(tokenized[0].ids))
    assert held.started.wait(60)
    assert engine.running == 1
    later = [engine.submit(t.ids, [0] * len(t.ids)) for t in tokenized[1:]]
    assert engine.waiting == 2
    with pytest.raises(Busy, match="3 embedding requests are running or waiting"):
        engine.submit(tokenized[0].ids, [0] * len(tokenized[0].ids))
    held.go.set()
    got = [f.result(60) for f in [first, *later]]
    assert held.passes == [1, 1, 2]   # the warm-up, the first request, the two that waited for it
    np.testing.assert_allclose(np.concatenate(got), embedder(folder).embed(TEXTS), atol=1e-6)
    engine.close()
    with pytest.raises(Busy, match="shutting down"):
        engine.submit(tokenized[0].ids, [0] * len(tokenized[0].ids))


def test_a_failed_pass_fails_its_requests_and_the_engine_goes_on(bert):
    folder = bert()
    e = embedder(folder)
    engine = EmbedEngine(e)
    engine.start()
    real = e.embed_ids

    def failing(ids, skip=0):
        raise FloatingPointError("NaN")
    e.embed_ids = failing
    with pytest.raises(FloatingPointError):
        engine.submit([[2, 3]], [0]).result(60)
    e.embed_ids = real
    assert engine.submit([[2, 5, 3]], [0]).result(60).shape == (1, 64)
    engine.close()


# ---- bodies ----

KEYS = ["model", "input", "encoding_format", "dimensions", "truncate", "prompt_name", "user", "prompt", "options",
        "keep_alive"]


def embed_bodies():
    return bodies({"model": BERT, "input": ["w1 w2"]}, KEYS)


@given(body=embed_bodies())
def test_fuzz_a_body_is_read_or_a_400_naming_what_is_wrong(body):
    for parse in (embeddings.parse_openai, embeddings.parse_ollama,
                  lambda b: embeddings.parse_ollama(b, older=True)):
        read = read_or_400(parse, body)
        assert read is None or isinstance(read.inputs, list) and (read.dimensions is None or read.dimensions >= 1)


@pytest.mark.fuzz
@settings(max_examples=60, deadline=None)
@given(body=embed_bodies(), path=st.sampled_from(["/v1/embeddings", "/api/embed", "/api/embeddings"]))
@example(body={"model": BERT, "input": [[2, 3]] * 2049}, path="/v1/embeddings")
@example(body={"model": BERT, "input": "a\ud800"}, path="/api/embed")
@example(body={"model": BERT, "input": ["x " * 5000]}, path="/v1/embeddings")
def test_fuzz_the_endpoints_answer_or_say_why_not_in_their_apis_shape(embedding_server, body, path):
    status, _, raw = embedding_server.post(path, json.dumps(body).encode())
    answer = json.loads(raw)
    if status != 200:
        assert 400 <= status < 500, (status, raw)
        assert isinstance(answer["error"]["message"] if path.startswith("/v1") else answer["error"], str)
    event(str(status))


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    """The bert model served alone (a module's server: the fuzz runs against one)."""
    folder = sentence_model(tmp_path_factory.mktemp("bert"), max_length=16)
    with serving(folder, BERT) as server:
        yield server
