"""LoRA adapters served (runner/generation/engine.py, runner/serve/llamacpp.py): each request at its
own scales of the adapters loaded, requests with different adapters in one pass, the prefix cache
keyed by the adapters too, and llama.cpp's `lora` field and GET/POST /lora-adapters."""
import dataclasses
import json

import numpy as np
import pytest
from hypothesis import event, example, given, settings, strategies as st

from nibble.formats.lora import read_lora
from nibble.formats.model_dir import write_model_dir
from nibble.runner.generation.engine import Engine
from nibble.runner.loader import from_model_dir
from nibble.runner.serve.api import parse_completion
from nibble.runner.serve.models import EngineOptions
from tests.serving import JSON, read_or_400, serving
from tests.test_engine import GREEDY, Collector, submit
from tests.test_lora import LORA, base
from tests.tiny import TEXT, byte_level_tokenizer

SCALES = [(1.0, 0.0), (0.0, 0.0), (0.0, 0.5), (1.0, 0.5)]


def served_base():
    """The adapters' base with a tokenizer of no merges (its 128 ids: plain ASCII text stays within them)."""
    return dataclasses.replace(base(), tokenizer=byte_level_tokenizer(TEXT, vocab_size=128))


def adapters(r4: float = 1.0, rs: float = 0.0):
    return [read_lora(LORA / "llama3-r4", r4), read_lora(LORA / "llama3-r8-rslora", rs)]


def greedy(model, tok, ids, n, scales) -> list[int]:
    """The reply, a token at a time through Model.forward at `scales`: what the engine must give."""
    cache, out = model.new_cache(), []
    logits = model.forward(ids, cache, adapters=np.float32(scales))
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model.forward([out[-1]], cache, adapters=np.float32(scales))
    return out


@pytest.fixture(scope="module")
def lora_model():
    model, tok = from_model_dir(served_base(), adapters())
    tok.eos_ids = frozenset()   # the random model would stop at random: let max_tokens decide
    return model, tok


def test_requests_with_different_adapters_share_passes_and_each_gets_its_own_reply(lora_model):
    model, tok = lora_model
    prompt = tok.encode("Thequickbrownfoxjumpsoverthelazydog", True)
    want = [greedy(model, tok, prompt, 10, s) for s in SCALES]
    assert len({tuple(w) for w in want}) == len(SCALES)   # each adapter changes the reply
    engine = Engine(model, tok, parallel=len(SCALES), ctx=128, prefill_chunk=64)
    passes = []
    run = model.forward_batch
    model.forward_batch = lambda *a, **k: passes.append(len(np.unique(a[1].seq))) or run(*a, **k)
    try:   # all four admitted at the first step: a prompt a step, then they decode together
        replies = [submit(engine, prompt, max_tokens=10, adapters=s) for s in SCALES]
        engine.start()
        assert [[t for e in c.all() for t in e.tokens] for c in replies] == want
    finally:
        engine.close()
        del model.forward_batch
    assert max(passes) == len(SCALES)   # all four decoded in one pass


def test_the_prefix_cache_keys_blocks_by_the_adapters(lora_model):
    model, tok = lora_model
    prompt = tok.encode("Thequickbrownfoxjumpsoverthelazydog." * 2, True)
    engine = Engine(model, tok, parallel=1, ctx=128, cache_tokens=1024)   # room for every prompt
    engine.start()
    try:
        cached = lambda scales: submit(engine, prompt, max_tokens=2, adapters=scales).last().usage.cached_tokens
        assert cached((1.0, 0.0)) == 0
        assert cached((0.0, 0.5)) == 0                   # another adapter: the keys and values differ
        assert cached((1.0, 0.0)) == len(prompt) // 16 * 16 > 0
        assert cached((0.0, 0.0)) == 0                   # none: the base's blocks, of which there are none yet
        assert cached(None) == len(prompt) // 16 * 16   # the model's own scales (1, 0): the first's
    finally:
        engine.close()


