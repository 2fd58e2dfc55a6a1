"""`GET /metrics` in Prometheus' text format (prometheus-client), on with `nibble serve --metrics`.

Counted as requests end: requests by API and HTTP status; for each model, its replies' tokens (the
prompt's, those found in the KV cache and of them those read from disk, those generated), the
time from a request's submission to its first token and from there to its last (counters, whose
rates are the prefill and decode speeds, and histograms of the time to the first token and per
token after it). Read at each scrape: the models loaded, each one's replies running and waiting,
and its KV blocks held by replies, kept as cache, and free.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import Response

from ..embedding.engine import EmbedEngine
from ..generation.decoding import Usage

# a request's path -> its API, the first prefix that matches
APIS = [("/v1/chat/completions", "openai_chat"), ("/v1/completions", "openai_completions"),
        ("/v1/responses", "openai_responses"), ("/v1/embeddings", "openai_embeddings"), ("/v1/messages", "anthropic"),
        ("/v1/models", "openai_models"), ("/api/", "ollama"), ("/metrics", "metrics"), ("/health", "health"),
        ("/v1/rerank", "rerank"), ("/v2/rerank", "rerank"), ("/rerank", "rerank")]
LATENCY = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)            # seconds to a first token
PER_TOKEN = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)             # seconds a token after it


def api_of(path: str) -> str:
    return next((api for prefix, api in APIS if path.startswith(prefix)), "llamacpp")


class Metrics:
    """One server's metrics over its `models` (serve.models.Models), in a registry of their own."""

    def __init__(self, models):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("nibble_requests", "HTTP requests answered, by API and status", ["api", "status"],
                                registry=r)
        tokens = lambda name, what: Counter(name, what, ["model"], registry=r)
        self.prompt = tokens("nibble_prompt_tokens", "prompt tokens of the replies that ended")
        self.cached = tokens("nibble_prompt_cached_tokens", "of those, found in the KV cache rather than prefilled")
        self.disk = tokens("nibble_prompt_disk_tokens", "of those, read back from the KV cache's disk tier")
        self.generated = tokens("nibble_generated_tokens", "tokens the replies generated")
        self.prefill_seconds = tokens("nibble_prefill_seconds", "seconds from submission to a reply's first token")
        self.decode_seconds = tokens("nibble_decode_seconds", "seconds from a reply's first token to its last")
        self.first_token = Histogram("nibble_time_to_first_token_seconds", "time to a reply's first token",
                                     ["model"], buckets=LATENCY, registry=r)
        self.per_token = Histogram("nibble_time_per_output_token_seconds", "time a token after the first",
                                   ["model"], buckets=PER_TOKEN, registry=r)
        r.register(_Live(models))

    def answered(self, path: str, status: int):
        self.requests.labels(api_of(path), str(status)).inc()

    def reply(self, model: str, usage: Usage, submitted: float, first: float | None, ended: float):
        """A reply that ended: its usage, and when it was submitted, gave its first token (None:
        none) and ended (time.monotonic())."""
        self.prompt.labels(model).inc(usage.prompt_tokens)
        self.cached.labels(model).inc(usage.cached_tokens)
        self.disk.labels(model).inc(usage.disk_tokens)
        self.generated.labels(model).inc(usage.completion_tokens)
        if first is None:
            return
        self.prefill_seconds.labels(model).inc(first - submitted)
        self.first_token.labels(model).observe(first - submitted)
        self.decode_seconds.labels(model).inc(ended - first)
        if usage.completion_tokens > 1:
            self.per_token.labels(model).observe((ended - first) / (usage.completion_tokens - 1))

    async def route(self, models, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _Live:
    """What a scrape reads from the models as they are."""

    def __init__(self, models):
        self.models = models

    def collect(self):
        loaded = self.models.loaded()
        yield GaugeMetricFamily("nibble_models_loaded", "models loaded", value=len(loaded))
        running = GaugeMetricFamily("nibble_requests_running", "replies (or embedding batches) running", labels=["model"])
        waiting = GaugeMetricFamily("nibble_requests_waiting", "requests queued for a free slot", labels=["model"])
        blocks = GaugeMetricFamily("nibble_kv_blocks", "KV blocks of 16 positions: held by replies, kept as cache, "
                                   "free", labels=["model", "state"])
        for served, _ in loaded:
            engine = served.engine
            running.add_metric([served.name], engine.running)
            waiting.add_metric([served.name], engine.waiting)
            if not isinstance(engine, EmbedEngine):
                pool = engine.pool
                free, cached = len(pool.free), len(pool.cached)
                for state, n in (("used", pool.blocks - free - cached), ("cached", cached), ("free", free)):
                    blocks.add_metric([served.name, state], n)
        yield from (running, waiting, blocks)
