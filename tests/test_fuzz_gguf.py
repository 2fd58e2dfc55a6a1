"""Fuzzing GGUF files: headers, metadata (kinds, counts, strings, arrays, absurd but well-typed
values), tensor tables (names, dims, types, offsets) and bytes, made from valid files by structured
and raw byte mutations, through open_model (formats/gguf.py and quant/gguf_import.py). Each case
ends in a model built from it or one line of NibbleError naming the file."""
import struct
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VT
from hypothesis import event, example, given
from hypothesis import strategies as st

from nibble.formats.errors import NibbleError
from nibble.quant.open_model import open_model
from nibble.runner.loader import from_model_dir
from tests.test_gguf import llama_cpp_tensors, random_blocks, write_gguf
from tests.tiny import tiny_config, tiny_tensors

pytestmark = [pytest.mark.fuzz, pytest.mark.filterwarnings("error::RuntimeWarning")]   # numpy's fail

DATA = Path(__file__).parent / "data" / "gguf"
SCALARS = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i",
           VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d"}


class Gguf(NamedTuple):
    """A GGUF file as lists to change: metadata [(key, value type, value)] (a string as bytes,
    an array as (item type, items)), tensors [(name, dims, type, offset)], the data region."""
    kv: list
    tensors: list
    data: bytes
    alignment: int

    def __repr__(self):   # a failing case's report: the data region is the base's, unchanged
        return f"Gguf(kv={self.kv!r}, tensors={self.tensors!r}, data=<{len(self.data)} bytes>)"


def parse(path: Path) -> Gguf:
    r = gguf.GGUFReader(path)
    kv = []
    for key, f in r.fields.items():
        if key.startswith("GGUF."):   # the reader's own fields for the header's counts
            continue
        kind = f.types[0]
        if kind == VT.ARRAY:
            sub = f.types[1]
            value = (sub, [bytes(f.parts[i]) if sub == VT.STRING else f.parts[i].tolist()[0]
                           for i in f.data])
        else:
            value = bytes(f.parts[-1]) if kind == VT.STRING else f.parts[-1].tolist()[0]
        kv.append((key.encode(), kind, value))
    tensors = [(t.name.encode(), [int(d) for d in t.shape], int(t.tensor_type), int(t.field.parts[5][0]))
               for t in r.tensors]
    return Gguf(kv, tensors, bytes(r.data[r.data_offset:]), r.alignment)


def _string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _value(kind: int, v) -> bytes:
    if kind == VT.STRING:
        return _string(v)
    if kind == VT.ARRAY:
        sub, items = v
        return struct.pack("<IQ", sub, len(items)) + b"".join(_value(sub, x) for x in items)
    return struct.pack("<" + SCALARS[kind], v)


def serialize(g: Gguf) -> bytes:
    out = b"GGUF" + struct.pack("<IQQ", 3, len(g.tensors), len(g.kv))
    out += b"".join(_string(k) + struct.pack("<I", kind) + _value(kind, v) for k, kind, v in g.kv)
    for name, dims, qtype, offset in g.tensors:
        out += _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)
    return out + bytes(-len(out) % g.alignment) + g.data


def _quantized_llama(tmp: Path) -> Path:
    """A one-layer llama whose matrices are in block types repacked, dequantized and requantized."""
    config = tiny_config(vocab_size=263, hidden_size=256, intermediate_size=256, num_hidden_layers=1)
    tensors = llama_cpp_tensors(tiny_tensors(config), config)
    rng = np.random.default_rng(0)
    types = {"attn_q": QType.Q8_0, "attn_k": QType.Q4_0, "attn_v": QType.Q4_1, "attn_output": QType.Q5_0,
             "ffn_gate": QType.Q4_K, "ffn_up": QType.Q5_K, "ffn_down": QType.IQ3_S}
    for name, w in tensors.items():
        qtype = types.get(name.split(".")[-2])
        if qtype is not None:
            tensors[name] = (random_blocks(rng, *w.shape, qtype), qtype)
    return write_gguf(tmp / "llama-quant.gguf", tensors, config=config)


