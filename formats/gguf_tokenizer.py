"""A GGUF file's tokenizer rebuilt as a `tokenizers` Tokenizer that gives llama.cpp's ids.

Two kinds (tokenizer.ggml.model): "gpt2", byte-level BPE split by the regexes llama.cpp picks by
tokenizer.ggml.pre; and "llama", SentencePiece as Llama 2 and Gemma use it. CONTROL tokens are
`special` added tokens, so setting `tokenizer.encode_special_tokens = True` reproduces
llama.cpp's parse_special=False mode, in which their text is tokenized as plain text.
"""
from __future__ import annotations

import json

import tokenizers
from tokenizers import (AddedToken, Regex, decoders, models, normalizers, pre_tokenizers,
                        processors)

from .errors import FormatError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED = 1, 2, 3, 4, 5

# tokenizer.ggml.pre -> the regexes llama-vocab.cpp splits text with, applied one after another.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_TOKENIZERS = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt-2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "llama-bpe": [_LLAMA3],
    "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2],
}
# llama.cpp looks whole pre-tokens up in the vocabulary before merging, and adds BOS by default.
_LLAMA3_STYLE = {"llama3", "llama-v3", "llama-bpe"}


def need(meta: dict, key: str):
    """The metadata value at `key`, or FormatError naming it."""
    if key not in meta:
        raise FormatError(f"GGUF metadata lacks {key}; the file is incomplete or not a model")
    return meta[key]


def gguf_tokenizer(meta: dict) -> tuple[tokenizers.Tokenizer, dict]:
    """The tokenizer llama.cpp builds from this metadata, and its tokenizer_config entries."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _MODELS:
        raise FormatError(f"GGUF tokenizer model {kind!r} is not supported: nibble rebuilds "
                          "byte-level BPE ('gpt2') and SentencePiece ('llama') tokenizers")
    tokens = need(meta, "tokenizer.ggml.tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise FormatError("GGUF vocabulary has duplicate tokens; llama.cpp refuses it too")
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    tok, add_bos = _MODELS[kind](meta, vocab)
    # llama.cpp matches CONTROL, UNKNOWN and USER_DEFINED tokens before the model; only the
    # first two are skipped when special tokens are not parsed, hence `special` for them alone.
    tok.add_tokens([AddedToken(tokens[i], special=types[i] != _USER_DEFINED, normalized=False)
                    for i in range(len(tokens)) if types[i] in (_UNKNOWN, _CONTROL, _USER_DEFINED)])

    config = {"add_bos_token": meta.get("tokenizer.ggml.add_bos_token", add_bos),
              "add_eos_token": meta.get("tokenizer.ggml.add_eos_token", False)}
    for key, id_key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                        ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        i = meta.get(f"tokenizer.ggml.{id_key}")
        if i is not None and i < len(tokens):
            config[key] = tokens[i]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    tok.post_processor = _post_processor(config, tok)
    return tok, config


def _byte_level_bpe(meta: dict, vocab: dict[str, int]) -> tuple[tokenizers.Tokenizer, bool]:
    """GPT-2's byte-level BPE with the pre-tokenizer of tokenizer.ggml.pre, and whether
    llama.cpp adds BOS by default."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise FormatError(f"GGUF pre-tokenizer {pre!r} is not supported; nibble knows "
                          f"{', '.join(_PRE_TOKENIZERS)}")
    merges = [_split_merge(m) for m in need(meta, "tokenizer.ggml.merges")]
    tok = _bpe(vocab, merges, ignore_merges=pre in _LLAMA3_STYLE)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, pre in _LLAMA3_STYLE


def _sentencepiece(meta: dict, vocab: dict[str, int]) -> tuple[tokenizers.Tokenizer, bool]:
    """SentencePiece's BPE as llama.cpp runs it, and True: llama.cpp adds BOS by default.

    llama.cpp writes spaces as U+2581, puts one before the text and after each special token
    (unless tokenizer.ggml.add_space_prefix is false, as in Gemma), and then, starting from
    single characters, merges again and again the adjacent pair that makes the highest-scoring
    token; characters left outside the vocabulary become <0xXX> byte tokens. That is BPE with a
    merge (a, b) for every token ab, ranked by ab's score. (Of two different tokens with equal
    scores, llama.cpp merges the leftmost pair, BPE the first ranked: real vocabularies give
    nearly every token its own score, 15 of Llama 2's 29,612 mergeable ones share one.)
    """
    tokens = list(vocab)   # in id order
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    merges = _merges_by_score(tokens, vocab, need(meta, "tokenizer.ggml.scores"))
    tok = _bpe(vocab, merges, byte_fallback=True,
               unk_token=None if unknown is None else tokens[unknown])
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    # Normalizers run on each stretch of text between added tokens: the prefix goes before each.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE)] * prefix
                                          + [normalizers.Replace(" ", _SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(" ", 1, 0)] * prefix)   # the prefix's space, off the text's start
    return tok, True


