"""Reranking: a query and documents in, a relevance score each out, as sentence-transformers'
CrossEncoder gives them (formats/cross_encoder.py says the kinds). Each (query, document) pair is
one text the encoder reads whole, every pair of a request in one pass; a head turns a pair's last
states into its logit, the model's activation into its score."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from nibble.formats.cross_encoder import Scoring, max_length, ranks, read_scoring
from nibble.formats.errors import NibbleError
from nibble.formats.model_dir import ModelDir
from ..kernels import prefill
from ..model import TensorGetter
from .embed import PASS_TOKENS, batches
from .encoder import Encoder

YES_NO_LENGTH = 8192   # tokens a yes/no reranker's pair is cut to, as Qwen3-Reranker's card cuts it


def not_a_reranker(name: str) -> NibbleError:
    return NibbleError(f"{name} is not a reranker: nibble reranks with cross-encoders (BERT's or XLM-RoBERTa's "
                       "...ForSequenceClassification, ms-marco-MiniLM's or bge-reranker's) and Qwen3-Reranker")


class Pairs(NamedTuple):
    ids: list[list[int]]     # each pair's, as the model reads it
    types: list[list[int]]   # their token types (the document's are 1 for BERT)
    cut: int                 # pairs cut to the model's length


class Reranker:
    """A cross-encoder model, its head and its Scoring."""

    def __init__(self, model_dir: ModelDir, name: str = "the model", source: Path | None = None):
        """`source`: the files the model came from, if `model_dir` is a copy of them (quantized),
        which says how it scores (a GGUF file's copy says nothing of it)."""
        source = source or model_dir.path
        if not ranks(source):
            raise not_a_reranker(name)
        self.scoring: Scoring = read_scoring(source)
        c = model_dir.config
        self.encoder = Encoder(c, model_dir.tensors)
        self.tokenizer = model_dir.tokenizer
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        longest = self.encoder.longest
        if self.scoring.prompt:
            self.max_length = min(YES_NO_LENGTH, longest)
            p = self.scoring.prompt
            self.prefix = self.tokenizer.encode(p.prefix, add_special_tokens=False).ids
            self.suffix = self.tokenizer.encode(p.suffix, add_special_tokens=False).ids
            if len(self.prefix) + len(self.suffix) >= self.max_length:
                raise NibbleError(f"{name}'s prompt takes {len(self.prefix) + len(self.suffix)} of its "
                                  f"{self.max_length} tokens")
        else:
            self.max_length = min(max_length(model_dir.tokenizer_config) or longest, longest)
            self.tokenizer.enable_truncation(self.max_length, strategy="longest_first")
        self.head = self._head(TensorGetter(model_dir.tensors, c.quantization), c, name)

    def _head(self, get: TensorGetter, c, name: str) -> tuple:
        D, kind = c.hidden_size, self.scoring.head
        if kind == "pooler":    # BERT's: [CLS] through the pooler's dense and tanh, then the classifier
            head = (get.dense("pooler.dense", (D, D)), get("pooler.dense.bias", (D,)),
                    get.dense("classifier", (1, D)), get("classifier.bias", (1,)))
        elif kind == "dense":   # RoBERTa's: <s> through classifier.dense and tanh, then out_proj
            head = (get.dense("classifier.dense", (D, D)), get("classifier.dense.bias", (D,)),
                    get.dense("classifier.out_proj", (1, D)), get("classifier.out_proj.bias", (1,)))
        elif kind == "score":   # a decoder's: the last token's normed state times `score`
            head = (get.dense("score", (1, D)),)
        elif "cls.output.weight" in get.tensors:   # a GGUF's: the rows of "yes" and "no", in that order
            rows = get.dense("cls.output", (2, D))
            head = () if rows is None else (rows[0] - rows[1],)
        else:                   # the logit of "yes" less that of "no": their rows of the head, subtracted
            p, vocab = self.scoring.prompt, self.tokenizer.get_vocab()
            words = [vocab.get(p.yes), vocab.get(p.no)]
            if None in words:
                raise NibbleError(f"{name}'s vocabulary has no {p.yes!r} or {p.no!r} token to score by")
            weight = self.encoder.decoder.embed if c.tie_word_embeddings else get.linear("lm_head", (c.vocab_size, D))
            if weight is None:
                head = ()
            else:
                both = (np.array(weight[words], np.float32) if isinstance(weight, np.ndarray)
                        else prefill.dequantize_rows(weight, np.array(words, np.int64)))
                head = (both[0] - both[1],)
        get.raise_if_missing()
        return head

    def pairs(self, query: str, documents: list[str], instruction: str | None = None) -> Pairs:
        """Each (query, document) pair's ids and token types, cut to max_length (the longer of the
        two cut first, as transformers' tokenizers cut a pair)."""
        if self.scoring.prompt is None:
            if instruction is not None:
                raise NibbleError("this reranker takes no instruction (Qwen3-Reranker's do)")
            encodings = self.tokenizer.encode_batch([(query, d) for d in documents])
            return Pairs([e.ids for e in encodings], [e.type_ids for e in encodings],
                         sum(bool(e.overflowing) for e in encodings))
        p, room = self.scoring.prompt, self.max_length - len(self.prefix) - len(self.suffix)
        texts = self.tokenizer.encode_batch([p.text(query, d, instruction) for d in documents], add_special_tokens=False)
        ids = [self.prefix + e.ids[:room] + self.suffix for e in texts]
        return Pairs(ids, [[0] * len(i) for i in ids], sum(len(e.ids) > room for e in texts))

    def logits(self, ids: list[list[int]], types: list[list[int]]) -> np.ndarray:
        """[pairs] float32: each pair's score before the activation, PASS_TOKENS tokens a pass."""
        out = np.empty(len(ids), np.float32)
        for batch in batches([len(i) for i in ids], PASS_TOKENS):
            states = self.encoder.encode([ids[i] for i in batch], [types[i] for i in batch])
            ends = np.stack([s[0] if self.encoder.decoder is None else s[-1] for s in states])
            out[batch] = self._logits(ends)
        return out

    def run(self, ids: list[list[int]], types: list[list[int]]) -> np.ndarray:
        """What an EmbedEngine calls: logits."""
        return self.logits(ids, types)

    def _logits(self, ends: np.ndarray) -> np.ndarray:
        if self.scoring.head in ("pooler", "dense"):
            w1, b1, w2, b2 = self.head
            return (np.tanh(ends @ w1.T + b1) @ w2.T + b2)[:, 0]
        w = self.head[0]
        return ends @ w.reshape(-1)

    def scores(self, logits: np.ndarray) -> np.ndarray:
        """The logits through the model's activation."""
        if self.scoring.activation == "identity":
            return logits
        return (1 / (1 + np.exp(-logits.astype(np.float64)))).astype(np.float32)

    def rerank(self, query: str, documents: list[str], instruction: str | None = None) -> np.ndarray:
        """Each document's score, in the order given."""
        return self.scores(self.logits(*self.pairs(query, documents, instruction)[:2]))
