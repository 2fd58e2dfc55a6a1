"""OpenAI's Responses API (runner/serve/responses.py) against the official openai client: whole and
streamed replies, a forced function call and its result's turn, a JSON schema, a thinking model's
reasoning items, the stateless server's refusals, and a fuzz of request bodies. Greedy, lengths
forced by max_output_tokens: every reply is the same each run."""
import asyncio
import json
from types import SimpleNamespace

import openai
import pydantic
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent

from nibble.formats.model_dir import write_model_dir
from nibble.runner.generation.decoding import Event, Usage
from nibble.runner.serve.api import Stamp, ThinkingOptions
from nibble.runner.serve.models import EngineOptions
from nibble.runner.serve.responses import parse, response_events
from nibble.runner.settings import SamplerSettings
from tests.serving import serving, with_context
from tests.test_serve_images import RED, data_url, png
from tests.tiny import tiny_model_dir, tiny_with_template

GREEDY = {"temperature": 0}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(write_model_dir(with_context(tiny_model_dir()), tmp_path_factory.mktemp("tiny") / "m")) as running:
        yield running


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """DeepSeek-R1's template opens a <think> block: the random model thinks until the server's
    budget of 5 tokens forces its end, then answers."""
    model = tiny_with_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
    options = EngineOptions(parallel=4, queue=16, ctx=4096, thinking=ThinkingOptions(budget=5))
    with serving(write_model_dir(with_context(model), tmp_path_factory.mktemp("r1") / "m"), options=options) as running:
        yield running


def create(server, input, **kwargs) -> Response:
    return server.client.responses.create(model="tiny", input=input, **(GREEDY | kwargs))


def streamed(server, input, **kwargs) -> list:
    """The events of a streamed reply, as the client's stream helper gives them."""
    with server.client.responses.stream(model="tiny", input=input, **(GREEDY | kwargs)) as stream:
        return list(stream)


def raw(server, body: dict) -> dict:
    status, _, data = server.post("/v1/responses", body)
    assert status == 200, data
    return json.loads(data)


def shape(output) -> list[tuple]:
    """Output items without their ids (new each reply)."""
    def one(item):
        if item.type == "function_call":
            return item.type, item.name, item.arguments, item.status
        return item.type, [part.text for part in item.content], item.status
    return [one(item) for item in output]


def joined(events, kind: str) -> str:
    return "".join(e.delta for e in events if e.type == kind)


def test_a_string_input_gets_a_response(server):
    r = create(server, "Hello there", max_output_tokens=12)
    [message] = r.output
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.output_text == message.content[0].text and r.output_text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.error is None
    # what the client reads loosely validates strictly too
    Response.model_validate(raw(server, {"input": "Hello there", "max_output_tokens": 12, **GREEDY}))


def test_instructions_and_message_items_read_as_chat_messages(server):
    """The same conversation by chat: the same prompt, so the same greedy reply."""
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be kind."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And "},
                                          {"type": "input_text", "text": "then?"}]}]
    r = create(server, items, instructions="Be brief.", max_output_tokens=10)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "And then?"}]
    chat = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, **GREEDY)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.instructions == "Be brief."


def test_a_streamed_response_is_the_whole_one_in_events(server):
    whole = create(server, "What is the capital of France?", max_output_tokens=20)
    events = streamed(server, "What is the capital of France?", max_output_tokens=20)
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert joined(events, "response.output_text.delta") == whole.output_text
    last = events[-1]   # a reply cut off ends in response.completed, its status incomplete
    assert last.type == "response.completed" and last.response.status == whole.status == "incomplete"
    assert shape(last.response.output) == shape(whole.output)
    assert last.response.usage.output_tokens == whole.usage.output_tokens
    assert {e.response.id for e in events if hasattr(e, "response")} == {last.response.id}


