"""GGUF import: a llama.cpp model file read into an in-memory ModelDir.

Tensors are renamed to Hugging Face names, with llama.cpp's q/k row permutation undone; a mixture
of experts' experts, stacked in one 3-D tensor [experts, rows, columns], keep that shape, named as
MLX's switch_mlp holds them; a matrix the converter split into several tensors is one again. The block types gguf_blocks knows are repacked, exactly, into MLX's
affine layout (`P.weight` packed uint32, `P.scales`, `P.biases`, and `quantization` in the config,
as an MLX checkpoint holds them; `P.values`, IQ4_NL's and MXFP4's table of levels; `P.high`, the
Q5 types' fifth bits (planes); stacked experts with the leading expert axis on each but the
table); other
quantized types are dequantized to float32, and F16/BF16 stay 16-bit. The config, tokenizer and
chat template are rebuilt from the metadata (the tokenizer by gguf_tokenizer, with llama.cpp's
ids).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from .config import ModelConfig, config_class
from . import families, progress, superblocks
from .errors import FormatError
from .gguf_blocks import BLOCK_TYPES, Repacked, repack
from .gguf_header import split_parts
from .gguf_metadata import check_metadata, float32_decimal
from .gguf_tokenizer import gguf_tokenizer, need
from .half import HalfTensor
from .model_dir import ModelDir

FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
# Every type the gguf package can dequantize: repacked (gguf_blocks.BLOCK_TYPES) or made float32.
SUPPORTED_TYPES = FLOAT_TYPES + tuple(t for t in QType
                                      if t not in FLOAT_TYPES and hasattr(gguf.quants, t.name))
_DEQUANT_STEP = 1 << 22  # elements per dequantization call: bounds the temporaries

TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight",
              # a ranking model's classifier (Qwen3-Reranker's rows of "yes" and "no"), kept by this name
              "cls.output.weight": "cls.output.weight"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Rope tables llama.cpp keeps as tensors; import_gguf reads them into the config
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's mixture-of-experts tensors, a block's router and its experts stacked, and their dims
# (GGUF's order, the fastest-varying first) by the metadata that sizes them
_EXPERT_DIMS = {"ffn_gate_inp": ("embedding_length", "expert_count"),
                **{f"ffn_{p}_exps": ("embedding_length", "expert_feed_forward_length", "expert_count")
                   for p in ("gate", "up")},
                "ffn_down_exps": ("expert_feed_forward_length", "embedding_length", "expert_count")}


class _Reader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap.

    GGUFReader slices its data once per metadata string, and np.memmap slices are slow enough
    that a 49k-token vocabulary takes about 5 s to parse; over a plain view of the same mapping,
    about 1.5 s.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray):
        self._data = value.view(np.ndarray)

    # GGUFReader reads past the end of the file as empty arrays and goes on: an array whose count
    # is 2**40 then loops until memory runs out. Values must lie inside the file, and an array's
    # items fit in what is left of it (a string takes 8 bytes at least, a scalar its size).
    def _get(self, offset, dtype, count=1, override_order=None):
        if offset + np.dtype(dtype).itemsize * int(count) > len(self._data):
            raise FormatError(f"a metadata value at byte {offset} runs past the end of the file")
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type == gguf.GGUFValueType.ARRAY:
            item, count = int(self._get(orig_offs, np.uint32)[0]), int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(item)
            least = np.dtype(scalar).itemsize if scalar is not None else 8   # a string's length, an array's header
            if count * least > len(self._data) - orig_offs - 12:
                raise FormatError(f"a metadata array at byte {orig_offs} holds {count} items, more than "
                                  f"the rest of the file can")
            if item == gguf.GGUFValueType.STRING:
                return self._strings(orig_offs, count)
            if scalar is not None:
                return self._scalars(orig_offs, count, item, scalar)
        return super()._get_field_parts(orig_offs, raw_type)

    # A vocabulary's arrays (SmolLM2's 49k tokens and merges, Qwen's 151k) as GGUFReader reads them:
    # two numpy views an item took 1.5 s (SmolLM2), a view of all the scalars and a memoryview a
    # string take a fraction of that. The parts are what contents() reads (an array's values in
    # one part where GGUFReader gives each its own: contents() of the whole array is the same).

    def _strings(self, orig_offs: int, count: int):
        """An array of `count` strings at orig_offs: GGUFReader's field parts, fast."""
        data, order = memoryview(self._data), "big" if self.byte_order == "S" else "little"
        pos, end = orig_offs + 12, len(self._data)
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        for _ in range(count):
            n = int.from_bytes(data[pos:pos + 8], order) if pos + 8 <= end else end
            if pos + 8 + n > end:
                raise FormatError(f"a metadata string at byte {pos} runs past the end of the file")
            parts.append(data[pos + 8:pos + 8 + n])
            pos += 8 + n
        return pos - orig_offs, parts, list(range(2, 2 + count)), [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]

    def _scalars(self, orig_offs: int, count: int, item: int, scalar):
        """An array of `count` scalars at orig_offs, all in one part."""
        values = self._get(orig_offs + 12, scalar, count)
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64), values]
        return 12 + int(values.nbytes), parts, [2], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(item)]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        """GGUFReader's tensors, once each is known to lie aligned, inside the file and apart
        from the others, as llama.cpp's gguf_init checks (the reader would view any bytes)."""
        spans = []   # (start, end, name) in the file
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            name = bytes(name).decode("utf-8", "replace")
            qtype = int(raw_type[0])
            if qtype not in QType._value2member_map_ or QType(qtype) not in gguf.GGML_QUANT_SIZES:
                raise FormatError(f"GGUF tensor {name} has unknown type {qtype}")
            block, size = gguf.GGML_QUANT_SIZES[QType(qtype)]
            n = math.prod(int(d) for d in dims)
            if n == 0:   # no model tensor is empty, and numpy cannot give one rows
                raise FormatError(f"GGUF tensor {name} has a dimension of 0: it holds nothing")
            if n % block:
                raise FormatError(f"GGUF tensor {name} has {n} elements, not whole blocks of "
                                  f"{block}")
            if int(offset[0]) % self.alignment:
                raise FormatError(f"GGUF tensor {name} starts at offset {int(offset[0])}, not a "
                                  f"multiple of general.alignment ({self.alignment})")
            start = start_offs + int(offset[0])
            spans.append((start, start + n // block * size, name))
        spans.sort()
        for (_, end, name), (start, _, after) in zip(spans, spans[1:]):
            if start < end:
                raise FormatError(f"GGUF tensors {name} and {after} overlap")
        for _, end, name in spans[-1:]:
            if end > len(self.data):
                raise FormatError(f"GGUF tensor {name} ends at byte {end}, past the end of the "
                                  f"file ({len(self.data)} bytes)")
        super()._build_tensors(start_offs, fields)


@dataclass
class GGUFImport:
    """A GGUF file as a ModelDir, and what its tensors were in the file."""
    model: ModelDir
    types: dict[str, QType]   # Hugging Face name (a repacked module's .weight) -> type in the file
    dequantized: list[str]    # module paths of matrices stored in a quantized type that is not
                              # repacked: float32 now (quant/ can quantize them again)


def import_gguf(path: str | Path, repack_blocks: bool = True) -> GGUFImport:
    """Read a GGUF file of one of families.gguf_archs() into a ModelDir with tensors under HF names.

    Matrices of gguf_blocks.BLOCK_TYPES are repacked into MLX's layout (repack_blocks=False:
    dequantized to float32 instead), other quantized types dequantized to float32, F32/F16/BF16
    kept as stored. Raises FormatError for a file that is not GGUF, another architecture, a tensor
    type outside SUPPORTED_TYPES, or a tokenizer gguf_tokenizer cannot rebuild.
    """
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: no such GGUF file")
    try:
        with progress.step():
            return _import(path, repack_blocks)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None


def read_tensors(path: Path) -> tuple[dict, dict]:
    """A GGUF file's tensors by their GGUF names, in numpy order (F32 and F16 as the memory map,
    BF16 a HalfTensor, any other type float32, none repacked, each checked finite), and its
    metadata: what a file other than a model's (a vision projector) is read as."""
    tensors, meta = _open(path)
    _check_types(tensors)
    return {t.name: _each_array(_finite(_read(t, False), t.name), _read_only) for t in tensors}, meta


def _open(path: Path) -> tuple[list, dict]:
    """The tensors and the metadata of the model in `path`, and in its other parts if it is split,
    decoded: any failure is the files'."""
    parts = split_parts(path)
    for part in parts:
        if not part.is_file():
            raise FormatError(f"{part.name}, part of the split model {parts[0].name}, is missing: "
                              f"a model in {len(parts)} parts needs them all, side by side")
    read = [_read_part(part, f"{part.name}: " if len(parts) > 1 else "") for part in parts]
    meta = read[0][1]
    count = meta.get("split.count", 1)
    if count != len(parts):
        raise FormatError(f"its metadata says it is {count} part(s) of a model, its name {len(parts)}: "
                          "a split model keeps the names gguf-split gave its parts")
    for i, (part, (_, part_meta)) in enumerate(zip(parts, read)):
        if (no := part_meta.get("split.no", 0)) != i:
            raise FormatError(f"{part.name} holds split.no {no!r} where its name says {i} (counted from 0)")
    tensors = [t for reader, _ in read for t in reader.tensors]
    if twice := [name for name, n in Counter(t.name for t in tensors).items() if n > 1][:1]:
        raise FormatError(f"GGUF tensor {twice[0]} is stored twice")
    return tensors, meta


def _read_part(part: Path, where: str) -> tuple[_Reader, dict]:
    """A file's reader and its metadata, decoded; errors begin with `where`."""
    try:
        reader = _Reader(part)
        return reader, {k: f.contents() for k, f in reader.fields.items()}
    except FormatError as e:
        raise FormatError(f"{where}{e}") from None
    except Exception as e:   # GGUFReader raises whatever numpy or Python meets in damaged bytes
        raise FormatError(f"{where}not a readable GGUF file ({type(e).__name__}: {e})") from None


def _import(path: Path, repack_blocks: bool) -> GGUFImport:
    progress.update(f"importing {path.name}: reading its metadata")   # seconds for a vocabulary of 50k
    tensors, meta = _open(path)
    arch = meta.get("general.architecture")
    layout = families.gguf_arch(arch) if isinstance(arch, str) else None
    if layout is None:
        raise FormatError(f"unsupported GGUF architecture {arch!r}; nibble imports "
                          f"{', '.join(families.gguf_archs())}")
    check_metadata(meta, arch)
    _check_types(tensors)
    raw = {t.name: t for t in tensors}
    rope = {n.removesuffix(".weight"): _rope_factors(raw.pop(n)) for n in _ROPE_TENSORS if n in raw}
    hf_names = {name: _hf_name(name, layout) for name in raw}   # all checked before the slow part
    tokenizer, tokenizer_config = gguf_tokenizer(meta)
    config = _config(meta, arch, layout, tie="output.weight" not in raw, rope=rope)
    _check_against_config(raw, config)
    _check_experts(raw, meta, arch + ".")
    _check_fused(raw, layout)
    read = {}   # Hugging Face name -> [(GGUF tensor, as read)]: several where layout.fused joins them
    for i, (name, t) in enumerate(raw.items()):
        progress.update(f"importing {path.name}: {i + 1} of {len(raw)} tensors")
        read.setdefault(hf_names[name], []).append((t, _tensor(t, layout, config, repack_blocks)))
    place = {kind: i for kinds in layout.fused.values() for i, kind in enumerate(kinds)}   # in its matrix
    tensors, types, schemes, dequantized = {}, {}, {}, []
    for hf, parts in read.items():
        parts.sort(key=lambda part: place.get(part[0].name.split(".")[-2], 0))
        module = hf.removesuffix(".weight")
        w = parts[0][1] if len(parts) == 1 else _each_array(_joined(parts), _read_only)
        types[hf] = parts[0][0].tensor_type
        if isinstance(w, Repacked):
            tensors |= {hf: w.weight, f"{module}.scales": w.scales, f"{module}.biases": w.biases}
            if w.values is not None:
                tensors[f"{module}.values"] = w.values
            if w.high is not None:
                tensors[f"{module}.high"] = w.high
            schemes[module] = w.bits, w.group_size
        else:
            tensors[hf] = w
            if len(parts[0][0].shape) in (2, 3) and any(t.tensor_type not in FLOAT_TYPES for t, _ in parts):
                dequantized.append(module)
    if schemes:   # mlx-lm writes the same dict under both keys (the second is what the Hub shows)
        q = _quantization(schemes)
        config = dataclasses.replace(config, quantization=q,
                                     extra={**config.extra, "quantization_config": dict(q)})
    generation_config = {k: v for k, v in (("bos_token_id", config.bos_token_id),
                                           ("eos_token_id", config.eos_token_id)) if v is not None}
    model = ModelDir(path=path, config=config, tensors=tensors, tokenizer=tokenizer,
                     tokenizer_config=tokenizer_config, generation_config=generation_config)
    return GGUFImport(model, types, dequantized)


def _tensor(t, layout: families.GGUFArch, config: ModelConfig, repack_blocks: bool):
    """One GGUF tensor as Hugging Face holds it: a matrix (or experts' matrices stacked) repacked
    if asked and its type allows, a norm without the converter's shift, q/k rows unpermuted."""
    kind = t.name.split(".")[-2]
    if layout.norm_shift and kind.endswith("norm"):
        w = _dequantize(t) - np.float32(layout.norm_shift)   # Hugging Face's w back
    else:
        w = _read(t, repack_blocks and len(t.shape) in (2, 3))
    w = _finite(w, t.name)
    # llama.cpp reorders llama's q/k rows for its rope kernel; the others are left as in HF.
    if layout.permuted_qk and kind in ("attn_q", "attn_k"):
        n_head = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
        w = _each_array(w, lambda a: _unpermute(a, n_head, t.name))
    return _each_array(w, _read_only)


def _joined(parts: list) -> np.ndarray | HalfTensor | Repacked:
    """Matrices [N_i, K] as read, [sum N_i, K] in their order: as stored where they are stored
    alike (one float type, or repacked to one width, kind of scales and table of levels), else
    float32."""
    ws = [w for _, w in parts]
    if len({_storage(w) for w in ws}) > 1:
        ws = [_dequantize(t) for t, _ in parts]   # each already found finite
    return _concatenated(ws)


def _concatenated(ws: list):
    """Tensors stored alike, one after the other along their first axis."""
    first = ws[0]
    if isinstance(first, Repacked):   # one table of levels, if any, for all
        return first._replace(**{f: _concatenated([getattr(w, f) for w in ws])
                                 for f in ("weight", "scales", "biases", "high") if getattr(first, f) is not None})
    if isinstance(first, HalfTensor):
        return first._replace(bits=np.concatenate([w.bits for w in ws]))
    return np.concatenate(ws)


def _storage(w) -> tuple:
    """What a tensor as read is stored as: its kind, and its width, 16-bit type or dtype (a
    repacked one's: its scales' and its table of levels)."""
    if isinstance(w, Repacked):
        return (Repacked, w.bits, w.group_size, _storage(w.scales), None if w.values is None else w.values.tobytes(),
                None if w.high is None else w.high.shape[-1])
    return (HalfTensor, w.bf16) if isinstance(w, HalfTensor) else (np.ndarray, w.dtype)


def _finite(w, name: str):
    """w, or FormatError naming the tensor if a value (or a repacked block's scale or bias) is NaN
    or infinite: a damaged file, whose NaNs would otherwise reach the disk and the logits."""
    if _nonfinite(w):
        raise FormatError(f"GGUF tensor {name} holds NaN or infinite values; the file is damaged")
    return w


def _nonfinite(w) -> bool:
    """Whether a tensor as read holds a NaN or an infinity (a repacked one: in a scale or bias)."""
    if isinstance(w, Repacked):
        two_level = superblocks.is_two_level(w.scales)
        return any(_nonfinite(superblocks.supers(a.reshape(-1, *a.shape[-2:])) if two_level else a)
                   for a in (w.scales, w.biases))
    if isinstance(w, HalfTensor):   # all exponent bits set: an infinity or a NaN
        exponent = np.uint16(0x7F80 if w.bf16 else 0x7C00)
        return bool(((w.bits & exponent) == exponent).any())
    return not np.isfinite(w).all()


def _check_against_config(tensors: dict, c: ModelConfig) -> None:
    """What llama.cpp checks of the tensors before it loads them: the embedding and output are
    [vocabulary, embedding_length] (GGUF lists the dims the other way round), and every block is
    one of block_count's."""
    for name in ("token_embd.weight", "output.weight"):
        dims = [int(n) for n in tensors[name].shape] if name in tensors else [c.hidden_size, c.vocab_size]
        if dims != [c.hidden_size, c.vocab_size]:
            raise FormatError(f"GGUF tensor {name} is {dims}, the metadata says [embedding_length "
                              f"{c.hidden_size}, {c.vocab_size} tokens]")
    for name in tensors:
        m = _BLOCK_NAME.fullmatch(name)
        if m and int(m[1]) >= c.num_hidden_layers:
            raise FormatError(f"GGUF tensor {name} is in block {m[1]}, but block_count is "
                              f"{c.num_hidden_layers}")


def _check_experts(tensors: dict, meta: dict, a: str) -> None:
    """What llama.cpp checks of a mixture of experts' tensors before it loads them: a block with
    any has its router and gate, up and down experts, each of the dims the metadata gives (an
    expert's width, where the file has none, as the block's ffn_gate_exps has it)."""
    blocks = {m[1] for m in map(_BLOCK_NAME.fullmatch, tensors) if m and m[2] in _EXPERT_DIMS}
    for i in sorted(blocks, key=int):
        names = {kind: f"blk.{i}.{kind}.weight" for kind in _EXPERT_DIMS}
        if missing := [n for n in names.values() if n not in tensors][:1]:
            raise FormatError(f"GGUF block {i} has experts but no {missing[0]}: a mixture of experts "
                              f"needs its router (ffn_gate_inp) and gate, up and down experts")
        gate = [int(n) for n in tensors[names["ffn_gate_exps"]].shape]
        sizes = {"embedding_length": meta[a + "embedding_length"],
                 "expert_count": meta.get(a + "expert_count", 0),   # llama.cpp's when absent
                 "expert_feed_forward_length": meta.get(a + "expert_feed_forward_length",
                                                        gate[1] if len(gate) == 3 else 0)}
        for kind, name in names.items():
            dims = [int(n) for n in tensors[name].shape]
            if dims != [sizes[k] for k in _EXPERT_DIMS[kind]]:
                raise FormatError(f"GGUF tensor {name} is {dims}, not "
                                  f"[{', '.join(f'{k} {sizes[k]}' for k in _EXPERT_DIMS[kind])}]")


def _check_fused(tensors: dict, layout: families.GGUFArch) -> None:
    """The GGUF tensors a Hugging Face matrix is split into (layout.fused): all there in a block
    that has one, matrices of as many columns."""
    for hf, kinds in layout.fused.items():
        blocks = {m[1] for m in map(_BLOCK_NAME.fullmatch, tensors) if m and m[2] in kinds}
        for i in sorted(blocks, key=int):
            names = [f"blk.{i}.{kind}.weight" for kind in kinds]
            if missing := [n for n in names if n not in tensors][:1]:
                raise FormatError(f"GGUF block {i} has no {missing[0]}: Hugging Face's {hf} is the rows "
                                  f"of {' and '.join(names)}")
            dims = [[int(n) for n in tensors[n].shape] for n in names]
            if any(len(d) != 2 or d[0] != dims[0][0] for d in dims):
                raise FormatError(f"GGUF tensors {' and '.join(names)} are {' and '.join(map(str, dims))}: "
                                  f"not the rows of one matrix ({hf})")


def _rope_factors(t) -> np.ndarray:
    """A rope table tensor: one finite factor per frequency."""
    if len(t.shape) != 1:
        raise FormatError(f"GGUF tensor {t.name} has shape {tuple(int(n) for n in t.shape)}; "
                          f"rope factors are one per frequency")
    return _finite(_dequantize(t), t.name)


def _check_types(tensors) -> None:
    """Fail before reading anything if one tensor has a type nibble cannot read."""
    for t in tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise FormatError(f"GGUF tensor {t.name} has type {t.tensor_type.name}, which nibble "
                              f"cannot read; it reads the float types and the quantized ones "
                              f"llama.cpp writes: {', '.join(q.name for q in SUPPORTED_TYPES)}")


def _read(t, repack_blocks: bool) -> np.ndarray | HalfTensor | Repacked:
    """A tensor in numpy order (GGUF lists ne[0], the fastest-varying dim, first): repacked if
    asked and its type allows (a table of levels: and its scales, see gguf_blocks.repack), F32
    and F16 as the file's memory map, BF16 as a HalfTensor of it, anything else dequantized to
    float32."""
    shape = tuple(int(n) for n in reversed(t.shape))
    if repack_blocks and t.tensor_type in BLOCK_TYPES and (w := repack(t.data, t.tensor_type)) is not None:
        return w
    if t.tensor_type in (QType.F32, QType.F16):
        return t.data.reshape(shape)
    if t.tensor_type == QType.BF16:
        return HalfTensor(t.data.view("<u2").reshape(shape), bf16=True)
    return _dequantize(t)


def _dequantize(t) -> np.ndarray:
    """float32 array in numpy order (NaN or inf from a damaged scale silently: _finite names it)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _dequantize_float32(t)


def _dequantize_float32(t) -> np.ndarray:
    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type in FLOAT_TYPES:
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    # gguf.quants.dequantize works 16 rows at a time, twice as slow as these larger steps.
    blocks = getattr(gguf.quants, t.tensor_type.name)
    blocks.init_grid()   # the IQ types' lookup tables: dequantize_rows does not make them
    rows = t.data.reshape(-1, t.data.shape[-1])
    out = np.empty((rows.shape[0], shape[-1]), np.float32)
    step = max(1, _DEQUANT_STEP // shape[-1])
    for i in range(0, len(rows), step):
        out[i:i + step] = blocks.dequantize_rows(rows[i:i + step])
    return out.reshape(shape)


def _each_array(w, f):
    """f applied to every array a tensor's rows are held in: they move together (a table of
    levels is no row's)."""
    if isinstance(w, Repacked):
        return w._replace(weight=f(w.weight), scales=_each_array(w.scales, f), biases=_each_array(w.biases, f),
                          high=None if w.high is None else f(w.high))
    if isinstance(w, HalfTensor):
        return w._replace(bits=f(w.bits))
    return f(w)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _quantization(schemes: dict[str, tuple[int, int]]) -> dict:
    """mlx-lm's `quantization` for the repacked modules, each one's (bits, group size): the
    commonest as the default, a per-module entry for the others."""
    bits, group_size = Counter(schemes.values()).most_common(1)[0][0]
    return {"group_size": group_size, "bits": bits, "mode": "affine",
            **{p: {"group_size": g, "bits": b} for p, (b, g) in schemes.items() if (b, g) != (bits, group_size)}}


def _unpermute(w: np.ndarray, n_head: int, name: str) -> np.ndarray:
    """Invert convert_hf_to_gguf.py's permute(), which interleaves each head's two rope halves.

    permute: [n_head, 2, rows/n_head/2, ...] -> swap axes 1, 2; so the inverse reads the rows as
    [n_head, rows/n_head/2, 2, ...] and swaps back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise FormatError(f"GGUF tensor {name} has {rows} rows, not a multiple of 2 x {n_head} heads")
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def _hf_name(name: str, layout: families.GGUFArch) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    names = BLOCK_NAMES | dict(layout.block_names) | {k: hf for hf, kinds in layout.fused.items() for k in kinds}
    m = _BLOCK_NAME.fullmatch(name)
    if m is None or m[2] not in names:
        raise FormatError(f"GGUF tensor {name} has no Hugging Face counterpart nibble knows")
    return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"


def _config(meta: dict, arch: str, layout: families.GGUFArch, tie: bool, rope: dict[str, np.ndarray]) -> ModelConfig:
    a = arch + "."
    hidden = need(meta, a + "embedding_length")
    n_head = need(meta, a + "attention.head_count")
    head_dim = meta.get(a + "attention.key_length", hidden // n_head)
    if not head_dim:
        raise FormatError(f"GGUF {a}embedding_length {hidden} is smaller than attention.head_count "
                          f"{n_head}, and the file has no attention.key_length")
    n_layers = need(meta, a + "block_count")
    fields = layout.fields(meta, a, n_layers, hidden // n_head, head_dim)
    model_type = fields.pop("model_type", layout.model_type)
    rope_dim = meta.get(a + "rope.dimension_count", head_dim)
    if rope_dim != head_dim and not families.of(model_type).partial_rotary:
        raise FormatError(f"GGUF rope.dimension_count {rope_dim} differs from the head size "
                          f"{head_dim}; nibble's {arch} rotates whole heads")
    theta = float32_decimal(meta.get(a + "rope.freq_base", 10000.0))
    if not 0 < theta < math.inf:   # RoPE's base: the tables divide by its powers (as config.json's)
        raise FormatError(f"GGUF {a}rope.freq_base is {theta:g}, not a positive number")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    eos = list(dict.fromkeys(eos))  # unique, in order; one id is written as an int, as HF does
    cls = config_class(model_type)
    known = {f.name for f in dataclasses.fields(cls)}
    extra = {k: fields.pop(k) for k in list(fields) if k not in known}   # what the vision reads (mrope_section)
    return cls(
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=need(meta, a + "feed_forward_length"),
        num_hidden_layers=n_layers,
        num_attention_heads=n_head,
        num_key_value_heads=meta.get(a + "attention.head_count_kv", n_head),
        head_dim=head_dim,
        vocab_size=len(need(meta, "tokenizer.ggml.tokens")),
        rms_norm_eps=float32_decimal(need(meta, a + "attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_scaling=_rope_scaling(meta, a, theta, head_dim, rope),
        partial_rotary_factor=None if rope_dim == head_dim else rope_dim / head_dim,
        max_position_embeddings=meta.get(a + "context_length", 2048),
        tie_word_embeddings=tie,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos[0] if len(eos) == 1 else eos or None,
        **fields,
        extra=extra,
    )


def _rope_scaling(meta: dict, a: str, theta: float, head_dim: int,
                  rope: dict[str, np.ndarray]) -> dict | None:
    """HF rope_scaling from the metadata, or from llama.cpp's per-frequency factors: Llama 3.x's
    rope_freqs, phi3's longrope factors."""
    if "rope_freqs" in rope:
        return _llama3_scaling(rope["rope_freqs"].astype(np.float64), theta, head_dim)
    if "rope_factors_long" in rope or "rope_factors_short" in rope:
        if len(rope) != 2:
            raise FormatError("GGUF has one of rope_factors_long.weight and "
                              "rope_factors_short.weight; longrope needs both")
        s = {"rope_type": "longrope", **{f"{k}_factor": [float32_decimal(v) for v in rope[f"rope_factors_{k}"]]
                                         for k in ("long", "short")}}
        if a + "rope.scaling.attn_factor" in meta:
            s["attention_factor"] = float32_decimal(meta[a + "rope.scaling.attn_factor"])
        return s
    kind = meta.get(a + "rope.scaling.type", "none")
    factor = float32_decimal(meta.get(a + "rope.scaling.factor", 1.0))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        orig = meta.get(a + "rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    raise FormatError(f"GGUF rope scaling type {kind!r} is not supported (nibble reads linear, yarn)")


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """Recover HF's llama3 rope_scaling from the rope_freqs tensor convert_hf_to_gguf.py wrote.

    The file keeps only the per-frequency divisors, so check them against the settings every
    Llama 3.x release uses, with the largest divisor as `factor`.
    """
    factor, low, high, old_ctx = float32_decimal(factors.max()), 1.0, 4.0, 8192
    if not factor >= 1:   # Llama 3's divisors are 1 and up; 0 or NaN is damage
        raise FormatError(f"GGUF rope_freqs.weight holds {factor:g} as its largest divisor, where "
                          f"Llama 3's rope scaling has 1 or more: the file is damaged")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((old_ctx * inv_freq / (2 * np.pi) - low) / (high - low), 0.0, 1.0)
    expected = 1.0 / ((1 - smooth) / factor + smooth)
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise FormatError("GGUF rope_freqs.weight does not match Llama 3's rope scaling; nibble "
                          "cannot rebuild it: use the Hugging Face release of this model")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": old_ctx}
