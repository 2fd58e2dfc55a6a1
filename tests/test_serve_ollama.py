"""ollama's API in nibble serve against the official ollama client: chat and generate, streamed and
not, raw, formats, tools, thinking, the model list and details, and ollama's error shape for every
bad body (a fuzz of both bodies: 200 or a 4xx, never a 500)."""
import base64
import importlib.metadata
import json

import ollama
import pytest
from hypothesis import event, example, given, strategies as st

from nibble.formats.model_dir import write_model_dir
from nibble.runner.text.reasoning import ThinkingOptions
from nibble.runner.serve import ollama as wire, ollama_models
from nibble.runner.serve.errors import ApiError
from nibble.runner.serve.models import EngineOptions
from nibble.runner.measure.synthetic import CHATML
from tests.serving import CTX, KEY, serving, with_context
from tests.test_serve import PERSON, TOOLS
from tests.test_serve_images import RED, png
from tests.tiny import TEMPLATES, tiny_model_dir

GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "What is the capital of France?"}]
POSITIONS = 2048   # room for the tools nibble lists in a system message for a template without them


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = with_context(tiny_model_dir(), POSITIONS)
    with serving(write_model_dir(model, tmp_path_factory.mktemp("tiny") / "tiny")) as running:
        yield running


@pytest.fixture(scope="module")
def thinker(r1_dir):
    """Served with a thinking budget of 5 tokens: ollama has no budget field, and the random model
    would otherwise think until num_predict."""
    with serving(r1_dir, "r1", EngineOptions(ctx=CTX, thinking=ThinkingOptions(budget=5))) as running:
        yield running


def client(server) -> ollama.Client:
    return ollama.Client(host=f"http://127.0.0.1:{server.port}", headers={"Authorization": f"Bearer {KEY}"})


def ndjson(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.decode().splitlines() if line]


def assert_durations(r):
    for name in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(r[name], int) and r[name] > 0, name
    assert r.prompt_eval_count > 0 and r.eval_count > 0


def test_a_chat_reply_and_the_same_reply_streamed(server):
    whole = client(server).chat(model="tiny", messages=USER, options=GREEDY | {"num_predict": 12})
    assert whole.model == "tiny" and whole.done and whole.message.role == "assistant"
    assert whole.done_reason in ("stop", "length") and 0 < whole.eval_count <= 12
    assert (whole.done_reason == "length") == (whole.eval_count == 12)
    assert whole.created_at.endswith("Z") and whole.message.thinking is None
    assert_durations(whole)
    chunks = list(client(server).chat(model="tiny", messages=USER, options=GREEDY | {"num_predict": 12}, stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.message.content for c in chunks) == whole.message.content
    last = chunks[-1]
    assert last.message.content == "" and last.done_reason == whole.done_reason
    assert last.eval_count == whole.eval_count and last.prompt_eval_count == whole.prompt_eval_count
    assert_durations(last)


def test_stream_is_the_default_and_its_lines_are_ndjson(server):
    status, headers, raw = server.post("/api/chat", {"model": "tiny", "messages": USER,
                                                     "options": GREEDY | {"num_predict": 4}})
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    lines = ndjson(raw)
    assert lines[-1]["done"] is True and all(not line["done"] for line in lines[:-1])


def test_generate_streamed_and_not_and_raw(server):
    whole = client(server).generate(model="tiny", prompt="The quick brown fox", options=GREEDY | {"num_predict": 10})
    assert whole.done and whole.done_reason in ("stop", "length") and isinstance(whole.response, str)
    assert_durations(whole)
    chunks = list(client(server).generate(model="tiny", prompt="The quick brown fox", stream=True,
                                          options=GREEDY | {"num_predict": 10}))
    assert "".join(c.response for c in chunks) == whole.response and chunks[-1].done
    raw = client(server).generate(model="tiny", prompt="The quick brown fox", raw=True,
                                  options=GREEDY | {"num_predict": 10})
    assert raw.prompt_eval_count < whole.prompt_eval_count   # no template around it
    # the same text through /v1/completions, which takes the prompt as it is
    same = server.client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10, **GREEDY)
    assert raw.response == same.choices[0].text
    system = client(server).generate(model="tiny", prompt="The quick brown fox", system="Answer in French.",
                                     options=GREEDY | {"num_predict": 2})
    assert system.prompt_eval_count > whole.prompt_eval_count


