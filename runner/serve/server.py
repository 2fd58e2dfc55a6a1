"""`nibble serve`'s process: the engine started and warmed up, uvicorn serving the app on it, and
Ctrl-C draining: running replies end with their final chunk, then the process exits 0."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable

import uvicorn

from nibble.formats.catalog import Details
from nibble.formats.errors import NibbleError
from ..engine import Engine
from ..model import Model
from ..tokenizer import Tokenizer
from .app import make_app
from .replies import Served

# uvicorn waits this long for open replies to end after Ctrl-C before cancelling them.
DRAIN_SECONDS = 5


class Server(uvicorn.Server):
    """uvicorn, telling the engine to drain before it stops: the engine ends every running reply
    at its next step ("stop") and refuses new ones, so each open stream sends its last chunk and
    `[DONE]` and closes; uvicorn then finds no connection left to wait for."""

    def __init__(self, served: Served, api_key: str | None = None, on_ready: Callable[[], None] = lambda: None):
        super().__init__(uvicorn.Config(make_app(served, api_key), lifespan="off", log_level="warning",
                                        access_log=False, timeout_graceful_shutdown=DRAIN_SECONDS))
        self.engine, self.on_ready = served.engine, on_ready

    def handle_exit(self, sig, frame):
        self.engine.drain()
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            self.on_ready()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: a free port), or one line saying why not: done before the
    model loads, so that a port in use is said at once."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise NibbleError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(model: Model, tokenizer: Tokenizer, name: str, sock: socket.socket, *, parallel: int, queue: int,
          ctx: int, kv_type: str, threads: int | None, cache_tokens: int | None, api_key: str | None,
          say: Callable[[str], None], details: Details | None = None):
    """Serve the OpenAI API on `sock` until Ctrl-C; `say` gets the ready line once the engine has
    warmed up and the port listens. `details` (what the model is) is for /api/ps."""
    engine = Engine(model, tokenizer, parallel=parallel, queue=queue, ctx=ctx, kv_type=kv_type, threads=threads,
                    cache_tokens=cache_tokens)
    engine.start()   # returns once a first pass has run: the kernels are compiled or loaded
    try:
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        served = Served(engine, tokenizer, name, int(time.time()), details)
        server = Server(served, api_key,
                        on_ready=lambda: say(f"nibble serve: {url} ({name}, {parallel} parallel)"))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:   # uvicorn raises the Ctrl-C it caught again once it has drained
            pass
    finally:
        engine.close()

