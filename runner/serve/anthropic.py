"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as the official
anthropic client and Claude Code send it: the body declared as pydantic models and read into api's
ChatBody, the reply written as Anthropic's message, its named server-sent events and its error
object. No model here: the handlers start and await a request as the OpenAI ones do
(runner/serve/pending.py).

A body's fields nibble does not know are ignored (`metadata`, `service_tier`, `cache_control` on
any block: the engine's pool keeps every prompt's prefix unasked); a field it knows with a wrong
type or value is a 400 that names it. Image blocks (a user message's, a tool result's) are read as
the body is (bodies.Images), on a worker thread.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from pydantic import Field, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..generation.decoding import Event
from ..text.reasoning import EFFORTS, STRONGER, Thinking, ThinkingOptions, template_effort
from ..text.tools import Call, Content
from .api import ChatBody, Options
from .bodies import (Base64, Body, Flag, ImageLocation, Images, ImageSource, JsonObject, Name, Sampling, Text, by,
                     integer, listed, message_content, one_of, read, refused, said)
from .errors import ApiError
from .models import Models
from .pending import Pending, Streamed, read_json, start, until_disconnected
from .replies import ReplyParts, chat_text, chat_turn, generating

UNREAD = ("document", "search_result")
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")   # those Anthropic's API takes
# tool_choice's type -> ChatBody's tool_choice
TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "required", "none": "none"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


# ---- the request ----

def parse_messages(body, counting: bool = False, images: Images = Images()) -> ChatBody:
    """A /v1/messages body (`counting`: a count_tokens body, which has no max_tokens) -> ChatBody,
    its images read by `images`, or ApiError naming the first bad field (or image)."""
    return read(MessagesRequest if counting else CreateRequest, body).chat_body(images)


def _blocks(kinds: str):
    """The rule a block of another kind breaks: one nibble reads nowhere is named as such."""
    return lambda kind: (f"is {kind}: nibble's models read no documents or search results" if kind in UNREAD
                         else f"must be {kinds}")


def _text(text: str) -> dict:
    """A string where blocks may be: one text block."""
    return {"type": "text", "text": text}


class TextBlock(Body):
    text: Text


TextBlocks = Annotated[list[Annotated[TextBlock, by("type", {"text": TextBlock}, _blocks('"text"'))]],
                       listed("must be a string or a list of text blocks", _text)]


class Base64Image(Body):
    media_type: one_of(*IMAGE_TYPES)
    data: Base64


class UrlImage(Body):
    url: ImageLocation


def _image_source(kind) -> str:
    if kind == "file":
        return "is 'file': nibble keeps no files: send the image as base64 or its URL"
    return 'must be "base64" or "url"'


class ImageBlock(Body):
    source: Annotated[Base64Image | UrlImage, by("type", {"base64": Base64Image, "url": UrlImage}, _image_source)]

    def image(self) -> ImageSource:
        source = self.source
        return source.url if isinstance(source, UrlImage) else ImageSource(source.data)


def _parts(blocks: list, place: str) -> list:
    """Text and image blocks as bodies.message_content takes them: text, or an image with its
    place (`place`[j]) in the body; other blocks left out."""
    return [b.text if isinstance(b, TextBlock) else (f"{place}[{j}]", b.image())
            for j, b in enumerate(blocks) if isinstance(b, (TextBlock, ImageBlock))]


class ToolResult(Body):
    tool_use_id: Text
    content: Annotated[list[Annotated[TextBlock | ImageBlock, by(
        "type", {"text": TextBlock, "image": ImageBlock}, _blocks('"text" or "image"'))]],
        listed("must be a string or a list of text and image blocks", _text)] | None = None
    is_error: Flag | None = None

    def message(self, place: str, images: Images) -> dict:
        """A "tool" message (the result at `place` in the body)."""
        parts = _parts(self.content or [], f"{place}.content")
        if self.is_error:   # the templates have no field for it: say it in words
            parts = [f"Error: {parts[0]}", *parts[1:]] if parts and isinstance(parts[0], str) else ["Error: ", *parts]
        return {"role": "tool", "tool_call_id": self.tool_use_id, "content": message_content(parts, images, "\n")}


