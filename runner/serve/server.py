"""`nibble serve`'s process: uvicorn serving the app over the models, the keep-alive sweeping, and
Ctrl-C draining: running replies end with their final chunk, then the process exits 0."""
from __future__ import annotations

import socket
from collections.abc import Callable

import uvicorn

from nibble.formats.errors import NibbleError
from .app import make_app
from .bodies import Images
from .guard import Callers, is_loopback
from .models import Models

# uvicorn waits this long for open replies to end after Ctrl-C before cancelling them.
DRAIN_SECONDS = 5


class Server(uvicorn.Server):
    """uvicorn, telling the engines to drain before it stops: each engine ends every running reply
    at its next step ("stop") and refuses new ones, so each open stream sends its last chunk and
    `[DONE]` and closes; uvicorn then finds no connection left to wait for."""

    def __init__(self, models: Models, api_key: str | None = None, on_ready: Callable[[], None] = lambda: None,
                 callers: Callers = Callers(), allow_image_urls: bool = False, metrics: bool = False):
        app = make_app(models, api_key, callers, Images(allow_urls=allow_image_urls), metrics)
        super().__init__(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=DRAIN_SECONDS))
        self.models, self.on_ready = models, on_ready

    def handle_exit(self, sig, frame):
        self.models.drain()
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


def exposed(host: str, api_key: str | None) -> str | None:
    """The line that says a server bound to `host` without an API key is open to its network."""
    if is_loopback(host) or api_key is not None:
        return None
    return (f"nibble serve: listening on {host} without --api-key: anyone on the network can use it "
            f"(--host 127.0.0.1 keeps it to this machine)")


def _adapters(models: Models) -> str:
    """The ready line's words for --lora's adapters (GET /lora-adapters lists them)."""
    loras = models.options.loras
    return f" with {len(loras)} LoRA adapter{'s' if len(loras) > 1 else ''}" if loras else ""


def serve(models: Models, sock: socket.socket, *, api_key: str | None, say: Callable[[str], None],
          warn: Callable[[str], None], callers: Callers, allow_image_urls: bool = False, metrics: bool = False):
    """Serve the OpenAI API over `models` (the default one loaded) on `sock` until Ctrl-C, to
    `callers`; `say` gets the ready line once the port listens, `warn` the line that says the
    network can use it. `allow_image_urls`: fetch the http(s) URLs of a request's images;
    `metrics`: serve GET /metrics."""
    try:
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        if (line := exposed(host, api_key)) is not None:
            warn(line)
        server = Server(models, api_key, callers=callers, allow_image_urls=allow_image_urls, metrics=metrics,
                        on_ready=lambda: say(f"nibble serve: {url} ({models.default}{_adapters(models)}, "
                                             f"{models.options.parallel} parallel)"))
        models.start_sweeping()
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:   # uvicorn raises the Ctrl-C it caught again once it has drained
            pass
    finally:
        models.close()
