"""The tokenizer rebuilt from GGUF metadata gives exactly llama.cpp's ids.

llama.cpp has two modes: parse_special=True matches CONTROL tokens such as <|im_start|> in the
text; parse_special=False tokenizes their text like any other. The rebuilt tokenizer marks CONTROL
tokens `special`, so `encode_special_tokens = True` gives the second mode.
"""
import hashlib
import json

import gguf
import jinja2
import numpy as np
import pydoc_data.topics
import pytest
import tokenizers

from nibble.formats.gguf import import_gguf
from tests.llamacpp import DATA, SMOLLM2, TOKENIZER
from tests.test_gguf import write_gguf



def encode(tok: tokenizers.Tokenizer, text: str, parse_special: bool) -> list[int]:
    tok.encode_special_tokens = not parse_special
    try:
        return tok.encode(text, add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = False


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return import_gguf(smollm2_gguf).model


def test_synthetic_control_and_user_defined(tmp_path):
    # The vocabulary of tests/test_gguf.py: CONTROL <|im_start|> (1), USER_DEFINED <tool> (3).
    tok = import_gguf(write_gguf(tmp_path / "t.gguf", {})).model.tokenizer
    the, lt = tok.token_to_id("Ġthe"), tok.token_to_id("<")
    assert encode(tok, "<|im_start|> the<tool>", True) == [1, the, 3]
    plain = encode(tok, "<|im_start|> the<tool>", False)
    assert plain[0] == lt and plain[-2:] == [the, 3]     # user-defined tokens always match
    assert tok.decode(plain, skip_special_tokens=False) == "<|im_start|> the<tool>"


def test_add_bos_token(tmp_path):
    meta = {"tokenizer.ggml.add_bos_token": (True, gguf.GGUFValueType.BOOL)}
    md = import_gguf(write_gguf(tmp_path / "bos.gguf", {}, meta=meta)).model
    assert md.tokenizer_config["add_bos_token"]
    assert md.tokenizer.encode(" the").ids == [1, md.tokenizer.token_to_id("Ġthe")]
    assert md.tokenizer.encode(" the", add_special_tokens=False).ids == [md.tokenizer.token_to_id("Ġthe")]


@pytest.mark.slow
def test_awkward_strings(smollm2):
    # llama.cpp's ids for 14 strings (Unicode, emoji, CRLF, code, special tokens), both modes.
    tok = smollm2.tokenizer
    for case in TOKENIZER["strings"]:
        text = case["text"]
        assert encode(tok, text, parse_special=True) == case["ids_parse_special"], text
        assert encode(tok, text, parse_special=False) == case["ids"], text
        assert tok.decode(case["ids_parse_special"], skip_special_tokens=False) == text
        assert tok.decode(case["ids"], skip_special_tokens=False) == text


@pytest.mark.slow
def test_tokenize_reference(smollm2):
    # `tokenize` of smollm2-llamacpp.json: ids and byte-level pieces, and a string with specials.
    ref = SMOLLM2["tokenize"]
    tok = smollm2.tokenizer
    ids = encode(tok, ref["text"], parse_special=True)
    assert ids == ref["ids"]
    assert [tok.id_to_token(i) for i in ids] == ref["pieces"]
    assert encode(tok, ref["special_text"], parse_special=True) == ref["special_ids_parse_special"]
    assert encode(tok, ref["special_text"], parse_special=False) == ref["special_ids_plain"]


@pytest.mark.slow
def test_chat_prompts(smollm2):
    # `greedy` of smollm2-llamacpp.json: the GGUF's chat template rendered, then tokenized.
    models = SMOLLM2["greedy"]["models"]
    template = jinja2.Template(smollm2.tokenizer_config["chat_template"])
    for out in models["SmolLM2-135M-Instruct.F32.gguf"]["outputs"]:
        text = template.render(messages=[{"role": "user", "content": out["prompt"]}],
                               add_generation_prompt=True)
        assert text == out["rendered_prompt"]
        assert smollm2.tokenizer.encode(text).ids == out["prompt_ids"]


@pytest.mark.slow
def test_pydoc_corpus(smollm2):
    # The perplexity corpus of smollm2-llamacpp.json; its ids are pydoc-topics-token-ids.npy.
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ref = TOKENIZER["pydoc_topics"]
    if hashlib.sha256(text.encode()).hexdigest() != ref["sha256_text"]:
        pytest.skip("this Python's pydoc topics differ from the corpus llama.cpp tokenized (3.11.7)")
    expected = np.load(DATA / ref["file"])
    ids = encode(smollm2.tokenizer, text, parse_special=True)
    assert len(ids) == ref["n_tokens"] == 112955
    np.testing.assert_array_equal(np.array(ids, np.int32), expected)
    assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_survives_tokenizer_json(smollm2):
    # hub.py writes the import out as tokenizer.json: the reloaded tokenizer must agree.
    tok = tokenizers.Tokenizer.from_str(smollm2.tokenizer.to_str())
    for case in TOKENIZER["strings"]:
        assert encode(tok, case["text"], parse_special=True) == case["ids_parse_special"]
        assert encode(tok, case["text"], parse_special=False) == case["ids"]
