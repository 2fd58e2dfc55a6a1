"""The OpenAI wire format of nibble serve on plain dicts: request bodies read and checked, and the
objects it answers parsed by the official client's own types."""
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from nibble.runner.generation.decoding import TokenLogprob, Usage
from nibble.runner.serve import api
from nibble.runner.serve.api import parse_chat, parse_completion
from nibble.runner.serve.errors import ApiError

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def chat(**fields):
    return parse_chat({"model": "m", "messages": USER} | fields)


def test_a_minimal_chat_body_takes_the_defaults():
    body = parse_chat({"messages": USER})
    o = body.options
    assert (o.model, o.stream, o.include_usage, o.max_tokens, o.sampling, o.stop, o.logprobs) == \
        (None, False, False, None, {}, (), None)
    assert (body.tools, body.tool_choice, body.tool_name, body.response_format, body.schema) == \
        ([], "none", None, "text", None)


def test_sampling_fields_and_nibbles_own_from_extra_body_are_read_and_unknown_ones_ignored():
    body = chat(temperature=0, top_p=0.5, seed=7, presence_penalty=0.5, frequency_penalty=-1, top_k=3,
                min_p=0.1, repeat_penalty=1.1, dry_multiplier=0.8, dry_base=2, dry_allowed_length=3,
                dry_penalty_last_n=-1, user="someone", metadata={"x": 1}, parallel_tool_calls=True)
    assert body.options.sampling == dict(temperature=0.0, top_p=0.5, seed=7, presence_penalty=0.5,
                                         frequency_penalty=-1.0, top_k=3, min_p=0.1, repetition_penalty=1.1,
                                         dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3,
                                         dry_penalty_last_n=-1)


def test_null_is_the_same_as_leaving_a_field_out():
    body = chat(temperature=None, stop=None, max_tokens=None, tools=None, response_format=None, n=None)
    assert body == chat()


def test_max_completion_tokens_wins_over_max_tokens_and_stop_may_be_one_string():
    assert chat(max_tokens=5, max_completion_tokens=9).options.max_tokens == 9
    assert chat(stop="\n").options.stop == ("\n",)
    assert chat(stop=["a", "", "b"]).options.stop == ("a", "b")


def test_logprobs_and_top_logprobs():
    assert chat(logprobs=True).options.logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).options.logprobs == 3
    assert chat(logprobs=False).options.logprobs is None


def test_stream_options_include_usage():
    assert chat(stream=True, stream_options={"include_usage": True}).options.include_usage
    assert not chat(stream=True).options.include_usage


@pytest.mark.parametrize("fields, param", [
    (dict(messages="hi"), "messages"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (dict(messages=[{"role": "user"}]), "messages[0].content"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].image_url.url"),
    (dict(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
     "messages[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0].image_url"),
    (dict(messages=["hi"]), "messages[0]"),
    (dict(model=3), "model"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(dry_multiplier=-1), "dry_multiplier"),
    (dict(dry_base=0.5), "dry_base"),
    (dict(dry_allowed_length=2.5), "dry_allowed_length"),
    (dict(seed=-1), "seed"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_completion_tokens="9"), "max_completion_tokens"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(stop=3), "stop"),
    (dict(n=2), "n"),
    (dict(stream="yes"), "stream"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(tools=[{"type": "function"}]), "tools[0]"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools[0].function.parameters"),
    (dict(tool_choice="auto"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="always"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS, response_format={"type": "json_object"}), "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format.type"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": "x"}}),
     "response_format.json_schema.schema"),
])
def test_each_bad_chat_field_is_a_400_naming_it(fields, param):
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": USER} | fields)
    assert (e.value.status, e.value.param, e.value.type) == (400, param, "invalid_request_error")
    assert param.split("[")[0].split(".")[0] in str(e.value)


def test_a_body_that_is_not_an_object_is_a_400():
    with pytest.raises(ApiError, match="the request body must be a JSON object"):
        parse_chat([1, 2])


def test_messages_are_read_for_the_template():
    body = chat(messages=[{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                          {"role": "tool", "tool_call_id": "1", "content": "ok"}])
    assert [(m["role"], m["content"]) for m in body.messages] == \
        [("system", "be brief"), ("user", "ab"), ("assistant", None), ("tool", "ok")]
    assert body.messages[2]["tool_calls"][0]["function"]["name"] == "f"
    assert body.messages[3]["tool_call_id"] == "1"


def test_tools_and_tool_choice():
    assert (chat(tools=TOOLS).tool_choice, chat(tools=TOOLS).tool_name) == ("auto", None)
    assert chat(tools=TOOLS, tool_choice="required").tool_choice == "required"
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert (named.tool_choice, named.tool_name) == ("required", "weather")
    # tools with tool_choice "none" leave response_format free
    assert chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}).response_format == "json_object"


def test_response_formats():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert (body.response_format, body.schema) == ("json_schema", schema)
    assert chat(response_format={"type": "json_object"}).response_format == "json_object"
    assert chat(response_format={"type": "text"}).response_format == "text"


def test_completion_bodies():
    body = parse_completion({"model": "m", "prompt": ["Once"], "max_tokens": 3, "logprobs": 2, "echo": False,
                             "best_of": 1, "suffix": None})
    assert (body.prompt, body.options.max_tokens, body.options.logprobs, body.suffix) == ("Once", 3, 2, None)
    assert parse_completion({"prompt": "def f(", "suffix": ")\n"}).suffix == ")\n"   # fill in the middle


@pytest.mark.parametrize("fields, param", [
    (dict(prompt=""), "prompt"), (dict(prompt=["a", "b"]), "prompt"), (dict(prompt=[1, 2]), "prompt"),
    (dict(suffix=3), "suffix"), (dict(echo=True), "echo"), (dict(best_of=2), "best_of"),
    (dict(logprobs=6), "logprobs"), (dict(logprobs=True), "logprobs"),
])
def test_each_bad_completion_field_is_a_400_naming_it(fields, param):
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "Once"} | fields)
    assert (e.value.status, e.value.param) == (400, param)