def test_an_empty_prompt_or_no_messages_loads_the_model(server):
    loaded = client(server).generate(model="tiny")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    chat = client(server).chat(model="tiny", messages=[])
    assert chat.done and chat.done_reason == "load" and chat.message.content == ""


def test_options_sampling_stop_and_a_num_predict_past_the_context(server):
    r = client(server).chat(model="tiny", messages=USER, options={
        "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.01, "repeat_penalty": 1.1, "repeat_last_n": -1,
        "presence_penalty": 0.1, "frequency_penalty": 0.1, "seed": -1, "num_predict": 6, "stop": ["\n\n", "x"],
        "num_ctx": 8192, "num_gpu": 99, "num_thread": 4, "use_mmap": True, "typical_p": 0.5}, keep_alive="10m")
    assert r.done and r.eval_count <= 6
    seeded = [client(server).chat(model="tiny", messages=USER, options={"temperature": 1, "seed": 7, "num_predict": 8})
              .message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    # ollama's num_predict is at most so many: the reply gets what the context leaves
    r = client(server).generate(model="tiny", prompt="Hi", raw=True, options=GREEDY | {"num_predict": 100_000})
    assert r.done_reason in ("stop", "length")


def test_format_json_and_a_schema(server):
    for seed in range(3):
        r = client(server).chat(model="tiny", messages=[{"role": "user", "content": "A person, as JSON"}],
                                format=PERSON, options={"temperature": 1.0, "seed": seed, "num_predict": 100})
        person = json.loads(r.message.content)
        assert r.done_reason == "stop" and set(person) == {"name", "age"}
        assert isinstance(person["name"], str) and len(person["name"]) <= 12 and 0 <= person["age"] <= 150
    r = client(server).generate(model="tiny", prompt="Any JSON object", format="json",
                                options=GREEDY | {"num_predict": 4})
    assert r.response.startswith("{")


def test_tools_are_accepted_and_a_call_and_its_result_go_back(server):
    r = client(server).chat(model="tiny", messages=USER, tools=TOOLS, options=GREEDY | {"num_predict": 8})
    assert r.done and r.done_reason in ("stop", "length")
    # ollama has no tool_choice; nibble takes "required" to force a call (one, by a grammar)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": TOOLS, "tool_choice": "required", "stream": False, "options": GREEDY | {"num_predict": 200}}
    status, _, raw = server.post("/api/chat", body)
    assert status == 200, raw
    forced = ollama.ChatResponse(**json.loads(raw))   # the client's own type
    [call] = forced.message.tool_calls
    assert call.function.name == "weather" and isinstance(call.function.arguments["city"], str)
    assert forced.message.content == "" and forced.done_reason == "stop"
    status, _, raw = server.post("/api/chat", body | {"stream": True})
    streamed = [ollama.ChatResponse(**line) for line in ndjson(raw)]
    assert [c.function for line in streamed for c in line.message.tool_calls or []] == [call.function]
    # the call and its result (named by tool_name, as ollama's clients send it) in the history
    history = body["messages"] + [forced.message, {"role": "tool", "tool_name": "weather", "content": "sunny, 21 C"}]
    answer = client(server).chat(model="tiny", messages=history, tools=TOOLS, options=GREEDY | {"num_predict": 8})
    assert answer.done and answer.prompt_eval_count > forced.prompt_eval_count + forced.eval_count


def test_a_tool_result_gets_the_id_of_the_call_it_answers():
    messages = wire.parse_chat({"messages": [
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "time", "arguments": {}}}]},
        {"role": "tool", "tool_name": "time", "content": "noon"},
        {"role": "tool", "tool_name": "weather", "content": "sunny"}]}).messages
    calls = messages[0]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}', "{}"]
    assert [m["tool_call_id"] for m in messages[1:]] == [calls[1]["id"], calls[0]["id"]]
    assert messages[1]["name"] == "time"


