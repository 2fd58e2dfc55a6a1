"""llama.cpp's `POST /infill`, the route editor plugins (llama.vscode, llama.vim) complete code by:
the file's text before the cursor (`input_prefix`) and after it (`input_suffix`), other files'
chunks (`input_extra`: {filename, text}), what is typed after the prefix (`prompt`), `n_predict`
and the sampling fields; the middle comes back whole or streamed, in llama.cpp's /completion
shape (`content`, `stop`, `timings`, ...). The prompt is runner/text/fim.py's; the KV cache keeps
the file's prefix, so the request a keystroke later prefills only what changed."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .api import Options, adapter_scales
from .bodies import Adapters, Body, Flag, FullSampling, Text, integer, read, stops
from .errors import ApiError
from .models import Models
from .pending import Pending, Streamed, read_json, start, until_disconnected
from .replies import Served, Turn, fill_turn

MAX_CHUNKS = 1024   # input_extra's chunks


class Chunk(Body):
    text: Text
    filename: Text = "tmp"   # llama.cpp's name for a chunk without one


class InfillRequest(FullSampling):
    model: Text | None = None
    input_prefix: Text
    input_suffix: Text
    input_extra: list[Chunk] = Field(default_factory=list, max_length=MAX_CHUNKS)
    prompt: Text = ""
    n_predict: integer(-1) | None = None   # -1 or none: up to the context; 0: the prompt only (cached)
    stream: Flag = False
    stop: stops(16) | None = None
    lora: Adapters | None = None

    def options(self) -> Options:
        # n_predict 0 is how llama.vscode has the server read a file's context ahead of the next
        # keystroke: the prompt runs (and stays in the cache), one token is sampled and dropped
        most = None if self.n_predict in (None, -1) else max(self.n_predict, 1)
        return Options(self.model, self.stream, False, most, self.sampling(), tuple(s for s in self.stop or () if s),
                       None, adapter_scales(self.lora))


@dataclass(frozen=True)
class InfillBody:
    prefix: str
    suffix: str
    extra: list[tuple[str, str]]   # (file name, text) chunks
    prompt: str
    options: Options
    silent: bool = False   # n_predict 0: the prompt read, nothing said


def infill_turn(served: Served, body: InfillBody) -> Turn:
    return fill_turn(served, body.prefix, body.suffix, body.extra, body.prompt, body.options, "input_prefix")


async def infill(models: Models, request: Request) -> Response:
    given = read(InfillRequest, await read_json(request))
    body = InfillBody(given.input_prefix, given.input_suffix, [(c.filename, c.text) for c in given.input_extra],
                      given.prompt, given.options(), given.n_predict == 0)
    pending = await start(models, body, infill_turn)
    if body.options.stream:
        return Streamed(_events(pending, body.silent), pending)
    with pending:
        return await until_disconnected(request, _whole(pending, body.silent))


async def _whole(pending: Pending, silent: bool) -> Response:
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            return JSONResponse(ApiError(500, f"the reply failed: {event.error}", type="server_error").body(), 500)
        if event.finish_reason:
            return JSONResponse(_last(pending, event, "" if silent else "".join(pending.text), silent))


async def _events(pending: Pending, silent: bool) -> AsyncIterator[str]:
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            yield _data(ApiError(500, f"the reply failed: {event.error}", type="server_error").body())
            return
        if event.text and not silent:
            yield _data({"content": event.text, "stop": False})
        if event.finish_reason:
            yield _data(_last(pending, event, "", silent))
            return


def _data(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def _last(pending: Pending, event, content: str, silent: bool) -> dict:
    """llama.cpp's last object of a completion: the text (whole, or "" after a stream), why it
    stopped, the tokens and the timings (`silent`: the prompt's only)."""
    usage, now = event.usage, time.monotonic()
    predicted = 0 if silent else usage.completion_tokens
    first = pending.first or now
    prompt_ms, predicted_ms = (first - pending.submitted) * 1000, (now - first) * 1000
    new = usage.prompt_tokens - usage.cached_tokens
    return {"content": content, "stop": True, "model": pending.served.name,
            "stop_type": "limit" if silent or event.finish_reason == "length" else "word" if event.stop_string else "eos",
            "stopping_word": event.stop_string or "", "truncated": False,
            "tokens_predicted": predicted, "tokens_evaluated": usage.prompt_tokens,
            "tokens_cached": usage.cached_tokens,
            "timings": {"prompt_n": new, "prompt_ms": prompt_ms,
                        "prompt_per_second": new / prompt_ms * 1000 if prompt_ms > 0 else 0.0,
                        "predicted_n": predicted, "predicted_ms": predicted_ms,
                        "predicted_per_second": predicted / predicted_ms * 1000 if predicted_ms > 0 else 0.0,
                        "cache_n": usage.cached_tokens}}
