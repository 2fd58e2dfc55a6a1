"""Perplexity over non-overlapping windows, and KL divergence against a saved run.

Each window of `ctx` tokens is evaluated from an empty cache; positions 0..ctx-2 predict tokens
1..ctx-1 (the method of ../shared/reference). Saved distributions are log-probabilities as 16-bit
codes with a per-row offset and scale, as llama-perplexity stores them: half of a float16 table's
rounding error, and 1.6 GB instead of 3.2 GB for 16k positions of a 49k vocabulary.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from nibble.formats.errors import NibbleError
from ..model import Model

MAGIC = b"NIBBLE-LOGPROBS1"
FLOOR = -30.0   # log-probabilities below this (p < 1e-13) are stored as the floor


@dataclass
class PerplexityResult:
    ppl: float
    tokens: int                      # predictions scored
    windows: int
    ctx: int
    kl_mean: float | None = None     # KL(base || this model), nats
    kl_median: float | None = None
    kl_p99: float | None = None
    top1_agree: float | None = None  # share of positions where both pick the same token

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def summary(self) -> str:
        s = f"perplexity {self.ppl:.4f} over {self.tokens} tokens ({self.windows} windows of {self.ctx})"
        if self.kl_mean is not None:
            s += (f"\nKL divergence mean {self.kl_mean:.6f}, median {self.kl_median:.6f}, "
                  f"p99 {self.kl_p99:.6f}; top-1 agreement {self.top1_agree:.4%}")
        return s


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[N, V] float32 logits -> float64 log-probabilities."""
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def evaluate(model: Model, tokens, ctx: int = 512, chunks: int | None = None,
             save_logits: str | None = None, kl_base: str | None = None, kv_type: str = "f32",
             decode: bool = False, progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Perplexity of `tokens` (the text's ids, no BOS) in non-overlapping windows of `ctx`.

    decode: run each window one token at a time, through the kernels generation uses (for
    quantized weights, integer dot products on rounded activations), instead of one batch.
    """
    tokens = np.asarray(tokens, np.int64)
    windows = len(tokens) // ctx if chunks is None else min(chunks, len(tokens) // ctx)
    if windows == 0:
        raise NibbleError(f"the text is {len(tokens)} tokens, shorter than one window of {ctx}: "
                          "give more text or a smaller --ctx")
    tokens = tokens[:windows * ctx].reshape(windows, ctx)
    vocab = model.config.vocab_size
    writer = LogprobWriter(save_logits, tokens, vocab) if save_logits else None
    base = LogprobReader(kl_base, tokens, vocab) if kl_base else None
    nll, kl, agree = [], [], []
    try:
        for w in range(windows):
            logits = _window_logits(model, tokens[w], model.new_cache(ctx, kv_type), decode)
            logp = log_softmax(logits)                                   # [ctx-1, V]
            nll.append(-logp[np.arange(ctx - 1), tokens[w, 1:]])
            if writer:
                writer.write(w, logp)
            if base:
                base_logp = base.read(w)
                kl.append((np.exp(base_logp) * (base_logp - logp)).sum(-1))
                agree.append(base_logp.argmax(-1) == logp.argmax(-1))
            if progress:
                progress(w + 1, windows)
    except BaseException:
        if writer:
            writer.abort()
        raise
    if writer:
        writer.close()
    nll = np.concatenate(nll)
    result = PerplexityResult(ppl=float(math.exp(nll.mean())), tokens=nll.size, windows=windows, ctx=ctx)
    if base:
        kl = np.concatenate(kl)
        result.kl_mean, result.kl_median = float(kl.mean()), float(np.median(kl))
        result.kl_p99, result.top1_agree = float(np.percentile(kl, 99)), float(np.concatenate(agree).mean())
    return result


def _window_logits(model: Model, window: np.ndarray, cache, decode: bool) -> np.ndarray:
    """[ctx-1, V] logits of the positions that predict window[1:]."""
    if decode:
        return np.concatenate([model.forward(window[i:i + 1], cache) for i in range(len(window) - 1)])
    return model.forward(window, cache, all_logits=True)[:-1]


def _fingerprint(tokens: np.ndarray, vocab: int) -> dict:
    return {"windows": tokens.shape[0], "ctx": tokens.shape[1], "vocab": vocab,
            "tokens_sha256": hashlib.sha256(tokens.astype(np.int64).tobytes()).hexdigest()}


class LogprobWriter:
    """Writes [windows, ctx-1, V] log-probabilities as uint16 codes, under a temporary name."""

    def __init__(self, path: str, tokens: np.ndarray, vocab: int):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        header = json.dumps(_fingerprint(tokens, vocab)).encode()
        rows = tokens.shape[0] * (tokens.shape[1] - 1)
        self.rows_per_window = tokens.shape[1] - 1
        with open(self.tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            self.offset = f.tell()
            f.truncate(self.offset + rows * (8 + 2 * vocab))   # sparse until written
        self.affine = np.memmap(self.tmp, np.float32, "r+", self.offset, (rows, 2))
        self.codes = np.memmap(self.tmp, np.uint16, "r+", self.offset + rows * 8, (rows, vocab))

    def write(self, window: int, logp: np.ndarray):
        rows = slice(window * self.rows_per_window, (window + 1) * self.rows_per_window)
        lo = np.maximum(logp.min(-1), FLOOR)
        scale = (logp.max(-1) - lo) / 65535 + 1e-30
        self.affine[rows] = np.stack([lo, scale], -1)
        self.codes[rows] = np.rint((np.maximum(logp, lo[:, None]) - lo[:, None]) / scale[:, None])

    def close(self):
        self.affine.flush()
        self.codes.flush()
        del self.affine, self.codes
        self.tmp.replace(self.path)

    def abort(self):
        del self.affine, self.codes
        self.tmp.unlink(missing_ok=True)


class LogprobReader:
    def __init__(self, path: str, tokens: np.ndarray, vocab: int):
        not_ours = f"{path} is not a file written by `nibble perplexity --save-logits`"
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise NibbleError(not_ours)
            size = int.from_bytes(f.read(8), "little")
            try:   # our headers are a few hundred bytes: a larger length is damage, not a header
                header = json.loads(f.read(size).decode()) if size <= 1 << 16 else None
            except (UnicodeDecodeError, json.JSONDecodeError):
                header = None
            if not isinstance(header, dict):
                raise NibbleError(f"{not_ours} (or it is damaged: its header is unreadable)")
            offset = f.tell()
            end = f.seek(0, os.SEEK_END)
        if header != _fingerprint(tokens, vocab):
            raise NibbleError(f"{path} was saved from other text, --ctx, --chunks or vocabulary: "
                              "run both models on the same file with the same settings")
        rows = tokens.shape[0] * (tokens.shape[1] - 1)
        if end != offset + rows * (8 + 2 * vocab):
            raise NibbleError(f"{path} is {end} bytes where its header promises "
                              f"{offset + rows * (8 + 2 * vocab)}: it is damaged or was cut short")
        self.rows_per_window = tokens.shape[1] - 1
        self.affine = np.memmap(path, np.float32, "r", offset, (rows, 2))
        self.codes = np.memmap(path, np.uint16, "r", offset + rows * 8, (rows, vocab))

    def read(self, window: int) -> np.ndarray:
        rows = slice(window * self.rows_per_window, (window + 1) * self.rows_per_window)
        lo, scale = self.affine[rows, 0:1].astype(np.float64), self.affine[rows, 1:2].astype(np.float64)
        return lo + self.codes[rows] * scale
