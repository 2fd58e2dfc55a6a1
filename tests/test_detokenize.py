"""Streaming detokenization against whole-sequence `Tokenizer.decode` on a byte-level BPE."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nibble.runner.text.detokenize import MAX_HELD_TOKENS, StreamDecoder, piece

CORPUS = ["Hello world, café naïve résumé. 東京は日本の首都です。 I ❤️ emoji 🎉🚀👍🏽 and 中文 text.",
          "Zoë déjà vu; Ελληνικά, русский, עברית, हिन्दी."] * 20
TEXTS = ["Zoë 🎉🚀 東京 café 👍🏽", "naïve 中文字符 🇫🇷 ok", "plain ascii only", "∑ x² ≤ ∞ — done…",
         "русский и हिन्दी"]
SPECIAL = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE (SmolLM2's kind) so small that multi-byte characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def stream(tokenizer, ids, **kwargs):
    decoder = StreamDecoder(tokenizer, **kwargs)
    deltas = [decoder.add(i) for i in ids]
    return deltas, decoder.flush()


def test_characters_do_span_tokens(tokenizer):
    """The fixture really splits characters, or the other tests prove nothing."""
    ids = tokenizer.encode("🎉").ids
    assert len(ids) > 1
    assert tokenizer.decode(ids[:1]).endswith("\ufffd")


@pytest.mark.parametrize("text", TEXTS)
def test_concatenation_equals_decode(tokenizer, text):
    ids = tokenizer.encode(text).ids
    deltas, tail = stream(tokenizer, ids)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text
    assert tail == ""
    assert not any("\ufffd" in d for d in deltas)


def test_text_comes_out_as_soon_as_characters_complete(tokenizer):
    ids = tokenizer.encode("ab 🎉").ids
    deltas, _ = stream(tokenizer, ids)
    assert deltas[-1] == "🎉" and all(d == "" for d in deltas[-len(tokenizer.encode("🎉").ids):-1])


def test_special_tokens(tokenizer):
    ids = tokenizer.encode(f"café{SPECIAL} 🎉").ids
    assert tokenizer.token_to_id(SPECIAL) in ids
    for skip in (True, False):
        deltas, tail = stream(tokenizer, ids, skip_special=skip)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
    assert SPECIAL not in "".join(stream(tokenizer, ids)[0])


def test_flush_returns_an_unfinished_character_as_decode_does(tokenizer):
    ids = tokenizer.encode("ok 🎉").ids[:-1]
    deltas, tail = stream(tokenizer, ids)
    assert "".join(deltas) == "ok "
    assert "".join(deltas) + tail == tokenizer.decode(ids)
    assert tail.endswith("\ufffd")


def test_window_stays_small(tokenizer):
    """Each step decodes only recent ids, so a long stream costs O(1) per token."""
    ids = tokenizer.encode(" ".join(TEXTS) * 50).ids
    decoder = StreamDecoder(tokenizer)
    out = []
    for i in ids:
        out.append(decoder.add(i))
        assert len(decoder._ids) <= 2 * MAX_HELD_TOKENS
    assert "".join(out) + decoder.flush() == tokenizer.decode(ids)


def test_junk_bytes_are_not_held_forever(tokenizer):
    """Bytes that never complete a character are let out as U+FFFD rather than held without end."""
    lone_bytes = [i for i in range(tokenizer.get_vocab_size())
                  if len(tokenizer.id_to_token(i)) == 1 and tokenizer.decode([i]) == "\ufffd"]
    junk = (lone_bytes * 3)[:3 * MAX_HELD_TOKENS]
    deltas, tail = stream(tokenizer, junk)
    assert sum(d != "" for d in deltas) >= 2
    assert "".join(deltas) + tail == "\ufffd" * len(junk)


def test_sentencepiece_spaces_survive():
    """Metaspace drops a window's leading space; decoding with the previous ids as context keeps it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["Hello world, again and again"] * 10, trainers.BpeTrainer(vocab_size=60))
    ids = tok.encode("Hello world again").ids
    assert tok.decode(ids[-1:]) == "again"  # alone, the space is gone
    deltas, tail = stream(tok, ids)
    assert deltas[-1] == " again"
    assert "".join(deltas) + tail == tok.decode(ids) == "Hello world again"


def _bytes(p) -> bytes:
    return p.encode() if isinstance(p, str) else bytes(p)


@pytest.mark.parametrize("text", ["naïve 🙂 日本", "plain words"])
def test_a_tokens_piece_is_its_text_or_its_bytes(tokenizer, text):
    """As llama.cpp's /tokenize gives pieces: text where a token holds whole characters, the
    token's bytes where it holds part of one; all of them together spell the text."""
    pieces = [piece(tokenizer, i) for i in tokenizer.encode(text).ids]
    assert b"".join(map(_bytes, pieces)) == text.encode()
    assert any(isinstance(p, list) for p in pieces) == (text != "plain words")
    for p in pieces:
        if isinstance(p, list):   # bytes only where they are no text by themselves
            with pytest.raises(UnicodeDecodeError):
                bytes(p).decode("utf-8")


def test_a_byte_fallback_tokens_piece_is_its_byte():
    """SentencePiece's <0xE2> tokens (Llama 2's vocabulary from its GGUF)."""
    from nibble.formats.gguf import import_gguf
    from tests.test_tokenizer_gguf import SPM
    tok = import_gguf(SPM).model.tokenizer
    ids = tok.encode("🙂", add_special_tokens=False).ids
    pieces = [piece(tok, i) for i in ids]
    assert b"".join(map(_bytes, pieces)).strip() == "🙂".encode() and any(isinstance(p, list) for p in pieces)
