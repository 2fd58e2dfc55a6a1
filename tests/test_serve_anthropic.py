"""nibble serve's Anthropic Messages API (runner/serve/anthropic.py) against the official anthropic
client, and in the shapes Claude Code sends: greedy replies of the tiny model, their lengths forced
by max_tokens; a thinking model's (DeepSeek-R1's template) thinking ended by its budget."""
import asyncio
import base64
import json

import anthropic
import pytest
from hypothesis import event, given, strategies as st

from nibble.formats.model_dir import write_model_dir
from nibble.runner.generation.decoding import Event, Usage
from nibble.runner.serve import anthropic as messages_api
from nibble.runner.serve.errors import ApiError
from nibble.runner.serve.replies import ReplyParts
from nibble.runner.serve.pending import MAX_BODY
from tests.serving import KEY, Running, serving, with_context
from tests.test_serve_images import RED, png
from tests.tiny import tiny_model_dir, tiny_with_template

GREEDY = {"temperature": 0}   # the client no longer takes sampling fields by name
R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
WEATHER = {"name": "weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(write_model_dir(with_context(tiny_model_dir()), tmp_path_factory.mktemp("tiny") / "m")) as running:
        yield running


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """The tiny model with DeepSeek-R1's template: every token it samples is thinking until a budget ends it."""
    with serving(write_model_dir(with_context(tiny_with_template(R1)), tmp_path_factory.mktemp("r1") / "m")) as running:
        yield running


def client(server: Running, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=key, max_retries=0)


def ask(server: Running, content="Hello there", max_tokens=20, **fields) -> anthropic.types.Message:
    return client(server).messages.create(model="tiny", max_tokens=max_tokens, extra_body=GREEDY,
                                          messages=[{"role": "user", "content": content}], **fields)


def streamed(server: Running, content="Hello there", max_tokens=20, **fields):
    """(the text_stream joined, the final message, the raw events of the stream)"""
    events = []
    with client(server).messages.stream(model="tiny", max_tokens=max_tokens, extra_body=GREEDY,
                                        messages=[{"role": "user", "content": content}], **fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    status, _, raw = server.post("/v1/messages", {"model": "tiny", "max_tokens": max_tokens, "stream": True,
                                                  "messages": [{"role": "user", "content": content}],
                                                  **GREEDY, **fields})
    assert status == 200, raw
    for frame in raw.decode().split("\n\n")[:-1]:
        name, data = frame.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return text, final, events


def blocks(message) -> list[tuple[str, str]]:
    """(type, text) of each content block, for comparing replies whose tool ids differ."""
    return [(b.type, b.text if b.type == "text" else b.thinking if b.type == "thinking"
             else json.dumps([b.name, b.input])) for b in message.content]


def test_a_reply(server):
    r = ask(server, max_tokens=12)
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert 0 < r.usage.output_tokens <= 12 and r.usage.input_tokens + r.usage.cache_read_input_tokens > 0
    assert (r.stop_reason == "max_tokens") == (r.usage.output_tokens == 12)
    assert r.usage.cache_creation_input_tokens == 0


def test_max_tokens_ends_a_reply_as_max_tokens(server):
    r = ask(server, "Tell me everything about the sky and the sea, " * 4, max_tokens=7)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 7


def test_a_streamed_reply_is_the_whole_one_in_events(server):
    whole = ask(server, "What is the capital of France?")
    text, final, events = streamed(server, "What is the capital of France?")
    assert text == whole.content[0].text and blocks(final) == blocks(whole)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[2] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert all(e["type"] == name for name, e in events)
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_reply_and_is_named(server):
    whole = ask(server, "What is the capital of France?").content[0].text
    stop = whole[4:6]
    r = ask(server, "What is the capital of France?", stop_sequences=["never said", stop])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == whole[:whole.index(stop)]
    text, final, _ = streamed(server, "What is the capital of France?", stop_sequences=[stop])
    assert (final.stop_reason, final.stop_sequence, text) == ("stop_sequence", stop, r.content[0].text)


def test_a_forced_tool_call_then_its_result_turn(server):
    """The grammar lets the model write one call (disable_parallel_tool_use is not false), so
    even greedy, the tiny model ends after it."""
    forced = dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "weather"})
    r = ask(server, "What is the weather in Paris?", max_tokens=200, **forced)
    [call] = r.content
    assert r.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "weather"
    assert call.id.startswith("toolu_") and isinstance(call.input["city"], str)
    _, final, events = streamed(server, "What is the weather in Paris?", max_tokens=200, **forced)
    assert blocks(final) == blocks(r) and final.stop_reason == "tool_use"
    deltas = [e["delta"] for name, e in events if name == "content_block_delta"]
    assert [json.loads(d["partial_json"]) for d in deltas] == [call.input]
    # the call and its result go back through the template, and the model answers them
    turn = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]}]
    answer = client(server).messages.create(model="tiny", max_tokens=8, messages=turn, tools=[WEATHER],
                                            extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > \
        r.usage.input_tokens + r.usage.cache_read_input_tokens + r.usage.output_tokens
    assert answer.usage.cache_read_input_tokens > 0   # the first turn's prompt, from the pool


def test_thinking_within_its_budget_then_the_answer(thinker):
    thinking = {"type": "enabled", "budget_tokens": 5}
    whole = ask(thinker, thinking=thinking)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking and whole.content[0].signature == ""
    text, final, events = streamed(thinker, thinking=thinking)
    assert blocks(final) == blocks(whole) and text == whole.content[1].text
    thought = "".join(e["delta"]["thinking"] for name, e in events
                      if name == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
    assert thought == whole.content[0].thinking
    signature = [i for i, (name, e) in enumerate(events) if e.get("delta", {}).get("type") == "signature_delta"]
    assert [events[i + 1][0] for i in signature] == ["content_block_stop"]   # the thinking block's end


def test_thinking_disabled_is_no_thinking_block(thinker):
    r = ask(thinker, thinking={"type": "disabled"})
    assert [b.type for b in r.content] == ["text"]


def test_count_tokens_is_the_prompt_a_reply_takes(server):
    fields = dict(system="You answer briefly.", messages=[{"role": "user", "content": "Weather in Paris?"}])
    count = client(server).messages.count_tokens(model="tiny", **fields).input_tokens
    r = client(server).messages.create(model="tiny", max_tokens=1, **fields)
    assert count == r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert client(server).messages.count_tokens(model="tiny", tools=[WEATHER], **fields).input_tokens > count


def test_the_key_as_x_api_key_and_a_wrong_one(server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(server, "sk-wrong").messages.create(model="tiny", max_tokens=1,
                                                   messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    status, _, _ = server.post("/v1/messages", {"model": "tiny", "max_tokens": 1,
                                                "messages": [{"role": "user", "content": "Hi"}]},
                               {"Authorization": "", "x-api-key": KEY})
    assert status == 200


@pytest.mark.parametrize("fields, kind, words", [
    ({"max_tokens": 0}, anthropic.BadRequestError, "max_tokens"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, anthropic.BadRequestError, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, anthropic.BadRequestError,
     "messages[0].content[0].source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, anthropic.BadRequestError,
     "no documents"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, anthropic.BadRequestError,
     "web_search_20250305"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, anthropic.BadRequestError, "nope"),
    ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, anthropic.BadRequestError,
     "thinking.budget_tokens"),
    ({"extra_body": {"temperature": -1}}, anthropic.BadRequestError, "temperature"),
    ({"model": "no-such-model"}, anthropic.NotFoundError, "no-such-model"),
    ({"max_tokens": 5000}, anthropic.BadRequestError, "context"),
])
def test_errors_raise_the_clients_typed_exceptions(server, fields, kind, words):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]} | fields
    for stream in (False, True):
        with pytest.raises(kind) as e:
            client(server).messages.create(**body, stream=stream)
        assert e.value.body["type"] == "error" and words in e.value.body["error"]["message"]


def test_a_missing_max_tokens_and_unknown_paths_answer_in_anthropics_shape(server):
    for path, body, status, kind in [
            ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error"),
            ("/v1/messages", b"{nope", 400, "invalid_request_error"),
            ("/v1/messages/nope", {}, 404, "not_found_error"),
            ("/v1/messages", b"[" * (MAX_BODY + 1), 413, "request_too_large")]:
        got, _, raw = server.post(path, body)
        assert got == status and json.loads(raw)["error"]["type"] == kind, raw


def test_claude_codes_shapes(server):
    """System and tools as blocks with cache_control, metadata, its beta headers, an earlier
    turn's thinking, call and result, and a streamed reply."""
    cached = {"cache_control": {"type": "ephemeral"}}
    body = {
        "model": "tiny", "max_tokens": 6, "stream": True, "temperature": 0,
        "metadata": {"user_id": "user_abc_account_def_session_123"},
        "system": [{"type": "text", "text": "You are Claude Code.", **cached},
                   {"type": "text", "text": "Answer in one line."}],
        "tools": [WEATHER | cached, {"name": "Bash", "description": "Runs a command", "input_schema": {
            "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"],
            "$schema": "http://json-schema.org/draft-07/schema#"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
                                         {"type": "text", "text": "What is the weather in Paris?", **cached}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Ask the tool.", "signature": "abc"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_01A", "name": "weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A", "is_error": False,
                 "content": [{"type": "text", "text": "sunny, 21 C"}]},
                {"type": "text", "text": "And tomorrow?", **cached}]}]}
    headers = {"Authorization": "", "x-api-key": KEY, "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    status, got, raw = server.post("/v1/messages?beta=true", body, headers)
    assert status == 200 and got["content-type"].startswith("text/event-stream"), raw
    assert raw.decode().startswith("event: message_start\n") and raw.decode().endswith("event: message_stop\n"
                                                                                      'data: {"type": "message_stop"}\n\n')
    fields = {k: v for k, v in body.items() if k not in ("stream", "temperature")}
    r = client(server).messages.create(**fields, extra_body=GREEDY,
                                       extra_headers={"anthropic-beta": headers["anthropic-beta"]})
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_structured_output_follows_its_schema(server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
              "required": ["answer"], "additionalProperties": False}
    r = ask(server, max_tokens=60, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.stop_reason == "end_turn" and isinstance(json.loads(r.content[0].text)["answer"], str)


def test_a_conversation_reads_into_the_neutral_body():
    """Tool results become "tool" messages ahead of the user's text, an assistant's tool_use its
    tool_calls and its thinking its reasoning_content; system blocks join."""
    body = messages_api.parse_messages({
        "max_tokens": 5, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": False},
        "thinking": {"type": "enabled", "budget_tokens": 7}, "stop_sequences": ["", "END"], "top_k": 3,
        "messages": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "Ask.", "signature": "s"},
                                                       {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "text", "text": "Thanks."},
                                                  {"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": [{"type": "text", "text": "no such city"}],
                                                   "is_error": True}]}]})
    assert body.messages == [
        {"role": "system", "content": "A\nB"}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Ask.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no such city"},
        {"role": "user", "content": "Thanks."}]
    assert body.tools == [{"type": "function", "function": {"name": "weather", "parameters": WEATHER["input_schema"],
                                                            "description": WEATHER["description"]}}]
    assert (body.tool_choice, body.tool_name, body.parallel_tool_calls) == ("required", None, True)
    assert (body.thinking.think, body.thinking.budget) == (True, 7)
    assert body.options.stop == ("END",) and body.options.sampling == {"top_k": 3} and body.options.max_tokens == 5


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}]}],
     "messages[0].content[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}],
     "messages[0].content[0].content[0].source"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/bmp",
                                                                "data": ""}}]}],
     "messages[0].content[0].source.media_type"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}], "messages[0].content[0].name"),
    ([{"role": "assistant", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "tool_use"}]}], "messages[0].content[0].type"),
])
def test_a_bad_block_is_a_400_naming_its_place(messages, param):
    with pytest.raises(ApiError) as e:
        messages_api.parse_messages({"max_tokens": 5, "messages": messages})
    assert (e.value.status, e.value.param) == (400, param) and str(e.value).startswith(f"{param} ")


