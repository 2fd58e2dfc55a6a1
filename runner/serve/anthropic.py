"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as the official
anthropic client and Claude Code send it: the body read into api's ChatBody, the reply written as
Anthropic's message, its named server-sent events and its error object. No model here: the
handlers start and await a request as the OpenAI ones do (runner/serve/pending.py).

A body's fields nibble does not know are ignored (`metadata`, `service_tier`, `cache_control` on
any block: the engine's pool keeps every prompt's prefix unasked); a field it knows with a wrong
type or value is a 400 that names it.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..generation.decoding import Event
from ..chat.reasoning import EFFORTS, STRONGER, Thinking, template_effort
from ..chat.tools import Call, Content
from .api import ApiError, ChatBody, Options, ThinkingOptions, bad, integer, json_object, sampling_fields, typed
from .models import Models
from .pending import Pending, Streamed, read_json, start, until_disconnected
from .replies import ReplyParts, chat_text, chat_turn, generating

SAMPLING = ("temperature", "top_p", "top_k")
MEDIA = ("image", "document", "search_result")
# tool_choice's type -> ChatBody's tool_choice
TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "required", "none": "none"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


# ---- the request ----

def parse_messages(body, counting: bool = False) -> ChatBody:
    """A /v1/messages body (`counting`: a count_tokens body, which has no max_tokens) -> ChatBody,
    or ApiError naming the first bad field."""
    body = json_object(body, "the request body")
    max_tokens = integer(body, "max_tokens", 1)
    if max_tokens is None and not counting:
        raise bad("max_tokens", "is required: the most tokens the reply may take")
    tools = custom_tools(body)
    tool_choice, tool_name, parallel = tool_choice_of(body, tools)
    output = json_object(body.get("output_config") or {}, "output_config")
    schema = output_schema(output)
    if schema is not None and tool_choice != "none":
        raise bad("output_config.format", "cannot be combined with tools: send one or the other")
    options = Options(typed(body, "model", str), bool(typed(body, "stream", bool)) and not counting, False,
                      max_tokens, sampling_fields({k: body[k] for k in SAMPLING if k in body}),
                      stop_sequences(body), None)
    return ChatBody(system_messages(body) + conversation(body), options, tools, tool_choice, tool_name, parallel,
                    "text" if schema is None else "json_schema", schema, thinking_of(body, output))


def system_messages(body: dict) -> list[dict]:
    system = body.get("system")
    if system is None or isinstance(system, str):
        text = system
    elif isinstance(system, list):
        text = "\n".join(text_block(b, f"system[{i}]") for i, b in enumerate(system))
    else:
        raise bad("system", "must be a string or a list of text blocks")
    return [{"role": "system", "content": text}] if text else []