def test_llamacpps_lora_field_and_lora_adapters_route(tmp_path):
    folder = write_model_dir(served_base(), tmp_path / "base")
    options = EngineOptions(parallel=2, ctx=128, loras=tuple(adapters()))
    body = {"prompt": "Thequickbrownfox", "max_tokens": 6, "temperature": 0}
    with serving(folder, options=options) as server:
        status, _, raw = server.post("/lora-adapters", None, method="GET")
        listed = [dict(a, path=a["path"].rsplit("/", 1)[-1]) for a in json.loads(raw)]
        assert status == 200 and listed == [{"id": 0, "path": "llama3-r4", "scale": 1.0},
                                            {"id": 1, "path": "llama3-r8-rslora", "scale": 0.0}]
        text = lambda **kw: server.client.completions.create(model="tiny", prompt=body["prompt"], max_tokens=6,
                                                              temperature=0, extra_body=kw).choices[0].text
        default, named = text(), text(lora=[{"id": 0, "scale": 1.0}])
        rs_only = text(lora=[{"id": 1, "scale": 0.5}])
        assert default == named != rs_only
        assert server.post("/lora-adapters", json.dumps([{"id": 1, "scale": 0.5}]).encode())[0] == 200   # r4 off
        assert text() == rs_only
        assert [a["scale"] for a in json.loads(server.post("/lora-adapters", None, method="GET")[2])] == [0.0, 0.5]
        assert text(lora=[]) == rs_only                  # an empty list: the server's scales, as llama.cpp's
        for bad, words in ([{"lora": {"id": 0}}, "lora must be a list"],
                           [{"lora": [{"id": 2, "scale": 1}]}, "lora: no adapter has id 2; GET /lora-adapters lists the 2"],
                           [{"lora": [{"id": 0, "scale": "x"}]}, "lora[0].scale must be a number from -100 to 100"],
                           [{"lora": [{"id": 0, "scale": 1e30}]}, "lora[0].scale must be a number from -100 to 100"],
                           [{"lora": [{"id": -1, "scale": 1}]}, "lora[0].id must be an integer of at least 0"]):
            status, _, raw = server.post("/v1/completions", body | bad)
            assert status == 400 and words in raw.decode(), raw
        for bad, words in ([{"id": 0}], "is missing"), ({"id": 0, "scale": 1}, "must be a list"), \
                          ([{"id": 5, "scale": 1}], "no adapter has id 5"):
            status, _, raw = server.post("/lora-adapters", json.dumps(bad).encode())
            assert status == 400 and words in raw.decode(), raw


def test_a_model_without_adapters_refuses_a_lora_field(tmp_path):
    folder = write_model_dir(served_base(), tmp_path / "base")
    with serving(folder, options=EngineOptions(parallel=1, ctx=128)) as server:
        status, _, raw = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "lora": [{"id": 0, "scale": 1}]})
        assert status == 400 and "tiny runs no LoRA adapters" in raw.decode()
        assert server.post("/lora-adapters", None, method="GET")[2] == b"[]"


# ---- bodies ----

@given(lora=JSON)
@example(lora=[{"id": 0, "scale": 1e308}])
def test_fuzz_a_lora_field_is_read_or_a_400_naming_it(lora):
    body = read_or_400(parse_completion, {"prompt": "Hi", "lora": lora})
    assert body is None or all(isinstance(i, int) and i >= 0 and np.isfinite(s) for i, s in body.options.lora)


@pytest.mark.fuzz
@settings(max_examples=40, deadline=None)
@given(lora=JSON | st.lists(st.fixed_dictionaries({"id": st.integers(-1, 3), "scale": st.floats(-4, 4)}), max_size=3),
       path=st.sampled_from(["/lora-adapters", "/v1/completions"]))
@example(lora=[{"id": 0, "scale": 1e30}], path="/v1/completions")
@example(lora=[{"id": 0, "scale": 100}, {"id": 1, "scale": -100}], path="/v1/completions")
def test_fuzz_the_routes_answer_or_say_why_not(lora_server, lora, path):
    body = lora if path == "/lora-adapters" else {"prompt": "Thequick", "max_tokens": 2, "lora": lora}
    status, _, raw = lora_server.post(path, json.dumps(body).encode())
    if status != 200:
        assert 400 <= status < 500 and isinstance(json.loads(raw)["error"]["message"], str), (status, raw)
    event(str(status))


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    folder = write_model_dir(served_base(), tmp_path_factory.mktemp("lora") / "base")
    with serving(folder, options=EngineOptions(parallel=2, ctx=128, loras=tuple(adapters()))) as server:
        yield server