class Failing:
    """A Pending whose reply fails at its first token."""
    served = type("Served", (), {"name": "tiny", "family": "generic"})
    turn = type("Turn", (), {"request": type("Request", (), {"prompt_ids": [1, 2, 3]}), "tool_names": ()})

    async def next(self):
        return Event("", (), "error", Usage(3, 0, 0), error="NaN in the logits")


def test_a_reply_that_fails_midstream_is_an_error_event():
    async def frames():
        events = messages_api.message_events("msg_x", Failing(), ReplyParts((), "generic"))
        return [frame async for frame in messages_api.named_events(events)]
    out = asyncio.run(frames())
    assert [f.split("\n")[0] for f in out] == ["event: message_start", "event: ping", "event: error"]
    error = json.loads(out[-1].split("\n")[1].removeprefix("data: "))
    assert error == {"type": "error", "error": {"type": "api_error", "message": "the reply failed: NaN in the logits"}}


# ---- fuzzing: every body is answered 200 or a 4xx in Anthropic's shape, and the server serves on ----

VALID = {"model": "tiny", "max_tokens": 2, "stream": False, "temperature": 0, "top_k": 1, "top_p": 1, "stop_sequences": ["\n\n"],
         "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
         "tools": [WEATHER], "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"},
         "metadata": {"user_id": "u"},
         "messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""},
                                                        {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                                         "input": {"city": "Paris"}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                    "content": "sunny", "is_error": True}]}]}
