"""llama.cpp's small routes on nibble serve (runner/serve/llamacpp.py): /tokenize, /detokenize,
/apply-template, /props, and OpenAI's GET /v1/models/{id}; each fuzzed like the other routes."""
import json

import pytest
from hypothesis import event, given, settings, strategies as st

from nibble.runner.loader import load
from tests.serving import serving
from tests.tiny import write_tiny_vision


@pytest.fixture(scope="module")
def server(tiny_dir):
    with serving(tiny_dir) as running:
        yield running


def post(server, path: str, body) -> tuple[int, dict]:
    status, _, raw = server.post(path, body)
    return status, json.loads(raw)


def test_tokenize_and_detokenize_round_trip(server, tiny_dir):
    _, tokenizer = load(str(tiny_dir))
    text = "Hello there, how are you?"
    status, out = post(server, "/tokenize", {"content": text})
    assert status == 200 and out["tokens"] == tokenizer.encode(text, add_bos=False)
    status, pieces = post(server, "/tokenize", {"content": text, "with_pieces": True})
    assert status == 200 and [p["id"] for p in pieces["tokens"]] == out["tokens"]
    assert "".join(p["piece"] for p in pieces["tokens"]) == text
    status, back = post(server, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back == {"content": text}
    if tokenizer.bos_id is not None:
        assert post(server, "/tokenize", {"content": text, "add_special": True})[1]["tokens"][0] == tokenizer.bos_id


def test_apply_template_is_the_chat_prompt(server, tiny_dir):
    _, tokenizer = load(str(tiny_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    status, out = post(server, "/apply-template", {"messages": messages})
    assert status == 200 and out["prompt"] == tokenizer.chat_template.render(messages)


def test_props_and_one_model(server):
    status, _, raw = server.post("/props", None, method="GET")
    props = json.loads(raw)
    assert status == 200 and props["model_alias"] == "tiny" and props["total_slots"] == 4
    assert props["default_generation_settings"]["n_ctx"] > 0 and props["modalities"] == {"vision": False, "audio": False}
    assert isinstance(props["chat_template"], str)
    status, _, raw = server.post("/v1/models/tiny", None, method="GET")
    assert status == 200 and json.loads(raw)["id"] == "tiny" and json.loads(raw)["object"] == "model"
    assert server.client.models.retrieve("tiny").id == "tiny"   # the official client's call
    status, _, raw = server.post("/v1/models/nope", None, method="GET")
    assert status == 404 and "not served here" in json.loads(raw)["error"]["message"]


def test_bad_bodies_are_400s_naming_the_field(server):
    for path, body, field in [("/tokenize", {}, "content"), ("/tokenize", {"content": 3}, "content"),
                              ("/detokenize", {"tokens": "x"}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens"), ("/apply-template", {}, "messages"),
                              ("/tokenize", {"content": "x", "model": "nope"}, "model")]:
        status, out = post(server, path, body)
        assert 400 <= status < 500 and field in out["error"]["message"], (path, body, out)
        assert "\n" not in out["error"]["message"]


def test_props_says_a_vision_model_reads_images(tmp_path):
    with serving(write_tiny_vision(tmp_path / "gemma3")) as running:
        status, _, raw = running.post("/props", None, method="GET")
    assert status == 200 and json.loads(raw)["modalities"]["vision"] is True


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
KEYS = ["content", "tokens", "messages", "with_pieces", "add_special", "model"]


@pytest.mark.fuzz
@settings(max_examples=60, deadline=None)
@given(body=st.dictionaries(st.sampled_from(KEYS), JSON, max_size=4),
       path=st.sampled_from(["/tokenize", "/detokenize", "/apply-template"]))
def test_fuzz_each_route_answers_or_says_why_not(server, body, path):
    status, out = post(server, path, body)
    if status != 200:
        assert 400 <= status < 500, (status, out)
        assert isinstance(out["error"]["message"], str) and "\n" not in out["error"]["message"]
    event(str(status))
