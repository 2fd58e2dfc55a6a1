"""OpenAI's Responses API, `POST /v1/responses`, as the official client's `responses.create` and
`responses.stream` and Codex use it: the body (its `input` items, flat function tools,
`text.format`, `reasoning`) read into api's ChatBody, and the reply written as a Response object
or as the typed server-sent events that build one (response.created ... response.completed).

The server is stateless: it keeps no responses, so every request carries the whole conversation
in `input` (the earlier turns' output items sent back as they came), and `previous_response_id`,
`conversation` and `background` are 400s that say so. As in chat, a field nibble does not know is
ignored, and one it knows with a wrong type or value is a 400 naming it.
"""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..chat.reasoning import STRONGER, Thinking, template_effort
from ..chat.tools import Call, Content
from . import api
from .api import ApiError, ChatBody, Options, Stamp, ThinkingOptions, bad, integer, json_object, typed
from .models import Models
from .pending import Pending, Streamed, read_json, start, until_disconnected
from .replies import ReplyParts, chat_turn

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
KEPT_NOWHERE = "nibble's server keeps no responses: send the whole conversation in input"


@dataclass(frozen=True)
class ResponsesBody:
    chat: ChatBody      # the neutral request
    echo: dict          # the request's settings as the Response object repeats them


# ---- the request ----

def parse(body) -> ResponsesBody:
    """A /v1/responses body -> ResponsesBody, or ApiError naming the first bad field."""
    body = json_object(body, "the request body")
    _refuse_state(body)
    tools = _function_tools(body)
    tool_choice, tool_name = _tool_choice(body, tools)
    response_format, schema = _text_format(body)
    if response_format != "text" and tool_choice != "none":
        raise bad("text.format", "cannot be combined with tools: send one or the other")
    max_tokens = integer(body, "max_output_tokens", 1)
    options = Options(typed(body, "model", str), typed(body, "stream", bool) or False, False, max_tokens,
                      api.sampling_fields(body), (), None)
    # a forced call may be several only when asked, as in chat (OpenAI's default is true)
    parallel = typed(body, "parallel_tool_calls", bool) or False
    effort, thinking = _thinking(body)
    chat = ChatBody(_messages(body), options, [_chat_tool(t) for t in tools], tool_choice, tool_name, parallel,
                    response_format, schema, thinking)
    return ResponsesBody(chat, _echo(body, tools, parallel, effort, max_tokens))


def _echo(body: dict, tools: list[dict], parallel: bool, effort: str | None, max_tokens: int | None) -> dict:
    """What a Response repeats of its request (the client's Response model wants each), the
    fields checked already. Nothing is stored, nor summarized."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {"instructions": body.get("instructions"), "tools": tools,
            "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
            "parallel_tool_calls": parallel, "text": {"format": fmt}, "reasoning": {"effort": effort, "summary": None},
            "max_output_tokens": max_tokens, "truncation": "disabled", "store": False, "background": False,
            "previous_response_id": None, "metadata": {}, "user": None}


def _refuse_state(body: dict):
    """What only a server that keeps responses could do."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise bad(name, f"is not supported: {KEPT_NOWHERE}")
    if body.get("background"):
        raise bad("background", "is not supported: nibble answers while the request waits (or streams)")


def _function_tools(body: dict) -> list[dict]:
    """The Responses API's flat function tools, checked: {type: "function", name, description,
    parameters, strict}. Built-in tools (web_search, file_search, ...) run on OpenAI's servers."""
    tools = typed(body, "tools", list) or []
    for i, tool in enumerate(tools):
        tool = json_object(tool, f"tools[{i}]")
        kind = tool.get("type")
        if kind is None:
            raise bad(f"tools[{i}].type", 'is missing: a function tool is {"type": "function", "name": ...}')
        if kind != "function":
            raise bad(f"tools[{i}].type", f"{_said(kind)} is not supported: nibble runs function tools only "
                                          "(built-in tools run on OpenAI's servers)")
        name = typed(tool, "name", str, f"tools[{i}].name")
        if not name:
            raise bad(f"tools[{i}].name", "must be a non-empty string")
        typed(tool, "description", str, f"tools[{i}].description")
        typed(tool, "parameters", dict, f"tools[{i}].parameters")
    return tools


