"""A nibble server for tests: on a free loopback port, in a thread of this process (the engine's
counts visible), with raw requests beside the official clients."""
import contextlib
import http.client
import json
import threading
import time

import openai

from nibble.runner.generation.engine import Engine
from nibble.runner.loader import load
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
    if models.embeds(name):   # as nibble serve starts
        models.load_now(name)
    else:
        models.add(name, *load(str(model_dir)))
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
