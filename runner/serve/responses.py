"""OpenAI's Responses API, `POST /v1/responses`, as the official client's `responses.create` and
`responses.stream` and Codex use it: the body (its `input` items, flat function tools,
`text.format`, `reasoning`) declared as pydantic models and read into api's ChatBody, and the reply
written as a Response object or as the typed server-sent events that build one (response.created
... response.completed).

The server is stateless: it keeps no responses, so every request carries the whole conversation
in `input` (the earlier turns' output items sent back as they came), and `previous_response_id`,
`conversation` and `background` are 400s that say so. As in chat, a field nibble does not know is
ignored, and one it knows with a wrong type or value is a 400 naming it. `input_image` parts are
read as the body is (bodies.Images), on a worker thread.
"""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..text.reasoning import STRONGER, Thinking, template_effort
from ..text.tools import Call, Content
from . import api
from .api import ChatBody, Options, Stamp, ThinkingKnobs
from .bodies import (Body, Flag, FullSampling, ImageLocation, Images, JsonObject, Name, Text, by, either, integer,
                     listed, message_content, one_of, read, refused, said, unsupported)
from .errors import ApiError
from .models import Models
from .pending import Pending, Streamed, read_json, start, until_disconnected
from .replies import ReplyParts, chat_turn

ROLES = ("user", "assistant", "system", "developer")
UNREAD_PARTS = ("input_file", "input_audio")
KEPT_NOWHERE = "nibble's server keeps no responses: send the whole conversation in input"


@dataclass(frozen=True)
class ResponsesBody:
    chat: ChatBody      # the neutral request
    echo: dict          # the request's settings as the Response object repeats them


# ---- the request ----

def parse(body, images: Images = Images()) -> ResponsesBody:
    """A /v1/responses body -> ResponsesBody, its images read by `images`, or ApiError naming the
    first bad field (or image)."""
    return read(ResponsesRequest, body).responses_body(images)


def _said(value) -> str:
    """A value as an error message quotes it: short, whatever it is."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class TextPart(Body):
    text: Text


class ImagePart(Body):
    image_url: ImageLocation | None = None   # detail: the tower's to decide, ignored
    file_id: Annotated[Any, unsupported("nibble keeps no files: send the image in image_url, as a data: URL")] = None

    @model_validator(mode="after")
    def _given(self):
        if self.image_url is None:
            raise refused("is missing", "image_url")
        return self


def _parts(kinds: dict[str, type[Body]], what: str):
    """A string, or parts of these kinds (the first, text: what a string is); nibble's models read
    no files or audio."""
    def otherwise(kind) -> str:
        if kind in UNREAD_PARTS:
            return f"{kind!r} is not supported: nibble's models read text and images"
        return f"must be {either(tuple(kinds))}"
    first = next(iter(kinds))
    return Annotated[list[Annotated[TextPart | ImagePart, by("type", kinds, otherwise)]],
                     listed(f"must be a string or a list of {what}", lambda text: {"type": first, "text": text})]


TextParts = _parts({"input_text": TextPart, "output_text": TextPart, "input_image": ImagePart}, "content parts")
ReasoningText = _parts({"reasoning_text": TextPart}, "text parts")


class MessageItem(Body):
    role: one_of(*ROLES)
    content: TextParts


class CallItem(Body):
    call_id: Text
    name: Name
    arguments: Text


class CallOutputItem(Body):
    call_id: Text
    output: TextParts


class ReasoningItem(Body):
    """An earlier reply's thinking (its reasoning_text), which the template may show or drop as
    it does chat's reasoning_content; a summary only, or encrypted content, is not it."""
    content: ReasoningText | None = None


class StoredItem(Body):
    """An item_reference, to an item only a server that keeps them has."""

    @model_validator(mode="before")
    @classmethod
    def _kept_nowhere(cls, value):
        raise refused(f"refers to a stored item: {KEPT_NOWHERE}")


