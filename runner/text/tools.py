"""Tool calls: OpenAI's `tools` through a model's chat template, and the calls in its reply parsed
back, as they stream.

Each family of templates asks for calls in its own syntax, told apart by
what the template's source holds, as llama.cpp does:

    hermes   `<tool_call>` (Qwen 2.5/3, Hermes 2/3, SmolLM3), one block per call:
             <tool_call>\n{"name": n, "arguments": {…}}\n</tool_call>
    llama3   `<|start_header_id|>ipython…` (Llama 3.x), one call, maybe after <|python_tag|>:
             {"name": n, "parameters": {…}}
    mistral  `[TOOL_CALLS]` (Mistral), the calls in one list:
             [TOOL_CALLS][{"name": n, "arguments": {…}}, …]
    harmony  gpt-oss's commentary channel, `to=functions.n` (runner/text/reasoning.py reads the
             channels and hands each call on in hermes' form)
    generic  any other template (it ignores tools): nibble lists the tools in a system message
             and asks for hermes' form
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass

from nibble.formats.errors import NibbleError

from .grammar import COMPACT, Grammar

FAMILIES = ("hermes", "llama3", "mistral", "harmony", "generic")

# What nibble tells a model whose template ignores tools (Qwen 2.5's words, hermes' syntax).
GENERIC_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")

MISTRAL_ID = re.compile("[A-Za-z0-9]{9}")   # its template refuses any other call id


class MessageError(NibbleError):
    """A conversation or a tool choice that cannot be given to the model (the server's 400)."""


@dataclass(frozen=True)
class Content:
    """Reply text that is not a tool call."""
    text: str


@dataclass(frozen=True)
class Call:
    """A tool call, whole: OpenAI's `tool_calls` entry."""
    index: int       # its place among the reply's calls
    id: str          # 9 random alphanumerics (Mistral's form, which every family accepts)
    name: str
    arguments: str   # a JSON object, as text


@dataclass(frozen=True)
class Syntax:
    """How a family's model writes its calls."""
    start: str          # the marker before a call
    end: str | None     # the marker after it; None: the call runs to the reply's end
    arguments: str      # the key of the arguments in the call's JSON
    listed: bool        # the calls are one JSON list (mistral), else one object per call
    bare: bool          # a reply that starts with "{" may be a call without the marker (llama3)


SYNTAX = {
    "hermes": Syntax("<tool_call>", "</tool_call>", "arguments", listed=False, bare=False),
    "generic": Syntax("<tool_call>", "</tool_call>", "arguments", listed=False, bare=False),
    "llama3": Syntax("<|python_tag|>", None, "parameters", listed=False, bare=True),
    "mistral": Syntax("[TOOL_CALLS]", None, "arguments", listed=True, bare=False),
    "harmony": Syntax("<tool_call>", "</tool_call>", "arguments", listed=False, bare=False),
}


def tool_family(template_source: str) -> str:
    """The family of tool-call syntax a chat template asks for (see the module's docstring)."""
    if "<|channel|>" in template_source:
        return "harmony"
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|start_header_id|>ipython<|end_header_id|>" in template_source:
        return "llama3"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    return "generic"


def prepare_messages(messages: list[dict], tools: list[dict] | None,
                     family: str) -> tuple[list[dict], list[dict] | None]:
    """OpenAI's messages and tools made ready for ChatTemplate.render(messages, tools=tools).

    Content None becomes "" and text parts are joined (templates expect a string); a call's
    `arguments`, a JSON string in OpenAI's API, becomes the object it holds (templates write it
    with tojson, which would encode it twice), as does a tool's JSON result for Llama 3's and gpt-oss's templates;
    Mistral's call ids become 9 alphanumerics. A generic template gets the tools in a system
    message and the calls and results as text. The caller's messages are left as they are.
    """
    out = []
    for m in messages:
        m = dict(m, content=_text(m.get("content"), m.get("role")))
        if m.get("tool_calls"):
            m["tool_calls"] = [_call_for_template(c, family) for c in m["tool_calls"]]
        if family == "mistral" and "tool_call_id" in m:
            m["tool_call_id"] = _mistral_id(m["tool_call_id"])
        if family in ("llama3", "harmony") and m.get("role") == "tool":
            m["content"] = _json_or_text(m["content"])   # their templates write a string with tojson
        out.append(m)
    if family != "generic":
        return out, tools or None
    return _generic(out, tools)


def _text(content, role) -> str | list[dict]:
    """A message's content as templates take it: a string, or its text and image parts as they
    are (a vision model's template writes its image marker for each image)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content} - {"text"}
        if not kinds:
            return "".join(p.get("text", "") for p in content)
        if kinds == {"image"}:
            return content
        others = ", ".join(sorted(map(str, kinds - {"image"})))
        raise MessageError(f"a {role} message's content may hold text and image parts only, not {others}")
    raise MessageError(f"a {role} message's content must be text or a list of text parts")


def _call_for_template(call: dict, family: str) -> dict:
    function = dict(call.get("function") or {})
    function["arguments"] = _json_or_text(function.get("arguments"))
    call = dict(call, function=function)
    if family == "mistral":
        call["id"] = _mistral_id(call.get("id") or "")
    return call


def _json_or_text(value):
    """The value a JSON text holds; anything else as it is (a model's malformed arguments)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _mistral_id(call_id: str) -> str:
    """An id as Mistral's template wants it; the same id always maps to the same one, so that a
    conversation renders the same text each turn (its prefix stays cached)."""
    if MISTRAL_ID.fullmatch(call_id):
        return call_id
    digest = hashlib.blake2b(call_id.encode(), digest_size=9).digest()
    return "".join("abcdefghijklmnopqrstuvwxyz0123456789"[b % 36] for b in digest)


def _generic(messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], None]:
    """Tools as a system message, calls as hermes text, results as user messages."""
    out, results = [], False   # results: the last message holds tool results
    for m in messages:
        if m.get("role") == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results:   # the results of one turn's calls: one user message
                out[-1] = dict(out[-1], content=out[-1]["content"] + "\n" + response)
            else:
                out.append({"role": "user", "content": response})
            results = True
            continue
        if m.get("tool_calls"):
            calls = [_hermes_call(c["function"]) for c in m["tool_calls"]]
            m = {"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + calls)}
        out.append(m)
        results = False
    if tools:
        prompt = GENERIC_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt)
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _hermes_call(function: dict) -> str:
    call = {"name": function.get("name"), "arguments": function.get("arguments")}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def forced_call_grammar(family: str, tools: list[dict], name: str | None = None,
                        parallel: bool = False) -> Grammar:
    """A grammar that lets the model write only calls, in its family's syntax, of `tools` (of the
    one named `name`): OpenAI's tool_choice "required" (or a named function). One call unless
    `parallel` (OpenAI's parallel_tool_calls; off by default, as in llama.cpp): a small model
    allowed more keeps writing calls until max_tokens rather than ending after the first."""
    if family == "harmony":   # its calls are special tokens around the JSON, which no grammar here writes
        raise MessageError("this model (gpt-oss) cannot be made to call a tool: send tool_choice \"auto\"")
    functions = [t.get("function") or {} for t in tools]
    if name is not None:
        functions = [f for f in functions if f.get("name") == name]
        if not functions:
            raise MessageError(f"tool_choice names the function {name!r}, which is not among the tools")
    syntax = SYNTAX[family]
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": f.get("name")},
                                      syntax.arguments: f.get("parameters") or {"type": "object"}},
                       "required": ["name", syntax.arguments], "additionalProperties": False}
                      for f in functions], "x-guidance": COMPACT}
    rules = f"call: %json {json.dumps(call)}\n"
    if syntax.listed:
        more = '(", " call)*' if parallel else ""
        start = f'start: {json.dumps(syntax.start)} "[" call {more} "]"\n'
    elif syntax.end is None:   # llama3: one call, its JSON alone
        start = "start: call\n"
    else:   # hermes: each call in its markers, on lines of their own
        opening, closing = json.dumps(syntax.start + "\n"), json.dumps("\n" + syntax.end)
        more = '("\\n" tagged)*' if parallel else ""
        start = f'start: tagged {more}\ntagged: {opening} call {closing}\n'
    return Grammar.lark(start + rules)


