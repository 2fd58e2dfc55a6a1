"""The models one server serves: those it may load (nibble's and the Hugging Face cache's, or
--models), loaded when a request names one, and unloaded when idle past the keep-alive or when a
load needs their place.

A request names a model as `nibble ls` prints it, matched as a string against that list: any other
name is the same 404, so no request makes the server read a path it names or the network. Loads
run one at a time on a thread of their own (a float model's first quantization takes minutes),
never on the event loop: the loaded models' requests are served meanwhile, and the requests for
the model being loaded await that one load. Each loaded model has its own Engine, so its own
generation thread; an embedding model or a reranker its EmbedEngine.

A model is in use from when a request names it until that request's reply ends (a `Lease`); one in
use is never unloaded.
"""
from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from nibble.formats import catalog, hub, presets
from nibble.formats.errors import NibbleError
from nibble.formats.cross_encoder import ranks
from ..text.reasoning import ThinkingOptions
from ..embedding.embed import Embedder
from ..embedding.engine import EmbedEngine
from ..embedding.rerank import Reranker
from ..generation.engine import Engine
from ..model import Model
from ..settings import DEFAULT_DRAFT
from ..text.tokenizer import Tokenizer
from .errors import ApiError
from .memory import available_memory, model_bytes, positions_for
from .replies import Embedding, Served

MAX_KEEP_ALIVE = 365 * 86400   # seconds; past that, -1 says it better
SWEEP_EVERY = 1.0              # seconds between two looks for models idle past the keep-alive
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True)
class EngineOptions:
    """How each model's engine runs (nibble serve's flags, the same for every model)."""
    parallel: int = 4
    queue: int = 16
    ctx: int = 4096               # each reply's context, at most the model's
    kv_type: str = "f32"
    threads: int | None = None
    cache_tokens: int | None = None
    quant: str | None = None      # as loader.load takes it
    thinking: ThinkingOptions = ThinkingOptions()   # --think, --reasoning-budget: each request may say otherwise
    draft: int = DEFAULT_DRAFT    # --draft: the most tokens a pass guesses ahead, for a reply decoding alone
    kv_disk: int = 0              # --kv-disk: bytes for KV blocks on disk (runner/kv/disk.py)
    draft_model: str | None = None   # --draft-model: drafts by it (each engine its own), not by prompt lookup
    loras: tuple = ()             # --lora: adapters (formats/lora.py) beside the default model's weights


def parse_keep_alive(text: str) -> float | None:
    """ollama's keep-alive: a duration ("5m", "30s", "1h30m", "300" seconds), 0 (unloaded once its
    replies end), or a negative one ("-1": never unloaded, None)."""
    s = text.strip()
    if re.fullmatch(r"-\d+(\.\d+)?|-(\d+(\.\d+)?(ms|s|m|h))+", s):
        return None
    if re.fullmatch(r"\d+(\.\d+)?", s):
        seconds = float(s)
    elif re.fullmatch(r"(\d+(\.\d+)?(ms|s|m|h))+", s):
        seconds = sum(float(n) * _UNITS[unit] for n, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", s))
    else:
        raise NibbleError(f"{text!r} is not a duration: write 5m, 30s, 1h, 300 (seconds), 0 (unload when "
                          "idle) or -1 (never unload)")
    if seconds > MAX_KEEP_ALIVE:
        raise NibbleError(f"{text!r} is more than a year: write -1 to keep models loaded until the server stops")
    return seconds


def say_duration(seconds: float) -> str:
    """5m, 30s, 1h30m: a keep-alive as ollama writes it."""
    if 0 < seconds < 1:
        return f"{seconds:g}s"
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n) or "0s"


@dataclass(eq=False)
class _Loaded:
    served: Served | Embedding
    nbytes: int | None     # the estimate it was loaded against (memory.model_bytes)
    used: float            # the clock when its last reply ended, or when it loaded


class Lease:
    """A request's hold on a loaded model, from its name to the end of its reply."""

    def __init__(self, models: Models, served: Served | Embedding):
        self.models, self.served, self._held = models, served, True

    def release(self):
        if self._held:
            self._held = False
            self.models._release(self.served.name)


