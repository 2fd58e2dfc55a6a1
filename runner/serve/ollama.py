"""ollama's API, its replies: /api/chat and /api/generate, for the official ollama clients and the
tools that speak ollama (Open WebUI, Continue, editors); its model listing is ollama_models.py.

Bodies are read into api's neutral ChatBody and CompletionBody by api's field readers, so a wrong
type is a 400 naming the field; replies are ollama's objects, streamed (ollama's default) as
newline-delimited JSON, the last one with `done: true`, why it ended and its durations in
nanoseconds; errors are ollama's `{"error": message}`. Options and fields ollama has that nibble has
no use for (num_ctx, num_gpu, keep_alive per request, ...) are accepted and ignored, as ollama
ignores options it does not know.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nibble.formats.errors import NibbleError
from ..chat.reasoning import Thinking, ThinkingOptions, template_effort
from ..chat.tools import Call
from . import api
from .api import (ApiError, ChatBody, CompletionBody, Options, bad, chat_message, function_tools, integer,
                  json_object, sampling_fields, typed)
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

def parse_chat(body) -> ChatBody:
    """An /api/chat body -> ChatBody (no messages: only load the model), or ApiError naming the
    first bad field."""
    body = json_object(body, "the request body")
    options = _options(body)
    tools = function_tools(body)
    response_format, schema = _format(body)
    return ChatBody(messages=_messages(typed(body, "messages", list) or []), options=options, tools=tools,
                    tool_choice=_tool_choice(body, tools), tool_name=None, parallel_tool_calls=False,
                    response_format=response_format, schema=schema, thinking=_thinking(body))


def parse_generate(body) -> ChatBody | CompletionBody:
    """An /api/generate body -> a CompletionBody (raw: the prompt as it is) or a ChatBody of the
    system and user messages (no messages: an empty prompt, which only loads the model)."""
    body = json_object(body, "the request body")
    for name, why in (("images", "nibble's models read no images"),
                      ("suffix", "nibble's models do not fill in the middle"),
                      ("template", "nibble renders the model's own chat template; send raw: true and the "
                                   "prompt as you want it"),
                      ("context", "nibble keeps no token context between requests: send the conversation "
                                  "to /api/chat")):
        if body.get(name):
            raise bad(name, f"is not supported: {why}")
    options = _options(body)
    prompt = typed(body, "prompt", str) or ""
    system = typed(body, "system", str)
    response_format, schema = _format(body)
    thinking = _thinking(body)
    if typed(body, "raw", bool) and prompt:
        if response_format != "text":   # completion_turn takes no grammar
            raise bad("format", "cannot be combined with raw: send the prompt without raw, or no format")
        return CompletionBody(prompt, options)
    messages = [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": prompt}]
    return ChatBody(messages=messages if prompt else [], options=options, tools=[], tool_choice="none",
                    tool_name=None, parallel_tool_calls=False, response_format=response_format, schema=schema,
                    thinking=thinking)


def _options(body: dict) -> Options:
    """What chat and generate share: model, stream (on unless false), logprobs, keep_alive, and
    ollama's `options` object."""
    model = typed(body, "model", str) or None   # ollama's clients always name one; curl users may not
    stream = typed(body, "stream", bool)
    logprobs = typed(body, "logprobs", bool) or False
    top = integer(body, "top_logprobs", 0, api.MAX_TOP_LOGPROBS) or 0
    check_keep_alive(body)
    given = body.get("options")
    given = {} if given is None else json_object(given, "options")
    with _under("options"):
        sampling = sampling_fields(_without_random_seed(given))
        repeat_last_n = integer(given, "repeat_last_n", -1)
        predict = integer(given, "num_predict")
        stop = _stops(given)
    if repeat_last_n is not None:
        sampling["repeat_last_n"] = ALL_OF_THEM if repeat_last_n == -1 else repeat_last_n
    return Options(model, stream is not False, False, predict if predict and predict > 0 else None,
                   sampling, stop, top if logprobs else None)


@contextlib.contextmanager
def _under(parent: str):
    """The readers' errors for the fields of `parent`, named as `parent.field`."""
    try:
        yield
    except ApiError as e:
        raise ApiError(e.status, f"{parent}.{e}", f"{parent}.{e.param}") from None


def _without_random_seed(options: dict) -> dict:
    """ollama's seed -1 (any negative one) is a fresh random seed each run: nibble's unset seed."""
    seed = options.get("seed")
    if isinstance(seed, (int, float)) and not isinstance(seed, bool) and seed < 0:
        return {k: v for k, v in options.items() if k != "seed"}
    return options


