"""Text in, ids out: the model's tokenizer, chat template, stop ids and sampling defaults in one place."""
from __future__ import annotations

import re
from collections.abc import Collection
from functools import cached_property

import numpy as np
import tokenizers

from nibble.formats.model_dir import ModelDir
from . import image_ids
from .template import ChatTemplate, build_messages
from .detokenize import StreamDecoder
from ..settings import DRY_SEQUENCE_BREAKERS, model_sampling


def as_text(data: bytes | str, source: str) -> tuple[str, str]:
    """`data` as text, its invalid UTF-8 replaced by U+FFFD (as llama.cpp's tokenizer and ollama's
    JSON encoding do, silently), and a line saying so that names `source` ("" when it was valid).
    A str may hold the bytes of a command-line argument that were not UTF-8, which Python keeps
    as lone surrogates and the tokenizer refuses: they are decoded as bytes from a pipe are."""
    if isinstance(data, str):
        try:
            data = data.encode("utf-8", "surrogateescape")   # argv's undecodable bytes, as they were
        except UnicodeEncodeError:
            data = data.encode("utf-8", "surrogatepass")     # other lone surrogates: invalid UTF-8
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as e:
        return data.decode("utf-8", "replace"), (f"{source} is not valid UTF-8 (from byte {e.start}): "
                                                 "its invalid bytes are read as U+FFFD")


class Tokenizer:
    def __init__(self, model_dir: ModelDir):
        self.tokenizer: tokenizers.Tokenizer = model_dir.tokenizer
        self.config = model_dir.tokenizer_config
        self.vocab_size = model_dir.config.vocab_size   # the model's: may be more ids than the tokenizer's
        self._eos = (model_dir.config.eos_ids, model_dir.generation_config.get("eos_token_id"),
                     self.config.get("eos_token"))
        # The model's sampling defaults (a SamplerSettings: its generation_config.json over nibble's
        # defaults), and a line for the user naming the values of that file it ignored ("" if none).
        self.sampling, self.sampling_note = model_sampling(model_dir.generation_config)
        self.opening = model_dir.conversation   # what every conversation starts with (a preset's)

    @cached_property
    def chat_template(self) -> ChatTemplate:
        return ChatTemplate.from_tokenizer_config(self.config)

    @cached_property
    def tool_template(self) -> ChatTemplate:
        """The template for a conversation with tools: the one named "tool_use" if the model has
        one (Hermes 2 and 3 do), as transformers picks it; else chat_template."""
        if isinstance(self.config.get("chat_template"), list):
            return ChatTemplate.from_tokenizer_config(self.config, "tool_use")
        return self.chat_template

    @cached_property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends a reply: config.json's, generation_config.json's and the eos token's."""
        config_ids, generation_ids, eos_token = self._eos
        ids = set(config_ids)
        ids |= {generation_ids} if isinstance(generation_ids, int) else set(generation_ids or ())
        if isinstance(eos_token, str) and (i := self.tokenizer.token_to_id(eos_token)) is not None:
            ids.add(i)
        return frozenset(ids)

    @cached_property
    def grammar_tokenizer(self):
        """llguidance's view of this vocabulary, for grammars (runner/text/grammar.py): built once, in
        about 0.3 s for 49k tokens. Ids past the tokenizer's own are never allowed."""
        import llguidance
        vocab = max(self.vocab_size, self.tokenizer.get_vocab_size())
        return llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=vocab, eos_token=sorted(self.eos_ids) or None)

    @cached_property
    def sequence_breakers(self) -> np.ndarray:
        """[vocab] bool: the ids whose text holds one of DRY's sequence breakers (runner/generation/sample.py),
        built once, in about 0.3 s for 49k tokens. llama.cpp also breaks where a breaker's characters
        fall in several tokens: none of these can, each being one character."""
        n = self.tokenizer.get_vocab_size()
        pieces = self.tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        breaker = re.compile("|".join(map(re.escape, DRY_SEQUENCE_BREAKERS)))
        mask = np.zeros(max(self.vocab_size, n), dtype=bool)
        mask[:n] = [breaker.search(piece) is not None for piece in pieces]
        return mask

    @property
    def bos_id(self) -> int | None:
        bos = self.config.get("bos_token")
        return self.tokenizer.token_to_id(bos) if isinstance(bos, str) else None

    def encode(self, text: str, add_bos: bool | None = None, images: Collection[str] = ()) -> list[int]:
        """Ids of `text`; special tokens written in it are parsed as such (the chat template
        writes them). A BOS id is prepended when the model asks for one and it is not already there.
        `images`: the digests of the images the prompt brought, whose tags (image_ids.tag) become
        their tokens' ids; any other tag is text."""
        ids = []
        pieces = image_ids.TAG.split(text) if images and image_ids.TAG_OPEN in text else [text]
        for i in range(0, len(pieces), 4):   # text, then a tag's digest, start and count
            ids += self.tokenizer.encode(pieces[i], add_special_tokens=False).ids
            if i + 1 < len(pieces):
                digest, start, count = pieces[i + 1], int(pieces[i + 2]), int(pieces[i + 3])
                ids += (image_ids.image_ids(digest, count, start) if digest in images else
                        self.tokenizer.encode(image_ids.tag(digest, count, start), add_special_tokens=False).ids)
        if add_bos is None:
            add_bos = bool(self.config.get("add_bos_token", False))
        if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def started(self, messages: list[dict]) -> list[dict]:
        """`messages` after what a preset starts every conversation with: its system prompt where
        they bring none (theirs wins), then its messages."""
        if not self.opening:
            return messages
        if messages and messages[0].get("role") == "system":
            return messages[:1] + [m for m in self.opening if m["role"] != "system"] + messages[1:]
        return self.opening + messages

    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Ids of a conversation (and the tools it may call) through the model's chat template,
        ready for the reply."""
        template = self.tool_template if tools else self.chat_template
        return self.encode(template.render(self.started(messages), tools=tools))

    def prompt(self, text: str, system: str | None = None, raw: bool = False) -> list[int]:
        """Ids for a one-shot prompt: raw text, or one user turn through the chat template."""
        return self.encode(text) if raw else self.chat(build_messages(text, system))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decoder(self, skip_special: bool = True) -> StreamDecoder:
        """A streaming decoder; skip_special=False keeps special tokens' text (tool-call markers)."""
        return StreamDecoder(self.tokenizer, skip_special)
