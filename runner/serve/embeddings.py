"""Embeddings over HTTP: OpenAI's `POST /v1/embeddings` and ollama's `POST /api/embed` (and its
older `/api/embeddings`), for the models nibble embeds with (runner/embedding/embed.py), each run by its
EmbedEngine (runner/embedding/engine.py).

A text past the model's length is cut to it, as sentence-transformers and ollama cut it;
`truncate: false` asks for a 400 instead.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import AfterValidator, Field, Strict
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nibble.formats.errors import NibbleError
from ..embedding.embed import Embedder
from ..generation.engine import Busy
from .bodies import Body, Flag, JsonObject, Text, integer, listed, one_of, read, refused, said
from .errors import ApiError
from .ollama import KeepAlive, served_name
from .pending import read_json
from .replies import Embedding

MAX_INPUTS = 2048   # texts in one request, as OpenAI's API allows
ENCODINGS = ("float", "base64")   # OpenAI's encoding_format


# ---- bodies ----

@dataclass(frozen=True)
class EmbedBody:
    model: str | None
    inputs: list               # texts, or (OpenAI's) lists of the model's token ids
    dimensions: int | None     # None: all of them
    truncate: bool             # cut what is past the model's length (else a 400)
    prompt: str | None         # the name of one of the model's prompts (None: its default)
    base64: bool = False       # OpenAI's encoding_format "base64": float32 little-endian bytes


def parse_openai(body) -> EmbedBody:
    """A /v1/embeddings body -> EmbedBody, or ApiError naming the first bad field. `truncate` and
    `prompt_name` (text-embeddings-inference's) are nibble's additions."""
    given = read(OpenAIEmbed, body)
    return EmbedBody(given.model or None, given.input, given.dimensions, given.truncate is not False,
                     given.prompt_name, given.encoding_format == "base64")


def parse_ollama(body, older: bool = False) -> EmbedBody:
    """An /api/embed body (`older`: /api/embeddings', whose text is `prompt`) -> EmbedBody."""
    if older:
        given = read(OllamaEmbeddings, body)
        inputs = [given.prompt] if given.prompt else []
    else:
        given = read(OllamaEmbed, body)
        inputs = given.input or []
    return EmbedBody(given.model or None, inputs, given.dimensions, given.truncate is not False, None)


def _at_most(inputs: list) -> list:
    if len(inputs) > MAX_INPUTS:
        raise refused(f"holds {len(inputs)} inputs: at most {MAX_INPUTS} a request")
    return inputs


def _as_list(given: str | list) -> list:
    """One text, or one list of token ids: a list of it."""
    return [given] if isinstance(given, str) or isinstance(given[0], int) else given


TokenIds = Annotated[list[Annotated[int, Strict()]], Field(min_length=1)]
OpenAIInputs = Annotated[Text | TokenIds | Annotated[list[Text], Field(min_length=1)]
                         | Annotated[list[TokenIds], Field(min_length=1)],
                         said("must be a string, a non-empty list of strings, a list of token ids or a list of lists "
                              "of token ids"), AfterValidator(_as_list), AfterValidator(_at_most)]


class Embed(Body):
    """What every embeddings body has."""
    model: Text | None = None
    dimensions: integer(1) | None = None
    truncate: Flag | None = None


class OpenAIEmbed(Embed):
    input: OpenAIInputs
    encoding_format: one_of(*ENCODINGS) | None = None
    prompt_name: Text | None = None


class OllamaEmbedBase(Embed):
    """What ollama's two embeddings bodies share."""
    keep_alive: KeepAlive | None = None
    options: JsonObject | None = None


class OllamaEmbed(OllamaEmbedBase):
    input: Annotated[list[Text], listed("must be a string or a list of strings"),
                     AfterValidator(_at_most)] | None = None


class OllamaEmbeddings(OllamaEmbedBase):
    """/api/embeddings' body (ollama's older one): one text, in `prompt`."""
    prompt: Text | None = None


# ---- running one ----

@dataclass(frozen=True)
class Embedded:
    vectors: np.ndarray   # [inputs, dimensions] float32
    tokens: int           # the tokens embedded (after cutting)


async def embed(served, body: EmbedBody) -> Embedded:
    """The body's vectors from its leased model; ApiError (400) for a model that does not embed or
    an input it cannot take, 503 when its engine is full."""
    if not isinstance(served, Embedding) or served.ranks:
        kind = "is a reranker" if isinstance(served, Embedding) else "generates text"
        raise ApiError(400, f"{served.name} {kind} and computes no embeddings: name an embedding model "
                            "(GET /v1/models lists those served; nibble pull all-minilm fetches one)", "model",
                       code="model_not_supported")
    if not body.inputs:   # ollama's way of loading a model ahead
        return Embedded(np.zeros((0, served.embedder.dimensions), np.float32), 0)
    ids, skip = await run_in_threadpool(_tokenized, served.embedder, body)
    vectors = await encoded(served, ids, [skip] * len(ids), "embedding")
    if body.dimensions is not None:
        with _param("dimensions"):
            vectors = served.embedder.shorten(vectors, body.dimensions)
    return Embedded(vectors, sum(len(i) for i in ids))


async def encoded(served: Embedding, ids: list[list[int]], each: list, what: str) -> np.ndarray:
    """What the model's EmbedEngine makes of texts (EmbedEngine.submit), awaited; 503 when it is
    full, 500 (the `what` failed) when its pass does."""
    try:
        future = served.engine.submit(ids, each)
    except Busy as e:
        raise ApiError(503, f"{e}: try again in a moment", type="server_error", code="server_busy") from None
    try:
        return await asyncio.wrap_future(future)
    except NibbleError as e:
        raise ApiError(500, f"the {what} failed: {e}", type="server_error") from None


def _tokenized(embedder: Embedder, body: EmbedBody) -> tuple[list[list[int]], int]:
    if isinstance(body.inputs[0], str):
        with _param("prompt_name"):
            tokenized = embedder.tokenize(body.inputs, body.prompt)
        ids, skip, cut = tokenized.ids, tokenized.skip, tokenized.cut
    else:
        with _param("input"):
            for i, given in enumerate(body.inputs):
                embedder.check_ids(given, f"input[{i}]")
        ids, skip = [given[:embedder.max_length] for given in body.inputs], 0
        cut = sum(len(given) > embedder.max_length for given in body.inputs)
    if cut and not body.truncate:
        raise ApiError(400, f"{cut} of the inputs take more than the model's {embedder.max_length} tokens: "
                            "shorten them, or leave truncate out to have them cut", "input",
                       code="context_length_exceeded")
    return ids, skip


@contextlib.contextmanager
def _param(name: str):
    """What the embedder refuses, as a 400 naming the field."""
    try:
        yield
    except ApiError:
        raise
    except NibbleError as e:
        raise ApiError(400, str(e), name) from None


# ---- handlers ----

async def openai(models, request: Request) -> Response:
    body = parse_openai(await read_json(request))
    lease = await models.lease(body.model)
    try:
        out = await embed(lease.served, body)
    finally:
        lease.release()
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if body.base64 else v.tolist()}
            for i, v in enumerate(out.vectors)]
    return JSONResponse({"object": "list", "data": data, "model": lease.served.name,
                         "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens}})


async def ollama(models, request: Request) -> Response:
    return await _ollama(models, request, older=False)


async def ollama_older(models, request: Request) -> Response:
    return await _ollama(models, request, older=True)


async def _ollama(models, request: Request, older: bool) -> Response:
    start = time.monotonic_ns()
    body = parse_ollama(await read_json(request), older)
    lease = await models.lease(served_name(models, body.model))
    loaded = time.monotonic_ns()
    try:
        out = await embed(lease.served, body)
    finally:
        lease.release()
    if older:
        return JSONResponse({"embedding": out.vectors[0].tolist() if len(out.vectors) else []})
    return JSONResponse({"model": lease.served.name, "embeddings": out.vectors.tolist(),
                         "total_duration": max(time.monotonic_ns() - start, 1),
                         "load_duration": max(loaded - start, 1), "prompt_eval_count": out.tokens})