class ToolCallParser:
    """A reply's text, fed as it streams, split into Content and whole Calls.

    Content streams at once, but for a tail that may be the start of a call's marker. A call is
    held until it is complete (its end marker, or the reply's end), then parsed: JSON whose
    name is one of `tool_names`. Anything else (bad JSON, an unknown name, no end marker) goes out
    as content, markers and all: a malformed call is the model's text, never an error.
    """

    def __init__(self, family: str, tool_names):
        self.syntax = SYNTAX[family]
        self.names = set(tool_names)
        self.calls = 0            # calls parsed so far: the reply ends "tool_calls" if any
        self._buffer = ""         # text not yet sent: a possible marker's start, or a call's text
        self._mode = "content"    # "content", "call" (after a start marker) or "bare" (llama3's "{")
        self._seen_text = False   # whether any non-space content has gone out
        self._after_call = False  # drop the whitespace between calls

    def feed(self, text: str) -> list[Content | Call]:
        """The deltas that `text`, the reply's next piece, completes."""
        self._buffer += text
        out = []
        while True:
            if self._mode == "content":
                if self.syntax.bare and not self._seen_text:
                    head = self._buffer.lstrip()
                    if not head:
                        return out
                    if head.startswith("{"):
                        self._mode = "bare"
                        return out
                i = self._buffer.find(self.syntax.start)
                if i >= 0:
                    out += self._content(self._buffer[:i])
                    self._buffer, self._mode = self._buffer[i + len(self.syntax.start):], "call"
                    continue
                keep = max((k for k in range(1, len(self.syntax.start))
                            if self._buffer.endswith(self.syntax.start[:k])), default=0)
                sent = len(self._buffer) - keep
                out += self._content(self._buffer[:sent])
                self._buffer = self._buffer[sent:]
                return out
            if self._mode == "call" and self.syntax.end is not None:
                j = self._buffer.find(self.syntax.end)
                if j < 0:
                    return out
                body, self._buffer = self._buffer[:j], self._buffer[j + len(self.syntax.end):]
                out += self._parsed(body, self.syntax.start + body + self.syntax.end)
                self._mode = "content"
                continue
            return out   # a call that runs to the reply's end

    def finish(self) -> list[Content | Call]:
        """What is left when the reply ends."""
        body, mode = self._buffer, self._mode
        self._buffer, self._mode = "", "content"
        if mode == "bare":
            return self._parsed(body, body)
        if mode == "call":
            if self.syntax.end is None:
                return self._parsed(body, self.syntax.start + body)
            return self._content(self.syntax.start + body)   # no end marker: not a call
        return self._content(body)

    def _content(self, text: str) -> list[Content]:
        if self._after_call:
            text = text.lstrip()
        if not text:
            return []
        self._seen_text, self._after_call = True, False
        return [Content(text)]

    def _parsed(self, body: str, raw: str) -> list[Content | Call]:
        """The calls in `body`, or `raw` as content if it does not hold valid ones."""
        calls = self._calls(body)
        if calls is None:
            return self._content(raw)
        out = []
        for name, arguments in calls:
            call_id = secrets.token_hex(5)[:9]
            out.append(Call(self.calls, call_id, name, json.dumps(arguments, ensure_ascii=False)))
            self.calls += 1
        self._after_call = True
        return out

    def _calls(self, body: str) -> list[tuple[str, dict]] | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        items = value if self.syntax.listed else [value]
        if not isinstance(items, list) or not items:
            return None
        calls = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in self.names:
                return None
            arguments = item.get(self.syntax.arguments, item.get("arguments", item.get("parameters", {})))
            if isinstance(arguments, str):   # some models encode them twice
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return None
            if not isinstance(arguments, dict):
                return None
            calls.append((item["name"], arguments))
        return calls
