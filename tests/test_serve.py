"""nibble serve against the official openai client: a server on a free loopback port in a thread of
this process for most tests (the engine's counts visible), and `nibble serve` in a subprocess for
its ready line, a full queue and Ctrl-C."""
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from nibble.formats.model_dir import write_model_dir
from nibble.runner.serve.server import listen
from nibble.runner.serve.pending import MAX_BODY
from tests.serving import CTX, KEY, Running, serving, with_context
from tests.test_cli import interruptible
from tests.tiny import tiny_model_dir

GREEDY = {"temperature": 0}
LONG = "Tell me everything about the sky and the sea, " * 4


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """The tiny model with a long context: a reply to its end takes far longer than any test waits."""
    return write_model_dir(with_context(tiny_model_dir(), 32768), tmp_path_factory.mktemp("tiny") / "long")


@pytest.fixture(scope="module")
def server(long_dir):
    with serving(long_dir) as running:
        yield running


def chat(server: Running, content: str, **kwargs):
    return server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                 **(GREEDY | kwargs))


def test_a_chat_reply(server):
    r = chat(server, "Hello there", max_tokens=12)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert (choice.finish_reason == "length") == (r.usage.completion_tokens == 12)


def test_a_streamed_chat_reply_is_the_blocking_one_in_pieces(server):
    whole = chat(server, "What is the capital of France?", max_tokens=20)
    chunks = list(chat(server, "What is the capital of France?", max_tokens=20, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # the prompt's blocks were cached by the first request
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    lines = server.events("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_follow_up_turn_finds_the_first_turn_and_its_reply_in_the_cache(server):
    """The reply as sampled, not as its text tokenizes again: the server remembers the ids."""
    messages = [{"role": "user", "content": "Numba compiles Python to machine code, said the fox"}]
    first = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, **GREEDY)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    then = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **GREEDY)
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1   # the last token sampled, never run
    assert then.usage.prompt_tokens_details.cached_tokens >= held // 16 * 16   # every full block of them


def test_completions_streamed_and_not(server):
    whole = server.client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10,
                                             logprobs=2, **GREEDY)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("stop", "length")
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == whole.choices[0].text and len(lp.tokens) == whole.usage.completion_tokens
    assert all(len(top) <= 2 and max(top.values()) >= logprob - 1e-6
               for top, logprob in zip(lp.top_logprobs, lp.token_logprobs))
    streamed = server.client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10,
                                                stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_models_and_health(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    c.request("GET", "/health")   # no key: open
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["status"] == "ok"


def test_api_ps_lists_the_model_loaded_and_nibble_ps_shows_it(server):
    from tests.test_cli import invoke
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    c.request("GET", "/api/ps", headers={"Authorization": f"Bearer {KEY}"})
    r = c.getresponse()
    [running] = json.loads(r.read())["models"]
    assert r.status == 200 and running["name"] == running["model"] == "tiny"
    assert running["size"] > 0 and running["size_vram"] == 0 and running["context_length"] == CTX
    result = invoke("ps", "--port", server.port, "--api-key", KEY)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[1].split()[:1] == ["tiny"]
    no_key = invoke("ps", "--port", server.port, env={"NIBBLE_API_KEY": None})
    assert no_key.exit_code == 1 and "asks for its API key" in no_key.stderr


def test_a_wrong_key_is_401_and_health_stays_open(server):
    wrong = openai.OpenAI(base_url=server.client.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    status, _, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                                  {"Authorization": ""})
    assert status == 401 and "API key" in json.loads(body)["error"]["message"]


def test_bad_json_is_400_and_the_server_serves_on(server):
    status, _, body = server.post("/v1/chat/completions", b'{"messages": [')
    error = json.loads(body)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and "not JSON" in error["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    assert chat(server, "hi", max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_a_web_page_elsewhere_is_refused_before_any_route_runs(server):
    """What a page on another site can send without a preflight (text/plain), and what one whose
    DNS name was rebound to 127.0.0.1 sends (its own name as Host): 403 in the API's shape, before
    the body is read (a body that is not JSON would be a 400)."""
    page = {"Content-Type": "text/plain", "Origin": "http://evil.example"}
    rebound = {"Host": "evil.example:8132", "Origin": "http://evil.example:8132"}
    for headers, named in ((page, "'http://evil.example'"), (rebound, "'evil.example'"),
                           ({"Host": "evil.example"}, "'evil.example'"), ({"Origin": "null"}, "'null'")):
        for body in (b"not json", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()):
            status, _, raw = server.post("/v1/chat/completions", body, headers)
            error = json.loads(raw)["error"]
            assert status == 403 and error["code"] == "forbidden" and named in error["message"], raw
    assert chat(server, "hi", max_tokens=2).choices[0].finish_reason in ("stop", "length")   # serves on


def test_a_page_on_localhost_gets_cors_answers(server):
    """A browser front end the user runs on this machine: its preflight is answered, and so is the
    request after it, with the headers that let the page read the reply."""
    origin = "http://localhost:3000"
    status, headers, _ = server.post("/v1/chat/completions", None, {
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"}, method="OPTIONS")
    assert status == 200 and headers["access-control-allow-origin"] == origin
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers, raw = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 2}, {"Origin": origin})
    assert status == 200 and headers["access-control-allow-origin"] == origin, raw
    status, _, _ = server.post("/v1/chat/completions", None, {
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}, method="OPTIONS")
    assert status == 403


def test_deep_nesting_and_half_a_surrogate_pair_are_400(server):
    """Two bodies under the 1 MB limit that once got 500: arrays nested 100,000 deep (Python's
    recursion limit) and a lone surrogate, which JSON may escape but no text holds."""
    status, _, raw = server.post("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nests" in json.loads(raw)["error"]["message"]
    status, _, raw = server.post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    assert status == 400 and "surrogate ('\\ud800')" in json.loads(raw)["error"]["message"], raw
    status, _, raw = server.post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": '
                                 b'"a\\ud83d\\ude00b"}], "max_tokens": 2}')   # a whole pair: text, served
    assert status == 200, raw


def test_an_unknown_model_or_path_is_404(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and "GET /v1/models lists" in e.value.body["message"]
    status, _, body = server.post("/v1/images/generations", {"prompt": "x"})
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_over_the_context_is_400_naming_both_numbers(server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "Hello there", max_tokens=CTX)
    message = e.value.body["message"]
    assert f"context is {CTX} tokens" in message and f"max_tokens asks for {CTX}" in message
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match=f"context is {CTX} tokens; the messages take"):
        chat(server, LONG * 100)


def test_a_body_over_the_limit_is_413_whether_its_length_is_said_or_not(server):
    big = b'{"messages": "' + b"x" * (MAX_BODY + 1) + b'"}'
    status, _, body = server.post("/v1/chat/completions", big)
    assert status == 413 and "over" in json.loads(body)["error"]["message"]
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    c.request("POST", "/v1/chat/completions", iter([b"x" * 65536] * (MAX_BODY // 65536 + 1)),
              {"Authorization": f"Bearer {KEY}"},
              encode_chunked=True)
    r = c.getresponse()
    assert r.status == 413
    c.close()


def test_a_client_that_disconnects_frees_its_sequence(server):
    """A reply to the end of the 32k context would take minutes: running drops to 0 only if the
    disconnect cancelled it."""
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": LONG, "stream": True, **GREEDY}),
              {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = c.getresponse()
    assert r.readline().startswith(b"data: ")   # the reply has started
    assert server.engine.running == 1
    engine, freed = server.engine, threading.Event()
    free = engine._free
    engine._free = lambda s: (free(s), freed.set())   # the engine thread lets the cancelled sequence go
    try:
        c.close()
        r.close()
        assert freed.wait(60)
    finally:
        del engine._free
    assert server.engine.running == 0


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}]


def test_a_json_schema_reply_validates(server):
    """Even the tiny random model's reply parses and validates: the grammar masks the rest."""
    for seed in range(3):
        r = chat(server, "A person, as JSON", max_tokens=100, temperature=1.0, seed=seed,
                 response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        person = json.loads(r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop"
        assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 12
        assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
    r = chat(server, "Any JSON object", max_tokens=4, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


def test_a_schema_the_grammar_refuses_is_a_400_naming_it(server):
    bad = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "hi", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
    assert e.value.body["param"] == "response_format.json_schema.schema" and "nope" in e.value.body["message"]


def test_a_forced_tool_call_then_its_result_turn(server):
    """The grammar lets the model write one call only (parallel_tool_calls is off), so even greedy, the
    tiny model ends after it (allowed more, it writes another and another until max_tokens)."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = dict(tools=TOOLS, tool_choice="required", max_tokens=200, **GREEDY)
    r = chat(server, messages[0]["content"], **forced)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather" and call.id
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # streamed, the same call comes as a delta, and the same finish
    chunks = list(chat(server, messages[0]["content"], stream=True, **forced))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, "weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the result goes back through the template, and the model answers it
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = server.client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8,
                                                   **GREEDY)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens   # the call and its result
    assert answer.usage.prompt_tokens_details.cached_tokens > 0   # the first turn's prompt, from the pool


PROMPTS = ["Hello there", "What is the capital of France?", "Numba compiles Python", "The sea and the sky",
           "def f(x): return x**2", "naïve café", "A small model answers", "The lazy dog"]


def test_sixteen_clients_four_requests_each_get_their_greedy_replies(server):
    alone = {p: chat(server, p, max_tokens=16).choices[0].message.content for p in PROMPTS}

    def client(i):
        out = []
        for j in range(4):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, **GREEDY}
            if j % 2:
                lines = server.events("/v1/chat/completions", body)
                assert lines[-1] == "[DONE]"
                text = "".join(json.loads(line)["choices"][0]["delta"].get("content") or "" for line in lines[:-1])
            else:
                text = chat(server, prompt, max_tokens=16).choices[0].message.content
            out.append((prompt, text))
        return out

    with ThreadPoolExecutor(16) as pool:
        replies = [r for rs in pool.map(client, range(16)) for r in rs]
    assert len(replies) == 64
    assert all(text == alone[prompt] for prompt, text in replies)


def test_nibble_serve_says_where_it_listens_refuses_past_its_queue_and_drains_on_ctrl_c(long_dir):
    """--parallel 1 --queue 1: a third request is a 503; Ctrl-C ends the running stream with its
    last chunk and [DONE], and the process exits 0."""
    import numba
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NUMBA_CACHE_DIR": numba.config.CACHE_DIR}
    proc = subprocess.Popen([sys.executable, "-m", "nibble.tui.cli.main", "serve", "-m", str(long_dir), "--port", "0",
                             "--parallel", "1", "--queue", "1", "--api-key", KEY, "-c", str(CTX)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=interruptible)
    try:
        line = proc.stdout.readline()
        assert line.startswith("nibble serve: http://127.0.0.1:") and line.endswith("/v1 (long, 1 parallel)\n"), \
            line + proc.stderr.read()
        server = Running(int(line.split(":")[3].split("/")[0]), None)
        streams = []
        for _ in range(2):   # one running, one waiting
            c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            c.request("POST", "/v1/completions", json.dumps({"prompt": LONG, "stream": True, **GREEDY}),
                      {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            streams.append((c, c.getresponse()))
        running = streams[0][1]
        assert running.status == 200 and running.readline().startswith(b"data: ")
        with pytest.raises(openai.APIStatusError) as e:
            server.client.completions.create(model="long", prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "server_busy"
        streams[1][0].close()
        proc.send_signal(signal.SIGINT)
        lines = [line for line in running.read().decode().split("\n\n") if line.strip()]
        assert lines[-1].strip() == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "stop"
        assert proc.wait(timeout=30) == 0   # a guard against a hang, not a speed check (busy CI machines)
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_gpu_layers_and_a_port_in_use_are_one_line(tiny_dir):
    from tests.test_cli import assert_one_line_error, invoke
    assert_one_line_error(invoke("serve", "-m", tiny_dir, "-ngl", "1"), code=2, match="drop -ngl")
    with listen("127.0.0.1", 0) as taken:
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(invoke("serve", "-m", tiny_dir, "--port", port), match=f"cannot listen on 127.0.0.1:{port}")


@pytest.fixture(scope="module")
def r1_server(r1_dir):
    with serving(r1_dir, "r1") as running:
        yield running


def test_thinking_comes_as_reasoning_content_before_the_answer(r1_server):
    """On the tiny model under DeepSeek-R1's template, which thinks until its budget ends it."""
    asked = dict(model="r1", messages=[{"role": "user", "content": "Why is the sky blue?"}], max_tokens=16,
                 temperature=0, extra_body={"reasoning_budget": 4})
    whole = r1_server.client.chat.completions.create(**asked).choices[0].message
    thinking = whole.model_extra["reasoning_content"]
    assert thinking.strip() and whole.model_extra["reasoning"] == thinking and whole.content
    chunks = list(r1_server.client.chat.completions.create(**asked, stream=True))
    deltas = [c.choices[0].delta.model_extra or {} for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thinking
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.content
    last_thought = max(i for i, d in enumerate(deltas) if d.get("reasoning_content"))
    assert all(not c.choices[0].delta.content for c in chunks[:last_thought + 1])   # thinking first
    off = r1_server.client.chat.completions.create(**asked | {"extra_body": {
        "chat_template_kwargs": {"enable_thinking": False}}}).choices[0].message
    assert "reasoning_content" not in (off.model_extra or {}) and off.content
    # a follow-up turn may send the thinking back: the template decides what the model sees
    follow = asked["messages"] + [{"role": "assistant", "content": whole.content, "reasoning_content": thinking},
                                  {"role": "user", "content": "And at sunset?"}]
    assert r1_server.client.chat.completions.create(**asked | {"messages": follow}).choices[0].message.content