def test_logprobs(server):
    r = client(server).chat(model="tiny", messages=USER, logprobs=True, top_logprobs=2,
                            options=GREEDY | {"num_predict": 5})
    assert len(r.logprobs) == r.eval_count
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-6 for lp in r.logprobs)


def test_think_gives_thinking_then_content_and_think_false_none(thinker):
    r = client(thinker).chat(model="r1", messages=USER, think=True, options=GREEDY | {"num_predict": 30})
    assert r.message.thinking and r.message.content
    chunks = list(client(thinker).chat(model="r1", messages=USER, think=True, stream=True,
                                       options=GREEDY | {"num_predict": 30}))
    kinds = [("thinking" if c.message.thinking else "") + ("content" if c.message.content else "") for c in chunks]
    assert kinds[0] == "" and not chunks[0].done   # the first object goes out before the prefill
    kinds = kinds[1:]
    first_content = next(i for i, k in enumerate(kinds) if "content" in k)
    assert "thinking" in kinds[0] and all("thinking" not in k for k in kinds[first_content + 1:])
    assert "".join(c.message.thinking or "" for c in chunks) == r.message.thinking
    off = client(thinker).chat(model="r1", messages=USER, think=False, options=GREEDY | {"num_predict": 10})
    assert not off.message.thinking and off.message.content
    generated = client(thinker).generate(model="r1", prompt="Why is the sky blue?", think=True,
                                         options=GREEDY | {"num_predict": 30})
    assert generated.thinking and generated.response
    assert client(thinker).chat(model="r1", messages=USER, think="high", options={"num_predict": 2}).done


def test_list_show_ps_version_and_heartbeat(server, thinker, r1_dir):
    [model] = client(server).list().models
    assert model.model == "tiny" and model.size > 0 and len(model.digest) == 64 and model.modified_at.year > 2000
    assert (model.details.format, model.details.family, model.details.families) == ("safetensors", "llama", ["llama"])
    assert model.details.parameter_size.endswith("K") and model.details.quantization_level == "f32"
    shown = client(server).show("tiny")
    assert shown.template == CHATML and shown.capabilities == ["completion"]
    assert shown.modelinfo["llama.context_length"] == POSITIONS and "num_ctx" in shown.parameters
    assert shown.details.family == "llama" and "FROM " in shown.modelfile
    assert client(thinker).show("r1").capabilities == ["completion", "thinking"]
    # a model not loaded is read from its files, without loading it
    on_disk = ollama_models.show_reply("r1", str(r1_dir), ollama_models.About.on_disk(str(r1_dir), CTX))
    assert on_disk["capabilities"] == ["completion", "thinking"] and on_disk["template"].startswith("{%")
    [running] = client(server).ps().models
    assert running.name == "tiny" and running.context_length == POSITIONS
    status, _, raw = server.post("/api/version", None, method="GET")
    assert status == 200 and json.loads(raw) == {"version": importlib.metadata.version("nibble")}
    status, _, _ = server.post("/", None, {"Authorization": ""}, method="HEAD")   # the ollama command's heartbeat
    assert status == 200


@pytest.mark.parametrize("template, capabilities", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", ["completion", "tools"]),
    ("Qwen-Qwen3-0.6B.jinja", ["completion", "tools", "thinking"]),
    ("openai-gpt-oss-120b.jinja", ["completion", "tools", "thinking"]),
    ("HuggingFaceTB-SmolLM3-3B.jinja", ["completion", "thinking"])])
def test_capabilities_from_the_template(template, capabilities):
    assert ollama_models.capabilities((TEMPLATES / template).read_text()) == capabilities


def test_an_unknown_model_is_404_and_the_latest_tag_is_the_model(server):
    for call in (lambda c: c.chat(model="llama3.2", messages=USER), lambda c: c.show("llama3.2"),
                 lambda c: c.generate(model="llama3.2", prompt="hi")):
        with pytest.raises(ollama.ResponseError) as e:
            call(client(server))
        assert e.value.status_code == 404 and "not found" in e.value.error
    assert client(server).chat(model="tiny:latest", messages=USER, options={"num_predict": 1}).model == "tiny"


