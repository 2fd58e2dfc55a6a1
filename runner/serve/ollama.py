"""ollama's API, its replies: /api/chat and /api/generate, for the official ollama clients and the
tools that speak ollama (Open WebUI, Continue, editors); its model listing is ollama_models.py.

Bodies are pydantic models (with what they share with the other APIs' in api.py and bodies.py),
read into api's neutral ChatBody and CompletionBody, so a wrong type is a 400 naming the field;
replies are ollama's objects, streamed (ollama's default) as newline-delimited JSON, the last one
with `done: true`, why it ended and its durations in nanoseconds; errors are ollama's
`{"error": message}`. Options and fields ollama has that nibble has
no use for (num_ctx, num_gpu, keep_alive per request, ...) are accepted and ignored, as ollama
ignores options it does not know. A message's `images` (base64) follow its text, read as the body
is (bodies.Images), on a worker thread.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nibble.formats.errors import NibbleError
from ..text.reasoning import Thinking, ThinkingOptions, template_effort
from ..text.tools import Call
from . import api
from .api import ChatBody, ChatContent, CompletionBody, Options, Tool, content_parts
from .bodies import (Base64, Body, Flag, FullSampling, Images, ImageSource, JsonObject, Name, Number, Text, integer,
                     message_content, one_of, read, refused, said, stops, unsupported)
from .errors import ApiError
from .models import Models, parse_keep_alive
from .pending import Pending, Streamed, read_json, start, until_disconnected
from .replies import ReplyParts, Served, chat_turn, completion_turn

# Stop strings in one request: ollama sets no limit (a Modelfile often has several), nibble a
# generous one, since each is looked for at every token.
MAX_STOPS = 32
THINK_LEVELS = ("low", "medium", "high", "max")
ALL_OF_THEM = 1 << 30   # repeat_last_n -1 (ollama: the whole context): more ids than any context holds


def error_body(e: ApiError) -> dict:
    return {"error": str(e)}


# ---- bodies ----

def parse_chat(body, images: Images = Images()) -> ChatBody:
    """An /api/chat body -> ChatBody (no messages: only load the model), its images read by
    `images`, or ApiError naming the first bad field (or image)."""
    chat = read(ChatRequest, body)
    tools = [t.model_dump(exclude_unset=True) for t in chat.tools or []]
    response_format, schema = chat.response_format()
    return ChatBody(messages=_messages(chat.messages or [], images), options=chat.neutral_options(), tools=tools,
                    tool_choice=chat.tool_choice or ("auto" if tools else "none"), tool_name=None,
                    parallel_tool_calls=False, response_format=response_format, schema=schema,
                    thinking=chat.thinking())


def parse_generate(body, images: Images = Images()) -> ChatBody | CompletionBody:
    """An /api/generate body -> a CompletionBody (raw: the prompt as it is) or a ChatBody of the
    system and user messages, the user's images after its prompt (no prompt and no images: no
    messages, which only loads the model)."""
    generate = read(GenerateRequest, body)
    options, prompt = generate.neutral_options(), generate.prompt or ""
    if generate.raw and prompt:
        return CompletionBody(prompt, options)
    system = [{"role": "system", "content": generate.system}] if generate.system else []
    user = [prompt, *((f"images[{k}]", ImageSource(data)) for k, data in enumerate(generate.images or []))]
    response_format, schema = generate.response_format()
    return ChatBody(messages=[*system, {"role": "user", "content": message_content(user, images)}]
                    if prompt or generate.images else [], options=options,
                    tools=[], tool_choice="none", tool_name=None, parallel_tool_calls=False,
                    response_format=response_format, schema=schema, thinking=generate.thinking())


def _duration(value):
    """keep_alive, checked as ollama checks it, then left: the server's --keep-alive applies to every model."""
    if isinstance(value, str):
        try:
            parse_keep_alive(value)
        except NibbleError as e:
            raise refused(str(e)) from None
    return value


KeepAlive = Annotated[Number | Text, said('must be a duration ("5m", "1h") or a number of seconds'),
                      AfterValidator(_duration)]


class OllamaOptions(FullSampling):
    """ollama's `options`: those nibble has no use for (num_ctx, num_gpu, ...) are ignored, as
    ollama ignores options it does not know."""
    repeat_last_n: integer(-1) | None = None
    num_predict: integer() | None = None
    stop: stops(MAX_STOPS) | None = None

    @field_validator("seed", mode="before")
    @classmethod
    def _random(cls, seed):
        """ollama's seed -1 (any negative one) is a fresh random seed each run: nibble's unset seed."""
        negative = isinstance(seed, (int, float)) and not isinstance(seed, bool) and seed < 0
        return None if negative else seed


