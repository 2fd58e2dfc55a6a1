"""Reranking over HTTP: `POST /v1/rerank` and `/rerank` (Cohere's `/v2/rerank`, llama.cpp's `/reranking`
spellings) in Jina's and Cohere's shape, which llama.cpp's server answers too, and text-embeddings-inference's
when a body names its documents `texts`; for the rerankers nibble runs (runner/embedding/rerank.py),
each run by its EmbedEngine, all the documents of a request in one pass.

relevance_score is the model's score as sentence-transformers' CrossEncoder.predict gives it: its
logit through the model's activation (a sigmoid unless the model says otherwise), so a probability
for the rerankers trained as classifiers. TEI's `raw_scores: true` asks for the logits.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import AfterValidator, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nibble.formats.errors import NibbleError
from .bodies import Body, Flag, Text, integer, read, refused, said
from .embeddings import MAX_INPUTS, encoded
from .errors import ApiError
from .pending import read_json
from .replies import Embedding


class Document(Body):
    """Jina's and Cohere's document object: its text."""
    text: Text


def _at_most(documents: list) -> list:
    if len(documents) > MAX_INPUTS:
        raise refused(f"holds {len(documents)} documents: at most {MAX_INPUTS} a request")
    return documents


Documents = Annotated[list[Text | Document], Field(min_length=1),
                      said("must be a non-empty list of strings or of objects with a text"), AfterValidator(_at_most)]


class RerankBody(Body):
    model: Text | None = None
    query: Text
    documents: Documents | None = None
    texts: Documents | None = None               # text-embeddings-inference's name for them
    top_n: integer(1) | None = None              # the best N (all of them if left out)
    return_documents: Flag | None = None         # Jina's and Cohere's: each result's document
    return_text: Flag | None = None              # TEI's: each result's text
    raw_scores: Flag | None = None               # TEI's: the logits, before the model's activation
    truncate: Flag | None = None                 # false: a 400 for a pair past the model's length
    instruction: Text | None = None              # Qwen3-Reranker's task, nibble's addition


@dataclass(frozen=True)
class Ranked:
    scores: np.ndarray   # [documents], in the order given
    tokens: int


async def rank(served, body: RerankBody, documents: list[str]) -> Ranked:
    """The scores of the body's documents from its leased model; ApiError (400) for a model that
    does not rerank or a pair it cannot take, 503 when its engine is full."""
    if not (isinstance(served, Embedding) and served.ranks):
        raise ApiError(400, f"{served.name} is no reranker: name one (GET /v1/models lists those served; "
                            "rerankers are cross-encoders such as bge-reranker or ms-marco-MiniLM, and Qwen3-Reranker)",
                       "model", code="model_not_supported")
    reranker = served.embedder
    try:
        pairs = await run_in_threadpool(reranker.pairs, body.query, documents, body.instruction)
    except NibbleError as e:
        raise ApiError(400, str(e), "instruction") from None
    if pairs.cut and body.truncate is False:
        raise ApiError(400, f"{pairs.cut} of the query and document pairs take more than the model's "
                            f"{reranker.max_length} tokens: shorten them, or leave truncate out to have them cut",
                       "documents", code="context_length_exceeded")
    logits = await encoded(served, pairs.ids, pairs.types, "reranking")
    scores = logits if body.raw_scores else reranker.scores(logits)
    return Ranked(scores, sum(len(i) for i in pairs.ids))


async def rerank(models, request: Request) -> Response:
    body = read(RerankBody, await read_json(request))
    tei = body.texts is not None and body.documents is None
    given = body.texts if tei else body.documents
    if given is None:
        raise ApiError(400, "documents is missing", "documents")
    documents = [d if isinstance(d, str) else d.text for d in given]
    lease = await models.lease(body.model)
    try:
        out = await rank(lease.served, body, documents)
    finally:
        lease.release()
    order = sorted(range(len(documents)), key=lambda i: -out.scores[i])[:body.top_n]
    if tei:
        return JSONResponse([{"index": i, "score": float(out.scores[i]),
                              **({"text": documents[i]} if body.return_text else {})} for i in order])
    results = [{"index": i, "relevance_score": float(out.scores[i]),
                **({"document": {"text": documents[i]}} if body.return_documents else {})} for i in order]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": lease.served.name, "object": "list",
                         "results": results, "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
                         "meta": {"billed_units": {"search_units": 1}}})

