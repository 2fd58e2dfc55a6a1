"""Streaming detokenization: token ids in, complete text out, one token at a time.

A character can span several tokens (byte-level BPE splits emoji and CJK into bytes), and some
decoders change a token's text depending on what precedes it (SentencePiece drops the leading
space of the first token). So each step decodes a short window of recent ids twice, with and
without the new ones, and emits the difference once it no longer ends in an incomplete character:
the method of Hugging Face's TextStreamer and text-generation-inference.

`tokenizers.decoders.DecodeStream` does the same but cannot flush: a sequence that ends halfway
through a character loses its tail, where `Tokenizer.decode` gives U+FFFD.
"""
from __future__ import annotations

import re

import tokenizers

# What decoding gives for an incomplete UTF-8 sequence: the signal to wait for more tokens.
REPLACEMENT = "\ufffd"
# A character spans at most 4 tokens (4 bytes), so a longer held run is junk bytes, not a character
# in progress; letting it out as U+FFFD bounds the window and keeps each step O(1).
MAX_HELD_TOKENS = 8


def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the
    others for chr(256 + n) in order."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(moved)}


_BYTES = _byte_level()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # SentencePiece's byte fallback


def piece(tokenizer: tokenizers.Tokenizer, token_id: int) -> str | list[int]:
    """One token's text, as llama.cpp's /tokenize gives it: a string, or the token's bytes where
    they are part of a character (a byte-level BPE's, a byte fallback's)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    raw = tokenizer.id_to_token(token_id) or ""
    if REPLACEMENT not in text or REPLACEMENT in raw:
        return text
    byte = _BYTE_TOKEN.fullmatch(raw)
    if byte:
        return [int(byte.group(1), 16)]
    if raw and all(c in _BYTES for c in raw):
        data = bytes(_BYTES[c] for c in raw)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return list(data)
    return text


class StreamDecoder:
    """Turns a stream of token ids into text deltas whose concatenation is `tokenizer.decode(ids)`.

        stream = StreamDecoder(tokenizer)
        text = "".join(stream.add(i) for i in ids) + stream.flush()
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._ids: list[int] = []  # the window: ids already emitted (context), then ids held back
        self._emitted = 0          # how many ids at the front of the window are already emitted

    def add(self, token_id: int) -> str:
        """Append one id; return the newly completed text (often "", never a partial character)."""
        self._ids.append(token_id)
        emitted_text, full_text = self._decode_window()
        complete = len(full_text) > len(emitted_text) and not full_text.endswith(REPLACEMENT)
        if complete or len(self._ids) - self._emitted > MAX_HELD_TOKENS:
            return self._advance(full_text[len(emitted_text):])
        return ""

    def flush(self) -> str:
        """Return whatever is held back (an unfinished character decodes to U+FFFD) and reset."""
        emitted_text, full_text = self._decode_window()
        self._ids, self._emitted = [], 0
        return full_text[len(emitted_text):]

    def _decode_window(self) -> tuple[str, str]:
        """The window's text without and with the held-back ids."""
        decode = self.tokenizer.decode
        emitted = decode(self._ids[:self._emitted], skip_special_tokens=self.skip_special)
        full = decode(self._ids, skip_special_tokens=self.skip_special)
        return emitted, full

    def _advance(self, delta: str) -> str:
        """Mark everything held as emitted; the newly emitted ids become the next window's context."""
        del self._ids[:self._emitted]
        self._emitted = len(self._ids)
        return delta