class OllamaRequest(Body):
    """What /api/chat and /api/generate bodies share."""
    model: Text | None = None   # ollama's clients always name one; curl users may not
    stream: Flag | None = None
    logprobs: Flag | None = None
    top_logprobs: integer(0, api.MAX_TOP_LOGPROBS) | None = None
    keep_alive: KeepAlive | None = None
    options: OllamaOptions | None = None
    format: Annotated[Literal["", "json"] | JsonObject, said('must be "json" or a JSON schema object')] | None = None
    # true, false, or a level, which thinks and is gpt-oss's reasoning effort
    think: Annotated[Flag | Literal[THINK_LEVELS],
                     said(f"must be true, false or one of {', '.join(THINK_LEVELS)}")] | None = None

    def neutral_options(self) -> Options:
        """Streamed unless stream is false, as ollama streams."""
        given = self.options or OllamaOptions()
        sampling, predict = given.sampling(), given.num_predict
        if given.repeat_last_n is not None:
            sampling["repeat_last_n"] = ALL_OF_THEM if given.repeat_last_n == -1 else given.repeat_last_n
        return Options(self.model or None, self.stream is not False, False,
                       predict if predict and predict > 0 else None, sampling, tuple(s for s in given.stop or () if s),
                       (self.top_logprobs or 0) if self.logprobs else None)

    def response_format(self) -> tuple[str, dict | None]:
        """`format`: "json" (any JSON object) or a JSON schema -> ChatBody's response_format and schema."""
        if self.format in (None, ""):
            return "text", None
        return ("json_object", None) if self.format == "json" else ("json_schema", self.format)

    def thinking(self) -> ThinkingOptions:
        if self.think is None or isinstance(self.think, bool):
            return ThinkingOptions(think=self.think)
        return ThinkingOptions(think=True, effort=template_effort(self.think))


class HistoryFunction(Body):
    name: Name
    # an object, or JSON text as OpenAI's clients send it
    arguments: Annotated[JsonObject | Text, said("must be an object")] | None = None


class HistoryCall(Body):
    """An earlier turn's call: {"function": {"name", "arguments": {...}}}."""
    function: HistoryFunction
    id: Text | None = None

    def openai(self, fallback_id: str) -> dict:
        """As OpenAI's, its id the one it came with or one made from its place (the same each
        turn: the prompt stays cached)."""
        arguments = {} if self.function.arguments is None else self.function.arguments
        return {"id": self.id or fallback_id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments if isinstance(arguments, str)
                             else json.dumps(arguments, ensure_ascii=False)}}


def _lower(role):
    return role.lower() if isinstance(role, str) else role


class OllamaMessage(Body):
    role: Annotated[one_of(*api.ROLES), BeforeValidator(_lower)]
    content: ChatContent | None = None   # ollama's may be left out
    images: list[Base64] | None = None   # after the content
    thinking: Text | None = None
    tool_calls: list[HistoryCall] | None = None
    tool_call_id: Text | None = None
    tool_name: Text | None = None

    def chat(self, i: int, images: Images) -> dict:
        """As an OpenAI chat message (the `i`th): its images after its content, thinking ->
        reasoning_content, tool calls with their arguments as JSON text and an id, tool_name -> name."""
        parts = [*content_parts(self.content or [], f"messages[{i}].content"),
                 *((f"messages[{i}].images[{k}]", ImageSource(data)) for k, data in enumerate(self.images or []))]
        out = {"role": "system" if self.role == "developer" else self.role, "content": message_content(parts, images)}
        if self.thinking:
            out["reasoning_content"] = self.thinking
        if self.tool_calls:
            out["tool_calls"] = [c.openai(f"call_{i}_{j}") for j, c in enumerate(self.tool_calls)]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_name:
            out["name"] = self.tool_name
        return out


class ChatRequest(OllamaRequest):
    messages: list[OllamaMessage] | None = None
    tools: list[Tool] | None = None
    # ollama has no tool_choice; nibble takes OpenAI's here too, so that a client can force a call
    # (with a grammar) when the model would not make one
    tool_choice: one_of(*api.TOOL_CHOICES) | None = None

    @model_validator(mode="after")
    def _required_needs_tools(self):
        if self.tool_choice == "required" and not self.tools:
            raise refused("needs tools", "tool_choice")
        return self


