"""One nibble serve, many models: tiny models laid out in a Hugging Face cache in tmp, served by a
server in a thread of this process (its clock and free memory injected), called over HTTP by the
official openai client. Loads are made to wait on events where a test needs one under way: no
test waits on time."""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from hypothesis import event, given, strategies as st

from nibble.formats.errors import NibbleError
from nibble.formats.model_dir import write_model_dir
from nibble.runner import loader
from nibble.runner.serve.memory import model_bytes, positions_for
from nibble.runner.serve.models import MAX_KEEP_ALIVE, EngineOptions, Models, parse_keep_alive, servable
from nibble.runner.serve.server import Server, listen
from tests.test_cli import assert_one_line_error, interruptible, invoke
from tests.test_hub import isolated, lay_out_snapshot  # noqa: F401 (a fixture)
from tests.test_serve import GREEDY, KEY, LONG, Running
from tests.tiny import tiny_model_dir, tiny_tensors

A, B, C = "org/tiny-a", "org/tiny-b", "org/long-c"
OPTIONS = EngineOptions(parallel=2, queue=4, ctx=32768)   # C's whole context: its replies run on
LOAD = loader.load   # held_loads replaces it for the loads a test holds


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """Three tiny models' files: A; B, twice A's layers (larger in memory); and C, with a context
    long enough that a reply to its end takes far longer than any test."""
    root = tmp_path_factory.mktemp("models")
    big, long = tiny_model_dir(seed=1), tiny_model_dir(seed=0)   # seed 0's greedy reply to LONG runs on
    big.config = type(big.config).from_dict(big.config.to_dict() | {"num_hidden_layers": 4})
    big.tensors = tiny_tensors(big.config, seed=1)
    long.config = type(long.config).from_dict(long.config.to_dict() | {"max_position_embeddings": 32768})
    return {A: _files(write_model_dir(tiny_model_dir(seed=0), root / "a")),
            B: _files(write_model_dir(big, root / "b")),
            C: _files(write_model_dir(long, root / "c"))}


@pytest.fixture
def cache(isolated, model_files):  # noqa: F811
    """The three models in a Hugging Face cache in tmp (nibble's own cache empty beside it)."""
    return {repo: lay_out_snapshot(isolated / "hf-hub", repo, files) for repo, files in model_files.items()}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Served(Running):
    """A running server over Models, what it logged, and its clock."""

    def __init__(self, port: int, models: Models, log: list[str], clock: Clock):
        super().__init__(port, None)
        self.models, self.log, self.clock = models, log, clock

    def ask(self, model: str, content: str = "Hello there", **kwargs):
        return self.client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                                   **(GREEDY | {"max_tokens": 4} | kwargs))

    def ps(self) -> list[dict]:
        import urllib.request
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/ps",
                                         headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())["models"]

    def loaded(self) -> list[str]:
        return sorted(m["name"] for m in self.ps())


@pytest.fixture
def serve(cache):
    """serve(**Models' keywords): a server over the cache's models, A loaded at start."""
    running = []

    def start(first=A, only=None, **kwargs) -> Served:
        log, clock = [], Clock()
        refs, default = servable(first, only)
        models = Models(refs, default, OPTIONS, log=log.append, clock=clock, **kwargs)
        if models.encodes(default):   # as nibble serve starts
            models.load_now(default)
        else:
            models.add(default, *LOAD(refs[default]))
        sock = listen("127.0.0.1", 0)
        server = Server(models, KEY)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:   # a start, not a wait on time: it either comes or the test hangs
            time.sleep(0.01)
        running.append((server, thread, models))
        return Served(sock.getsockname()[1], models, log, clock)

    yield start
    for server, thread, models in running:
        server.should_exit = True
        thread.join()
        models.close()


