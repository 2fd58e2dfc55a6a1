"""An encoder (BERT's): the token ids of several texts in, each token's hidden state out, all the
texts in one pass, packed one after another (no padding)."""
from __future__ import annotations

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.errors import NibbleError
from .cache import HostKV, Rows, blocks_for
from .kernels import compiling, cpu, prefill
from .model import TensorGetter
from .models import family
from .stages import CPUStage
from .threads import ThreadChooser


class Encoder:
    """A model whose family is an encoder (family.FAMILY.encoder): Model's layers, ropes and
    stages without the head, and an embedding of positions and token types besides words."""

    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray]):
        self.config = c = config
        self.family = family(c)
        get = TensorGetter(tensors, c.quantization)
        self.embeddings = self.family.Embeddings(get, c)
        self.layers = [self.family.layer(get, c, i) for i in range(c.num_hidden_layers)]
        get.raise_if_missing()
        self.ropes = self.family.ropes(c, c.max_position_embeddings)
        self.stages = [CPUStage(self, 0, len(self.layers), head=False)]
        self.threads = ThreadChooser()

    @property
    def nbytes(self) -> int:
        """Bytes of the weights."""
        e = self.embeddings
        weights = [e.words, e.positions, e.types, e.norm, e.norm_bias, *(w for layer in self.layers for w in layer)]
        return sum(w.nbytes for w in weights)

    def encode(self, ids: list, types: list | None = None) -> list[np.ndarray]:
        """Each text's token ids (and token types: zeros if None) -> its tokens' hidden states
        [n, D], float32: those it gets alone (to float32's rounding: the matrix kernels block a
        pass's rows by its size)."""
        lengths = [len(i) for i in ids]
        longest = self.config.max_position_embeddings
        if not all(0 < n <= longest for n in lengths):
            raise NibbleError(f"each text must take 1 to {longest} tokens (the model's positions), not {min(lengths) if min(lengths) < 1 else max(lengths)}")
        tokens = np.concatenate([np.asarray(i, np.int64) for i in ids])
        kinds = (np.zeros(len(tokens), np.int64) if types is None
                 else np.concatenate([np.asarray(t, np.int64) for t in types]))
        positions = np.concatenate([np.arange(n) for n in lengths])
        blocks = [blocks_for(n) for n in lengths]
        tables = np.zeros((len(ids), max(blocks)), np.int32)
        first = np.cumsum([0, *blocks])
        for s, b in enumerate(blocks):   # each text its own blocks
            tables[s, :b] = np.arange(first[s], first[s] + b)
        rows = Rows.of(positions, np.repeat(np.arange(len(ids)), lengths), tables)
        c = self.config
        kv = _OneLayerKV(HostKV.allocate(1, c.num_key_value_heads, int(first[-1]), c.head_dim, np.float32))
        with self.threads.pass_of(len(tokens)):
            x = self.embedding(tokens, positions, kinds)
            x = self.stages[0].run(x, kv, rows, np.zeros(0, np.int64))
        compiling.finish()
        return np.split(x, np.cumsum(lengths)[:-1])

    def embedding(self, tokens: np.ndarray, positions: np.ndarray | None = None,
                  types: np.ndarray | None = None) -> np.ndarray:
        """[T] ids at `positions` (0.. if None) of token `types` (0 if None) -> [T, D] float32 rows,
        the sum of their word, position and type rows, LayerNormed."""
        e = self.embeddings
        tokens = np.asarray(tokens, np.int64)
        x = (np.array(e.words[tokens], np.float32) if isinstance(e.words, np.ndarray)
             else prefill.dequantize_rows(e.words, tokens))
        x += e.positions[np.arange(len(tokens)) if positions is None else positions]
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