class Models:
    """The models a server may serve (`refs`: name -> what loader.load takes), `default` first:
    the one a request without a `model` gets. At most `max_models` loaded; `keep_alive` seconds
    idle unloads one (None: never). `clock` (seconds) times the idleness and `available` says the
    memory free (None: unknown): tests inject both."""

    def __init__(self, refs: dict[str, str], default: str, options: EngineOptions, *, max_models: int = 3,
                 keep_alive: float | None = 300.0, log: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic,
                 available: Callable[[], int | None] = available_memory):
        if default not in refs:
            raise NibbleError(f"the default model {default!r} is not among those served")
        if max_models < 1:
            raise NibbleError(f"--max-models must be at least 1, got {max_models}")
        self.refs = {default: refs[default]} | refs   # the default first: /v1/models lists it first
        self.default, self.options, self.max_models, self.keep_alive = default, options, max_models, keep_alive
        self.created = int(time.time())
        self._log, self._clock, self._available = log, clock, available
        self._loaded: dict[str, _Loaded] = {}
        self._users: Counter[str] = Counter()          # requests holding or awaiting each model
        self._loading: dict[str, asyncio.Future] = {}  # on the event loop: the load under way of each
        self._lock = threading.Lock()                  # _loaded, _users and _closed, from any thread
        self._one_load = threading.Lock()
        self._closed = False
        self._stop_sweeping = threading.Event()
        self.metrics = None   # the server's metrics.Metrics, with --metrics (replies count themselves there)

    def serve_also(self, name: str):
        """Answer to `name` from now on (a preset made while the server runs: what -m takes)."""
        with self._lock:
            self.refs.setdefault(name, name)

    # What the routes ask

    async def lease(self, name: str | None) -> Lease:
        """The model `name` (None: the default), loaded first if it is not; a 404 for a name not
        served, a 503 when it cannot be loaded now (no room, shutting down)."""
        name = self.default if name is None else name
        if name not in self.refs:
            raise ApiError(404, f"the model {name!r} is not served here: GET /v1/models lists those that are",
                           "model", code="model_not_found")
        with self._lock:
            if self._closed:
                raise ApiError(503, "the server is shutting down", type="server_error", code="server_busy")
            self._users[name] += 1
        try:
            if name not in self._loaded:
                await asyncio.shield(self._load_soon(name))
            return Lease(self, self._loaded[name].served)   # in use: nothing unloads it now
        except BaseException:
            self._release(name)
            raise

    def loaded(self) -> list[tuple[Served | Embedding, float | None]]:
        """Each loaded model and when it would be unloaded (time.time(); None: never), the
        most recently used first."""
        now_clock, now = self._clock(), time.time()
        with self._lock:
            out = []
            for name, m in sorted(self._loaded.items(), key=lambda kv: -kv[1].used):
                idle = 0.0 if self._users[name] else now_clock - m.used
                until = None if self.keep_alive is None else now + max(self.keep_alive - idle, 0.0)
                out.append((m.served, until))
        return out

    def engines(self) -> list[Engine | EmbedEngine]:
        with self._lock:
            return [m.served.engine for m in self._loaded.values()]

    # Loading and unloading

    def add(self, name: str, model: Model, tokenizer: Tokenizer):
        """A model loaded by the caller (the one loaded at start) joins the loaded ones."""
        self._keep(self._served(name, model, tokenizer), self._estimate(name))

    def _load_soon(self, name: str) -> asyncio.Future:
        """The load of `name` on a thread of its own, shared by the requests awaiting it."""
        if name in self._loading:
            return self._loading[name]
        loop = asyncio.get_running_loop()
        future = self._loading[name] = loop.create_future()

        def finish(error: BaseException | None):
            del self._loading[name]
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
                future.exception()   # retrieved: a load nobody awaits any more is not an asyncio warning

        def work():
            try:
                self._load(name)
                error = None
            except NibbleError as e:
                error = e if isinstance(e, ApiError) else \
                    ApiError(500, f"{name} could not be loaded: {e}", "model", type="server_error")
            except BaseException as e:   # a bug: the route's handler answers 500
                error = e
            loop.call_soon_threadsafe(finish, error)
        threading.Thread(target=work, name=f"nibble load {name}", daemon=True).start()
        return future

    def load_now(self, name: str):
        """Load `name` on this thread (the model -m names, at start), unless it is loaded."""
        self._load(name, "")

    def _load(self, name: str, why: str = " for a request"):
        with self._one_load:
            if name in self._loaded:
                return
            nbytes = self._estimate(name)
            cache = "" if self.encodes(name) else " with its KV cache"
            about = f" (about {gb(nbytes)}{cache})" if nbytes is not None else ""
            self._log(f"loading {name}{why}{about} ...")
            try:
                self._make_room(name, nbytes)
            except ApiError as e:
                self._log(f"not loading {name}: {e}")
                raise
            start = time.monotonic()
            self._keep(self._open(name), nbytes)
            self._log(f"loaded {name} in {time.monotonic() - start:.1f} s")

    def _open(self, name: str) -> Served | Embedding:
        from nibble.quant.open_model import open_model
        from ..loader import as_quantized, load
        o, ref = self.options, self.refs[name]
        if not self.encodes(name):
            loras = o.loras if name == self.default else ()   # -m's model: the adapters are its
            return self._served(name, *load(ref, o.quant, 0, False, o.ctx, background=True, loras=loras))
        source, model_dir = hub.resolve(ref, record=False), as_quantized(ref, open_model(ref), o.quant)
        embedder = Reranker(model_dir, name, source) if ranks(source) else Embedder(model_dir, name)
        engine = EmbedEngine(embedder, parallel=o.parallel, queue=o.queue, threads=o.threads)
        engine.start()
        return Embedding(engine, name, self.created, self._details(name, embedder.encoder.config))

    def _served(self, name: str, model: Model, tokenizer: Tokenizer) -> Served:
        """A model that generates, its engine started."""
        o = self.options
        engine = Engine(model, tokenizer, parallel=o.parallel, queue=o.queue, ctx=o.ctx, kv_type=o.kv_type,
                        threads=o.threads, cache_tokens=o.cache_tokens, kv_disk=o.kv_disk,
                        draft_model=self._draft_model(name, tokenizer))
        engine.start()   # returns once a first pass has run: the kernels are compiled or loaded
        if tokenizer.sampling_note:
            self._log(f"{name}: {tokenizer.sampling_note}")
        return Served(engine, tokenizer, name, self.created, self._details(name, model.config), o.thinking, o.draft)

    def _draft_model(self, name: str, tokenizer: Tokenizer):
        """--draft-model's model for `name`'s engine (its own: an engine's thread runs it), or None:
        none asked, drafts off, or (said in the log) another vocabulary than `name`'s."""
        o = self.options
        if o.draft_model is None or not o.draft:
            return None
        from ..loader import load_draft
        try:
            drafts = load_draft(o.draft_model, o.quant, tokenizer, o.ctx)
        except NibbleError as e:
            if name == self.default:
                raise
            self._log(f"{name}: no draft model: {e}")
            return None
        drafts.model.threads.pin(o.threads)
        return drafts

    def _details(self, name: str, config) -> catalog.Details:
        return as_loaded(catalog.describe(hub.resolve(self.refs[name], record=False)), config.quantization)

    def _keep(self, served: Served | Embedding, nbytes: int | None):
        with self._lock:
            closed = self._closed
            if not closed:
                self._loaded[served.name] = _Loaded(served, nbytes, self._clock())
        if closed:   # Ctrl-C came during the load
            served.engine.close()
            raise ApiError(503, "the server is shutting down", type="server_error", code="server_busy")

    def encodes(self, name: str) -> bool:
        """Whether the model's files say it is an embedding model or a reranker, which an EmbedEngine
        runs (its headers only: no weight is read)."""
        try:
            return catalog.encodes(hub.resolve(self.refs[name], record=False))
        except (NibbleError, OSError):
            return False   # the load says what is wrong

    def _estimate(self, name: str) -> int | None:
        """Bytes the model would take loaded; None where its files do not say (the load will)."""
        o = self.options
        try:
            path = hub.resolve(self.refs[name], record=False)   # served models are on disk: no network
            positions = 0 if self.encodes(name) else positions_for(path, o.parallel, o.ctx, o.cache_tokens)
            return model_bytes(path, o.quant, positions, o.kv_type)
        except (NibbleError, OSError, ValueError, TypeError, AttributeError):
            return None

    def _make_room(self, name: str, nbytes: int | None):
        """Unload the least recently used idle models while there are max_models loaded, or too
        little memory for `nbytes`; a 503 (and nothing unloaded) if even all of them would not do."""
        free = self._available() if nbytes is not None else None
        with self._lock:
            idle = sorted((m for n, m in self._loaded.items() if not self._users[n]), key=lambda m: m.used)
            count, freed, victims = len(self._loaded), 0, []
            for m in idle:
                if count - len(victims) < self.max_models and (free is None or nbytes <= free + freed):
                    break
                victims.append(m)
                freed += m.nbytes or 0
            if count - len(victims) >= self.max_models:
                raise ApiError(503, f"{count} models are loaded (--max-models {self.max_models}) and all have "
                                    f"replies running: try {name} again once one ends",
                               type="server_error", code="server_busy")
            if free is not None and nbytes > free + freed:
                raise ApiError(503, f"{name} needs about {gb(nbytes)} of memory and {gb(free + freed)} is "
                                    "available, with the idle models unloaded: try it once other models' "
                                    "replies end, or start the server with a smaller --ctx-size or --parallel",
                               type="server_error", code="insufficient_memory")
            for m in victims:
                del self._loaded[m.served.name]
        for m in victims:
            self._unload(m, f"to make room for {name}")

    def sweep(self):
        """Unload the models idle for keep_alive or longer (a thread calls this every SWEEP_EVERY s)."""
        if self.keep_alive is None:
            return
        now = self._clock()
        with self._lock:
            gone = [m for n, m in self._loaded.items() if not self._users[n] and now - m.used >= self.keep_alive]
            for m in gone:
                del self._loaded[m.served.name]
        for m in gone:
            self._unload(m, f"idle for {say_duration(self.keep_alive)}")

    def start_sweeping(self):
        def sweeper():
            while not self._stop_sweeping.wait(SWEEP_EVERY):
                self.sweep()
        threading.Thread(target=sweeper, name="nibble keep-alive", daemon=True).start()

    def _unload(self, m: _Loaded, why: str):
        m.served.engine.close()   # idle: its thread ends at once
        self._log(f"unloaded {m.served.name}, {why}")

    def _release(self, name: str):
        with self._lock:
            self._users[name] -= 1
            if name in self._loaded and not self._users[name]:
                self._loaded[name].used = self._clock()

    def drain(self):
        """Ctrl-C: every loaded engine ends its replies at the next step; no more requests or loads."""
        with self._lock:
            self._closed = True
        for engine in self.engines():
            engine.drain()

    def close(self):
        self._stop_sweeping.set()
        with self._lock:
            self._closed = True
            loaded, self._loaded = list(self._loaded.values()), {}
        for m in loaded:
            m.served.engine.close()


