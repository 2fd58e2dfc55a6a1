"""The OpenAI API's wire side: request bodies checked and read into plain values, and the response,
chunk and error objects the official client expects. No HTTP here: the tests feed it dicts.

A body's fields nibble does not know are ignored, as OpenAI's server ignores them; a field it knows
with a wrong type or value is a 400 that names it. `null` is the same as leaving a field out.
"""
from __future__ import annotations

import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from nibble.formats.errors import NibbleError
from ..chat.reasoning import ThinkingOptions
from ..settings import SamplerSettings

MAX_STOPS = 4              # OpenAI's limit on `stop` strings
MAX_TOP_LOGPROBS = 20      # chat's `top_logprobs`
MAX_TEXT_LOGPROBS = 5      # completions' `logprobs`
ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")

# The body's sampling fields -> SamplerSettings' names. top_k, min_p, repeat_penalty and the dry_
# fields (llama.cpp's server's names) are not OpenAI's: clients send them in `extra_body`
# (repetition_penalty is vLLM's spelling).
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repeat_penalty": "repetition_penalty", "repetition_penalty": "repetition_penalty",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "dry_multiplier": "dry_multiplier", "dry_base": "dry_base",
                   "dry_allowed_length": "dry_allowed_length", "dry_penalty_last_n": "dry_penalty_last_n",
                   "seed": "seed"}
INTEGER_FIELDS = ("top_k", "dry_allowed_length", "dry_penalty_last_n", "seed")


class ApiError(NibbleError):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict:
        return error_body(str(self), self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str, rule: str) -> ApiError:
    return ApiError(400, f"{param} {rule}", param)


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


@dataclass(frozen=True)
class ChatBody:
    messages: list[dict]           # roles and content checked; developer -> system, text parts joined
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


def parse_chat(body) -> ChatBody:
    """A /v1/chat/completions body -> ChatBody, or ApiError naming the first bad field."""
    body = json_object(body, "the request body")
    logprobs = typed(body, "logprobs", bool) or False
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs", "needs logprobs set to true")
    max_tokens = integer(body, "max_tokens", 1)
    newer = integer(body, "max_completion_tokens", 1)   # OpenAI's newer name for it
    options = _options(body, newer if newer is not None else max_tokens, (top or 0) if logprobs else None)
    tools = function_tools(body)
    tool_choice, tool_name = _tool_choice(body, tools)
    parallel_tool_calls = typed(body, "parallel_tool_calls", bool) or False
    response_format, schema = response_format_of(body)
    if response_format != "text" and tool_choice != "none":
        raise bad("response_format", "cannot be combined with tools: send one or the other")
    messages = typed(body, "messages", list)
    if not messages:
        raise bad("messages", "must be a non-empty list of messages")
    return ChatBody([chat_message(m, i) for i, m in enumerate(messages)], options, tools, tool_choice, tool_name,
                    parallel_tool_calls, response_format, schema, thinking_options(body))


def thinking_options(body: dict) -> ThinkingOptions:
    """OpenAI's reasoning_effort ("none" or "minimal": off), llama-server's chat_template_kwargs
    (its enable_thinking) and reasoning_budget, and ollama's think."""
    kwargs = json_object(body.get("chat_template_kwargs") or {}, "chat_template_kwargs")
    think = typed(kwargs, "enable_thinking", bool, "chat_template_kwargs.enable_thinking")
    effort = typed(body, "reasoning_effort", str)
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}")
    if effort in ("none", "minimal"):
        think, effort = False, None
    given = typed(body, "think", bool)
    think = given if given is not None else think
    return ThinkingOptions(think, integer(body, "reasoning_budget", -1), effort, kwargs)


def parse_completion(body) -> CompletionBody:
    """A /v1/completions body -> CompletionBody, or ApiError naming the first bad field."""
    body = json_object(body, "the request body")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", "must be a non-empty string (or a list of one)")
    if body.get("suffix"):
        raise bad("suffix", "is not supported")
    if body.get("echo"):
        raise bad("echo", "is not supported")
    if integer(body, "best_of", 1) not in (None, 1):
        raise bad("best_of", "is not supported: leave it out or set 1")
    logprobs = integer(body, "logprobs", 0, MAX_TEXT_LOGPROBS)
    return CompletionBody(prompt, _options(body, integer(body, "max_tokens", 1), logprobs))