def _bases() -> dict[str, bytes]:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        files = [*sorted(DATA.glob("*.gguf")), _quantized_llama(Path(tmp))]
        return {p.stem: p.read_bytes() for p in files}


BASES = _bases()
PARSED = {}


def parsed(name: str) -> Gguf:
    if name not in PARSED:
        import tempfile
        with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
            f.write(BASES[name])
            f.flush()
            PARSED[name] = parse(Path(f.name))
    return PARSED[name]


def _ints(lo: int, hi: int):
    edges = [v for v in (0, 1, 2, 3, 5, 7, 63, 64, 255, 10**9, 2**31, 2**32, 2**40, 2**63, -1, lo, hi)
             if lo <= v <= hi]
    return st.sampled_from(edges) | st.integers(lo, hi)


def scalar(kind: int):
    """Any value of a GGUF scalar type: edge values, absurd sizes, NaN and infinities included."""
    fmt = SCALARS[kind]
    if fmt == "?":
        return st.booleans()
    if fmt in "fd":
        return st.floats(width=32 if fmt == "f" else 64)
    bits = 8 * struct.calcsize(fmt)
    lo, hi = (0, 2**bits - 1) if fmt.isupper() else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return _ints(lo, hi)


STRINGS = st.binary(max_size=8) | st.sampled_from(
    [b"yarn", b"linear", b"none", b"llama", b"gemma3", b"gpt2", b"llama-bpe", b"<s>", b"\xff\xfe"])
SCALAR_KINDS = st.sampled_from(sorted(SCALARS))


@st.composite
def typed_values(draw) -> tuple[int, object]:
    """A value of any kind: a scalar, a string, or an array of either."""
    kind = draw(st.sampled_from([*SCALARS, VT.STRING, VT.ARRAY]))
    if kind == VT.STRING:
        return kind, draw(STRINGS)
    if kind == VT.ARRAY:
        sub = draw(SCALAR_KINDS | st.just(VT.STRING))
        return kind, (sub, draw(st.lists(STRINGS if sub == VT.STRING else scalar(sub), max_size=6)))
    return kind, draw(scalar(kind))


def _keys(arch: str) -> list[bytes]:
    """Keys nibble reads that a file may leave out."""
    return [k.encode() for k in (
        f"{arch}.rope.scaling.type", f"{arch}.rope.scaling.factor", f"{arch}.attention.sliding_window",
        f"{arch}.attention.sliding_window_pattern", f"{arch}.rope.scaling.original_context_length",
        f"{arch}.final_logit_softcapping", f"{arch}.attention.key_length", f"{arch}.rope.dimension_count",
        "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.scores", "tokenizer.ggml.add_space_prefix",
        "general.alignment", "general.architecture")]


@st.composite
def _changed_value(draw, kind: int, value):
    """Another value of the same kind: an array cut, extended, or with an item replaced."""
    if kind == VT.STRING:
        return draw(STRINGS)
    if kind != VT.ARRAY:
        return draw(scalar(kind))
    sub, items = value
    items = list(items)
    item = STRINGS if sub == VT.STRING else scalar(sub)
    how = draw(st.sampled_from(["cut", "extend", "replace"]))
    if how == "cut":
        del items[draw(st.integers(0, len(items))):]
    elif how == "extend":
        items += draw(st.lists(item, min_size=1, max_size=3))
    elif items:
        items[draw(st.integers(0, len(items) - 1))] = draw(item)
    return sub, items


