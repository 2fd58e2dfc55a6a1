"""Embeddings: texts in, one vector each, as sentence-transformers makes them from the model's
files (formats/sentence_transformers.py): tokenized without padding and cut to the model's
length, run through the encoder many texts a pass, pooled, normalized if the model says so."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from nibble.formats.errors import NibbleError
from nibble.formats.model_dir import ModelDir
from nibble.formats.sentence_transformers import Pipeline, embeds, read_pipeline
from .encoder import Encoder

PASS_TOKENS = 8192   # tokens of texts run in one pass: long lists go in several


class Tokenized(NamedTuple):
    ids: list[list[int]]   # each text's, a prompt before it
    skip: int              # the first tokens pooling leaves out (a prompt's, where the model says)
    cut: int               # texts cut to the model's length


class Embedder:
    """An encoder model and its Pipeline."""

    def __init__(self, model_dir: ModelDir, name: str = "the model"):
        if not embeds(model_dir.path, model_dir.config.model_type):
            raise NibbleError(f"{name} is a {model_dir.config.model_type} model, which generates text: nibble "
                              "embeds with embedding models, BERT's (-m all-minilm) or a decoder trained to embed "
                              "with sentence-transformers' files (Qwen3-Embedding)")
        self.encoder = Encoder(model_dir.config, model_dir.tensors)
        self.pipeline: Pipeline = read_pipeline(model_dir.path) if model_dir.path else Pipeline()
        longest = self.encoder.longest
        self.max_length = min(self.pipeline.max_length or longest, longest)
        self.tokenizer = model_dir.tokenizer
        self.tokenizer.no_padding()   # a tokenizer.json may pad every text to a fixed length
        self.tokenizer.enable_truncation(self.max_length)

    @property
    def dimensions(self) -> int:
        return self.encoder.config.hidden_size * len(self.pipeline.pooling)

    def tokenize(self, texts: list[str], prompt: str | None = None) -> Tokenized:
        """Each text's ids, `prompt` (a name in the model's prompts; its default_prompt_name if
        None) before it, cut to max_length."""
        name = prompt if prompt is not None else self.pipeline.default_prompt
        if name is not None and name not in self.pipeline.prompts:
            known = ", ".join(self.pipeline.prompts) or "none"
            raise NibbleError(f"the model has no prompt named {name!r} (its prompts: {known})")
        before = self.pipeline.prompts.get(name, "") if name is not None else ""
        encodings = self.tokenizer.encode_batch([before + t for t in texts])
        skip = 0
        if before and not self.pipeline.include_prompt:   # sentence-transformers' prompt length
            alone = self.tokenizer.encode(before)
            skip = len(alone.ids) - (1 if alone.special_tokens_mask[-1] else 0)
        return Tokenized([e.ids for e in encodings], skip, sum(bool(e.overflowing) for e in encodings))

    def embed(self, texts: list[str], prompt: str | None = None) -> np.ndarray:
        """[len(texts), dimensions] float32."""
        return self.embed_ids(*self.tokenize(texts, prompt)[:2])

    def embed_ids(self, ids: list[list[int]], skip: int | Sequence[int] = 0) -> np.ndarray:
        """The vectors of texts already tokenized (tokenize's ids), pooled from token `skip` on
        (one count for all, or one a text)."""
        skips = np.broadcast_to(skip, len(ids))
        out = np.empty((len(ids), self.dimensions), np.float32)
        for batch in batches([len(i) for i in ids], PASS_TOKENS):
            states = self.encoder.encode([ids[i] for i in batch])
            for i, s in zip(batch, states):
                out[i] = pool(s[min(skips[i], len(s) - 1):], self.pipeline.pooling)
        return _unit(out) if self.pipeline.normalize else out

    def run(self, ids: list[list[int]], skips: Sequence[int]) -> np.ndarray:
        """What an EmbedEngine calls: embed_ids."""
        return self.embed_ids(ids, skips)

    def shorten(self, vectors: np.ndarray, dimensions: int) -> np.ndarray:
        """Each vector's first `dimensions`, of unit length again where the model normalizes; only
        a model trained for it has shorter vectors that mean anything (Pipeline.matryoshka)."""
        if not 0 < dimensions <= self.dimensions:
            raise NibbleError(f"dimensions must be 1 to {self.dimensions} (the model's vectors)")
        if dimensions == self.dimensions:
            return vectors
        if not self.pipeline.matryoshka:
            raise NibbleError(f"this model's vectors have {self.dimensions} dimensions and were not trained to "
                              "be cut short (its model card does not say Matryoshka): ask for all of them")
        short = np.ascontiguousarray(vectors[:, :dimensions])
        return _unit(short) if self.pipeline.normalize else short

    def check_ids(self, ids: list[int], what: str = "the token ids"):
        """NibbleError naming `what` unless each of `ids` is one of the model's tokens."""
        vocab = self.encoder.config.vocab_size
        if not all(0 <= i < vocab for i in ids):
            raise NibbleError(f"{what} must be token ids from 0 to {vocab - 1} (the model's vocabulary)")


def _unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), np.float32(1e-12))


def pool(states: np.ndarray, modes: tuple[str, ...]) -> np.ndarray:
    """One text's token states [n, D] -> its vector, each mode's [D] concatenated in order
    (sentence-transformers' Pooling)."""
    n = len(states)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(states[0])
        elif mode == "max":
            parts.append(states.max(0))
        elif mode == "mean":
            parts.append(states.mean(0))
        elif mode == "mean_sqrt_len":
            parts.append(states.sum(0) / np.sqrt(np.float32(n)))
        elif mode == "weightedmean":   # the i-th token weighs i + 1
            w = np.arange(1, n + 1, dtype=np.float32)
            parts.append(w @ states / w.sum())
        elif mode == "lasttoken":
            parts.append(states[-1])
        else:
            raise NibbleError(f"unknown pooling mode {mode!r}")
    return np.concatenate(parts)


def batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indexes of texts in runs of at most `budget` tokens (a longer text runs alone)."""
    out, run, used = [], [], 0
    for i, n in enumerate(lengths):
        if run and used + n > budget:
            out.append(run)
            run, used = [], 0
        run.append(i)
        used += n
    return out + [run] if run else out
