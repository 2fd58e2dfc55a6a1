"""nibble serve's reranking: /v1/rerank and /rerank in Jina's and Cohere's shape (and
text-embeddings-inference's), on tests/data/rerank/'s BERT and Qwen3-Reranker laid out in a Hugging
Face cache beside a tiny chat model: the scores the Reranker gives, sorted, cut to top_n; a
request's documents in one pass; each model refusing the others' requests; every body fuzzed."""
import json
import shutil

import numpy as np
import pytest
from hypothesis import event, example, given, settings, strategies as st

from nibble.formats.model_dir import read_model_dir
from nibble.runner.embedding.rerank import Reranker
from nibble.runner.serve.bodies import read
from nibble.runner.serve.rerank import RerankBody
from tests.serving import bodies, read_or_400, serving
from tests.test_hub import isolated, lay_out_snapshot  # noqa: F401 (a fixture)
from tests.test_rerank import DATA, reference
from tests.test_serve_models import A, cache, model_files, serve  # noqa: F401 (fixtures)

BERT, QWEN = "org/bert-reranker", "org/qwen3-reranker"
WANT = reference("bert")
QUERY, DOCUMENTS = WANT["query"], WANT["documents"]


@pytest.fixture
def rerankers(isolated, cache):  # noqa: F811
    for repo, kind in ((BERT, "bert"), (QWEN, "qwen3-reranker")):
        folder = DATA / kind
        lay_out_snapshot(isolated / "hf-hub", repo, {p.name: p.read_bytes() for p in folder.iterdir()
                                                     if p.is_file() and p.name != "scores.json"})


def test_the_results_are_the_rerankers_scores_best_first(serve, rerankers):  # noqa: F811
    server = serve(first=BERT, only=[BERT, QWEN, A])
    status, _, raw = server.post("/v1/rerank", {"model": BERT, "query": QUERY, "documents": DOCUMENTS})
    answer = json.loads(raw)
    assert status == 200 and answer["model"] == BERT and answer["object"] == "list"
    order = np.argsort(-np.array(WANT["scores"]), kind="stable")
    assert [r["index"] for r in answer["results"]] == order.tolist()
    np.testing.assert_allclose([r["relevance_score"] for r in answer["results"]],
                               np.array(WANT["scores"])[order], atol=1e-5)
    assert "document" not in answer["results"][0]
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] == sum(map(len, WANT["ids"]))
    # Cohere's and Jina's extras: the best N, documents returned, documents as objects
    for path in ("/rerank", "/v2/rerank", "/v1/reranking", "/reranking"):
        status, _, raw = server.post(path, {"model": BERT, "query": QUERY, "top_n": 2, "return_documents": True,
                                            "documents": [{"text": d} for d in DOCUMENTS]})
        results = json.loads(raw)["results"]
        assert status == 200 and [r["index"] for r in results] == order[:2].tolist()
        assert [r["document"] for r in results] == [{"text": DOCUMENTS[i]} for i in order[:2]]


def test_the_tei_shape_and_raw_scores(serve, rerankers):  # noqa: F811
    server = serve(first=BERT, only=[BERT, A])
    status, _, raw = server.post("/rerank", {"query": QUERY, "texts": DOCUMENTS, "raw_scores": True,
                                             "return_text": True})
    results = json.loads(raw)
    order = np.argsort(-np.array(WANT["logits"]), kind="stable")
    assert status == 200 and [r["index"] for r in results] == order.tolist()
    np.testing.assert_allclose([r["score"] for r in results], np.array(WANT["logits"])[order], atol=1e-5)
    assert [r["text"] for r in results] == [DOCUMENTS[i] for i in order]