@st.composite
def structured(draw, name: str) -> Gguf:
    """A base file with one to three of its metadata values, keys or tensor entries changed."""
    g = parsed(name)
    kv, tensors = list(g.kv), list(g.tensors)
    arch = dict((k, v) for k, _, v in kv)[b"general.architecture"].decode()
    for _ in range(draw(st.integers(1, 3))):
        i, t = draw(st.integers(0, len(kv) - 1)), draw(st.integers(0, len(tensors) - 1))
        how = draw(st.sampled_from(["value", "value", "kind", "drop", "add", "key",
                                    "name", "dims", "type", "offset", "drop tensor", "tensor twice"]))
        key, kind, value = kv[i]
        name_, dims, qtype, offset = tensors[t]
        if how == "value":
            kv[i] = (key, kind, draw(_changed_value(kind, value)))
        elif how == "kind":
            kv[i] = (key, *draw(typed_values()))
        elif how == "drop":
            del kv[i]
        elif how == "add":
            kv.append((draw(st.sampled_from(_keys(arch))), *draw(typed_values())))
        elif how == "key":   # not UTF-8, or another key's name: the key twice
            kv[i] = (draw(st.sampled_from([k for k, _, _ in kv]) | st.binary(max_size=6)), kind, value)
        elif how == "name":
            tensors[t] = (draw(st.sampled_from([n for n, *_ in tensors]) | STRINGS
                               | st.sampled_from([b"blk.99.attn_q.weight", b"rope_freqs.weight"])),
                          dims, qtype, offset)
        elif how == "dims":
            dims = draw(st.lists(_ints(0, 2**64 - 1), min_size=1, max_size=4)
                        | st.permutations(dims) | st.just([*dims, 1]))
            tensors[t] = (name_, list(dims), qtype, offset)
        elif how == "type":
            tensors[t] = (name_, dims, draw(st.sampled_from([int(q) for q in QType]) | _ints(0, 2**32 - 1)),
                          offset)
        elif how == "offset":
            offset = draw(st.sampled_from([offset + g.alignment, offset - g.alignment, offset + 4,
                                           len(g.data)]) | _ints(0, 2**64 - 1))
            tensors[t] = (name_, dims, qtype, offset % 2**64)
        elif how == "drop tensor" and len(tensors) > 1:
            del tensors[t]
        elif how == "tensor twice":
            tensors.insert(draw(st.integers(0, len(tensors))), tensors[t])
        if len(kv) == 0:
            break
    return g._replace(kv=kv, tensors=tensors)   # the data region shared with the base


class RawEdits(NamedTuple):
    """A base file's bytes edited: (how, at, what) in order."""
    name: str
    edits: list

    def build(self) -> bytes:
        out = bytearray(BASES[self.name])
        for how, at, what in self.edits:
            if how == "flip":
                out[at] ^= what
            elif how == "overwrite":
                out[at:at + len(what)] = what
            elif how == "cut":
                del out[at:]
            else:
                out += what
        return bytes(out)


@st.composite
def raw_bytes(draw, name: str) -> RawEdits:
    """A base file with bits flipped (in the header and tables, or in the tensors), bytes
    overwritten, cut or extended."""
    size = len(BASES[name])
    tables = size - len(parsed(name).data)
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["flip tables", "flip tables", "flip data", "overwrite", "cut", "extend"]))
        end = min(tables, size)   # the tables' end, or the file's if cut there
        if how.startswith("flip") and size:
            start, stop = (0, end) if how == "flip tables" else (end, size)
            at = draw(st.integers(start, max(start, stop - 1)))
            edits.append(("flip", min(at, size - 1), 1 << draw(st.integers(0, 7))))
        elif how == "overwrite" and size:
            at = draw(st.integers(0, max(0, end - 1)))
            new = draw(st.binary(min_size=1, max_size=8))
            edits.append(("overwrite", at, new))
            size = max(size, at + len(new))
        elif how == "cut":
            at = draw(st.integers(0, size))
            edits.append(("cut", at, None))
            size = at
        else:
            new = draw(st.binary(min_size=1, max_size=64))
            edits.append(("extend", None, new))
            size += len(new)
    return RawEdits(name, edits)