PNG = base64.b64encode(png(RED)).decode()
IMAGES = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
          {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG[:40]}},
          {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}},
          {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 8), st.sampled_from([10**20, -2**63, 1e308, 0.5]),
                    st.floats(allow_nan=False), st.text(max_size=8),
                    st.sampled_from(["user", "assistant", "text", "tool_use", "tool_result", "thinking", "image",
                                     "enabled", "disabled", "any", "tool", "weather", "\ud800", "base64", "url",
                                     "image/png", "image/bmp", PNG, PNG[:40], "data:image/png;base64," + PNG]))
JSON = st.recursive(SCALARS | st.sampled_from(IMAGES), lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                    max_leaves=12)


def paths(value, at=()):
    yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from paths(inner, at + (key,))


def mutated(body, path, new):
    """`body` with the value at `path` replaced by `new` (deleted: new is the sentinel `paths`)."""
    if not path:
        return new
    head, *rest = path
    out = dict(body) if isinstance(body, dict) else list(body)
    if not rest and new is paths:
        del out[head]
    else:
        out[head] = mutated(out[head], rest, new)
    return out


def answered(server: Running, data: bytes) -> int:
    status, headers, raw = server.post("/v1/messages", data)
    if status == 200:
        if headers["content-type"].startswith("text/event-stream"):
            assert "event: error" not in raw.decode() and raw.decode().endswith('{"type": "message_stop"}\n\n')
        else:
            assert json.loads(raw)["type"] == "message"
    else:
        assert 400 <= status < 500, (status, raw)
        body = json.loads(raw)
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), raw
    return status


