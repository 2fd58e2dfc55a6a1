"""The OpenAI API's wire side: chat and completions bodies, declared as pydantic models (with the
field types and rules every API's share, in bodies.py) and read into the neutral ChatBody and
CompletionBody that every API's bodies become; and the response and chunk objects the official
client expects (its error object: errors.py). No HTTP here: the tests feed it dicts.

A body's fields nibble does not know are ignored, as OpenAI's server ignores them; a field it knows
with a wrong type or value is a 400 that names it. `null` is the same as leaving a field out.
A message's images (`image_url` parts) are read as the body is (bodies.Images): parse on a worker
thread, not the event loop.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from ..text.reasoning import ThinkingOptions
from .bodies import (Adapters, AdapterScale, Body, Flag, FullSampling, ImageLocation, Images, JsonObject, Name, Text, by, integer, listed,
                     message_content, one_of, read, refused, said, stops, unsupported)

MAX_STOPS = 4              # OpenAI's limit on `stop` strings
MAX_TOP_LOGPROBS = 20      # chat's `top_logprobs`
MAX_TEXT_LOGPROBS = 5      # completions' `logprobs`
ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
TOOL_CHOICES = ("none", "auto", "required")
FORMATS = ("text", "json_object", "json_schema")   # response_format's types


@dataclass(frozen=True)
class Options:
    """What chat and completions bodies share."""
    model: str | None              # None: the one the server runs
    stream: bool
    include_usage: bool            # stream_options.include_usage: a last chunk with the usage
    max_tokens: int | None         # None: the rest of the context
    sampling: dict                 # the SamplerSettings fields the body sets, to lay over the model's
    stop: tuple[str, ...]
    logprobs: int | None           # top alternatives per token (0..20); None: no logprobs
    lora: tuple[tuple[int, float], ...] = ()   # llama.cpp's: (adapter id, scale); none: the server's scales


@dataclass(frozen=True)
class ChatBody:
    messages: list[dict]           # roles and content checked; developer -> system; content text, or parts with images
    options: Options
    tools: list[dict]              # OpenAI's [{"type": "function", "function": {...}}], as given
    tool_choice: str               # "none" | "auto" | "required" (a named tool: "required" + tool_name)
    tool_name: str | None
    parallel_tool_calls: bool      # a forced call may be several (OpenAI's field; off unless true, as in llama.cpp)
    response_format: str           # "text" | "json_object" | "json_schema"
    schema: dict | None            # json_schema's schema
    thinking: ThinkingOptions = ThinkingOptions()   # how the model may think


@dataclass(frozen=True)
class CompletionBody:
    prompt: str
    options: Options
    suffix: str | None = None   # fill in the middle between prompt and suffix


def parse_chat(body, images: Images = Images()) -> ChatBody:
    """A /v1/chat/completions body -> ChatBody, its images read by `images`, or ApiError naming
    the first bad field (or image)."""
    return read(ChatRequest, body).chat_body(images)


def parse_completion(body) -> CompletionBody:
    """A /v1/completions body -> CompletionBody, or ApiError naming the first bad field."""
    return read(CompletionRequest, body).completion_body()


# ---- the bodies ----

class StreamOptions(Body):
    include_usage: Flag | None = None


class OpenAIRequest(FullSampling):
    """What chat and completions bodies share."""
    model: Text | None = None
    stream: Flag | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[integer(1, 1), said("must be 1: nibble gives one choice per request")] | None = None
    stop: stops(MAX_STOPS) | None = None
    lora: Adapters | None = None

    @model_validator(mode="after")
    def _streamed(self):
        if self.stream_options is not None and not self.stream:
            raise refused("is only allowed when stream is true", "stream_options")
        return self

    def options(self, max_tokens: int | None, logprobs: int | None) -> Options:
        include_usage = self.stream_options is not None and bool(self.stream_options.include_usage)
        return Options(self.model, bool(self.stream), include_usage, max_tokens, self.sampling(),
                       tuple(s for s in self.stop or () if s), logprobs, adapter_scales(self.lora))


def adapter_scales(lora: list[AdapterScale] | None) -> tuple[tuple[int, float], ...]:
    return tuple((a.id, a.scale) for a in lora or ())


class TemplateKwargs(Body, extra="allow"):
    """chat_template_kwargs: passed to the template as they came."""
    enable_thinking: Flag | None = None


class ThinkingKnobs(Body):
    """Chat's thinking knobs besides OpenAI's reasoning_effort: llama-server's chat_template_kwargs
    (its enable_thinking) and reasoning_budget, and ollama's think."""
    chat_template_kwargs: TemplateKwargs | None = None
    reasoning_budget: integer(-1) | None = None
    think: Flag | None = None

    def thinking(self, effort: str | None) -> ThinkingOptions:
        """With OpenAI's reasoning effort ("none" or "minimal": off)."""
        kwargs = self.chat_template_kwargs or TemplateKwargs()
        think = kwargs.enable_thinking
        if effort in ("none", "minimal"):
            think, effort = False, None
        return ThinkingOptions(think if self.think is None else self.think, self.reasoning_budget, effort,
                               kwargs.model_dump(exclude_unset=True))