@pytest.mark.parametrize("path, body, named", [
    ("/api/chat", {"messages": USER, "options": {"temperature": -1}}, "options.temperature"),
    ("/api/chat", {"messages": USER, "options": {"num_predict": "ten"}}, "options.num_predict"),
    ("/api/chat", {"messages": USER, "options": {"stop": [1]}}, "options.stop"),
    ("/api/chat", {"messages": USER, "options": []}, "options"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "messages[0].images[0]"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["not base64"]}]}, "messages[0].images[0]"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": "aGk="}]}, "messages[0].images"),
    ("/api/chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/api/chat", {"messages": USER, "think": "very"}, "think"),
    ("/api/chat", {"messages": USER, "format": "yaml"}, "format"),
    ("/api/chat", {"messages": USER, "keep_alive": "soon"}, "keep_alive"),
    ("/api/chat", {"messages": USER, "stream": "yes"}, "stream"),
    ("/api/chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("/api/generate", {"prompt": "hi", "images": ["aGk="]}, "images[0]"),
    ("/api/generate", {"prompt": "hi", "images": ["aGk="], "raw": True}, "images"),
    ("/api/generate", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("/api/generate", {"prompt": "hi", "context": [1, 2, 3]}, "context"),
    ("/api/generate", {"prompt": "hi", "raw": True, "format": "json"}, "format"),
    ("/api/generate", {"prompt": 3}, "prompt"),
    ("/api/show", {"model": 3}, "model"),
])
def test_a_bad_field_is_a_400_naming_it_in_ollamas_shape(server, path, body, named):
    status, _, raw = server.post(path, body)
    error = json.loads(raw)
    assert status == 400 and list(error) == ["error"] and error["error"].startswith(named), raw


def test_other_errors_in_ollamas_shape(server):
    for path, body, headers, expected in (("/api/chat", b"{", {}, 400), ("/api/pull", {"model": "x"}, {}, 404),
                                          ("/api/chat", {"messages": USER}, {"Authorization": ""}, 401),
                                          ("/api/tags", None, {"Origin": "http://evil.example"}, 403)):
        status, _, raw = server.post(path, body, headers, method="GET" if path == "/api/tags" else "POST")
        assert status == expected and isinstance(json.loads(raw)["error"], str), raw
    with pytest.raises(ollama.ResponseError) as e:
        client(server).chat(model="tiny", messages=USER, options={"temperature": "hot"})
    assert e.value.status_code == 400 and e.value.error == "options.temperature must be a number"


def test_parse_chat_reads_ollamas_fields_into_the_neutral_body():
    body = wire.parse_chat({"model": "m", "messages": [
        {"role": "User", "content": "hi"}, {"role": "assistant", "content": "yes", "thinking": "hm"}],
        "think": "max", "format": "json", "stream": False, "logprobs": True,
        "options": {"num_predict": -1, "seed": 3, "stop": "\n"}})
    assert body.messages[0]["role"] == "user" and body.messages[1]["reasoning_content"] == "hm"
    assert (body.thinking.think, body.thinking.effort) == (True, "high")
    assert (body.response_format, body.options.stream, body.options.max_tokens, body.options.logprobs) == \
        ("json_object", False, None, 0)
    assert body.options.sampling == {"seed": 3} and body.options.stop == ("\n",)
    assert wire.parse_chat({"messages": []}).options.stream   # ollama streams unless told not to
    with pytest.raises(ApiError, match="options.repeat_last_n"):
        wire.parse_chat({"messages": [], "options": {"repeat_last_n": -2}})


# ---- fuzz ----