def to_bytes(body) -> bytes:
    # lone surrogates written as JSON escapes, as a client in another language might send them
    return json.dumps(body).encode()


@pytest.mark.fuzz
@given(JSON)
def test_fuzz_any_json_body(server, body):
    event(f"status {answered(server, to_bytes(body))}")


@pytest.mark.fuzz
@given(st.data())
def test_fuzz_a_valid_body_mutated(server, data):
    path = data.draw(st.sampled_from(list(paths(VALID))))
    new = data.draw(st.one_of(JSON, st.just(paths)) if path else JSON)
    event(f"status {answered(server, to_bytes(mutated(VALID, path, new)))}")


HOLES = [("messages", 0, "content"), ("system",), ("metadata",), ("messages", 1, "content", 1, "input"),
         ("tools", 0, "input_schema"), ("tools", 0, "input_schema", "properties", "city")]


@pytest.mark.parametrize("depth", [100, 900, 10_000, 100_000])
@pytest.mark.parametrize("nest", [(b"[", b"]"), (b'{"a": ', b"}")])
def test_deep_nesting_anywhere_is_served_or_400(server, depth, nest):
    """Arrays or objects nested past Python's recursion limit (read_json's 400), or just short
    of it, where the body's fields, its template and a forced call's grammar would recurse."""
    nested = nest[0] * depth + (b"1" if nest[0] != b"[" else b"") + nest[1] * depth
    for hole in HOLES:
        for forced in ({"type": "auto"}, {"type": "any"}):
            body = mutated(mutated(VALID, ("tool_choice",), forced), hole, "@@HOLE@@")
            answered(server, to_bytes(body).replace(b'"@@HOLE@@"', nested))


def test_a_lone_surrogate_is_400(server):
    status, _, raw = server.post("/v1/messages", b'{"model": "tiny", "max_tokens": 2, '
                                                 b'"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert status == 400 and "surrogate" in json.loads(raw)["error"]["message"]


@pytest.mark.fuzz
@given(st.data())
def test_fuzz_count_tokens_bodies(server, data):
    """count_tokens reads the same body (max_tokens aside): a count, or a 4xx in Anthropic's shape."""
    path = data.draw(st.sampled_from(list(paths(VALID))))
    body = mutated(VALID, path, data.draw(JSON)) if path and data.draw(st.booleans()) else data.draw(JSON)
    status, _, raw = server.post("/v1/messages/count_tokens", to_bytes(body))
    if status == 200:
        assert isinstance(json.loads(raw)["input_tokens"], int)
    else:
        assert 400 <= status < 500 and json.loads(raw)["type"] == "error", (status, raw)
    event(f"status {status}")


def test_count_tokens_counts_a_prompt_past_the_context(server):
    """A count is what a client asks before it trims a conversation: no context error."""
    long = "The quick brown fox jumps over the lazy dog. " * 600
    count = client(server).messages.count_tokens(model="tiny", messages=[{"role": "user", "content": long}])
    assert count.input_tokens > 4096
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client(server).messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": long}])