class ThinkingBlock(Body):
    thinking: Text


class RedactedThinking(Body):
    """Anthropic's encrypted thinking: nothing a local model reads."""


class ToolUse(Body):
    id: Text
    name: Text
    input: JsonObject = Field(default_factory=dict)


class UserMessage(Body):
    content: Annotated[list[Annotated[TextBlock | ImageBlock | ToolResult, by(
        "type", {"text": TextBlock, "image": ImageBlock, "tool_result": ToolResult},
        _blocks('"text", "image" or "tool_result" in a user message'))]],
        listed("must be a string or a list of content blocks", _text)]

    def messages(self, i: int, images: Images) -> list[dict]:
        """The `i`th message's tool results (first, where Anthropic requires them), each a "tool"
        message; then its text blocks, joined, as one user message (with images: its text and
        image blocks, in order)."""
        place = f"messages[{i}].content"
        results = [b.message(f"{place}[{j}]", images) for j, b in enumerate(self.content) if isinstance(b, ToolResult)]
        parts = _parts(self.content, place)
        return results + ([{"role": "user", "content": message_content(parts, images, "\n")}]
                          if parts or not results else [])


class AssistantMessage(Body):
    content: Annotated[list[Annotated[TextBlock | ThinkingBlock | RedactedThinking | ToolUse, by(
        "type", {"text": TextBlock, "thinking": ThinkingBlock, "redacted_thinking": RedactedThinking,
                 "tool_use": ToolUse},
        'must be "text", "thinking", "redacted_thinking" or "tool_use" in an assistant message')]],
        listed("must be a string or a list of content blocks", _text)]

    def messages(self, i: int, images: Images) -> list[dict]:
        """One message: its tool_use blocks its tool_calls, its thinking its reasoning_content."""
        text = [b.text for b in self.content if isinstance(b, TextBlock)]
        thoughts = [b.thinking for b in self.content if isinstance(b, ThinkingBlock)]
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in self.content if isinstance(b, ToolUse)]
        m = {"role": "assistant", "content": "\n".join(text) if text or not calls else None}
        if thoughts:
            m["reasoning_content"] = "\n".join(thoughts)
        if calls:
            m["tool_calls"] = calls
        return [m]


Message = Annotated[UserMessage | AssistantMessage, by(
    "role", {"user": UserMessage, "assistant": AssistantMessage},
    'must be "user" or "assistant" (the system prompt goes in `system`)')]


class CustomTool(Body):
    name: Name
    input_schema: JsonObject
    description: Text | None = None

    def function_tool(self) -> dict:
        """As OpenAI's tool, which the templates and grammars read."""
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def _server_tool(kind) -> str:
    """A server tool (web search, code execution: a `type` such as "web_search_20250305") is a 400
    naming it: answering without it, the model would make its results up."""
    return (f"is {kind!r}, a tool Anthropic's servers run: nibble's models call only tools the client runs, "
            "given by name and input_schema")


class ToolChoice(Body):
    type: one_of(*TOOL_CHOICES)
    name: Text | None = None
    disable_parallel_tool_use: Flag | None = None

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and self.name is None:
            raise refused("is missing", "name")
        return self


class OutputFormat(Body):
    """Structured outputs: a grammar holds the reply to the schema."""
    type: Annotated[Literal["json_schema"], said('must be "json_schema"')]
    schema_: JsonObject = Field(alias="schema")


class OutputConfig(Body):
    format: OutputFormat | None = None
    effort: one_of(*EFFORTS, *STRONGER) | None = None   # gpt-oss's reasoning effort (its highest past "high")


class ThinkingConfig(Body):
    """{"type": "enabled", "budget_tokens": N}: think, at most N tokens; "disabled": not;
    "adaptive": think as much as the model likes."""
    type: Annotated[Literal["enabled", "disabled", "adaptive", "between_tools"],
                    said('must be "enabled", "disabled" or "adaptive"')]
    budget_tokens: integer(1) | None = None