PNG = base64.b64encode(png(RED)).decode()
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.sampled_from([2**63, -(2**63), 10**30]),
                    st.floats(allow_nan=False), st.text(max_size=8),
                    st.sampled_from(["user", "assistant", "tool", "system", "json", "high", "max", "5m", "tiny",
                                     "\ud800", "tiny:latest", "weather", PNG, PNG[:40], "aGk=", "not base64",
                                     "data:image/png;base64," + PNG]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["role", "content", "function", "name", "arguments",
                                                       "type", "properties", "thinking", "tool_calls",
                                                       "tool_name", "images", "x"]) | st.text(max_size=4),
                                      inner, max_size=3), max_leaves=10)
OPTIONS = {"temperature": 0, "num_predict": 3}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "options": OPTIONS}
GENERATE = {"model": "tiny", "prompt": "Hi", "options": OPTIONS}
CHAT_KEYS = ["model", "messages", "tools", "format", "options", "stream", "think", "keep_alive", "tool_choice",
             "logprobs", "top_logprobs"]
GENERATE_KEYS = ["model", "prompt", "system", "raw", "format", "options", "stream", "think", "keep_alive",
                 "images", "suffix", "context", "template"]
OPTION_KEYS = ["temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty", "repeat_last_n",
               "presence_penalty", "frequency_penalty", "num_ctx"]   # num_predict stays: replies stay short


@st.composite
def bodies(draw, base: dict, keys: list[str]):
    """Random JSON, or `base` with fields replaced (its options' and first message's too) or removed."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    body = json.loads(json.dumps(base))
    for key in draw(st.sets(st.sampled_from(keys), max_size=2)):
        body.pop(key, None)
    body |= draw(st.dictionaries(st.sampled_from(keys), JSON, max_size=3))
    if body.get("options") is None:   # the model's own num_predict: a reply to the end of the context
        body["options"] = OPTIONS
    if isinstance(body.get("options"), dict):
        body["options"] = {**body["options"], **draw(st.dictionaries(st.sampled_from(OPTION_KEYS), JSON, max_size=2)),
                           "num_predict": 3}
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        messages[0] = messages[0] | draw(st.dictionaries(
            st.sampled_from(["role", "content", "thinking", "images", "tool_calls", "tool_name"]), JSON, max_size=2))
    return body


def answered_well(server, path: str, body) -> str:
    """Send `body`: a 200 (its last line done, or an error object) or a 4xx in ollama's shape."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, headers, raw = server.post(path, data)
    if status == 200:
        lines = ndjson(raw)
        assert lines and (lines[-1].get("done") is True or isinstance(lines[-1].get("error"), str)), raw
        return "200"
    assert 400 <= status < 500, (status, raw)
    assert isinstance(json.loads(raw)["error"], str), raw
    return str(status)


@pytest.mark.fuzz
@given(body=bodies(CHAT, CHAT_KEYS))
@example(body=b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
@example(body=b"[" * 100_000 + b"]" * 100_000)
@example(body={**CHAT, "messages": [{"role": "user", "content": "x" * 5000}] * 2})
def test_fuzz_chat_bodies_are_answered_or_a_4xx(server, body):
    event(answered_well(server, "/api/chat", body))


@pytest.mark.fuzz
@given(body=bodies(GENERATE, GENERATE_KEYS))
@example(body=b'{"prompt": "\\ud800"}')
@example(body=b'{"prompt": "' + b"[" * 50_000 + b'", "options": {"num_predict": 1}}')
def test_fuzz_generate_bodies_are_answered_or_a_4xx(server, body):
    event(answered_well(server, "/api/generate", body))


@pytest.mark.fuzz
@given(body=st.one_of(JSON, st.dictionaries(st.sampled_from(["model", "name", "verbose"]), JSON, max_size=3)))
@example(body={"model": "tiny"})
@example(body={"model": "../../etc/passwd"})
def test_fuzz_show_bodies_are_answered_or_a_4xx(server, body):
    status, _, raw = server.post("/api/show", json.dumps(body).encode())
    if status == 200:
        assert json.loads(raw)["capabilities"][0] == "completion"
    else:
        assert 400 <= status < 500 and isinstance(json.loads(raw)["error"], str), (status, raw)
    event(str(status))
