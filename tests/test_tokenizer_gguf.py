"""The tokenizer rebuilt from GGUF metadata gives exactly llama.cpp's ids: byte-level BPE
(SmolLM2's) and SentencePiece (Llama 2's vocabulary, from llama.cpp's own tests).

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

SPM = DATA / "llamacpp-vocab" / "ggml-vocab-llama-spm.gguf"   # Llama 2's SentencePiece vocabulary
SPM_REF = json.loads((DATA / "llamacpp-vocab" / "llama-spm-llamacpp.json").read_text(encoding="utf-8"))


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


# ---- SentencePiece (tokenizer.ggml.model "llama"): llama.cpp's own Llama 2 vocabulary ----

def read_vocab_tests(path):
    """llama.cpp's test-tokenizer-0 cases: strings in .inp split as read_tests() splits them, ids
    in .out (tokenized without BOS, special tokens not parsed)."""
    raw = path.with_name(path.name + ".inp").read_text(encoding="utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    texts = texts[:-1] if texts[-1] == "" else texts   # the file ends with a separator
    ids = [[int(i) for i in line.split()]
           for line in path.with_name(path.name + ".out").read_text(encoding="utf-8").splitlines()]
    assert len(texts) == len(ids) == 46
    return zip(texts, ids)


def spm_variant(path, add_space_prefix: bool):
    """The llama-spm vocabulary file rewritten with tokenizer.ggml.add_space_prefix set (Gemma's
    are false)."""
    fields = gguf.GGUFReader(SPM).fields.values()
    w = gguf.GGUFWriter(str(path), "llama")
    for f in fields:
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            array = f.types[0] == gguf.GGUFValueType.ARRAY
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[1] if array else None)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def spm():
    return import_gguf(SPM).model


def test_sentencepiece_vocab_tests(spm):
    for text, ids in read_vocab_tests(SPM):
        assert encode(spm.tokenizer, text, parse_special=False) == ids, text


def test_sentencepiece_awkward_strings(spm):
    # Leading and repeated spaces, Unicode, digits, byte fallback, special tokens: both modes, and
    # with BOS, which SentencePiece GGUFs add by default.
    assert spm.tokenizer_config["add_bos_token"] and spm.tokenizer_config["bos_token"] == "<s>"
    for tok in (spm.tokenizer, tokenizers.Tokenizer.from_str(spm.tokenizer.to_str())):
        for case in SPM_REF["strings"]:
            text = case["text"]
            assert encode(tok, text, parse_special=False) == case["ids"], text
            assert encode(tok, text, parse_special=True) == case["ids_parse_special"], text
            assert tok.encode(text).ids == case["ids_bos_parse_special"], text
            if "\u2581" not in text:   # SentencePiece writes spaces as U+2581: it cannot tell them apart
                assert tok.decode(case["ids"], skip_special_tokens=False) == text


def test_sentencepiece_without_space_prefix(tmp_path):
    tok = import_gguf(spm_variant(tmp_path / "gemma-style.gguf", False)).model.tokenizer
    for case in SPM_REF["no_space_prefix"]:
        assert encode(tok, case["text"], parse_special=True) == case["ids_parse_special"], case["text"]
        assert tok.decode(case["ids_parse_special"], skip_special_tokens=False) == case["text"]


def test_sentencepiece_chat_prompt(spm):
    # Through nibble's Tokenizer, as a Llama 2 chat prompt is encoded: BOS once, [INST] as text.
    from nibble.runner.text.tokenizer import Tokenizer
    case = next(c for c in SPM_REF["strings"] if c["text"].startswith("[INST]"))
    assert Tokenizer(spm).encode(case["text"]) == case["ids_bos_parse_special"]
    assert Tokenizer(spm).encode("<s>" + case["text"]) == case["ids_bos_parse_special"]