def as_loaded(details: catalog.Details, quantization: dict | None) -> catalog.Details:
    """A safetensors model's details with the quantization it runs at (as_quantized's)."""
    if details.format != "safetensors" or not quantization:
        return details
    return replace(details, quantization=f"int{quantization['bits']} g{quantization['group_size']}")


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def servable(start: str, only: list[str] | None = None) -> tuple[dict[str, str], str]:
    """The names a server answers to, each with what loader.load takes, and the name of `start`
    (-m, loaded at start): the models `only` names (--models), else every model in nibble's and
    the Hugging Face cache and every preset, each under the name `nibble ls` prints it by; `start`
    among them (a path outside the caches under its last part). Command-line names only: they may be paths."""
    cached = catalog.list_cached_models()

    made = presets.names()

    def entry(ref: str, required: bool) -> tuple[str, str]:
        if ref in made:
            return ref, ref
        if found := catalog.find(ref, cached):
            return found.ref, found.ref
        if Path(ref).expanduser().exists():
            return Path(ref).expanduser().name, ref
        if required:
            raise NibbleError(f"--models: {ref} is not in nibble's cache or the Hugging Face cache "
                              "(nibble ls lists them; nibble pull fetches one)")
        return ref, ref

    default, start_ref = entry(start, False)
    refs = {default: start_ref}
    if only is None:   # a cached model named as -m's path is: -m's wins
        return refs | {m.ref: m.ref for m in cached if m.ref not in refs} | {p: p for p in made if p not in refs}, default
    for name, ref in (entry(r, True) for r in only):
        if refs.setdefault(name, ref) != ref:
            raise NibbleError(f"--models: two models go by the name {name!r}: {refs[name]} and {ref}")
    return refs, default
