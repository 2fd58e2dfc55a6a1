"""A decoder-only transformer of any family in runner/models/: its weights, its stages, the forward pass."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nibble.formats.catalog import identity
from nibble.formats.config import ModelConfig
from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.half import HalfTensor
from nibble.formats.lora import LoRA
from nibble.quant.affine import QuantizedTensor, dequantize
from nibble.quant.convert import read_linear
from .background import Background
from .kv.blocks import chain_root
from .kv.cache import BLOCK, KVCache, KVPool, Rows, blocks_for, kv_dtype
from .kernels import compiling, prefill
from .kernels.linear import SMALL, LoRAWeight, Weight, prepare, read_only
from .models import family
from .stages import CPUStage
from .threads import ThreadChooser


class ContextFull(NibbleError):
    """The tokens do not fit in what is left of the context."""


class NonFinite(NibbleError):
    """NaN or Inf in the hidden state or the logits: the message names the layer where they appeared."""


class Model:
    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray], head: bool = True,
                 source: str | None = None, loras: Sequence[LoRA] = ()):
        """head=False: the blocks and the final norm only (an embedder's: a checkpoint saved
        without its head may hold none). source: what names the weights (catalog.identity of
        their files), which the disk tier of the KV cache keeps blocks under; None: weights
        built in memory, no disk tier. loras: adapters run beside the weights they target, not
        merged (kernels/linear.LoRAWeight), in the same pass, each row of a pass at its sequence's
        scales (forward's and forward_batch's `adapters`), by default at lora_scales."""
        self.config = config
        self.source = source
        loras = [lora.for_model(config) for lora in loras]   # a GGUF adapter's q/k rows by the model's heads
        c = config
        D = c.hidden_size
        self.family = family(c)
        if self.family.encoder:
            raise NibbleError(f"{c.model_type} is an encoder, an embedding model: it embeds text "
                              f"(nibble embed), it does not generate")
        get = TensorGetter(tensors, c.quantization, loras, rows=c.max_position_embeddings)
        self.adapters = list(loras)
        # the scale each adapter runs at where a pass is not told otherwise (--lora PATH:SCALE;
        # the server's POST /lora-adapters replaces it)
        self.lora_scales = np.array([lora.scale for lora in loras], np.float32)
        self._row_scales = get.scales   # every LoRAWeight's view of it: each row's scales, set by _run
        self._adapter_names = [identity(lora.path) for lora in loras]   # what prefix_root keys blocks by
        self.embed = read_only(get.linear("model.embed_tokens", (c.vocab_size, D)))   # [V, D]
        self.embed_scale = self.family.embed_scale(c, self.embed)           # on the embedded rows
        self.norm = self.family.norm(get, "model.norm.weight", (D,))         # [D]
        if head and self.norm is not None and self.family.logits_scale(c) != 1:   # logits = norm(x) . lm_head
            self.norm = self.norm * np.float32(self.family.logits_scale(c))
        self.norm = read_only(self.norm)
        self.lm_head = (None if not head else self.embed if c.tie_word_embeddings
                        else read_only(get.linear("lm_head", (c.vocab_size, D))))   # [V, D]
        self.layers = [read_only(self.family.layer_weights(get, c, i)) for i in range(c.num_hidden_layers)]
        get.raise_if_missing()
        get.raise_if_unused_adapters()
        self.ropes = self.family.ropes(c, c.max_position_embeddings)   # each layer's (cos, sin)
        self.stages = [CPUStage(self, 0, len(self.layers), head=head)]   # see stages.py
        self.offload_note = ""   # what offload_layers has to tell the user
        self.background = Background()   # none: a first run compiles the full kernels first (see background.py)
        self.threads = ThreadChooser()   # the kernels' thread count, pass by pass (threads.py)
        self.vision = None   # the vision tower of a model that reads images (runner/vision), else None

    @property
    def gpu_stage(self):
        """The stage on the GPU (offload.GPUStage), or None."""
        return next((s for s in self.stages if s.on_gpu), None)

    def offload_layers(self, gpu_layers: int, ctx: int | None = None, require_gpu: bool = False) -> str:
        """Run the last `gpu_layers` layers (-1: all) on the GPU, as many as fit in its memory
        with a KV cache of `ctx` positions (default: the model's). -> one line for the user, or
        "" (no GPU: the CPU runs everything, and the line says why; NoGPU if `require_gpu`).
        Caches made before no longer fit the model: forward refuses them."""
        from .offload import setup
        longest = self.config.max_position_embeddings   # what new_cache will allow
        gpu, self.offload_note = setup(self, gpu_layers, min(ctx or longest, longest), require_gpu)
        L = len(self.layers)
        if gpu is None:
            self.stages = [CPUStage(self, 0, L, head=True)]
            return self.offload_note
        self.stages = ([CPUStage(self, 0, gpu.first, head=False)] if gpu.first else []) + [gpu]
        if gpu.head is None:   # the output head on the CPU, after the GPU's layers
            self.stages.append(CPUStage(self, L, L, head=True))
        return self.offload_note

    def new_pool(self, blocks: int, kv_type: str = "f32") -> KVPool:
        """A pool of `blocks` KV blocks (BLOCK positions each) for sequences to share (forward_batch)."""
        dtype = kv_dtype(kv_type)
        return KVPool([stage.new_cache(blocks * BLOCK, dtype) for stage in self.stages], self.stages, blocks)

    def new_cache(self, ctx: int | None = None, kv_type: str = "f32") -> KVCache:
        """One sequence of up to `ctx` positions (default: the model's context) on a pool of its
        own, its blocks in order."""
        ctx = min(ctx or self.config.max_position_embeddings, self.config.max_position_embeddings)
        blocks = blocks_for(ctx)
        return KVCache.on_pool(self.new_pool(blocks, kv_type), ctx, range(blocks))

    def forward(self, tokens, cache: KVCache, all_logits: bool = False,
                act_sq: np.ndarray | None = None, *, draft: Sequence[int] = (),
                adapters: np.ndarray | None = None) -> np.ndarray:
        """Run tokens at positions cache.pos.. (they become the sequence's ids there) and return
        logits [T, V] (all_logits) or [1, V].

        `draft`: ids guessed to follow, run after `tokens` in the same pass, their logits returned
        after the last token's ([1 + len(draft), V]) but not kept: the caller adds those it accepts
        to cache.ids and cache.pos, and the next pass overwrites the keys and values of the rest.

        act_sq, if given: each layer's sums of its projections' squared inputs by layer index
        (float64, as the family's act_shape; see decoder_layer), accumulated.

        adapters: the scale of each of the model's LoRA adapters for these tokens (None: lora_scales).
        """
        T, pos0 = len(tokens), cache.pos
        run = np.asarray([*tokens, *draft], np.int64)
        self._check_pool(cache.pool)
        if pos0 + len(run) > cache.size:
            raise ContextFull(f"{pos0 + len(run)} tokens do not fit in the context of {cache.size}")
        if blocks_for(pos0 + len(run)) > len(cache.blocks.blocks):
            raise NibbleError(f"the KV cache's block table holds {len(cache.blocks.blocks) * BLOCK} positions, "
                              f"not the {pos0 + len(run)} this pass needs")
        logit_rows = np.arange(len(run)) if all_logits else np.arange(T - 1, len(run))
        x = self._run(run, Rows.single(pos0, len(run), cache.table), cache.pool, logit_rows, act_sq, [cache.ids],
                      None if adapters is None else np.asarray(adapters, np.float32)[None])
        cache.ids[pos0:pos0 + T] = [int(t) for t in tokens]
        cache.pos += T
        return x

    def forward_batch(self, tokens, rows: Rows, pool: KVPool, logit_rows,
                      ids: Sequence[Sequence[int]] | None = None, adapters: np.ndarray | None = None) -> np.ndarray:
        """Run one pass over rows of several sequences -> logits [len(logit_rows), V] of the rows
        logit_rows (indexes into tokens). `ids`: each sequence's ids (by rows.seq), at least those
        before its rows, which a vision-language model's RoPE may turn by (runner/vision; None:
        text alone before them). `adapters`: each sequence's scale of each of the model's LoRA
        adapters [sequences, adapters] (None: lora_scales for all), so that requests with different
        adapters share a pass.

        Row t is token tokens[t] at position rows.positions[t] of sequence rows.seq[t], whose
        blocks in `pool` are rows.tables[rows.seq[t]] in order; a sequence's rows are consecutive
        positions (one for a decoded token, several for a chunk of its prompt), the positions
        before them already in its blocks. Each row's k/v is stored, then attended causally.

        Batch invariant: a sequence's logits do not depend on the other rows of the pass. Decoded
        rows (a sequence's only row) go through the layers in groups of at most linear.SMALL,
        whose kernels compute each row as they would alone (bit-identical to Model.forward), and
        prompt rows in one group after them: a step that mixes both reads the weights twice.
        """
        tokens = np.asarray(tokens, np.int64)
        rows, logit_rows = Rows.of(*rows), np.asarray(logit_rows, np.int64)
        self._check_pool(pool)
        _check_rows(tokens, rows, pool, logit_rows, self.config.max_position_embeddings)
        if self.gpu_stage is not None and len(np.unique(rows.seq)) > 1:
            raise NibbleError("a pass over several sequences runs on the CPU only: load the model "
                              "without --gpu-layers")
        counts = np.bincount(rows.seq, minlength=len(rows.tables))
        alone = counts[rows.seq] == 1
        decoded, prompt = np.flatnonzero(alone), np.flatnonzero(~alone)
        groups = [decoded[i:i + SMALL] for i in range(0, len(decoded), SMALL)]
        groups += [prompt] if len(prompt) else []
        logits = np.empty((len(logit_rows), self.config.vocab_size), np.float32)
        local = np.empty(len(tokens), np.int64)   # each row's index in its group
        for group in groups:
            local[group] = np.arange(len(group))
            wanted = np.isin(logit_rows, group)
            logits[wanted] = self._run(tokens[group], rows.part(group),
                                       pool, local[logit_rows[wanted]], ids=ids, adapters=adapters)
        return logits

    def prefix_root(self, adapters: np.ndarray | None = None) -> bytes:
        """The root of the chain of hashes that KV blocks run at these scales of the adapters
        (None: lora_scales) are known by (runner/kv/blocks.py): the adapters a sequence runs are
        part of what its keys and values hold, and one that runs none shares the base's blocks."""
        scales = self.lora_scales if adapters is None else adapters
        return chain_root(repr([(name, float(s)) for name, s in zip(self._adapter_names, scales) if s]))

    def _place_scales(self, seq: np.ndarray, adapters: np.ndarray | None):
        """Each row's scales of the adapters, where its LoRAWeights read them (by rows.seq)."""
        if len(seq) > len(self._row_scales):
            raise NibbleError(f"a pass with LoRA adapters runs at most {len(self._row_scales)} rows, not {len(seq)}")
        if adapters is None:
            self._row_scales[:len(seq)] = self.lora_scales
            return
        adapters = np.asarray(adapters, np.float32)
        if adapters.ndim != 2 or adapters.shape[1] != len(self.adapters) or seq.max() >= len(adapters):
            raise NibbleError(f"adapters must give each of the pass's sequences a scale for each of the "
                              f"{len(self.adapters)} adapters, got {list(adapters.shape)}")
        self._row_scales[:len(seq)] = adapters[seq]

    def _check_pool(self, pool: KVPool):
        if pool.stages is not self.stages:
            raise NibbleError("this KV cache is another model's, or from before offload_layers moved "
                              "this one's layers: make a new one with model.new_cache()")

    def _run(self, tokens: np.ndarray, rows: Rows, pool: KVPool, logit_rows: np.ndarray,
             act_sq: np.ndarray | None = None, ids: Sequence[Sequence[int]] | None = None,
             adapters: np.ndarray | None = None) -> np.ndarray:
        """The pass itself: embedding, the stages, the head on x[logit_rows]."""
        if self.adapters:
            self._place_scales(rows.seq, adapters)
        x = self.embedding(tokens)                                       # [T, D] residual stream
        adds = ()
        if self.vision is not None:
            rows, adds = self.vision.placed(tokens, rows, ids), self.vision.deep(tokens)
        with self.threads.pass_of(len(tokens)):
            for stage, kv in zip(self.stages, pool.parts):   # the last one returns the logits
                x = stage.run(x, kv, rows, logit_rows, act_sq, adds=adds)
        compiling.finish()   # if this pass compiled kernels (a first run), say it is over
        # One check of the logits a pass (the sampler reads them anyway); which layer went wrong
        # is looked for only when they are not finite, so decoding is as fast as without it.
        if not np.isfinite(x).all():
            self._raise_where_non_finite(tokens, rows, pool, logit_rows, adds)
        return x

    def _raise_where_non_finite(self, tokens: np.ndarray, rows: Rows, pool: KVPool, logit_rows: np.ndarray, adds=()):
        """Run the same pass again (over the same cache positions), checking the output of the
        embedding, of each layer and of the head, and raise NonFinite naming the first that holds
        NaN or Inf."""
        L = len(self.layers)
        why = "produced NaN/Inf values: its weights may hold NaN/Inf, or its activations overflow float32"
        head = "model.embed_tokens, tied" if self.config.tie_word_embeddings else "lm_head"

        def check(where: int, x: np.ndarray):
            """`where`: a layer's index, or L for the output head."""
            if not np.isfinite(x).all():
                part = (f"layer {where} of {L} (model.layers.{where})" if where < L else
                        f"the output head (model.norm, {head})")
                raise NonFinite(f"{part} {why}")

        x = self.embedding(tokens)
        if not np.isfinite(x).all():
            raise NonFinite(f"the embedding (model.embed_tokens) {why}")
        for stage, kv in zip(self.stages, pool.parts):
            x = stage.run(x, kv, rows, logit_rows, check=check, adds=adds)
        raise NonFinite("the logits held NaN/Inf values, but the same pass run again layer by layer did not")

    def embedding(self, tokens: np.ndarray) -> np.ndarray:
        """[T] ids -> [T, D] float32 rows of the embedding table (float32, quantized or 16-bit:
        only these rows are made float32), times the family's embed_scale; an image's ids
        (below 0, text/image_ids.py) -> the rows its vision makes, as they are."""
        image = tokens < 0
        if image.any():
            if self.vision is None:
                raise NibbleError(f"{self.config.model_type} reads no images: a prompt holds image ids")
            rows = np.empty((len(tokens), self.config.hidden_size), np.float32)
            rows[image] = self.vision.rows(tokens[image])[:, :self.config.hidden_size]
            if not image.all():
                rows[~image] = self.embedding(tokens[~image])
            return rows
        if isinstance(self.embed, np.ndarray):
            rows = np.array(self.embed[tokens], np.float32)
        else:
            rows = prefill.dequantize_rows(self.embed, tokens)
        rows *= self.embed_scale
        return rows


def _check_rows(tokens: np.ndarray, rows: Rows, pool: KVPool, logit_rows: np.ndarray, longest: int):
    """Refuse, in one line, a pass whose rows the kernels would read or write out of bounds."""
    T, (S, width) = len(tokens), rows.tables.shape
    if len(rows.positions) != T or len(rows.seq) != T:
        raise NibbleError(f"a pass of {T} tokens needs {T} positions and sequences, got "
                          f"{len(rows.positions)} and {len(rows.seq)}")
    if T == 0:
        raise NibbleError("a pass needs at least one token")
    if rows.seq.min() < 0 or rows.seq.max() >= S:
        raise NibbleError(f"the rows name sequences outside the {S} block tables given")
    if rows.positions.min() < 0 or rows.positions.max() >= min(longest, width * BLOCK):
        raise ContextFull(f"position {rows.positions.max()} is past the context: {longest} positions "
                          f"for the model, {width * BLOCK} in the block tables")
    last = np.zeros(S, np.int64)
    np.maximum.at(last, rows.seq, rows.positions // BLOCK + 1)   # blocks each sequence reads
    used = rows.tables[np.arange(width)[None, :] < last[:, None]]
    if len(used) and (used.min() < 0 or used.max() >= pool.blocks):
        raise NibbleError(f"a block table names blocks outside the pool of {pool.blocks}")
    if len(logit_rows) and (logit_rows.min() < 0 or logit_rows.max() >= T):
        raise NibbleError(f"logit_rows must index the {T} rows of the pass")


class TensorGetter:
    """Fetches weights by HF name, checking shapes and collecting the missing names."""

    def __init__(self, tensors: dict[str, np.ndarray], quantization: dict | None, loras: Sequence[LoRA] = (),
                 rows: int = 0):
        """rows: the most rows a pass of the model runs, for which the adapters' scales are kept."""
        self.tensors = tensors
        self.quantization = quantization
        self.missing: list[str] = []
        # module -> (A [R, K], B [N, R], owner [R]): the pairs of every adapter that targets it
        # side by side, owner the adapter of each rank
        self.adapters: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.loras = loras
        self.scales = np.zeros((rows if loras else 0, len(loras)), np.float32)   # each row's, set each pass
        for j, lora in enumerate(loras):
            for module, (a, b) in lora.pairs.items():
                owner = np.full(len(a), j, np.int64)
                if module in self.adapters:
                    a0, b0, owner0 = self.adapters[module]
                    a, b, owner = np.concatenate([a0, a]), np.concatenate([b0, b], axis=1), np.concatenate([owner0, owner])
                self.adapters[module] = (np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32), owner)

    def linear(self, path: str, shape: tuple) -> Weight | None:
        """The weight of module `path` as stored (no copy): float32 [N, K], bf16 or f16 as a
        HalfTensor, or quantized; with the adapters' pairs beside it where any targets it."""
        w = self._linear(path, shape)
        if w is None or path not in self.adapters:
            return w
        a, b, owner = self.adapters.pop(path)
        if a.shape[1] != shape[1] or b.shape[0] != shape[0]:
            raise FormatError(f"the adapter's {path} is {b.shape[0]}x{a.shape[1]}, the model's {shape[0]}x{shape[1]}")
        return LoRAWeight(w, a, b, owner, self.scales)

    def raise_if_unused_adapters(self):
        """FormatError naming a module an adapter targets that no weight of the model was read from."""
        if self.adapters:
            where = next(str(lora.path) for lora in self.loras if next(iter(self.adapters)) in lora.pairs)
            raise FormatError(f"{where}: the adapter changes {next(iter(self.adapters))}, which this model does not "
                              "run as one matrix (an adapter trained on another model, or on an expert or a fused "
                              "matrix)")

    def _linear(self, path: str, shape: tuple) -> Weight | None:
        if f"{path}.weight" not in self.tensors:
            self.missing.append(f"{path}.weight")
            return None
        qt = read_linear(self.tensors, self.quantization, path)
        if isinstance(qt, np.ndarray) and qt.dtype == np.float16:
            qt = HalfTensor.of_float16(qt)
        if isinstance(qt, np.ndarray):
            return self(f"{path}.weight", shape)
        if isinstance(qt, HalfTensor):
            self._check_shape(f"{path}.weight", qt, shape)
            return qt
        if qt.shape != shape:
            raise FormatError(f"quantized tensor {path}.weight holds a {qt.shape[0]}x{qt.shape[1]} "
                              f"matrix, the config needs {shape[0]}x{shape[1]}")
        return prepare(qt)

    def dense(self, path: str, shape: tuple) -> np.ndarray | None:
        """The weight of module `path` as float32, a quantized one dequantized (a copy): small
        matrices the kernels take in float, such as a router, which mlx-lm quantizes to 8 bits."""
        if f"{path}.scales" not in self.tensors:
            return self(f"{path}.weight", shape)
        qt = read_linear(self.tensors, self.quantization, path)
        if qt.shape != shape:
            raise FormatError(f"quantized tensor {path}.weight holds a {qt.shape[0]}x{qt.shape[1]} "
                              f"matrix, the config needs {shape[0]}x{shape[1]}")
        return dequantize(qt)

    def experts(self, path: str, name: str, count: int, shape: tuple, each: str | None = None) -> Weight | None:
        """The `count` experts' matrices `name` [N, K] of the MoE module `path` (a layer's mlp) as
        one weight with a leading expert axis (kernels/moe.py): float32 [E, N, K], or quantized
        with stacked arrays. Stored stacked (MLX's `path.switch_mlp.name`), as stored (a
        quantized one stays in the file's memory map); one tensor an expert
        (`path.experts.E.<each>`, `each` the checkpoint's name if not `name`), stacked here: a copy."""
        stacked = f"{path}.switch_mlp.{name}"
        if f"{stacked}.weight" in self.tensors:
            w = read_linear(self.tensors, self.quantization, stacked)
            if isinstance(w, QuantizedTensor):
                if w.weight.shape[0] != count or w.shape != shape:
                    raise FormatError(f"quantized tensor {stacked}.weight holds {w.weight.shape[0]} "
                                      f"{w.shape[0]}x{w.shape[1]} matrices, the config needs {count} "
                                      f"{shape[0]}x{shape[1]}")
                return prepare(w)
            return self(f"{stacked}.weight", (count, *shape))
        parts = [self.linear(f"{path}.experts.{e}.{each or name}", shape) for e in range(count)]
        if any(p is None for p in parts):
            return None
        parts = [p.widen() if isinstance(p, HalfTensor) else p for p in parts]   # 16-bit: float32
        if all(isinstance(p, np.ndarray) for p in parts):
            return np.stack(parts)
        kinds = {(type(p), p.scales.dtype, p.bf16, None if p.values is None else p.values.tobytes(),
                  None if p.high is None else p.high.shape)
                 if isinstance(p, QuantizedTensor) else None for p in parts}
        if len(kinds) > 1 or None in kinds:
            raise FormatError(f"the experts' {path}.experts.*.{name} are not all stored alike: nibble "
                              f"stacks them into one weight")
        first = parts[0]
        return type(first)(*(np.stack([getattr(p, f) for p in parts]) for f in ("weight", "scales", "biases")),
                           first.bits, first.group_size, first.bf16, first.values,
                           None if first.high is None else np.stack([p.high for p in parts]))

    def stored(self, name: str, shape: tuple):
        """A tensor as stored (no copy), its shape checked."""
        t = self.tensors.get(name)
        if t is None:
            self.missing.append(name)
            return None
        self._check_shape(name, t, shape)
        return t

    def __call__(self, name: str, shape: tuple) -> np.ndarray | None:
        """A float32 tensor: norm weights and biases, which are small (1-D), widened if stored
        in 16 bits (a copy)."""
        t = self.stored(name, shape)
        if t is None:
            return None
        if isinstance(t, HalfTensor):
            return t.widen()
        if t.dtype != np.float32:
            if t.dtype.kind != "f":
                raise FormatError(f"tensor {name} is {t.dtype}: the float path needs float weights")
            t = t.astype(np.float32)   # f16 (or f64) -> f32, a copy
        return t

    @staticmethod
    def _check_shape(name: str, t, shape: tuple):
        if t.shape != shape:
            raise FormatError(f"tensor {name} has shape {list(t.shape)}, the config needs {list(shape)}")

    def raise_if_missing(self):
        if self.missing:
            more = f" and {len(self.missing) - 3} more" if len(self.missing) > 3 else ""
            raise FormatError(f"tensors missing for the config: {', '.join(self.missing[:3])}{more}")
