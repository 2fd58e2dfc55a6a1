"""The small routes of llama.cpp's server that editors and clients probe, in its shapes:
`POST /tokenize` (with_pieces), `POST /detokenize`, `POST /apply-template` (a conversation through
the model's chat template, as /v1/chat/completions would prompt it), `GET /props` (the model,
its context, its chat template, the server's defaults) and `GET`/`POST /lora-adapters` (the LoRA
adapters loaded, and the scales a request runs them at unless its `lora` says otherwise); and
OpenAI's `GET /v1/models/{id}`. Each takes an optional `model` (the default one otherwise), as
llama.cpp's router does."""
from __future__ import annotations

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..text.detokenize import piece
from ..text.template import ChatTemplateError
from . import api
from .bodies import Adapters, Body, Flag, Text, read
from .errors import ApiError
from .models import Models
from .ollama_models import nibble_version
from .pending import read_json
from .replies import chat_text, generating, named_scales

MAX_TOKENS = 1 << 20   # ids one /detokenize takes


class TokenizeBody(Body):
    model: Text | None = None
    content: Text
    add_special: Flag = False   # the model's BOS before the ids, where it has one
    with_pieces: Flag = False   # each id with its text (its bytes where that is part of a character)


class DetokenizeBody(Body):
    model: Text | None = None
    tokens: list[int]


class ModelBody(Body):
    model: Text | None = None


async def tokenize(models: Models, request: Request) -> Response:
    body = read(TokenizeBody, await read_json(request))
    lease = await models.lease(body.model)
    try:
        tokenizer = generating(lease.served).tokenizer
        ids = await run_in_threadpool(tokenizer.encode, body.content, body.add_special)
        if not body.with_pieces:
            return JSONResponse({"tokens": ids})
        pieces = await run_in_threadpool(lambda: [piece(tokenizer.tokenizer, i) for i in ids])
        return JSONResponse({"tokens": [{"id": i, "piece": piece} for i, piece in zip(ids, pieces)]})
    finally:
        lease.release()


async def detokenize(models: Models, request: Request) -> Response:
    body = read(DetokenizeBody, await read_json(request))
    if len(body.tokens) > MAX_TOKENS:
        raise ApiError(400, f"tokens holds {len(body.tokens)} ids, more than the {MAX_TOKENS} one request takes", "tokens")
    lease = await models.lease(body.model)
    try:
        tokenizer = generating(lease.served).tokenizer
        vocab = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = next((i for i in body.tokens if not 0 <= i < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens holds {bad}, not an id of this model's vocabulary (0 to {vocab - 1})", "tokens")
        text = await run_in_threadpool(tokenizer.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return JSONResponse({"content": text})
    finally:
        lease.release()


async def apply_template(models: Models, request: Request) -> Response:
    """{"prompt": the text /v1/chat/completions would run for the same body} (its images' tags
    where the template wrote its image markers)."""
    body = await run_in_threadpool(api.parse_chat, await read_json(request), request.app.state.images)
    lease = await models.lease(body.options.model)
    try:
        text, _, _ = await run_in_threadpool(chat_text, generating(lease.served), body)
        return JSONResponse({"prompt": text})
    finally:
        lease.release()


async def props(models: Models, request: Request) -> Response:
    """The model (?model=NAME, or the default), loaded if it is not, as llama.cpp's /props says it."""
    name = request.query_params.get("model")
    lease = await models.lease(name)
    try:
        served = generating(lease.served)
        try:
            template = served.tokenizer.chat_template.source
        except ChatTemplateError:
            template = ""
        o, engine = models.options, served.engine
        return JSONResponse({
            "default_generation_settings": {"n_ctx": engine.ctx, "params": {"n_predict": -1}},
            "total_slots": o.parallel, "model_alias": served.name, "model_path": models.refs[served.name],
            "chat_template": template, "modalities": {"vision": engine.model.vision is not None, "audio": False},
            "build_info": f"nibble {nibble_version()}"})
    finally:
        lease.release()


async def lora_adapters(models: Models, request: Request) -> Response:
    """GET: the model's adapters (?model=NAME, or the default) as llama.cpp lists them, `id` what
    a request's `lora` names; POST [{"id", "scale"}]: the scales requests run them at from now on,
    those not named off. Requests already running keep theirs."""
    body = read(_AdapterList, {"lora": await read_json(request)}).lora if request.method == "POST" else None
    lease = await models.lease(request.query_params.get("model"))
    try:
        model = generating(lease.served).engine.model
        if body is None:
            return JSONResponse([{"id": i, "path": str(lora.path), "scale": float(scale)}
                                 for i, (lora, scale) in enumerate(zip(model.adapters, model.lora_scales))])
        scales = named_scales(len(model.adapters), api.adapter_scales(body))
        model.lora_scales = np.float32(scales)   # one assignment: the engine's thread reads the old array or this one
        return JSONResponse({"success": True})
    finally:
        lease.release()


class _AdapterList(Body):
    lora: Adapters


async def model_info(models: Models, request: Request) -> Response:
    """OpenAI's GET /v1/models/{id}: one model of /v1/models, a 404 for any other name."""
    name = request.path_params["id"]
    if name not in models.refs:
        raise ApiError(404, f"the model {name!r} is not served here: GET /v1/models lists those that are",
                       "model", code="model_not_found")
    return JSONResponse(api.models([name], models.created)["data"][0])
