"""Whole texts through a model's blocks, each token's last hidden state out, all the texts in one
pass, packed one after another (no padding): an encoder's (BERT's: bidirectional, its embedding of
words, positions and token types), or a decoder's run as an embedder (Qwen3-Embedding's: causal,
its own embedding, the final norm after the blocks)."""
from __future__ import annotations

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.errors import NibbleError
from ..background import Background
from ..kv.cache import HostKV, Rows
from ..kernels import compiling, cpu, prefill
from ..kernels.linear import read_only
from ..model import Model, TensorGetter
from ..models import family
from ..stages import CPUStage
from ..threads import ThreadChooser


class Encoder:
    """Model's layers, ropes and stages without the head: an encoder family's (family.encoder)
    with its Embeddings, or a decoder's (`decoder`: the Model, headless, whose embedding and final
    norm the pass takes)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray]):
        self.config = c = config
        self.family = family(c)
        if self.family.encoder:
            get = TensorGetter(tensors, c.quantization)
            self.embeddings, self.decoder = self.family.Embeddings(get, c), None
            self.layers = [read_only(self.family.layer_weights(get, c, i)) for i in range(c.num_hidden_layers)]
            get.raise_if_missing()
            self.ropes = self.family.ropes(c, c.max_position_embeddings)
            self.offset = self.family.position_offset(c)
        else:
            self.decoder = Model(c, tensors, head=False)
            self.layers, self.ropes = self.decoder.layers, self.decoder.ropes
            self.offset = 0
        self.longest = c.max_position_embeddings - self.offset   # a text's most tokens
        self.stages = [CPUStage(self, 0, len(self.layers), head=False)]
        self.threads = ThreadChooser()
        self.background = Background()   # none: an embedder compiles its kernels whole (runner/background.py)

    @property
    def nbytes(self) -> int:
        """Bytes of the weights."""
        if self.decoder:
            d = self.decoder
            weights = [d.embed, d.norm]
        else:
            e = self.embeddings
            weights = [e.words, e.positions, e.types, e.norm, e.norm_bias]
        return sum(w.nbytes for w in [*weights, *(w for layer in self.layers for w in layer)])

    def encode(self, ids: list, types: list | None = None) -> list[np.ndarray]:
        """Each text's token ids (and token types: zeros if None) -> its tokens' hidden states
        [n, D], float32: those it gets alone (to float32's rounding: the matrix kernels block a
        pass's rows by its size)."""
        lengths = [len(i) for i in ids]
        longest = self.longest
        if not all(0 < n <= longest for n in lengths):
            raise NibbleError(f"each text must take 1 to {longest} tokens (the model's positions), not {min(lengths) if min(lengths) < 1 else max(lengths)}")
        tokens = np.concatenate([np.asarray(i, np.int64) for i in ids])
        kinds = (np.zeros(len(tokens), np.int64) if types is None
                 else np.concatenate([np.asarray(t, np.int64) for t in types]))
        rows, blocks = Rows.packed(lengths)
        c = self.config
        kv = _OneLayerKV(HostKV.allocate(1, c.num_key_value_heads, blocks, c.head_dim, np.float32))
        with self.threads.pass_of(len(tokens)):
            x = self.embedding(tokens, rows.positions, kinds)
            x = self.stages[0].run(x, kv, rows, np.zeros(0, np.int64))
            if self.decoder:
                cpu.rmsnorm(x, self.decoder.norm, c.rms_norm_eps, x)
        compiling.finish()
        return np.split(x, np.cumsum(lengths)[:-1])

    def embedding(self, tokens: np.ndarray, positions: np.ndarray | None = None,
                  types: np.ndarray | None = None) -> np.ndarray:
        """[T] ids at `positions` (0.. if None) of token `types` (0 if None) -> [T, D] float32 rows,
        the sum of their word, position and type rows, LayerNormed (a decoder's: its embedding's
        rows, which know no positions or types)."""
        tokens = np.asarray(tokens, np.int64)
        if self.decoder:
            return self.decoder.embedding(tokens)
        e = self.embeddings
        x = (np.array(e.words[tokens], np.float32) if isinstance(e.words, np.ndarray)
             else prefill.dequantize_rows(e.words, tokens))
        x += e.positions[(np.arange(len(tokens)) if positions is None else positions) + self.offset]
        x += e.types[0] if types is None else e.types[types]
        cpu.layernorm(x, e.norm, e.norm_bias, self.config.rms_norm_eps, x)
        return x


class _OneLayerKV:
    """One layer's blocks for every layer: an encoder's layer attends over the keys and values of
    this pass only, which the next layer no longer needs."""

    def __init__(self, kv: HostKV):
        self.kv = kv

    def layer(self, i: int) -> tuple:
        return self.kv.layer(0)