class GenerateRequest(OllamaRequest):
    images: list[Base64] | None = None   # after the prompt, in its user message
    suffix: Annotated[Any, unsupported("nibble's models do not fill in the middle")] = None
    template: Annotated[Any, unsupported("nibble renders the model's own chat template; send raw: true and the "
                                         "prompt as you want it")] = None
    context: Annotated[Any, unsupported("nibble keeps no token context between requests: send the conversation "
                                        "to /api/chat")] = None
    prompt: Text | None = None
    system: Text | None = None
    raw: Flag | None = None

    @model_validator(mode="after")
    def _raw_takes_no_format(self):
        if self.raw and self.prompt and self.format not in (None, ""):   # completion_turn takes no grammar
            raise refused("cannot be combined with raw: send the prompt without raw, or no format", "format")
        if self.raw and self.images:   # images reach a model through its chat template
            raise refused("cannot be combined with raw: a raw prompt holds no images; leave raw out", "images")
        return self


def _messages(given: list[OllamaMessage], images: Images) -> list[dict]:
    """ollama's messages -> OpenAI's chat dicts. A tool result names its tool (tool_name), not its
    call: each is paired with the first unanswered call of that name, whose id it gets."""
    out, unanswered = [], []   # unanswered: (id, name) of the last assistant message's calls
    for i, message in enumerate(given):
        m = message.chat(i, images)
        if m.get("tool_calls"):
            unanswered = [(c["id"], c["function"]["name"]) for c in m["tool_calls"]]
        elif m["role"] == "tool" and "tool_call_id" not in m:
            name = m.get("name")
            pair = next((p for p in unanswered if name is None or p[1] == name), None)
            if pair is not None:
                unanswered.remove(pair)
                m["tool_call_id"] = pair[0]
        out.append(m)
    return out


# ---- replies ----

class Clock:
    """A reply's durations as ollama reports them, in nanoseconds on the event loop: from the
    request's start to its model leased and its prompt ready (loading), to its first event (the
    prompt's prefill), to its last (the rest of the reply)."""

    def __init__(self):
        self.start = time.monotonic_ns()
        self.ready = self.first = self.last = self.start

    def leased(self):
        self.ready = self.first = self.last = time.monotonic_ns()

    def event(self, first: bool):
        self.last = time.monotonic_ns()
        if first:
            self.first = self.last

    def load(self) -> dict:
        return {"total_duration": _positive(self.ready - self.start), "load_duration": _positive(self.ready - self.start)}

    def durations(self, usage) -> dict:
        return {"total_duration": _positive(self.last - self.start),
                "load_duration": _positive(self.ready - self.start),
                "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": _positive(self.first - self.ready),
                "eval_count": usage.completion_tokens, "eval_duration": _positive(self.last - self.first)}


def _positive(ns: int) -> int:
    """At least 1 ns: a reply of one event has no time between its first and last, and clients
    divide eval_count by eval_duration for tokens per second."""
    return max(ns, 1)


@dataclass
class Piece:
    """A reply's part in neutral form, as chat and generate both write it: what one event added,
    or (folded) the whole reply; `done` on the last: done_reason and the durations."""
    content: str = ""
    thinking: str = ""
    calls: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    done: dict | None = None

    def add(self, other: Piece) -> Piece:
        self.content += other.content
        self.thinking += other.thinking
        self.calls += other.calls
        self.logprobs += other.logprobs
        self.done = other.done
        return self


async def pieces(pending: Pending, parts: ReplyParts, clock: Clock, logprobs: bool) -> AsyncIterator[Piece]:
    """The engine's events as Pieces (those that add nothing left out), then the last with its
    durations; ApiError if the reply fails (NaN in the logits, say)."""
    first = True
    while True:
        event = await pending.next()
        clock.event(first)
        first = False
        if event.finish_reason == "error":
            raise ApiError(500, f"the reply failed: {event.error}", type="server_error")
        piece = Piece(logprobs=(api.chat_logprobs(event.logprobs) or {}).get("content", []) if logprobs else [])
        for part in parts.feed(event):
            if isinstance(part, Call):
                piece.calls.append(tool_call(part))
            elif isinstance(part, Thinking):
                piece.thinking += part.text
            else:
                piece.content += part.text
        if piece.content or piece.thinking or piece.calls or piece.logprobs:
            yield piece
        if event.finish_reason:   # a last object of its own, as ollama's; "stop" after calls too
            yield Piece(done={"done_reason": event.finish_reason, **clock.durations(event.usage)})
            return