def _chat_tool(tool: dict) -> dict:
    """A flat tool in chat's shape, {type, function: {...}}, which the templates and grammars read."""
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _tool_choice(body: dict, tools: list[dict]) -> tuple[str, str | None]:
    """-> chat's tool_choice and tool_name: {type: "function", name} forces that tool."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise bad("tool_choice", "needs tools")
        return choice, None
    name = choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}')
    if name not in {t["name"] for t in tools}:
        raise bad("tool_choice", f"names {name!r}, which is not in tools")
    return "required", name


def _text_format(body: dict) -> tuple[str, dict | None]:
    """`text.format` -> chat's response_format and schema."""
    text = body.get("text")
    fmt = json_object(text, "text").get("format") if text is not None else None
    if fmt is None:
        return "text", None
    kind = json_object(fmt, "text.format").get("type")
    if kind in ("text", "json_object"):
        return kind, None
    if kind != "json_schema":
        raise bad("text.format.type", 'must be "text", "json_object" or "json_schema"')
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad("text.format.schema", "must be a JSON schema object")
    return "json_schema", schema


def _thinking(body: dict) -> tuple[str | None, ThinkingOptions]:
    """`reasoning.effort` read as chat's reasoning_effort ("none" or "minimal": off), with chat's
    other knobs a client may send in extra_body (chat_template_kwargs, reasoning_budget, think).
    -> (the effort as given, for the echo; the options)."""
    reasoning = body.get("reasoning")
    reasoning = json_object(reasoning, "reasoning") if reasoning is not None else {}
    effort = typed(reasoning, "effort", str, "reasoning.effort")
    asked = template_effort(effort)
    if asked is not None and asked not in api.REASONING_EFFORTS:
        raise bad("reasoning.effort", f"must be one of {', '.join((*api.REASONING_EFFORTS, *STRONGER))}")
    return effort, api.thinking_options({**body, "reasoning_effort": asked})


def _messages(body: dict) -> list[dict]:
    """`instructions` and `input` -> chat messages."""
    instructions = typed(body, "instructions", str)
    given = body.get("input")
    if isinstance(given, str):
        items = [{"role": "user", "content": given}]
    elif isinstance(given, list) and given:
        items = given
    else:
        raise bad("input", "must be a string or a non-empty list of items")
    conversation = Conversation([{"role": "system", "content": instructions}] if instructions else [])
    for i, item in enumerate(items):
        conversation.add(json_object(item, f"input[{i}]"), f"input[{i}]")
    return conversation.messages


class Conversation:
    """Input items -> chat messages. An earlier turn's items (its reasoning, message and function
    calls, as its output listed them) become one assistant message, as chat templates expect a
    turn; a function_call_output becomes a tool message."""

    def __init__(self, messages: list[dict]):
        self.messages = messages
        self.thought: str | None = None      # a reasoning item's text, for the assistant message after it
        self.names: dict[str, str] = {}      # call_id -> the function called, for its output's message

    def add(self, item: dict, where: str):
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            self._output(item, where)
        elif kind == "reasoning":
            self._reasoning(item, where)
        elif kind == "item_reference":
            raise bad(where, f"refers to a stored item: {KEPT_NOWHERE}")
        else:
            raise bad(f"{where}.type", f"{_said(kind)} is not supported: nibble reads message, reasoning, "
                                       "function_call and function_call_output items")

    def _message(self, item: dict, where: str):
        role = item.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}")
        content = item.get("content")
        if content is None:
            raise bad(f"{where}.content", "is missing")
        if role == "assistant":
            self._assistant(_text(content, f"{where}.content"))
        else:
            self.messages.append({"role": "system" if role == "developer" else role,
                                  "content": _text(content, f"{where}.content")})

    def _call(self, item: dict, where: str):
        call_id, name, arguments = (_string(item, k, where) for k in ("call_id", "name", "arguments"))
        if not name:
            raise bad(f"{where}.name", "must be a non-empty string")
        self.names[call_id] = name
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and self.thought is None:   # the same turn's
            last.setdefault("tool_calls", []).append(call)
        else:
            self._assistant(None)["tool_calls"] = [call]

    def _output(self, item: dict, where: str):
        call_id = _string(item, "call_id", where)
        output = item.get("output")
        if output is None:
            raise bad(f"{where}.output", "is missing")
        message = {"role": "tool", "tool_call_id": call_id, "content": _text(output, f"{where}.output")}
        if call_id in self.names:   # some templates name the function whose result it is
            message["name"] = self.names[call_id]
        self.messages.append(message)

    def _reasoning(self, item: dict, where: str):
        """An earlier reply's thinking (its reasoning_text), which the template may show or drop as
        it does chat's reasoning_content; a summary only, or encrypted content, is not it."""
        content = item.get("content")
        if content is not None:
            self.thought = (self.thought or "") + _text(content, f"{where}.content", ("reasoning_text",))

    def _assistant(self, content: str | None) -> dict:
        message = {"role": "assistant", "content": content}
        if self.thought is not None:
            message["reasoning_content"], self.thought = self.thought, None
        self.messages.append(message)
        return message


