"""Fill-in-the-middle (runner/text/fim.py): a coder model's FIM tokens found by name, the prompt
llama.cpp's /infill makes (its repo-level layout and its cuts), and the routes that run it:
llama.cpp's POST /infill, whole and streamed, and /v1/completions with a `suffix`."""
import dataclasses
import json

import pytest
from hypothesis import event, given, settings, strategies as st

from nibble.formats.model_dir import write_model_dir
from nibble.runner.kv.cache import BLOCK
from nibble.runner.text.fim import BATCH, SNIPPET, fim_tokens, infill_ids
from tests.serving import serving, with_context
from tests.tiny import FIM, tiny_coder_dir, tiny_tokenizer


@pytest.fixture(scope="module")
def coder_dir(tmp_path_factory):
    """With the server's context (llama.cpp's layout gives other files' chunks what a context
    leaves past a batch of 2048: none in the tiny model's own 256)."""
    return write_model_dir(with_context(tiny_coder_dir()), tmp_path_factory.mktemp("tiny") / "coder")


@pytest.fixture(scope="module")
def server(coder_dir):
    with serving(coder_dir) as running:
        yield running


def encoder():
    tok = tiny_tokenizer()
    tok.add_special_tokens(FIM)
    return tok, lambda text: tok.encode(text, add_special_tokens=False).ids


