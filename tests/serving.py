"""A nibble server for tests: on a free loopback port, in a thread of this process (the engine's
counts visible), with raw requests beside the official clients."""
import contextlib
import http.client
import json
import threading
import time

import openai
from hypothesis import event, strategies as st

from nibble.runner.generation.engine import Engine
from nibble.runner.loader import load
from nibble.runner.serve.errors import ApiError
from nibble.runner.serve.models import EngineOptions, Models
from nibble.runner.serve.server import Server, listen

KEY = "sk-test"
CTX = 4096


class Running:
    def __init__(self, port: int, engine: Engine):
        self.port, self.engine = port, engine
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)

    def post(self, path: str, body: bytes | dict | None, headers: dict | None = None,
             method: str = "POST") -> tuple[int, dict, bytes]:
        """A raw request: (status, headers, body)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        c.request(method, path, data, {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                                       **(headers or {})})
        r = c.getresponse()
        out = (r.status, dict(r.getheaders()), r.read())
        c.close()
        return out

    def events(self, path: str, body: dict) -> list[str]:
        """The data lines of a streamed reply, `[DONE]` included."""
        status, _, raw = self.post(path, body | {"stream": True})
        assert status == 200, raw
        return [line[len("data: "):] for line in raw.decode().split("\n\n") if line]


def with_context(model, positions: int = CTX):
    """A tiny model (its own context: 256) with room for the server's context."""
    model.config = type(model.config).from_dict(model.config.to_dict() | {"max_position_embeddings": positions})
    return model


@contextlib.contextmanager
def serving(model_dir, name: str = "tiny", options: EngineOptions = EngineOptions(parallel=4, queue=16, ctx=CTX),
            metrics: bool = False):
    """The model at `model_dir` (one that generates, or embeds) served as `name`, asking for the key
    KEY; `metrics`: with GET /metrics."""
    models = Models({name: str(model_dir)}, name, options)
    if models.encodes(name):   # as nibble serve starts
        models.load_now(name)
    else:
        models.add(name, *load(str(model_dir), loras=options.loras))
    [engine] = models.engines()
    sock = listen("127.0.0.1", 0)
    uvicorn = Server(models, KEY, metrics=metrics)
    thread = threading.Thread(target=uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uvicorn.started:
        time.sleep(0.01)
    try:
        yield Running(sock.getsockname()[1], engine)
    finally:
        uvicorn.should_exit = True
        thread.join()
        models.close()


def read_or_400(parse, body):
    """parse(body) (a route's reader of a body), or None where it refused the body with a 400
    naming the field in one line, as it must; the outcome counted as a hypothesis event."""
    try:
        given = parse(body)
    except ApiError as e:
        assert e.status == 400 and str(e).startswith(f"{e.param} ") and "\n" not in str(e)
        event("400")
        return None
    event("read")
    return given


SCALARS = st.none() | st.booleans() | st.integers(-3, 200) | st.floats(allow_nan=False) | st.text(max_size=8)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=10)


@st.composite
def bodies(draw, good: dict, keys: list[str]):
    """A route's bodies to fuzz it with: any JSON one time in ten; else the `good` body, less one of
    its fields at times, with up to three of `keys` set to any JSON."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    body = dict(good)
    for key in draw(st.sets(st.sampled_from(list(good)), max_size=1)):
        body.pop(key)
    return body | draw(st.dictionaries(st.sampled_from(keys), JSON, max_size=3))