def _stops(options: dict) -> tuple[str, ...]:
    stop = options.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad("stop", f"must be a list of at most {MAX_STOPS} strings")
    return tuple(s for s in stops if s)


def check_keep_alive(body: dict):
    """Checked as ollama checks it, then left: the server's --keep-alive applies to every model."""
    value = body.get("keep_alive")
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return
    if not isinstance(value, str):
        raise bad("keep_alive", 'must be a duration ("5m", "1h") or a number of seconds')
    try:
        parse_keep_alive(value)
    except NibbleError as e:
        raise bad("keep_alive", f"is not a duration: {e}") from None


def _format(body: dict) -> tuple[str, dict | None]:
    """ollama's `format`: "json" (any JSON object) or a JSON schema -> api's response_format."""
    given = body.get("format")
    if given in (None, ""):
        return "text", None
    if given == "json":
        return "json_object", None
    if not isinstance(given, dict):
        raise bad("format", 'must be "json" or a JSON schema object')
    return "json_schema", given


def _tool_choice(body: dict, tools: list[dict]) -> str:
    """ollama has no tool_choice; nibble takes OpenAI's "none", "auto" and "required" here too, so
    that a client can force a call (with a grammar) when the model would not make one."""
    choice = typed(body, "tool_choice", str)
    if choice is None:
        return "auto" if tools else "none"
    if choice not in ("none", "auto", "required"):
        raise bad("tool_choice", 'must be "none", "auto" or "required"')
    if choice == "required" and not tools:
        raise bad("tool_choice", "needs tools")
    return choice


def _thinking(body: dict) -> ThinkingOptions:
    """ollama's think: true, false, or a level ("low", "medium", "high", "max"), which thinks
    and is gpt-oss's reasoning effort."""
    think = body.get("think")
    if think is None or isinstance(think, bool):
        return ThinkingOptions(think=think)
    if think not in THINK_LEVELS:
        raise bad("think", f"must be true, false or one of {', '.join(THINK_LEVELS)}")
    return ThinkingOptions(think=True, effort=template_effort(think))


def _messages(given: list) -> list[dict]:
    """ollama's messages -> api's (OpenAI's) chat dicts. A tool result names its tool (tool_name),
    not its call: each is paired with the first unanswered call of that name, whose id it gets."""
    out, unanswered = [], []   # unanswered: (id, name) of the last assistant message's calls
    for i, m in enumerate(given):
        m = _message(m, i)
        if m.get("tool_calls"):
            unanswered = [(c["id"], c["function"]["name"]) for c in m["tool_calls"]]
        elif m["role"] == "tool" and "tool_call_id" not in m:
            name = m.get("name")
            pair = next((p for p in unanswered if name is None or p[1] == name), None)
            if pair is not None:
                unanswered.remove(pair)
                m["tool_call_id"] = pair[0]
        out.append(chat_message(m, i))
    return out


def _message(m, i: int) -> dict:
    """One ollama message as an OpenAI chat dict: thinking -> reasoning_content, tool calls with
    their arguments as JSON text and an id, tool_name -> name."""
    where = f"messages[{i}]"
    m = json_object(m, where)
    if m.get("images"):
        raise bad(f"{where}.images", "is not supported: nibble's models read no images")
    role = m.get("role")
    out = {"role": role.lower() if isinstance(role, str) else role,
           "content": "" if m.get("content") is None else m["content"]}   # ollama's content may be left out
    thinking = typed(m, "thinking", str, f"{where}.thinking")
    if thinking:
        out["reasoning_content"] = thinking
    calls = typed(m, "tool_calls", list, f"{where}.tool_calls")
    if calls:
        out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]", f"call_{i}_{j}") for j, c in enumerate(calls)]
    for ours, theirs in (("tool_call_id", "tool_call_id"), ("name", "tool_name")):
        value = typed(m, theirs, str, f"{where}.{theirs}")
        if value:
            out[ours] = value
    return out


def _history_call(call, where: str, fallback_id: str) -> dict:
    """An earlier turn's call: {"function": {"name", "arguments": {...}}} -> OpenAI's, its id
    the one it came with or one made from its place (the same each turn: the prompt stays cached)."""
    function = json_object(json_object(call, where).get("function"), f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.function.name", "must be a non-empty string")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, (dict, str)):   # a string: JSON text, as OpenAI's clients send it
        raise bad(f"{where}.function.arguments", "must be an object")
    call_id = typed(call, "id", str, f"{where}.id") or fallback_id
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False)}}


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
    body = _named(models, parse_chat(await read_json(request)))
    return await _reply(models, request, body, clock, chat_object)


async def generate(models: Models, request: Request) -> Response:
    clock = Clock()
    body = _named(models, parse_generate(await read_json(request)))
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