Item = Annotated[MessageItem | CallItem | CallOutputItem | ReasoningItem | StoredItem, by(
    "type", {None: MessageItem, "message": MessageItem, "function_call": CallItem,
             "function_call_output": CallOutputItem, "reasoning": ReasoningItem, "item_reference": StoredItem},
    lambda kind: f"{_said(kind)} is not supported: nibble reads message, reasoning, function_call and "
                 "function_call_output items")]


class FunctionTool(Body, extra="allow"):
    """The Responses API's flat function tool: {type: "function", name, description, parameters, strict}."""
    name: Name
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: Flag | None = None

    def chat_tool(self) -> dict:
        """In chat's shape, {type, function: {...}}, which the templates and grammars read."""
        given = {k: getattr(self, k) for k in ("name", "description", "parameters", "strict")}
        return {"type": "function", "function": {k: v for k, v in given.items() if v is not None}}


def _built_in(kind) -> str:
    """Built-in tools (web_search, file_search, ...) run on OpenAI's servers."""
    if kind is None:
        return 'is missing: a function tool is {"type": "function", "name": ...}'
    return f"{_said(kind)} is not supported: nibble runs function tools only (built-in tools run on OpenAI's servers)"


class FunctionChoice(Body):
    type: Literal["function"]
    name: Text