class MessagesRequest(Sampling):
    """What /v1/messages and count_tokens read (count_tokens has no max_tokens)."""
    model: Text | None = None
    max_tokens: integer(1) | None = None
    stream: Flag | None = None
    system: TextBlocks | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Annotated[CustomTool, by("type", {None: CustomTool, "custom": CustomTool}, _server_tool)]] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = None
    stop_sequences: list[Text] | None = None

    @model_validator(mode="after")
    def _consistent(self):
        names = {t.name for t in self.tools or []}
        kind = self.tool_choice.type if self.tool_choice else None
        if kind in ("any", "tool") and not names:
            raise refused(f"{kind!r} needs tools", "tool_choice")
        if kind == "tool" and self.tool_choice.name not in names:
            raise refused(f"names {self.tool_choice.name!r}, which is not in tools", "tool_choice.name")
        if self._schema() is not None and self._choice()[0] != "none":
            raise refused("cannot be combined with tools: send one or the other", "output_config.format")
        return self

    def chat_body(self, images: Images) -> ChatBody:
        system = "\n".join(b.text for b in self.system or [])
        messages = [*([{"role": "system", "content": system}] if system else []),
                    *(m for i, message in enumerate(self.messages) for m in message.messages(i, images))]
        options = Options(self.model, bool(self.stream), False, self.max_tokens, self.sampling(),
                          tuple(s for s in self.stop_sequences or () if s), None)
        schema = self._schema()
        return ChatBody(messages, options, [t.function_tool() for t in self.tools or []], *self._choice(),
                        "text" if schema is None else "json_schema", schema, self._thinking())

    def _schema(self) -> dict | None:
        output = self.output_config
        return output.format.schema_ if output is not None and output.format is not None else None

    def _choice(self) -> tuple[str, str | None, bool]:
        """-> (ChatBody's tool_choice, tool_name, parallel_tool_calls). A forced call is one call
        unless disable_parallel_tool_use is false: a small model allowed more keeps writing calls
        until max_tokens (api's parallel_tool_calls, off unless asked, for the same reason)."""
        choice = self.tool_choice
        if choice is None:
            return ("auto" if self.tools else "none"), None, False
        return ((TOOL_CHOICES[choice.type] if self.tools else "none"), choice.name if choice.type == "tool" else None,
                choice.disable_parallel_tool_use is False)

    def _thinking(self) -> ThinkingOptions:
        """Left out: as the server and the model say."""
        effort = template_effort(self.output_config.effort if self.output_config is not None else None)
        kind = self.thinking.type if self.thinking is not None else None
        if kind is None:
            return ThinkingOptions(effort=effort)
        if kind == "disabled":
            return ThinkingOptions(think=False)
        return ThinkingOptions(think=True, budget=self.thinking.budget_tokens if kind == "enabled" else None,
                               effort=effort)


class CreateRequest(MessagesRequest):
    """A /v1/messages body."""
    max_tokens: integer(1)   # the most tokens the reply may take


# ---- the reply ----

def message(id: str, model: str, content: list[dict], stop: tuple[str | None, str | None], u: dict) -> dict:
    return {"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": u}