def test_qwen3_reranker_takes_an_instruction(serve, rerankers):  # noqa: F811
    server = serve(first=QWEN, only=[QWEN, A])
    want = reference("qwen3-reranker")
    status, _, raw = server.post("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    scores = {r["index"]: r["relevance_score"] for r in json.loads(raw)["results"]}
    np.testing.assert_allclose([scores[i] for i in range(len(DOCUMENTS))], want["scores"], atol=1e-5)
    reranker = Reranker(read_model_dir(DATA / "qwen3-reranker"))
    status, _, raw = server.post("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS[:2], "instruction": "Find code"})
    told = {r["index"]: r["relevance_score"] for r in json.loads(raw)["results"]}
    np.testing.assert_allclose([told[0], told[1]], reranker.rerank(QUERY, DOCUMENTS[:2], "Find code"), atol=1e-5)


def test_what_a_reranker_cannot_take_is_a_400(serve, rerankers):  # noqa: F811
    server = serve(first=BERT, only=[BERT, A])
    status, _, raw = server.post("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "truncate": False})
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
    assert "3 of the query and document pairs take more than the model's 40 tokens" in json.loads(raw)["error"]["message"]
    status, _, raw = server.post("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "instruction": "x"})
    assert status == 400 and "takes no instruction" in json.loads(raw)["error"]["message"]


def test_a_reranker_and_a_chat_model_each_refuse_the_others_requests(serve, rerankers):  # noqa: F811
    server = serve(first=BERT, only=[BERT, A])
    status, _, raw = server.post("/v1/rerank", {"model": A, "query": "q", "documents": ["d"]})
    assert status == 400 and json.loads(raw)["error"]["code"] == "model_not_supported"
    assert "is no reranker" in json.loads(raw)["error"]["message"]
    status, _, raw = server.post("/v1/chat/completions", {"model": BERT, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "is a reranker, which generates no text: POST /v1/rerank" in raw.decode()
    status, _, raw = server.post("/v1/embeddings", {"model": BERT, "input": "hi"})
    assert status == 400 and "is a reranker and computes no embeddings" in raw.decode()


def test_a_requests_documents_run_in_one_pass(rerankers, isolated):  # noqa: F811
    folder = isolated / "bert"
    shutil.copytree(DATA / "bert", folder)
    with serving(folder, BERT) as server:
        reranker = server.engine.embedder
        passes, real = [], reranker.logits
        reranker.logits = lambda ids, types: passes.append(len(ids)) or real(ids, types)
        status, _, _ = server.post("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS * 5})
    assert status == 200 and passes == [20]


# ---- bodies ----

KEYS = ["model", "query", "documents", "texts", "top_n", "return_documents", "return_text", "raw_scores", "truncate",
        "instruction"]


def rerank_bodies():
    return bodies({"model": BERT, "query": "bicycles", "documents": ["a wheel", {"text": "penguins"}]}, KEYS)


@given(body=rerank_bodies())
def test_fuzz_a_body_is_read_or_a_400_naming_what_is_wrong(body):
    given = read_or_400(lambda b: read(RerankBody, b), body)
    assert given is None or isinstance(given.query, str) and (given.top_n is None or given.top_n >= 1)


@pytest.mark.fuzz
@settings(max_examples=60, deadline=None)
@given(body=rerank_bodies(), path=st.sampled_from(["/v1/rerank", "/rerank"]))
@example(body={"model": BERT, "query": "q", "documents": ["d"] * 2049}, path="/v1/rerank")
@example(body={"model": BERT, "query": "a\ud800", "documents": ["d"]}, path="/rerank")
@example(body={"model": BERT, "query": "q", "documents": ["x " * 5000], "truncate": False}, path="/v1/rerank")
@example(body={"model": BERT, "query": "x " * 5000, "documents": ["d"]}, path="/v1/rerank")
def test_fuzz_the_endpoints_answer_or_say_why_not(rerank_server, body, path):
    status, _, raw = rerank_server.post(path, json.dumps(body).encode())
    answer = json.loads(raw)
    if status != 200:
        assert 400 <= status < 500, (status, raw)
        assert isinstance(answer["error"]["message"], str)
    event(str(status))


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory):
    """The BERT reranker served alone (a module's server: the fuzz runs against one)."""
    folder = tmp_path_factory.mktemp("rerank") / "bert"
    shutil.copytree(DATA / "bert", folder)
    with serving(folder, BERT) as server:
        yield server
