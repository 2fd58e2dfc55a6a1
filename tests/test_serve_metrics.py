"""nibble serve --metrics: GET /metrics in Prometheus' text format, parsed by prometheus-client's
own parser after requests whose usage the replies report."""
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nibble.runner.serve.metrics import api_of
from tests.serving import serving


@pytest.fixture(scope="module")
def server(tiny_dir):
    with serving(tiny_dir, metrics=True) as running:
        yield running


def scrape(server) -> dict:
    status, headers, raw = server.post("/metrics", None, method="GET")
    assert status == 200 and headers["content-type"].startswith("text/plain"), raw
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(raw.decode()) for s in family.samples}


def test_a_scrape_counts_requests_tokens_and_latencies(server):
    before = scrape(server)
    replies = [server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Hi {i}"}],
                                                     max_tokens=5, temperature=0) for i in range(2)]
    status, _, _ = server.post("/v1/chat/completions", {"messages": "nope"})
    assert status == 400
    after = scrape(server)

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)
    assert grew("nibble_requests_total", api="openai_chat", status="200") == 2
    assert grew("nibble_requests_total", api="openai_chat", status="400") == 1
    assert grew("nibble_prompt_tokens_total", model="tiny") == sum(r.usage.prompt_tokens for r in replies)
    assert grew("nibble_generated_tokens_total", model="tiny") == sum(r.usage.completion_tokens for r in replies)
    assert grew("nibble_prompt_cached_tokens_total", model="tiny") == sum(
        r.usage.prompt_tokens_details.cached_tokens for r in replies)
    assert grew("nibble_time_to_first_token_seconds_count", model="tiny") == 2
    assert grew("nibble_prefill_seconds_total", model="tiny") > 0
    assert after[("nibble_models_loaded", ())] == 1
    assert after[("nibble_requests_running", (("model", "tiny"),))] == 0
    blocks = [v for (name, labels), v in after.items() if name == "nibble_kv_blocks"]
    assert len(blocks) == 3 and sum(blocks) == server.engine.pool.blocks


def test_metrics_ask_for_the_key_and_are_off_by_default(server, tiny_dir):
    status, _, raw = server.post("/metrics", None, {"Authorization": "Bearer wrong"}, method="GET")
    assert status == 401 and "API key" in json.loads(raw)["error"]["message"]
    with serving(tiny_dir) as plain:
        status, _, _ = plain.post("/metrics", None, method="GET")
    assert status == 404