class TextFormat(Body, extra="allow"):
    type: one_of(*api.FORMATS)
    schema_: JsonObject | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _has_schema(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise refused("is missing", "schema")
        return self


class TextOptions(Body):
    format: TextFormat | None = None


class ReasoningOptions(Body):
    # read as chat's reasoning_effort ("none" or "minimal": off)
    effort: one_of(*api.REASONING_EFFORTS, *STRONGER) | None = None


class ResponsesRequest(FullSampling, ThinkingKnobs):
    """Chat's other thinking knobs too, which a client may send in extra_body (chat_template_kwargs,
    reasoning_budget, think)."""
    model: Text | None = None
    stream: Flag | None = None
    input: Annotated[list[Item], Field(min_length=1), listed("must be a string or a non-empty list of items",
                                                            lambda text: {"role": "user", "content": text})]
    instructions: Text | None = None
    tools: list[Annotated[FunctionTool, by("type", {"function": FunctionTool}, _built_in)]] | None = None
    tool_choice: Annotated[Literal[api.TOOL_CHOICES] | FunctionChoice, said(
        'must be "none", "auto", "required" or {"type": "function", "name": ...}')] | None = None
    # a forced call may be several only when asked, as in chat (OpenAI's default is true)
    parallel_tool_calls: Flag | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: integer(1) | None = None
    # what only a server that keeps responses could do
    previous_response_id: Annotated[Any, unsupported(KEPT_NOWHERE)] = None
    conversation: Annotated[Any, unsupported(KEPT_NOWHERE)] = None
    background: Annotated[Any, unsupported("nibble answers while the request waits (or streams)")] = None

    @model_validator(mode="after")
    def _consistent(self):
        choice = self.tool_choice
        if choice in ("auto", "required") and not self.tools:
            raise refused("needs tools", "tool_choice")
        if isinstance(choice, FunctionChoice) and choice.name not in {t.name for t in self.tools or []}:
            raise refused(f"names {choice.name!r}, which is not in tools", "tool_choice")
        if self._format()[0] != "text" and self._choice()[0] != "none":
            raise refused("cannot be combined with tools: send one or the other", "text.format")
        return self

    def responses_body(self, images: Images) -> ResponsesBody:
        options = Options(self.model, bool(self.stream), False, self.max_output_tokens, self.sampling(), (), None)
        effort = self.reasoning.effort if self.reasoning is not None else None
        chat = ChatBody(self._messages(images), options, [t.chat_tool() for t in self.tools or []], *self._choice(),
                        bool(self.parallel_tool_calls), *self._format(), self.thinking(template_effort(effort)))
        return ResponsesBody(chat, self._echo(effort))

    def _choice(self) -> tuple[str, str | None]:
        """-> chat's tool_choice and tool_name: {type: "function", name} forces that tool."""
        if self.tool_choice is None:
            return ("auto" if self.tools else "none"), None
        if isinstance(self.tool_choice, FunctionChoice):
            return "required", self.tool_choice.name
        return self.tool_choice, None

    def _format(self) -> tuple[str, dict | None]:
        """`text.format` -> chat's response_format and schema."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return "text", None
        return fmt.type, fmt.schema_ if fmt.type == "json_schema" else None

    def _messages(self, images: Images) -> list[dict]:
        """`instructions` and `input` -> chat messages."""
        conversation = Conversation([{"role": "system", "content": self.instructions}] if self.instructions else [],
                                    images)
        for i, item in enumerate(self.input):
            conversation.add(item, f"input[{i}]")
        return conversation.messages

    def _echo(self, effort: str | None) -> dict:
        """What a Response repeats of its request (the client's Response model wants each).
        Nothing is stored, nor summarized."""
        tools = [t.model_dump(exclude_unset=True) for t in self.tools or []]
        choice = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        return {"instructions": self.instructions, "tools": tools,
                "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else self._choice()[0],
                "parallel_tool_calls": bool(self.parallel_tool_calls),
                "text": {"format": fmt.model_dump(by_alias=True, exclude_unset=True) if fmt else {"type": "text"}},
                "reasoning": {"effort": effort, "summary": None}, "max_output_tokens": self.max_output_tokens,
                "truncation": "disabled", "store": False, "background": False, "previous_response_id": None,
                "metadata": {}, "user": None}


class Conversation:
    """Input items -> chat messages. An earlier turn's items (its reasoning, message and function
    calls, as its output listed them) become one assistant message, as chat templates expect a
    turn; a function_call_output becomes a tool message."""

    def __init__(self, messages: list[dict], images: Images):
        self.messages, self.images = messages, images
        self.thought: str | None = None      # a reasoning item's text, for the assistant message after it
        self.names: dict[str, str] = {}      # call_id -> the function called, for its output's message

    def add(self, item: MessageItem | CallItem | CallOutputItem | ReasoningItem, place: str):
        """The item at `place` in the body."""
        if isinstance(item, MessageItem):
            self._message(item, place)
        elif isinstance(item, CallItem):
            self._call(item)
        elif isinstance(item, CallOutputItem):
            self._output(item, place)
        elif item.content is not None:
            self.thought = (self.thought or "") + _joined(item.content)

    def _content(self, parts: list[TextPart | ImagePart], place: str) -> str | list[dict]:
        """Parts joined, or with images, each in order (bodies.message_content)."""
        return message_content([p.text if isinstance(p, TextPart) else (f"{place}[{j}]", p.image_url)
                                for j, p in enumerate(parts)], self.images)

    def _message(self, item: MessageItem, place: str):
        content = self._content(item.content, f"{place}.content")
        if item.role == "assistant":
            self._assistant(content)
        else:
            self.messages.append({"role": "system" if item.role == "developer" else item.role, "content": content})

    def _call(self, item: CallItem):
        self.names[item.call_id] = item.name
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and self.thought is None:   # the same turn's
            last.setdefault("tool_calls", []).append(call)
        else:
            self._assistant(None)["tool_calls"] = [call]

    def _output(self, item: CallOutputItem, place: str):
        content = self._content(item.output, f"{place}.output")
        message = {"role": "tool", "tool_call_id": item.call_id, "content": content}
        if item.call_id in self.names:   # some templates name the function whose result it is
            message["name"] = self.names[item.call_id]
        self.messages.append(message)

    def _assistant(self, content: str | list[dict] | None) -> dict:
        message = {"role": "assistant", "content": content}
        if self.thought is not None:
            message["reasoning_content"], self.thought = self.thought, None
        self.messages.append(message)
        return message


def _joined(parts: list[TextPart]) -> str:
    return "".join(p.text for p in parts)


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
    # on a worker thread: images are decoded, and with --allow-image-urls fetched
    body = await run_in_threadpool(parse, await read_json(request), request.app.state.images)
    pending = await start(models, body.chat, chat_turn)
    stamp = Stamp(_new_id("resp"), int(time.time()), pending.served.name)
    events = response_events(stamp, body.echo, pending)
    if body.chat.options.stream:
        return Streamed(server_sent(events), pending)
    with pending:
        return await until_disconnected(request, whole(events))