STAMP = api.Stamp("chatcmpl-1", 1700000000, "tiny")
USAGE = Usage(prompt_tokens=12, completion_tokens=3, cached_tokens=8)
LOGPROBS = (TokenLogprob(5, "Hi", -0.25, ((5, "Hi", -0.25), (7, "Hello", -1.5))),
            TokenLogprob(9, " there", -0.5, ((9, " there", -0.5),)))


def test_a_chat_completion_parses_in_the_official_client():
    reply = ChatCompletion.model_validate(api.chat_completion(STAMP, "Hi there", [], "stop", LOGPROBS, USAGE))
    assert reply.choices[0].message.content == "Hi there"
    assert reply.choices[0].finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (12, 3, 15)
    assert reply.usage.prompt_tokens_details.cached_tokens == 8
    first = reply.choices[0].logprobs.content[0]
    assert (first.token, first.logprob, first.bytes) == ("Hi", -0.25, [72, 105])
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("Hi", -0.25), ("Hello", -1.5)]


def test_a_tool_call_reply_parses_in_the_official_client():
    call = api.tool_call(0, "abcdefghi", "weather", '{"city": "Paris"}')
    del call["index"]   # a whole message's calls have no index
    reply = ChatCompletion.model_validate(api.chat_completion(STAMP, None, [call], "tool_calls", None, USAGE))
    message = reply.choices[0].message
    assert message.content is None and reply.choices[0].logprobs is None
    assert (message.tool_calls[0].id, message.tool_calls[0].function.name,
            message.tool_calls[0].function.arguments) == ("abcdefghi", "weather", '{"city": "Paris"}')


def test_chunks_parse_in_the_official_client():
    role = ChatCompletionChunk.model_validate(api.chat_chunk(STAMP, {"role": "assistant", "content": ""}))
    assert role.choices[0].delta.role == "assistant"
    text = ChatCompletionChunk.model_validate(api.chat_chunk(STAMP, {"content": "Hi"}, logprobs=LOGPROBS[:1]))
    assert text.choices[0].delta.content == "Hi" and text.choices[0].logprobs.content[0].token == "Hi"
    call = ChatCompletionChunk.model_validate(api.chat_chunk(STAMP, {"tool_calls": [
        api.tool_call(0, "abcdefghi", "weather", "{}")]}))
    assert call.choices[0].delta.tool_calls[0].index == 0
    last = ChatCompletionChunk.model_validate(api.chat_chunk(STAMP, {}, "tool_calls"))
    assert last.choices[0].finish_reason == "tool_calls"
    usage = ChatCompletionChunk.model_validate(api.usage_chunk(STAMP, "chat.completion.chunk", USAGE))
    assert usage.choices == [] and usage.usage.prompt_tokens_details.cached_tokens == 8


def test_a_text_completion_parses_in_the_official_client_with_its_logprobs():
    reply = Completion.model_validate(api.text_completion(STAMP, "Hi there", "length", LOGPROBS, USAGE))
    assert reply.object == "text_completion" and reply.choices[0].text == "Hi there"
    lp = reply.choices[0].logprobs
    assert (lp.tokens, lp.token_logprobs, lp.text_offset) == (["Hi", " there"], [-0.25, -0.5], [0, 2])
    assert lp.top_logprobs[0] == {"Hi": -0.25, "Hello": -1.5}
    chunk = api.text_completion(STAMP, " there", None, LOGPROBS[1:], offset=2)
    assert "usage" not in chunk and chunk["choices"][0]["logprobs"]["text_offset"] == [2]


def test_errors_are_openais_shape():
    e = ApiError(404, "no such model", "model", code="model_not_found")
    assert e.body() == {"error": {"message": "no such model", "type": "invalid_request_error", "param": "model",
                                  "code": "model_not_found"}}