def _text(content, where: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """A string, or text parts joined: nibble's models read no images, files or audio."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        part = json_object(part, f"{where}[{j}]")
        kind = part.get("type")
        if kind in MEDIA_PARTS:
            raise bad(f"{where}[{j}].type", f"{kind!r} is not supported: nibble's models read text only")
        if kind not in kinds:
            raise bad(f"{where}[{j}].type", f"must be {' or '.join(map(repr, kinds))}")
        texts.append(_string(part, "text", f"{where}[{j}]"))
    return "".join(texts)


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad(f"{where}.{name}", "must be a string")
    return value


def _said(value) -> str:
    """A value as an error message quotes it: short, whatever it is."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---- the reply ----

class OutputItems:
    """A reply's parts as Response output items, in order: a change of kind (thinking, text, a
    call) closes the item being written and opens the next. Each step returns the stream events
    that say it; `items` is the output so far, the one being written left out."""

    TEXT = {"reasoning": "reasoning_text", "message": "output_text"}   # each item's text part

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None    # the reasoning or message item being written
        self.text: list[str] = []

    def add(self, part: Thinking | Content | Call) -> list[dict]:
        if isinstance(part, Call):
            return self.close() + self._call(part)
        kind = "reasoning" if isinstance(part, Thinking) else "message"
        events = [] if self.open is not None and self.open["type"] == kind else self.close() + self._start(kind)
        self.text.append(part.text)
        return events + [{"type": f"response.{self.TEXT[kind]}.delta", **self._where(), "delta": part.text,
                          **_logprobs(kind)}]

    def close(self, status: str = "completed") -> list[dict]:
        """The item being written, finished (`status` "incomplete": the reply was cut off)."""
        if self.open is None:
            return []
        kind, text, where = self.open["type"], "".join(self.text), self._where()
        item = _item(kind, self.open["id"], status, [_part(kind, text)])
        self.items.append(item)
        self.open, self.text = None, []
        return [{"type": f"response.{self.TEXT[kind]}.done", **where, "text": text, **_logprobs(kind)},
                {"type": "response.content_part.done", **where, "part": _part(kind, text)},
                {"type": "response.output_item.done", "output_index": where["output_index"], "item": item}]

    def _start(self, kind: str) -> list[dict]:
        self.open = _item(kind, _new_id("rs" if kind == "reasoning" else "msg"), "in_progress", [])
        return [{"type": "response.output_item.added", "output_index": len(self.items), "item": self.open},
                {"type": "response.content_part.added", **self._where(), "part": _part(kind, "")}]

    def _call(self, call: Call) -> list[dict]:
        """A call comes whole (parsed once its text ends): its arguments in one delta."""
        index, item_id = len(self.items), _new_id("fc")
        started = _function_call(item_id, call, "", "in_progress")
        self.items.append(_function_call(item_id, call, call.arguments, "completed"))
        where = {"item_id": item_id, "output_index": index}
        return [{"type": "response.output_item.added", "output_index": index, "item": started},
                {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments},
                {"type": "response.function_call_arguments.done", **where, "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": index, "item": self.items[-1]}]

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}