def conversation(body: dict) -> list[dict]:
    """Anthropic's messages -> OpenAI-style ones: a user message's tool results become "tool"
    messages, an assistant's tool_use blocks its tool_calls, its thinking its reasoning_content."""
    messages = typed(body, "messages", list)
    if not messages:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        m = json_object(m, where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", 'must be "user" or "assistant" (the system prompt goes in `system`)')
        blocks = content_blocks(m.get("content"), f"{where}.content")
        out += user_messages(blocks, where) if role == "user" else [assistant_message(blocks, where)]
    return out


def content_blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content blocks")
    return [json_object(block, f"{where}[{j}]") for j, block in enumerate(content)]


def user_messages(blocks: list[dict], where: str) -> list[dict]:
    """The tool results (first, where Anthropic requires them), each a "tool" message; then the
    text blocks, joined, as one user message."""
    results, text = [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "tool_result":
            results.append(tool_result(block, at))
        elif kind == "text" or kind in MEDIA:   # text_block refuses media, saying why
            text.append(text_block(block, at))
        else:
            raise bad(f"{at}.type", 'must be "text" or "tool_result" in a user message')
    return results + ([{"role": "user", "content": "\n".join(text)}] if text or not results else [])


def tool_result(block: dict, at: str) -> dict:
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        text = "\n".join(text_block(b, f"{at}.content[{k}]") for k, b in enumerate(content))
    else:
        raise bad(f"{at}.content", "must be a string or a list of text blocks")
    if typed(block, "is_error", bool, f"{at}.is_error"):   # the templates have no field for it: say it in words
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": required(block, "tool_use_id", str, at), "content": text}


def assistant_message(blocks: list[dict], where: str) -> dict:
    text, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            text.append(text_block(block, at))
        elif kind == "thinking":
            thoughts.append(required(block, "thinking", str, at))
        elif kind == "tool_use":
            arguments = json_object(block.get("input", {}), f"{at}.input")
            calls.append({"id": required(block, "id", str, at), "type": "function",
                          "function": {"name": required(block, "name", str, at),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind != "redacted_thinking":   # that one is Anthropic's encrypted text: nothing a local model reads
            raise bad(f"{at}.type", 'must be "text", "thinking", "redacted_thinking" or "tool_use" '
                                    'in an assistant message')
    m = {"role": "assistant", "content": "\n".join(text) if text or not calls else None}
    if thoughts:
        m["reasoning_content"] = "\n".join(thoughts)
    if calls:
        m["tool_calls"] = calls
    return m


def text_block(block, at: str) -> str:
    kind = json_object(block, at).get("type")
    if kind in MEDIA:
        raise bad(f"{at}.type", f"is {kind}: nibble's models read no images or documents")
    if kind != "text":
        raise bad(f"{at}.type", 'must be "text"')
    return required(block, "text", str, at)


def required(block: dict, name: str, kind: type, at: str):
    value = typed(block, name, kind, f"{at}.{name}")
    if value is None:
        raise bad(f"{at}.{name}", "is missing")
    return value


def custom_tools(body: dict) -> list[dict]:
    """Anthropic's tools -> OpenAI's. A server tool (web search, code execution: a `type` such as
    "web_search_20250305") is a 400 naming it: answering without it, the model would make its
    results up."""
    out = []
    for i, tool in enumerate(typed(body, "tools", list) or []):
        where = f"tools[{i}]"
        kind = json_object(tool, where).get("type")
        if kind not in (None, "custom"):
            raise bad(f"{where}.type", f"is {kind!r}, a tool Anthropic's servers run: nibble's models "
                                       "call only tools the client runs, given by name and input_schema")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.name", "must be a non-empty string")
        function = {"name": name, "parameters": json_object(tool.get("input_schema"), f"{where}.input_schema")}
        description = typed(tool, "description", str, f"{where}.description")
        if description:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def tool_choice_of(body: dict, tools: list[dict]) -> tuple[str, str | None, bool]:
    """-> (ChatBody's tool_choice, tool_name, parallel_tool_calls). A forced call is one call
    unless disable_parallel_tool_use is false: a small model allowed more keeps writing calls
    until max_tokens (api's parallel_tool_calls, off unless asked, for the same reason)."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None, False
    kind = json_object(choice, "tool_choice").get("type")
    if not isinstance(kind, str) or kind not in TOOL_CHOICES:
        raise bad("tool_choice.type", 'must be "auto", "any", "tool" or "none"')
    if kind in ("any", "tool") and not tools:
        raise bad("tool_choice", f"{kind!r} needs tools")
    name = None
    if kind == "tool":
        name = required(choice, "name", str, "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad("tool_choice.name", f"names {name!r}, which is not in tools")
    parallel = typed(choice, "disable_parallel_tool_use", bool, "tool_choice.disable_parallel_tool_use") is False
    return (TOOL_CHOICES[kind] if tools else "none"), name, parallel


def output_schema(output: dict) -> dict | None:
    """output_config.format (structured outputs: {"type": "json_schema", "schema": ...}), which a
    grammar holds the reply to."""
    spec = output.get("format")
    if spec is None:
        return None
    if json_object(spec, "output_config.format").get("type") != "json_schema":
        raise bad("output_config.format.type", 'must be "json_schema"')
    return json_object(spec.get("schema"), "output_config.format.schema")


def thinking_of(body: dict, output: dict) -> ThinkingOptions:
    """{"type": "enabled", "budget_tokens": N}: think, at most N tokens; "disabled": not;
    "adaptive": think as much as the model likes. Left out: as the server and the model say.
    output_config.effort is gpt-oss's reasoning effort (its highest past "high")."""
    effort = typed(output, "effort", str, "output_config.effort")
    if effort not in (None, *EFFORTS, *STRONGER):
        raise bad("output_config.effort", f"must be one of {', '.join((*EFFORTS, *STRONGER))}")
    effort = template_effort(effort)
    thinking = body.get("thinking")
    if thinking is None:
        return ThinkingOptions(effort=effort)
    kind = json_object(thinking, "thinking").get("type")
    if kind == "disabled":
        return ThinkingOptions(think=False)
    if kind in ("adaptive", "between_tools"):
        return ThinkingOptions(think=True, effort=effort)
    if kind != "enabled":
        raise bad("thinking.type", 'must be "enabled", "disabled" or "adaptive"')
    # integer() names the field by its key: the key given as the field's whole name
    budget = integer({"thinking.budget_tokens": thinking.get("budget_tokens")}, "thinking.budget_tokens", 1)
    return ThinkingOptions(think=True, budget=budget, effort=effort)


def stop_sequences(body: dict) -> tuple[str, ...]:
    stops = typed(body, "stop_sequences", list) or []
    if not all(isinstance(s, str) for s in stops):
        raise bad("stop_sequences", "must be a list of strings")
    return tuple(s for s in stops if s)


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
    body = parse_messages(await read_json(request))
    pending = await start(models, body, chat_turn)
    id, parts = f"msg_{secrets.token_hex(12)}", ReplyParts(pending.turn.tool_names, pending.served.family)
    if body.options.stream:
        return Streamed(named_events(message_events(id, pending, parts)), pending)
    with pending:
        return await until_disconnected(request, whole_message(id, pending, parts))


async def count_tokens(models: Models, request: Request) -> Response:
    """The prompt's tokens, through the template with its tools, as /v1/messages would run it."""
    body = parse_messages(await read_json(request), counting=True)
    lease = await models.lease(body.options.model)
    try:   # template and tokenizer, off the loop; a prompt past the context is counted all the same
        text, _ = await run_in_threadpool(chat_text, generating(lease.served), body)
        count = len(await run_in_threadpool(lease.served.tokenizer.encode, text))
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