class Steps:
    """A loaded model's engine steps: counted, and held while `run` is clear (a reply that runs
    on for as long as the test needs)."""

    def __init__(self, server: Served, name: str):
        [engine] = [s.engine for s, _ in server.models.loaded() if s.name == name]
        self.count, self.target = 0, None
        self.run, self.reached = threading.Event(), threading.Event()
        self.run.set()
        real = engine._step

        def step(running):
            assert self.run.wait(60), "the test never let the engine go on"
            real(running)
            self.count += 1
            if self.target is not None and self.count >= self.target:
                self.reached.set()
        engine._step = step

    def wait_for(self, more: int) -> bool:
        self.target = self.count + more
        return self.reached.wait(60)


def chat_stream(server: Served, model: str, max_tokens: int):
    """A streamed chat reply's lines: the first (the role) comes before any step of the engine."""
    return server.client.chat.completions.with_streaming_response.create(
        model=model, messages=[{"role": "user", "content": LONG}], stream=True, max_tokens=max_tokens, **GREEDY)


@pytest.fixture
def held_loads(monkeypatch):
    """Loads that wait until the test lets them go: `started` is set when one begins, `go` lets it
    finish; `calls` counts them."""
    class Held:
        started, go, calls = threading.Event(), threading.Event(), []
    def load(ref, *args, **kwargs):
        Held.calls.append(ref)
        Held.started.set()
        assert Held.go.wait(60), "the test never let the load finish"
        return LOAD(ref, *args, **kwargs)
    monkeypatch.setattr(loader, "load", load)
    return Held