def _options(body: dict, max_tokens: int | None, logprobs: int | None) -> Options:
    if integer(body, "n", 1) not in (None, 1):
        raise bad("n", "must be 1: nibble gives one choice per request")
    model = typed(body, "model", str)
    stream = typed(body, "stream", bool) or False
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    include_usage = bool(typed(json_object(stream_options or {}, "stream_options"), "include_usage", bool,
                                "stream_options.include_usage"))
    return Options(model, stream, include_usage, max_tokens, sampling_fields(body), stop_strings(body), logprobs)


def sampling_fields(body: dict) -> dict:
    """The sampling fields the body sets, each checked by SamplerSettings' own rules."""
    given = {}
    for param, name in SAMPLING_FIELDS.items():
        value = integer(body, param) if name in INTEGER_FIELDS else number(body, param)
        if value is None:
            continue
        try:
            SamplerSettings(**{name: value})
        except NibbleError as e:
            raise ApiError(400, f"{param}: {e}", param) from None
        given[name] = value
    return given


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad("stop", f"must be a string or a list of at most {MAX_STOPS} strings")
    return tuple(s for s in stops if s)


def chat_message(m, i: int) -> dict:
    """One message, checked: a known role, content as text (OpenAI's text parts joined) or null."""
    where = f"messages[{i}]"
    m = json_object(m, where)
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"{where}.content", "parts must be text: nibble's models read no images or audio")
        content = "".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise bad(f"{where}.content", "must be a string, a list of text parts or null")
    if content is None and not (role == "assistant" and m.get("tool_calls")):
        raise bad(f"{where}.content", "is missing")
    out = {**m, "role": "system" if role == "developer" else role, "content": content}
    thought = m.get("reasoning_content", m.get("reasoning"))   # an earlier reply's thinking (LM Studio's name too)
    if thought is not None:
        if not isinstance(thought, str):
            raise bad(f"{where}.reasoning_content", "must be a string")
        out["reasoning_content"] = thought
    if "tool_calls" in m:
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls):
            raise bad(f"{where}.tool_calls", "must be a list of {\"function\": {\"name\", \"arguments\"}}")
    return out


def function_tools(body: dict) -> list[dict]:
    tools = typed(body, "tools", list) or []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise bad(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
        if not isinstance(function.get("parameters", {}), dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
    return tools


def _tool_choice(body: dict, tools: list[dict]) -> tuple[str, str | None]:
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice != "none" and not tools:
        raise bad("tool_choice", "needs tools")
    if choice in ("none", "auto", "required"):
        return choice, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                                 '"function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools}:
        raise bad("tool_choice", f"names {name!r}, which is not in tools")
    return "required", name


def response_format_of(body: dict) -> tuple[str, dict | None]:
    rf = body.get("response_format")
    if rf is None:
        return "text", None
    kind = json_object(rf, "response_format").get("type")
    if kind in ("text", "json_object"):
        return kind, None
    if kind != "json_schema":
        raise bad("response_format.type", 'must be "text", "json_object" or "json_schema"')
    spec = json_object(rf.get("json_schema"), "response_format.json_schema")
    schema = spec.get("schema")
    if schema is None:
        return "json_object", None
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", "must be a JSON schema object")
    return "json_schema", schema


def json_object(value, name: str) -> dict:
    if not isinstance(value, dict):
        raise bad(name, "must be a JSON object")
    return value


def typed(body: dict, name: str, kind: type, param: str | None = None):
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise bad(param or name, f"must be {_KIND_WORDS[kind]}")
    return value


_KIND_WORDS = {bool: "true or false", str: "a string", list: "a list", dict: "an object"}


def number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, "must be a number")
    return float(value)


def integer(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo) \
            or (hi is not None and value > hi):
        rule = ("an integer" + (f" from {lo}" if lo is not None else "")
                + (f" to {hi}" if hi is not None else (" or more" if lo is not None else "")))
        raise bad(name, f"must be {rule}")
    return value


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