def usage(input_tokens: int, output_tokens: int = 0, cached: int = 0) -> dict:
    """Anthropic counts the prompt's tokens read from the cache apart from the rest."""
    return {"input_tokens": input_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def final_usage(event: Event) -> dict:
    u = event.usage
    return usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def stop_of(parts: ReplyParts, event: Event) -> tuple[str, str | None]:
    """-> (stop_reason, stop_sequence) of a reply's last event."""
    reason = parts.finish_reason(event.finish_reason)
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if event.stop_string is not None:
        return "stop_sequence", event.stop_string
    return "end_turn", None


def tool_use_id(call: Call) -> str:
    """In Anthropic's style; the next request's tool_result names it, which the template is given as is."""
    return f"toolu_{call.id}"


def empty_block(part: Thinking | Content | Call) -> dict:
    """A part's block as content_block_start opens it, or as the whole reply's content starts it."""
    if isinstance(part, Call):
        return {"type": "tool_use", "id": tool_use_id(part), "name": part.name, "input": {}}
    if isinstance(part, Thinking):
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def add_part(content: list[dict], part: Thinking | Content | Call) -> None:
    """A part into a whole reply's content: text or thinking runs on in the last block when that
    is of its kind; each call is a block of its own."""
    block = empty_block(part)
    if isinstance(part, Call):
        content.append({**block, "input": json.loads(part.arguments)})
        return
    key = block["type"]
    if not content or content[-1]["type"] != key:
        content.append(block)
    content[-1][key] += part.text


class BlockEvents:
    """A streamed reply's parts -> content_block_start, _delta and _stop events: a block opens
    when a part's kind differs from the open one's (each call is one), and closes before the next
    opens; a thinking block ends with its (empty: nobody can check one) signature."""

    def __init__(self):
        self.index, self.open = -1, None   # the open block's index and type

    def add(self, part: Thinking | Content | Call) -> list[dict]:
        block = empty_block(part)
        out = []
        if block["type"] != self.open or isinstance(part, Call):
            out += self.close()
            self.index, self.open = self.index + 1, block["type"]
            out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        out.append({"type": "content_block_delta", "index": self.index, "delta": delta(part)})
        return out

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        out = [{"type": "content_block_delta", "index": self.index,
                "delta": {"type": "signature_delta", "signature": ""}}] if self.open == "thinking" else []
        self.open = None
        return out + [{"type": "content_block_stop", "index": self.index}]


def delta(part: Thinking | Content | Call) -> dict:
    if isinstance(part, Call):
        return {"type": "input_json_delta", "partial_json": part.arguments}
    if isinstance(part, Thinking):
        return {"type": "thinking_delta", "thinking": part.text}
    return {"type": "text_delta", "text": part.text}


def error_body(e: ApiError) -> dict:
    """Anthropic's error object, its type by the status (a status it has no name for: by class)."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(e)}}


def failed(event: Event) -> ApiError:
    """A reply the engine could not go on with (NaN in the logits, say)."""
    return ApiError(500, f"the reply failed: {event.error}", type="server_error")


# ---- the handlers ----

async def messages(models: Models, request: Request) -> Response:
    # on a worker thread: images are decoded, and with --allow-image-urls fetched
    body = await run_in_threadpool(parse_messages, await read_json(request), False, request.app.state.images)
    pending = await start(models, body, chat_turn)
    id, parts = f"msg_{secrets.token_hex(12)}", ReplyParts(pending.turn.tool_names, pending.served.family)
    if body.options.stream:
        return Streamed(named_events(message_events(id, pending, parts)), pending)
    with pending:
        return await until_disconnected(request, whole_message(id, pending, parts))


async def count_tokens(models: Models, request: Request) -> Response:
    """The prompt's tokens, through the template with its tools, as /v1/messages would run it."""
    body = await run_in_threadpool(parse_messages, await read_json(request), True, request.app.state.images)
    lease = await models.lease(body.options.model)
    try:   # template and tokenizer, off the loop; a prompt past the context is counted all the same
        text, _, images = await run_in_threadpool(chat_text, generating(lease.served), body)
        count = len(await run_in_threadpool(lease.served.tokenizer.encode, text, None, images))
    finally:
        lease.release()
    return JSONResponse({"input_tokens": count})


async def whole_message(id: str, pending: Pending, parts: ReplyParts) -> Response:
    content = []
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            e = failed(event)
            return JSONResponse(error_body(e), e.status)
        for part in parts.feed(event):
            add_part(content, part)
        if event.finish_reason:
            return JSONResponse(message(id, pending.served.name, content, stop_of(parts, event), final_usage(event)))


async def message_events(id: str, pending: Pending, parts: ReplyParts) -> AsyncIterator[dict]:
    # at once, before the first token: the client sees the reply start
    yield {"type": "message_start", "message": message(id, pending.served.name, [], (None, None),
                                                       usage(len(pending.turn.request.prompt_ids)))}
    yield {"type": "ping"}
    blocks = BlockEvents()
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            yield error_body(failed(event))
            return
        for part in parts.feed(event):
            for out in blocks.add(part):
                yield out
        if event.finish_reason:
            for out in blocks.close():
                yield out
            stop_reason, stop_sequence = stop_of(parts, event)
            # the usage's counts are totals, which the client lays over message_start's
            yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                   "usage": final_usage(event)}
            yield {"type": "message_stop"}
            return


async def named_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Anthropic's server-sent events: each named by its type."""
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