def test_one_server_answers_for_two_models_loading_the_second_on_request(serve):
    server = serve()
    assert [m.id for m in server.client.models.list().data] == [A, C, B]   # the default first, loaded or not
    assert server.loaded() == [A]
    a, b = server.ask(A), server.ask(B)
    assert (a.model, b.model) == (A, B) and a.choices[0].finish_reason in ("stop", "length")
    assert b.choices[0].message.content and b.usage.completion_tokens > 0
    # the seeds differ: the second model's greedy reply is its own
    assert server.ask(B, max_tokens=12).choices[0].message.content != server.ask(A, max_tokens=12).choices[0].message.content
    assert server.loaded() == [A, B]
    assert any(line.startswith(f"loading {B} for a request") for line in server.log)
    assert any(line.startswith(f"loaded {B} in ") and line.endswith(" s") for line in server.log)
    # streamed, and a request without a model gets the default one
    chunks = list(server.ask(B, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[0].model == B
    status, _, body = server.post("/v1/completions", {"prompt": "The sky", "max_tokens": 2})
    assert status == 200 and json.loads(body)["model"] == A
    result = invoke("ps", "--port", server.port, "--api-key", KEY)
    assert result.exit_code == 0, result.output
    rows = result.stdout.splitlines()[1:]
    assert sorted(row.split()[0] for row in rows) == [A, B] and all("minutes from now" in row for row in rows)


def test_with_max_models_1_a_load_unloads_the_least_recently_used(serve):
    server = serve(max_models=1)
    server.ask(B)
    assert server.loaded() == [B] and f"unloaded {A}, to make room for {B}" in server.log
    server.ask(A)
    assert server.loaded() == [A] and f"unloaded {B}, to make room for {A}" in server.log


def test_the_least_recently_used_goes_first(serve):
    server = serve(max_models=2)
    server.clock.now += 1
    server.ask(B)
    server.clock.now += 1
    server.ask(A)   # A is used after B now
    server.clock.now += 1
    server.ask(C)
    assert server.loaded() == sorted([A, C]) and f"unloaded {B}, to make room for {C}" in server.log


def test_keep_alive_unloads_an_idle_model_and_never_one_with_a_reply_running(serve):
    server = serve(keep_alive=300)
    server.ask(B)
    [b] = [m for m in server.ps() if m["name"] == B]
    assert b["expires_at"].endswith("Z") and b["expires_at"] != "9999-12-31T23:59:59Z"
    server.clock.now += 299
    server.models.sweep()
    assert server.loaded() == [A, B]
    server.clock.now += 1
    server.models.sweep()
    assert server.loaded() == [] and f"unloaded {B}, idle for 5m" in server.log
    # a reply that runs past the keep-alive keeps its model
    server.ask(C)
    steps = Steps(server, C)
    steps.run.clear()
    with chat_stream(server, C, 8) as stream:
        lines = (line for line in stream.iter_lines() if line)
        assert next(lines).startswith("data: ")   # the reply has started, and holds
        server.clock.now += 10_000
        server.models.sweep()
        assert server.loaded() == [C]
        steps.run.set()
        assert list(lines)[-1] == "data: [DONE]"
    server.models.sweep()
    assert server.loaded() == [C]   # the keep-alive counts from the reply's end: the clock has not moved since
    server.clock.now += 300
    server.models.sweep()
    assert server.loaded() == []
    assert server.ask(A).model == A   # loaded again on request


def test_keep_alive_minus_1_keeps_models_until_the_server_stops(serve):
    server = serve(keep_alive=None)
    server.clock.now += 10 ** 9
    server.models.sweep()
    assert [m["expires_at"] for m in server.ps()] == ["9999-12-31T23:59:59Z"]


def test_an_unknown_model_or_a_path_is_the_same_404_and_nothing_is_read(serve, cache, held_loads, tmp_path):
    server = serve()
    messages = {}
    for name in ["gpt-4o", str(cache[B]), str(cache[B] / "config.json"), str(tmp_path / "nothing-here"),
                 "../" + B, "hf.co/" + B, "org/tiny-a:Q4_K_M", "/etc/passwd", ""]:
        with pytest.raises(openai.NotFoundError) as e:
            server.ask(name)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
        messages[name] = e.value.body["message"].replace(repr(name), "NAME")
    assert len(set(messages.values())) == 1, messages   # a path that exists reads as one that does not
    assert held_loads.calls == [] and server.loaded() == [A]


def test_a_model_that_would_not_fit_in_memory_is_a_503_until_unloading_the_idle_ones_makes_room(serve, cache):
    need = {name: model_bytes(cache[name], None, positions_for(cache[name], OPTIONS.parallel, OPTIONS.ctx, None),
                              "f32") for name in (A, B)}
    assert need[B] > need[A]
    free = [need[B] - need[A] - 1]
    server = serve(available=lambda: free[0])
    with pytest.raises(openai.InternalServerError) as e:
        server.ask(B)
    assert e.value.status_code == 503 and e.value.body["code"] == "insufficient_memory"
    assert f"{B} needs about " in e.value.body["message"] and e.value.response.headers["retry-after"] == "1"
    assert server.loaded() == [A]   # it would not have been enough: A was left loaded
    free[0] += 1
    assert server.ask(B).model == B and f"unloaded {A}, to make room for {B}" in server.log
    free[0] = None   # where the machine does not say, nothing is checked
    assert server.ask(A).model == A and server.loaded() == [A, B]


def test_a_load_does_not_stall_another_models_stream_and_requests_share_it(serve, held_loads):
    """While B's load is held, C's engine goes on with its stream, C answers a new request, and a
    second request for B joins the load under way."""
    server = serve(first=C)
    steps = Steps(server, C)
    with chat_stream(server, C, 10_000) as stream:
        lines = (line for line in stream.iter_lines() if line)
        assert next(lines).startswith("data: ")
        with ThreadPoolExecutor(2) as pool:
            replies = [pool.submit(server.ask, B) for _ in range(2)]
            assert held_loads.started.wait(60)
            while server.models._users[B] < 2:   # the second request has joined the load under way
                time.sleep(0.01)
            assert steps.wait_for(20)   # C's reply is decoded while B loads ...
            assert server.ask(C, max_tokens=2).model == C   # ... and C answers a new request
            assert all(next(lines).startswith("data: ") for _ in range(20))
            assert not any(r.done() for r in replies)
            held_loads.go.set()
            assert [r.result().model for r in replies] == [B, B]
    assert held_loads.calls == [B]


def test_max_models_all_busy_is_a_503(serve):
    server = serve(first=C, max_models=1)
    steps = Steps(server, C)
    steps.run.clear()
    with chat_stream(server, C, 4) as stream:
        lines = (line for line in stream.iter_lines() if line)
        assert next(lines).startswith("data: ")
        with pytest.raises(openai.InternalServerError) as e:
            server.ask(B)
        assert e.value.status_code == 503 and "--max-models 1" in e.value.body["message"]
        steps.run.set()
        assert list(lines)[-1] == "data: [DONE]"
    assert server.ask(B).model == B and server.loaded() == [B]


def test_models_serves_only_those_it_names(cache, serve):
    refs, default = servable(A, [B])
    assert (list(refs), default) == ([A, B], A)
    assert servable(str(cache[B]), None)[1] == B   # -m by its path: the name nibble ls prints
    with pytest.raises(NibbleError, match="nope is not in nibble's cache or the Hugging Face cache"):
        servable(A, ["nope"])
    server = serve(only=[B])
    assert [m.id for m in server.client.models.list().data] == [A, B]
    with pytest.raises(openai.NotFoundError):
        server.ask(C)


def test_the_openai_client_in_a_real_nibble_serve_process(cache, isolated):  # noqa: F811
    """`nibble serve --models` in a subprocess: its log says what it loads, for whom."""
    import os
    import signal
    import subprocess
    import sys

    import numba
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NUMBA_CACHE_DIR": numba.config.CACHE_DIR}
    proc = subprocess.Popen([sys.executable, "-m", "nibble.tui.cli.main", "serve", "--models", f"{A},{B}", "--port", "0",
                             "--api-key", KEY, "--max-models", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=interruptible)
    try:
        line = proc.stdout.readline()
        assert line.endswith(f"/v1 ({A}, 4 parallel)\n"), line + proc.stderr.read()
        server = Running(int(line.split(":")[3].split("/")[0]), None)
        for model in (A, B, A):
            r = server.client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=3, **GREEDY)
            assert r.model == model
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0   # a guard against a hang, not a speed check
        log = proc.stderr.read()
        assert "Traceback" not in log
        for said in ["1 more model loaded on request", f"loading {B} for a request",
                     f"unloaded {A}, to make room for {B}", f"loaded {B} in ", f"unloaded {B}, to make room for {A}"]:
            assert said in log, log
    finally:
        proc.kill()
        proc.wait()


@given(st.one_of(st.text(max_size=12), st.sampled_from(
    ["5m", "30s", "1h30m", "-1", "0", "-5m", "300", "1.5h", "5", "m", "5 m", "1e3", "nan", "inf", "-0", "99999999h",
     "٣m", "1h-1m", "--1", "5M"])))
def test_fuzz_keep_alive_is_a_duration_forever_or_one_line(text):
    try:
        seconds = parse_keep_alive(text)
    except NibbleError as e:
        event("refused")
        assert "\n" not in str(e) and repr(text) in str(e)
        return
    event("forever" if seconds is None else "a duration")
    assert seconds is None or 0 <= seconds <= MAX_KEEP_ALIVE


def test_keep_alive_reads_as_ollama_writes_it():
    assert [parse_keep_alive(t) for t in ["5m", "30s", "1h30m", "300", "0", "-1", "-5m", "1.5h", "500ms"]] == \
        [300, 30, 5400, 300, 0, None, None, 5400, 0.5]


@given(option=st.sampled_from(["--keep-alive", "--max-models", "--models"]),
       value=st.one_of(st.text(max_size=8), st.sampled_from(["0", "-1", "1e9", ",", "a,,b", " ", "5m", A])))
def test_fuzz_serves_new_options_are_one_line(isolated, option, value):  # noqa: F811
    """Whatever they hold, the serve stops at a one-line error: the port is taken, or the value is wrong."""
    with listen("127.0.0.1", 0) as taken:
        taken.listen()
        result = invoke("serve", option, value, "--port", taken.getsockname()[1])
    event(f"exit {result.exit_code}")
    assert_one_line_error(result, code=result.exit_code)
    assert result.exit_code in (1, 2)