class TextPart(Body):
    text: Text


class ImageUrl(Body):
    url: ImageLocation
    # detail ("auto", "low", "high") is the tower's to decide: ignored


def _url_alone(value):
    """image_url given as the URL itself, as some clients send it."""
    return {"url": value} if isinstance(value, str) else value


class ImagePart(Body):
    image_url: Annotated[ImageUrl, BeforeValidator(_url_alone)]


# A message's content: text, or text and image parts
ContentPart = Annotated[TextPart | ImagePart, by("type", {"text": TextPart, "image_url": ImagePart},
                                                 'must be "text" or "image_url": nibble reads no audio or files')]
ChatContent = Annotated[list[ContentPart], listed("must be a string, a list of content parts or null",
                                                  lambda text: {"type": "text", "text": text})]


def content_parts(parts: list[TextPart | ImagePart], place: str) -> list:
    """Content parts as bodies.message_content takes them: text, or an image with its place
    (`place`[j]) in the body."""
    return [p.text if isinstance(p, TextPart) else (f"{place}[{j}]", p.image_url.url) for j, p in enumerate(parts)]


class CalledFunction(Body, extra="allow"):
    name: Text


class ToolCall(Body, extra="allow"):
    function: CalledFunction


class ChatMessage(Body, extra="allow"):
    """One message; its other fields (tool_call_id, name, ...) go to the template as they came."""
    role: one_of(*ROLES)
    content: ChatContent | None = None
    reasoning_content: Text | None = None   # an earlier reply's thinking
    reasoning: Text | None = None           # LM Studio's name for it
    tool_calls: Annotated[list[ToolCall], said('must be a list of {"function": {"name", "arguments"}}')] | None = None

    @model_validator(mode="after")
    def _said_something(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise refused("is missing", "content")
        return self

    def chat(self, i: int, images: Images) -> dict:
        """As the templates read it (the `i`th message): developer -> system, text parts joined
        (or, with images, the parts in order), thinking as reasoning_content."""
        content = None if self.content is None else message_content(
            content_parts(self.content, f"messages[{i}].content"), images)
        out = {**self.model_dump(exclude_unset=True, exclude={"content"}), "content": content,
               "role": "system" if self.role == "developer" else self.role}
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None:
            out["reasoning_content"] = thought
        return out


class Function(Body, extra="allow"):
    name: Name
    parameters: JsonObject = Field(default_factory=dict)


class FunctionTool(Body, extra="allow"):
    """A tool, passed to the template and the grammar as it came."""
    type: Literal["function"] = "function"
    function: Function


Tool = Annotated[FunctionTool, said('must be {"type": "function", "function": {"name": ..., "parameters": ...}}',
                                    keep=("function", "parameters"))]


class FunctionName(Body):
    name: Text


class NamedTool(Body):
    function: FunctionName


class JsonSchema(Body):
    schema_: JsonObject | None = Field(None, alias="schema")   # None: any JSON object


class ResponseFormat(Body):
    type: one_of(*FORMATS)
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _has_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise refused("is missing", "json_schema")
        return self

    def kind(self) -> tuple[str, dict | None]:
        """-> ChatBody's response_format and schema."""
        if self.type != "json_schema":
            return self.type, None
        schema = self.json_schema.schema_
        return ("json_object", None) if schema is None else ("json_schema", schema)


class ChatRequest(OpenAIRequest, ThinkingKnobs):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: integer(1) | None = None
    max_completion_tokens: integer(1) | None = None   # OpenAI's newer name for it
    logprobs: Flag | None = None
    top_logprobs: integer(0, MAX_TOP_LOGPROBS) | None = None
    tools: list[Tool] | None = None
    tool_choice: Annotated[Literal[TOOL_CHOICES] | NamedTool, said(
        'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')] | None = None
    parallel_tool_calls: Flag | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: one_of(*REASONING_EFFORTS) | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise refused("needs logprobs set to true", "top_logprobs")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise refused("needs tools", "tool_choice")
        if isinstance(choice, NamedTool) and choice.function.name not in {t.function.name for t in self.tools}:
            raise refused(f"names {choice.function.name!r}, which is not in tools", "tool_choice")
        if self.response_format is not None and self.response_format.type != "text" and self._choice()[0] != "none":
            raise refused("cannot be combined with tools: send one or the other", "response_format")
        return self

    def _choice(self) -> tuple[str, str | None]:
        """-> ChatBody's tool_choice and tool_name."""
        if self.tool_choice is None:
            return ("auto" if self.tools else "none"), None
        if isinstance(self.tool_choice, NamedTool):
            return "required", self.tool_choice.function.name
        return self.tool_choice, None

    def chat_body(self, images: Images) -> ChatBody:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        options = self.options(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        response_format, schema = self.response_format.kind() if self.response_format else ("text", None)
        return ChatBody([m.chat(i, images) for i, m in enumerate(self.messages)], options,
                        [t.model_dump(exclude_unset=True) for t in self.tools or []], *self._choice(),
                        bool(self.parallel_tool_calls), response_format, schema, self.thinking(self.reasoning_effort))


def _only(value):
    """A list of one: that one."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


class CompletionRequest(OpenAIRequest):
    prompt: Annotated[Name, BeforeValidator(_only), said("must be a non-empty string (or a list of one)")]
    suffix: Text | None = None
    echo: Annotated[Any, unsupported()] = None
    best_of: Annotated[integer(1, 1), said("is not supported: leave it out or set 1")] | None = None
    logprobs: integer(0, MAX_TEXT_LOGPROBS) | None = None
    max_tokens: integer(1) | None = None

    def completion_body(self) -> CompletionBody:
        return CompletionBody(self.prompt, self.options(self.max_tokens, self.logprobs), self.suffix)


# ---- responses ----

@dataclass(frozen=True)
class Stamp:
    """What every object of one reply repeats: its id, creation time and model."""
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> Stamp:
        return cls(f"{prefix}-{secrets.token_hex(12)}", int(time.time()), model)


def usage(u) -> dict:
    """An engine Usage -> OpenAI's usage, with the reused prompt tokens as cached_tokens and,
    nibble's own, those of them read back from its disk tier as disk_tokens."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "disk_tokens": u.disk_tokens}}


def chat_completion(stamp: Stamp, content: str | None, tool_calls: list[dict], finish_reason: str,
                    logprobs: Sequence, u, thinking: str | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if thinking:   # llama-server's name, and LM Studio's and mlx-lm's
        message["reasoning_content"] = message["reasoning"] = thinking
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": stamp.id, "object": "chat.completion", "created": stamp.created, "model": stamp.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                         "logprobs": chat_logprobs(logprobs)}],
            "usage": usage(u)}


def chat_chunk(stamp: Stamp, delta: dict, finish_reason: str | None = None, logprobs: Sequence | None = None) -> dict:
    return {"id": stamp.id, "object": "chat.completion.chunk", "created": stamp.created, "model": stamp.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                         "logprobs": chat_logprobs(logprobs)}]}