def test_every_streamed_frame_is_a_typed_event(server):
    status, headers, data = server.post("/v1/responses", {"input": "Hi", "max_output_tokens": 4, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    frames = [frame.split("\n") for frame in data.decode().split("\n\n") if frame]
    for n, (name, payload) in enumerate(frames):
        e = json.loads(payload.removeprefix("data: "))
        assert name == f"event: {e['type']}" and e["sequence_number"] == n
        EVENTS.validate_python(e)
    assert json.loads(frames[-1][1].removeprefix("data: "))["response"]["status"] == "incomplete"


def test_a_forced_function_call_then_its_result_turn(server):
    """The grammar lets the model write one call (parallel_tool_calls is off unless asked), which
    ends the reply; the call and its output go back as input items."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = dict(tools=[WEATHER], tool_choice={"type": "function", "name": "weather"}, max_output_tokens=200)
    r = create(server, question, **forced)
    [call] = r.output
    assert call.type == "function_call" and call.name == "weather" and call.call_id and call.id.startswith("fc_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert r.status == "completed" and r.output_text == "" and r.tool_choice.name == "weather"
    # streamed: the same call, its arguments in a delta, and get_final_response as the client builds it
    with server.client.responses.stream(model="tiny", input=question, **forced, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert joined(events, "response.function_call_arguments.delta") == call.arguments
    assert shape(final.output) == shape(r.output) and final.status == "completed"
    assert final.output[0].parsed_arguments == json.loads(call.arguments)   # a strict tool's, parsed by the client
    # the result's turn: the call as the reply gave it, and its output
    answer = create(server, [*question, *r.output, {"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "sunny, 21 C"}], tools=[WEATHER], max_output_tokens=8)
    assert answer.status in ("completed", "incomplete")
    assert answer.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens   # the call and its result
    assert answer.usage.input_tokens_details.cached_tokens > 0   # the first turn's prompt, from the pool


def test_a_json_schema_reply_parses_and_validates(server):
    """Even the tiny random model's reply validates: the grammar masks the rest, and ends it."""
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        r = create(server, "A person, as JSON", text=fmt, max_output_tokens=100, temperature=1.0,
                   extra_body={"seed": seed})
        person = json.loads(r.output_text)
        assert r.status == "completed" and r.text.format.type == "json_schema"
        assert set(person) == {"name", "age"} and len(person["name"]) <= 12 and 0 <= person["age"] <= 150
    with server.client.responses.stream(model="tiny", input="A person, as JSON", text=fmt, max_output_tokens=100,
                                        **GREEDY) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text).keys() == {"name", "age"}
    r = create(server, "Any JSON object", text={"format": {"type": "json_object"}}, max_output_tokens=4)
    assert r.output_text.startswith("{")


def test_a_thinking_model_gives_a_reasoning_item_then_its_answer(thinker):
    whole = create(thinker, "Why is the sky blue?", max_output_tokens=24)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
    assert message.type == "message" and whole.output_text == message.content[0].text
    assert whole.usage.output_tokens_details.reasoning_tokens == 5   # the budget, then the answer
    events = streamed(thinker, "Why is the sky blue?", max_output_tokens=24)
    assert joined(events, "response.reasoning_text.delta") == reasoning.content[0].text
    assert joined(events, "response.output_text.delta") == whole.output_text
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    assert shape(events[-1].response.output) == shape(whole.output)


def test_reasoning_effort_none_turns_thinking_off(thinker):
    r = create(thinker, "Why is the sky blue?", reasoning={"effort": "none"}, max_output_tokens=8)
    assert [item.type for item in r.output] == ["message"] and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.reasoning.effort == "none"


def test_an_earlier_turns_reasoning_goes_back_as_input(thinker):
    first = create(thinker, "Why is the sky blue?", max_output_tokens=12)
    then = create(thinker, [{"role": "user", "content": "Why is the sky blue?"}, *first.output,
                            {"role": "user", "content": "Are you sure?"}], max_output_tokens=4)
    assert then.usage.input_tokens > first.usage.input_tokens and then.output[0].type == "reasoning"


def test_a_previous_response_id_is_refused_as_the_server_keeps_none(server):
    with pytest.raises(openai.BadRequestError) as e:
        create(server, "Hi", previous_response_id="resp_123", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and "keeps no responses" in e.value.body["message"]


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"input": "Hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": "Hi", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": "hot"}, "temperature"),
])
def test_what_nibble_cannot_do_is_a_400_naming_the_field(server, body, param):
    status, _, data = server.post("/v1/responses", body)
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", error


def test_a_reply_that_fails_ends_its_stream_in_response_failed():
    """The engine's error event (NaN in the logits, say): every item opened is closed, and the
    last event is response.failed with OpenAI's error, which the client's stream state takes."""
    usage = Usage(5, 3, 0)
    replies = iter([Event("", (), None, None, thinking="Hmm"), Event("Hel", (), None, None),
                    Event("", (), "error", usage, error="NaN in the logits")])

    async def next_event():
        return next(replies)
    pending = SimpleNamespace(next=next_event, served=SimpleNamespace(family="generic"),
                              turn=SimpleNamespace(tool_names=(), request=SimpleNamespace(
                                  settings=SamplerSettings(), reasoning=None)))

    async def run():
        return [e async for e in response_events(Stamp("resp_1", 0, "tiny"), parse({"input": "Hi"}).echo, pending)]
    events = [{**e, "sequence_number": n} for n, e in enumerate(asyncio.run(run()))]
    for e in events:
        EVENTS.validate_python(e)
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1]
    failed = events[-1]["response"]
    assert events[-1]["type"] == "response.failed" and failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "the reply failed: NaN in the logits"}
    assert [item["status"] for item in failed["output"]] == ["completed", "incomplete"]


# ---- fuzz ----

FIELDS = ["model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning",
          "max_output_tokens", "temperature", "top_p", "stream", "store", "metadata", "user", "truncation",
          "previous_response_id", "background", "conversation", "include", "seed", "top_k", "reasoning_budget",
          "think", "chat_template_kwargs"]