def _merges_by_score(tokens: list[str], vocab: dict[str, int],
                     scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scoring token first."""
    ranked = sorted((-scores[i], i, cut) for i, t in enumerate(tokens) for cut in range(1, len(t))
                    if t[:cut] in vocab and t[cut:] in vocab)
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **options) -> tokenizers.Tokenizer:
    """tokenizers' BPE over this vocabulary, or FormatError saying why it refuses them."""
    try:
        return tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, **options))
    except Exception as e:   # tokenizers raises plain Exception: "Token `x` out of vocabulary"
        raise FormatError(f"GGUF tokenizer.ggml.tokens and tokenizer.ggml.merges do not make a "
                          f"BPE tokenizer ({e})") from None


_MODELS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece}
_SPACE = "\u2581"   # SentencePiece's visible space


def _split_merge(merge: str) -> tuple[str, str]:
    """Split a merge "a b" into ("a", "b") as llama.cpp does: at the first space after index 0."""
    i = merge.find(" ", 1)
    if i < 0:
        raise FormatError(f"GGUF tokenizer merge {merge!r} is not two tokens separated by a space")
    return merge[:i], merge[i + 1:]


def _post_processor(config: dict, tok: tokenizers.Tokenizer):
    """Add BOS/EOS on encode(add_special_tokens=True) as llama.cpp's add_bos/add_eos do."""
    before = [config["bos_token"]] if config["add_bos_token"] and "bos_token" in config else []
    after = [config["eos_token"]] if config["add_eos_token"] and "eos_token" in config else []
    if not before and not after:
        return None
    return processors.TemplateProcessing(
        single=" ".join(before + ["$A"] + after),
        pair=" ".join(before + ["$A"] + after + before + ["$B:1"] + after),
        special_tokens=[(t, tok.token_to_id(t)) for t in dict.fromkeys(before + after)])


# Hugging Face's tokenizer.json spellings of the splits of llama.cpp's pre-tokenizers (the
# converter's tokenizers): the pre-tokenizer a byte-level BPE is written under, with _PRE_TOKENIZERS'.
_HF_SPLITS = {
    "llama-bpe": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
}


def gguf_vocab(tok: tokenizers.Tokenizer, tokenizer_config: dict, vocab_size: int) -> dict:
    """The tokenizer.* metadata llama.cpp builds this tokenizer from (the inverse of
    gguf_tokenizer): a byte-level BPE as "gpt2", under the pre-tokenizer whose splits it makes,
    padded with unused tokens to the embedding's `vocab_size` rows, as llama.cpp's converter
    does. FormatError for another kind, or splits no pre-tokenizer of llama.cpp makes."""
    spec = json.loads(tok.to_str())
    model, pre = spec.get("model") or {}, _pre_name(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or pre is None:
        raise FormatError("its tokenizer is not a byte-level BPE split as one of llama.cpp's "
                          f"pre-tokenizers ({', '.join(sorted(_PRE_TOKENIZERS))}); nibble writes those")
    vocab = tok.get_vocab(with_added_tokens=True)
    if len(vocab) > vocab_size:
        raise FormatError(f"its tokenizer has {len(vocab)} tokens, more than the embedding's {vocab_size} rows")
    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [_UNUSED] * vocab_size
    for text, i in vocab.items():
        tokens[i], types[i] = text, _NORMAL
    for added in spec.get("added_tokens", []):
        types[added["id"]] = _CONTROL if added["special"] else _USER_DEFINED
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])],
            "tokenizer.ggml.add_bos_token": bool(tokenizer_config.get("add_bos_token", False)),
            "tokenizer.ggml.add_eos_token": bool(tokenizer_config.get("add_eos_token", False))}
    for key, id_key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                        ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        if isinstance(tokenizer_config.get(key), str) and tokenizer_config[key] in vocab:
            meta[f"tokenizer.ggml.{id_key}"] = vocab[tokenizer_config[key]]
    if isinstance(tokenizer_config.get("chat_template"), str):
        meta["tokenizer.chat_template"] = tokenizer_config["chat_template"]
    return meta


def _pre_name(pre: dict | None) -> str | None:
    """The name llama.cpp gives the splits of a tokenizer.json's pre_tokenizer, or None."""
    pre = pre or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not parts or parts[-1].get("type") != "ByteLevel" or parts[-1].get("add_prefix_space"):
        return None
    *before, byte_level = parts
    if byte_level.get("use_regex", True):   # ByteLevel's own split, GPT-2's regex
        digits = tuple(p.get("type") == "Digits" and p.get("individual_digits") for p in before)
        return {(): "gpt-2", (True,): "smollm"}.get(digits)
    regexes = [p.get("pattern", {}).get("Regex") if p.get("type") == "Split" and p.get("behavior") == "Isolated"
               and not p.get("invert") else None for p in before]
    return next((name for table in (_PRE_TOKENIZERS, _HF_SPLITS) for name, rs in table.items() if rs == regexes),
                None)