def test_the_fim_tokens_are_found_by_name():
    tok, _ = encoder()
    fim = fim_tokens(tok)
    ids = [tok.token_to_id(t) for t in FIM]
    assert (fim.pre, fim.suf, fim.mid, fim.rep, fim.sep) == (ids[0], ids[1], ids[2], ids[4], ids[5])
    assert set(fim.ends) == {"<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
    assert fim_tokens(tiny_tokenizer()) is None   # a model without them
    starcoder = tiny_tokenizer()
    starcoder.add_special_tokens(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"])
    assert fim_tokens(starcoder).pre == starcoder.token_to_id("<fim_prefix>") and fim_tokens(starcoder).sep is None


def test_the_prompt_is_llama_cpp_s_repo_level_layout():
    tok, enc = encoder()
    fim = fim_tokens(tok)
    ids = infill_ids(enc, fim, "def f(x):\n    ", "\n\nprint(f(2))", [("util.py", "def g(): pass\n")], "ret",
                     ctx=4096, max_tokens=64, bos=None)
    want = ([fim.rep, *enc("myproject\n"), fim.sep, *enc("util.py\n"), *enc("def g(): pass\n"), fim.sep,
             *enc("filename\n"), fim.pre, *enc("def f(x):\n    "), *enc("ret"), fim.suf, *enc("\n\nprint(f(2))"),
             fim.mid])
    assert ids == want


def test_the_cuts_keep_the_prefix_s_end_the_suffix_s_start_and_the_latest_chunks():
    tok, enc = encoder()
    fim = fim_tokens(tok)
    prefix, suffix = "ab " * 3000, "cd " * 3000
    ids = infill_ids(enc, fim, prefix, suffix, [("a", "x " * 500)], "", ctx=4096, max_tokens=100, bos=7)
    pre, suf, mid = ids.index(fim.pre), ids.index(fim.suf), ids.index(fim.mid)
    assert ids[pre - 1] == 7 and ids[pre + 1:suf] == enc(prefix)[-3 * (BATCH // 4):]
    assert ids[suf + 1:mid] == enc(suffix)[:BATCH // 4 - 2] and mid == len(ids) - 1
    chunks = ids[:pre - 1]   # the context less a batch and twice the reply: 4096 - 2048 - 200
    assert len(chunks) == min(4096 - BATCH - 200, len(chunks)) and chunks[-len(enc("filename\n")):] == enc("filename\n")
    no_sep = dataclasses.replace(fim, sep=None, rep=None)
    ids = infill_ids(enc, no_sep, "a", "b", [("n", "t")], "", ctx=4096, max_tokens=None, bos=None)
    assert ids[:len(enc(SNIPPET))] == enc(SNIPPET)


def test_infill_whole_and_streamed(server):
    other = "".join(f"x{i} = {i}\n" for i in range(20))   # a file of several KV blocks
    body = {"input_prefix": "def f(x):\n    ", "input_suffix": "\n", "input_extra": [{"filename": "a.py", "text": other}],
            "n_predict": 6, "temperature": 0}
    status, _, raw = server.post("/infill", body)
    whole = json.loads(raw)
    assert status == 200 and whole["stop"] is True and whole["tokens_predicted"] <= 6
    assert whole["stop_type"] in ("limit", "eos", "word") and whole["timings"]["predicted_n"] == whole["tokens_predicted"]
    chunks = [json.loads(line[len("data: "):]) for line in server.post("/infill", body | {"stream": True})[2].decode().split("\n\n")
              if line]
    assert chunks[-1]["stop"] is True and "".join(c["content"] for c in chunks) == whole["content"]
    # a keystroke later: the same file with one character more finds its prefix in the KV cache
    again = json.loads(server.post("/infill", body | {"input_prefix": body["input_prefix"] + "r"})[2])
    assert again["tokens_cached"] > 0 and again["timings"]["prompt_n"] < again["tokens_evaluated"]


def test_llama_vscodes_requests(server):
    """llama.vscode's two bodies as its src/llama-server.ts builds them: the file's chunks read
    ahead (n_predict 0: nothing said, the prompt cached), then a completion that finds them cached."""
    chunks = [{"text": "".join(f"y{i} = {i}\n" for i in range(12)), "time": 1732900000, "filename": "b.py"}]
    ahead = {"input_prefix": "", "input_suffix": "", "input_extra": chunks, "prompt": "", "n_predict": 0,
             "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1}
    status, _, raw = server.post("/infill", ahead)
    read = json.loads(raw)
    assert status == 200 and read["content"] == "" and read["tokens_predicted"] == 0 and read["stop_type"] == "limit"
    completion = {"input_prefix": "def g(y):\n    ", "input_suffix": "\n", "input_extra": chunks, "prompt": "re",
                  "n_predict": 8, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
                  "cache_prompt": True, "n_indent": 4, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000}
    status, _, raw = server.post("/infill", completion)
    done = json.loads(raw)
    assert status == 200 and isinstance(done["content"], str) and 1 <= done["tokens_predicted"] <= 8
    # the chunks read ahead, to the KV block their FIM tokens end in
    assert done["tokens_cached"] >= (read["tokens_evaluated"] - 4) // BLOCK * BLOCK > 0


def test_completions_with_a_suffix_fill_the_middle(server):
    r = server.client.completions.create(model="tiny", prompt="def f(x):\n    ", suffix="\n", max_tokens=5, temperature=0)
    direct = json.loads(server.post("/infill", {"input_prefix": "def f(x):\n    ", "input_suffix": "\n", "n_predict": 5,
                                                "temperature": 0})[2])
    assert r.choices[0].text == direct["content"]


def test_a_model_without_fim_tokens_is_one_400(tiny_dir):
    with serving(tiny_dir) as plain:
        status, _, raw = plain.post("/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert status == 400 and "no fill-in-the-middle tokens" in json.loads(raw)["error"]["message"]
        status, _, raw = plain.post("/v1/completions", {"prompt": "a", "suffix": "b"})
        assert status == 400 and json.loads(raw)["error"]["param"] == "suffix"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=10)


@pytest.mark.fuzz
@settings(max_examples=50, deadline=None)
@given(body=st.fixed_dictionaries({}, optional={k: JSON for k in ("input_prefix", "input_suffix", "input_extra", "prompt",
                                                                  "n_predict", "stream", "stop", "temperature")}))
def test_fuzz_infill_answers_or_says_why_not(server, body):
    n = body.get("n_predict")
    if isinstance(n, int) and not isinstance(n, bool) and n >= -1:
        body["n_predict"] = 4 if n == -1 else min(n, 4)   # a reply that ends soon; below -1 stays (a 400)
    elif "n_predict" not in body:
        body["n_predict"] = 4
    status, _, raw = server.post("/infill", body)
    if status != 200:
        assert 400 <= status < 500, (status, raw)
        assert "\n" not in json.loads(raw)["error"]["message"]
    event(str(status))