ITEM_TYPES = ["message", "function_call", "function_call_output", "reasoning", "item_reference", "input_text",
              "output_text", "reasoning_text", "input_image", "web_search", "function", "json_schema", "json_object",
              "text", "none", "auto", "required"]
IMAGE_URLS = [data_url(png(RED)), data_url(png(RED)[:40]), "data:text/plain;base64,aGk=", "http://127.0.0.1:9/x.png",
              "file:///etc/passwd"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2, 9), st.sampled_from([2**31, 2**63, 10**30]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                    st.sampled_from(["\ud800", "tiny", "user", "assistant", "developer", "tool", "weather",
                                     "high", "none", *ITEM_TYPES, *IMAGE_URLS]))
KEYS = st.sampled_from(["type", "role", "content", "text", "name", "call_id", "arguments", "output", "schema",
                        "format", "effort", "parameters", "summary", "id", "image_url", "file_id", *FIELDS])
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
                    max_leaves=10)
PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "reasoning_text", "input_image"])
                              | JUNK}, optional={"text": st.text(max_size=8) | JUNK,
                                                 "image_url": st.sampled_from(IMAGE_URLS) | JUNK,
                                                 "file_id": st.just("file_1") | JUNK})
ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(ITEM_TYPES) | JUNK, "role": st.sampled_from(["user", "assistant", "system", "developer"])
    | JUNK, "content": st.text(max_size=8) | st.lists(PART, max_size=3) | JUNK,
    "call_id": st.sampled_from(["c1", "c2"]) | JUNK, "name": st.just("weather") | JUNK,
    "arguments": st.just('{"city": "Paris"}') | JUNK, "output": st.text(max_size=8) | st.lists(PART, max_size=2)})
BASE = {"model": "tiny", "input": [{"role": "user", "content": "Hi"}], "instructions": "Be brief.",
        "tools": [WEATHER], "tool_choice": "auto", "text": {"format": {"type": "text"}},
        "reasoning": {"effort": "low"}, "max_output_tokens": 2, **GREEDY}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                 "content": st.lists(PART, min_size=1, max_size=3)})
VALUES = st.one_of(JUNK, st.lists(ITEM, max_size=4), st.lists(PART, max_size=2),
                   st.lists(MESSAGE, min_size=1, max_size=2),
                   st.sampled_from([[WEATHER], {"type": "function", "name": "weather"}, {"type": "web_search"},
                                    {"format": {"type": "json_schema", "name": "p", "schema": PERSON}},
                                    {"format": {"type": "json_object"}}, {"effort": "minimal"}]))


@st.composite
def bodies(draw):
    """A valid body with fields replaced or removed, or any JSON at all."""
    if draw(st.integers(0, 4)) == 0:
        body = draw(JUNK)
    else:
        body = dict(BASE)
        for key in draw(st.sets(st.sampled_from(sorted(body)), max_size=2)):
            del body[key]
        body |= draw(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=3))
    if isinstance(body, dict):   # a reply the fuzz can wait for: a few tokens, or a context's worth (a 400)
        limit = body.get("max_output_tokens")
        if limit is None or (isinstance(limit, (int, float)) and not isinstance(limit, bool) and 8 < limit < 1e6):
            body["max_output_tokens"] = 2
    return body


DEEP = b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.fuzz
@given(bodies())
@example(DEEP)
@example(b'{"input": "\\ud800", "max_output_tokens": 2}')
@example(b'{"input": [{"role": "user", "content": [{"type": "input_text", "text": "\\udfff"}]}]}')
@example(b"not json")
@example({"input": "Hi", "max_output_tokens": 2, "stream": True})
@example({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE_URLS[0]}]}]})
def test_any_body_gets_a_response_or_a_4xx_in_openais_shape(server, body):
    status, _, data = server.post("/v1/responses", body if isinstance(body, bytes) else json.dumps(body).encode())
    if status == 200:
        event("200")
        if data.startswith(b"event: "):
            frames = [json.loads(frame.split("\ndata: ", 1)[1]) for frame in data.decode().split("\n\n") if frame]
            assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
            assert frames[-1]["type"] == "response.completed"
        else:
            reply = json.loads(data)
            assert reply["object"] == "response" and reply["status"] in ("completed", "incomplete")
        return
    error = json.loads(data)["error"]
    event(f"{status} {error['param']}")
    assert 400 <= status < 500, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str) and set(error) == {
        "message", "type", "param", "code"}


def test_responses_stream_gives_the_final_response_of_a_reply_cut_short(server):
    """The client's stream helper waits for response.completed: a reply cut by max_output_tokens
    ends in one too, its status incomplete."""
    with server.client.responses.stream(model="tiny", input="Tell me a story.", max_output_tokens=6,
                                        temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == text and final.usage.output_tokens == 6