def text_completion(stamp: Stamp, text: str, finish_reason: str | None, logprobs: Sequence | None,
                    u=None, offset: int = 0) -> dict:
    """A completions reply, or (u None) one chunk of a streamed one; `offset`: characters before `text`."""
    out = {"id": stamp.id, "object": "text_completion", "created": stamp.created, "model": stamp.model,
           "choices": [{"index": 0, "text": text, "finish_reason": finish_reason,
                        "logprobs": text_logprobs(logprobs, offset)}]}
    if u is not None:
        out["usage"] = usage(u)
    return out


def usage_chunk(stamp: Stamp, object: str, u) -> dict:
    """stream_options.include_usage: the last chunk, with no choices."""
    return {"id": stamp.id, "object": object, "created": stamp.created, "model": stamp.model,
            "choices": [], "usage": usage(u)}


def tool_call(index: int, id: str, name: str, arguments: str) -> dict:
    return {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_logprobs(items: Sequence | None) -> dict | None:
    """Engine TokenLogprobs -> chat's {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if not items:
        return None
    return {"content": [{**_token(t.text, t.logprob),
                         "top_logprobs": [_token(text, lp) for _, text, lp in t.top]} for t in items]}


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def text_logprobs(items: Sequence | None, offset: int = 0) -> dict | None:
    """Engine TokenLogprobs -> completions' {tokens, token_logprobs, top_logprobs, text_offset}."""
    if not items:
        return None
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.text)
    return {"tokens": [t.text for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{text: lp for _, text, lp in t.top} for t in items], "text_offset": offsets}


def models(names: list[str], created: int) -> dict:
    """/v1/models: every model the server can serve, loaded or not."""
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "nibble"} for name in names]}