@st.composite
def files(draw) -> Gguf | RawEdits:
    """A damaged file as the edits that make it, not its bytes: hypothesis keeps every case's
    value, and 10,000 files' bytes outgrow the machine's memory."""
    name = draw(st.sampled_from(sorted(BASES)))
    return draw(structured(name) | raw_bytes(name))


def _with(name: str, key: bytes, kind: int, value) -> Gguf:
    g = parsed(name)
    kv = [(k, t, v) for k, t, v in g.kv if k != key] + [(key, kind, value)]
    return g._replace(kv=kv)


def _tokens_cut(name: str, n: int) -> Gguf:
    g = parsed(name)
    kv = [(k, t, (v[0], v[1][:n]) if k.startswith(b"tokenizer.ggml.token") else v) for k, t, v in g.kv]
    return g._replace(kv=kv)


def _array_count_at(name: str, key: bytes) -> int:
    """Where the item count of metadata array `key` is in the base file."""
    return BASES[name].index(_string(key)) + 8 + len(key) + 4 + 4   # the key, its type, the items'


@given(files())
@example(BASES["smollm3"])
@example(_with("smollm3", b"smollm3.context_length", VT.UINT64, 2**40))
@example(_with("smollm3", b"smollm3.block_count", VT.UINT32, 10**9))
@example(_with("smollm3", b"smollm3.attention.head_count_kv", VT.UINT32, 3))
@example(_with("phi3-longrope", b"phi3.attention.head_count", VT.UINT32, 3))
@example(_tokens_cut("smollm3", 100))   # a vocabulary smaller than the embedding
@example(_with("smollm3", b"smollm3.block_count", VT.UINT32, 2))   # a block of tensors left over
@example(_with("phi3-longrope", b"phi3.embedding_length", VT.UINT32, 32))
@example(_with("phi3-longrope", b"phi3.embedding_length", VT.UINT32, 2))   # heads of no dims
@example(_with("smollm3", b"smollm3.rope.freq_base", VT.FLOAT64, 1e300))   # beyond float32
@example(RawEdits("smollm3", [("overwrite", _array_count_at("smollm3", b"tokenizer.ggml.token_type"),
                                struct.pack("<Q", 2**40))]))   # looped until memory ran out
@example(_with("gemma3-text", b"gemma3.rope.freq_base", VT.FLOAT32, 0.0)._replace(   # divided by 0
    tensors=[(b"rope_freqs.weight" if i == 1 else n, *rest)
             for i, (n, *rest) in enumerate(parsed("gemma3-text").tensors)]))
@example(parsed("smollm3")._replace(tensors=[(b"b\nlk" + n[1:] if i == 3 else n, *rest)   # a name of two lines
                                             for i, (n, *rest) in enumerate(parsed("smollm3").tensors)]))
@example(RawEdits("llama-quant", []))   # repacked, dequantized and requantized types
@example(parsed("llama-quant")._replace(tensors=[(n, [0] if n == b"blk.0.attn_q.weight" else d, q, o)
                                                 for n, d, q, o in parsed("llama-quant").tensors]))
def test_gguf_opens_or_is_refused_in_one_line(tmp_path, case):
    path = tmp_path / "m.gguf"
    path.unlink(missing_ok=True)   # a new file: the last case's tensors may still map the old one
    path.write_bytes(case if isinstance(case, bytes) else
                     serialize(case) if isinstance(case, Gguf) else case.build())
    try:
        model_dir = open_model(str(path))
    except NibbleError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)
        event(f"outcome: {type(e).__name__}")
        return
    c = model_dir.config
    if c.max_position_embeddings * c.rotary_dim > 1 << 20:   # RoPE tables too large to make here
        event("outcome: opened, too large to build")
        return
    # Built, not run: a file's weights may hold any finite values, and what the kernels make of
    # ones that overflow is not the file reader's to decide.
    try:
        from_model_dir(model_dir)
    except NibbleError as e:
        assert "\n" not in str(e), str(e)
        event(f"outcome: opened, refused at load: {type(e).__name__}")
        return
    event("outcome: built")