def _item(kind: str, item_id: str, status: str, parts: list[dict]) -> dict:
    if kind == "reasoning":   # nibble writes no summaries: the thinking itself is the content
        return {"type": "reasoning", "id": item_id, "summary": [], "content": parts, "status": status}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _logprobs(kind: str) -> dict:
    """Output text's events carry logprobs (nibble gives none here); reasoning text's do not."""
    return {"logprobs": []} if kind == "message" else {}


def _function_call(item_id: str, call: Call, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": arguments, "status": status}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def response(stamp: Stamp, echo: dict, settings, status: str, output: list[dict], usage: dict | None = None,
             error: dict | None = None) -> dict:
    """The Response object: `settings` the SamplerSettings the reply ran with."""
    return {"id": stamp.id, "object": "response", "created_at": stamp.created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": stamp.model, "output": output, "usage": usage,
            "temperature": settings.temperature, "top_p": settings.top_p, **echo}


def usage(u, reasoning_tokens: int) -> dict:
    """An engine Usage -> the Responses API's: the prompt tokens reused from the pool are
    cached_tokens, the rest (prefilled, and kept in the pool for a next turn) cache_write_tokens."""
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                     "cache_write_tokens": u.prompt_tokens - u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


async def response_events(stamp: Stamp, echo: dict, pending: Pending) -> AsyncIterator[dict]:
    """The reply as the Responses API's stream events (no sequence numbers yet), the last one
    response.completed or response.failed with the whole response. The first goes out at once:
    the client sees the response start before its first token. A reply cut by max_output_tokens
    ends in response.completed too, its response's status "incomplete": OpenAI's server sends
    response.incomplete, which the openai client's responses.stream() then fails on
    (get_final_response raises)."""
    settings = pending.turn.request.settings
    parts, output = ReplyParts(pending.turn.tool_names, pending.served.family), OutputItems()
    yield {"type": "response.created", "response": response(stamp, echo, settings, "in_progress", [])}
    yield {"type": "response.in_progress", "response": response(stamp, echo, settings, "in_progress", [])}
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            for e in output.close("incomplete"):
                yield e
            failure = {"code": "server_error", "message": f"the reply failed: {event.error}"}
            yield {"type": "response.failed",
                   "response": response(stamp, echo, settings, "failed", output.items, error=failure)}
            return
        for part in parts.feed(event):
            for e in output.add(part):
                yield e
        if event.finish_reason:
            break
    status = "incomplete" if event.finish_reason == "length" else "completed"
    for e in output.close(status):
        yield e
    split = pending.turn.request.reasoning   # counted the thinking tokens as the engine ran
    yield {"type": "response.completed", "response": response(
        stamp, echo, settings, status, output.items, usage(event.usage, split.thinking_tokens if split else 0))}


async def server_sent(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The Responses API's server-sent events: each named by its type, numbered in order."""
    number = 0
    async for e in events:
        yield f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': number}, ensure_ascii=False)}\n\n"
        number += 1


async def whole(events: AsyncIterator[dict]) -> Response:
    """The response the events end with: the reply a stream would build, so the two agree."""
    async for e in events:
        last = e
    if last["type"] == "response.failed":
        failure = last["response"]["error"]
        return JSONResponse(ApiError(500, failure["message"], type="server_error").body(), 500)
    return JSONResponse(last["response"])


async def create(models: Models, request: Request) -> Response:
    body = parse(await read_json(request))
    pending = await start(models, body.chat, chat_turn)
    stamp = Stamp(_new_id("resp"), int(time.time()), pending.served.name)
    events = response_events(stamp, body.echo, pending)
    if body.chat.options.stream:
        return Streamed(server_sent(events), pending)
    with pending:
        return await until_disconnected(request, whole(events))