def tool_call(call: Call) -> dict:
    """A call as ollama writes it: its arguments an object, not JSON text."""
    return {"id": call.id, "function": {"index": call.index, "name": call.name, "arguments": json.loads(call.arguments)}}


def chat_object(model: str, piece: Piece) -> dict:
    message = {"role": "assistant", "content": piece.content}
    if piece.thinking:
        message["thinking"] = piece.thinking
    if piece.calls:
        message["tool_calls"] = piece.calls
    return {**_stamp(model), "message": message, **_ending(piece)}


def generate_object(model: str, piece: Piece) -> dict:
    return {**_stamp(model), "response": piece.content, **({"thinking": piece.thinking} if piece.thinking else {}),
            **_ending(piece)}


def _stamp(model: str) -> dict:
    now = datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
    return {"model": model, "created_at": now}


def _ending(piece: Piece) -> dict:
    return {**({"logprobs": piece.logprobs} if piece.logprobs else {}), "done": piece.done is not None,
            **(piece.done or {})}


# ---- handlers ----

async def chat(models: Models, request: Request) -> Response:
    clock = Clock()
    # on a worker thread: images are decoded, and with --allow-image-urls fetched
    body = _named(models, await run_in_threadpool(parse_chat, await read_json(request), request.app.state.images))
    return await _reply(models, request, body, clock, chat_object)


async def generate(models: Models, request: Request) -> Response:
    clock = Clock()
    body = _named(models, await run_in_threadpool(parse_generate, await read_json(request),
                                                  request.app.state.images))
    return await _reply(models, request, body, clock, generate_object)


async def _reply(models: Models, request: Request, body: ChatBody | CompletionBody, clock: Clock,
                 shape: Callable[[str, Piece], dict]) -> Response:
    if isinstance(body, ChatBody) and not body.messages:   # ollama's way of loading a model ahead
        lease = await models.lease(body.options.model)
        lease.release()
        clock.leased()
        return JSONResponse(shape(lease.served.name, Piece(done={"done_reason": "load", **clock.load()})))
    pending = await start(models, body, _within_context(completion_turn if isinstance(body, CompletionBody)
                                                        else chat_turn))
    clock.leased()
    name = pending.served.name
    parts = ReplyParts(pending.turn.tool_names, pending.served.family)
    reply = pieces(pending, parts, clock, body.options.logprobs is not None)
    if body.options.stream:
        return Streamed(_lines(name, reply, shape), pending, media_type="application/x-ndjson")
    with pending:
        return await until_disconnected(request, _whole(name, reply, shape))


def _within_context(make_turn):
    """ollama's num_predict is at most so many tokens: one past what the context leaves after the
    prompt gets the rest of the context (clients send their setting whatever the prompt's length),
    where OpenAI's max_tokens is a 400."""
    def make(served: Served, body):
        try:
            return make_turn(served, body)
        except ApiError as e:
            if e.code != "context_length_exceeded" or body.options.max_tokens is None:
                raise
            return make_turn(served, replace(body, options=replace(body.options, max_tokens=None)))
    return make


async def _lines(model: str, reply: AsyncIterator[Piece], shape) -> AsyncIterator[str]:
    """A streamed reply: one JSON object a line, the first (empty) at once, before the prompt's
    prefill, as the other APIs' first events; a failure as ollama's error object, which its
    clients raise."""
    yield _line(shape(model, Piece()))
    try:
        async for piece in reply:
            yield _line(shape(model, piece))
    except ApiError as e:
        yield _line(error_body(e))


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


async def _whole(model: str, reply: AsyncIterator[Piece], shape) -> Response:
    whole = Piece()
    try:
        async for piece in reply:
            whole.add(piece)
    except ApiError as e:
        return JSONResponse(error_body(e), e.status)
    return JSONResponse(shape(model, whole))


def _named(models: Models, body):
    """The body with its model as the server names it: ollama's clients may add the default tag
    `:latest` to a name that has none."""
    return replace(body, options=replace(body.options, model=served_name(models, body.options.model)))


def served_name(models: Models, name: str | None) -> str:
    if name is None:
        return models.default
    if name in models.refs:
        return name
    if name.endswith(":latest") and name.removesuffix(":latest") in models.refs:
        return name.removesuffix(":latest")
    raise ApiError(404, f"model {name!r} not found: GET /api/tags lists the models served here", "model",
                   code="model_not_found")
