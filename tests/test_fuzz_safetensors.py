"""Fuzzing safetensors files: headers (JSON structure, dtypes, shapes, offsets, metadata, lengths,
nesting, duplicate keys, non-UTF-8) and bodies (truncated, extended, bits flipped), made from valid
files by structured and raw byte mutations, fed to the reader and to open_model. Each case ends in
tensors or one line of FormatError; tensors read are what the safetensors crate reads."""
import json
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from safetensors import deserialize

from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import ModelDir
from nibble.formats.safetensors import read_safetensors, tensor_spec, write_safetensors
from nibble.quant.open_model import open_model

pytestmark = pytest.mark.fuzz

DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL",
          "F8_E4M3", "F8_E5M2", "C64", "f32", "", "F32 "]
INTS = st.integers(-2, 40) | st.sampled_from([2**31, 2**32, 2**62, 2**63, 2**64, 2**64 + 1, -(2**63)])
SCALARS = st.none() | st.booleans() | INTS | st.floats() | st.text(max_size=6) | st.sampled_from(DTYPES)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=6)
# what a header's fields are replaced by: near-valid values first, then anything
FIELD_VALUES = {"dtype": st.sampled_from(DTYPES) | JUNK,
                "shape": st.lists(INTS, max_size=4) | JUNK,
                "data_offsets": st.lists(INTS, min_size=2, max_size=2) | st.lists(INTS, max_size=3) | JUNK,
                "extra": JUNK}


def _header(raw: bytes) -> tuple[list, int]:
    """A file's header as a list of (name, entry) pairs (a name may come twice), and its length."""
    (n,) = struct.unpack("<Q", raw[:8])
    return list(json.loads(raw[8:8 + n]).items()), n


def _serialize(pairs: list) -> bytes:
    return ("{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}").encode()


@st.composite
def header_mutations(draw, raw: bytes) -> bytes:
    """The file with its JSON header changed, its length field set to fit or not, its body kept,
    cut or extended."""
    pairs, n = _header(raw)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(pairs) - 1))
        name, entry = pairs[i]
        how = draw(st.sampled_from(["field", "field", "drop", "twice", "rename", "metadata", "nest"]))
        if how == "field" and isinstance(entry, dict) and name != "__metadata__":
            field = draw(st.sampled_from(sorted(FIELD_VALUES)))
            pairs[i] = (name, {**entry, field: draw(FIELD_VALUES[field])})
        elif how == "drop" and len(pairs) > 1:
            del pairs[i]
        elif how == "twice":   # the same name twice, or an entry's key twice
            pairs.insert(draw(st.integers(0, len(pairs))), (name, entry))
        elif how == "rename":
            pairs[i] = (draw(st.text(max_size=4) | st.sampled_from([p[0] for p in pairs])), entry)
        elif how == "metadata":
            pairs.insert(0, ("__metadata__", draw(st.dictionaries(st.text(max_size=3),
                                                                  st.text(max_size=3)) | JUNK)))
        elif how == "nest":
            pairs = [(name, dict(pairs))] if draw(st.booleans()) else [(name, [dict(pairs)] * 2)]
    blob = _serialize(pairs)
    if draw(st.booleans()) and draw(st.booleans()):   # a byte that is not UTF-8 inside the JSON
        at = draw(st.integers(0, len(blob)))
        blob = blob[:at] + bytes([draw(st.integers(0x80, 0xFF))]) + blob[at:]
    blob += b" " * draw(st.sampled_from([0, -len(blob) % 8, 3]))
    length = draw(st.sampled_from([len(blob)] * 4 + [len(blob) - 1, len(blob) + 1, n]) | INTS)
    body = raw[8 + n:]
    cut = draw(st.sampled_from([len(body)] * 3 + [0]) | st.integers(0, len(body) + 16))
    body = body[:cut] + bytes(max(0, cut - len(body)))
    return struct.pack("<Q", length % 2**64) + blob + body


@st.composite
def byte_mutations(draw, raw: bytes) -> bytes:
    """The file with bits flipped (anywhere, in the length and header, or in the tensors' bytes),
    bytes overwritten, cut or extended."""
    out = bytearray(raw)
    (n,) = struct.unpack("<Q", raw[:8])
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "flip header", "flip data", "overwrite", "cut", "extend"]))
        if how.startswith("flip") and out:
            start, end = {"flip": (0, len(out)), "flip header": (0, 8 + n),
                          "flip data": (8 + n, len(out))}[how]
            at = draw(st.integers(start, max(start, min(end, len(out)) - 1)))
            out[min(at, len(out) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif how == "overwrite" and out:
            at = draw(st.integers(0, len(out) - 1))
            new = draw(st.binary(min_size=1, max_size=8))
            out[at:at + len(new)] = new
        elif how == "cut":
            del out[draw(st.integers(0, len(out))):]
        elif how == "extend":
            out += draw(st.binary(min_size=1, max_size=16))
    return bytes(out)


def mutations(raw: bytes):
    return header_mutations(raw) | byte_mutations(raw)


def assert_as_the_crate_reads(tensors: dict, raw: bytes) -> None:
    """What nibble read is what the safetensors crate reads: the same names, dtypes, shapes and
    bytes."""
    crate = dict(deserialize(raw))
    assert tensors.keys() == crate.keys()
    for name, t in tensors.items():
        spec = tensor_spec(t)
        assert (spec.dtype, list(spec.shape)) == (crate[name]["dtype"], crate[name]["shape"]), name
        assert (t.bits if isinstance(t, HalfTensor) else t).tobytes() == bytes(crate[name]["data"]), name


def replace_file(path: Path, raw: bytes) -> None:
    """A new file at `path`: the last case's tensors may still map the old one."""
    path.unlink(missing_ok=True)
    path.write_bytes(raw)


def one_line(e: NibbleError, path) -> str:
    assert "\n" not in str(e) and str(path) in str(e), str(e)
    return f"outcome: {type(e).__name__}"


def _small_file() -> bytes:
    """A file of every kind of tensor: each dtype width, bf16, an empty one, a rank-3 one."""
    rng = np.random.default_rng(0)
    tensors = {"f32": rng.standard_normal((3, 4)).astype(np.float32),
               "f16": rng.standard_normal(5).astype(np.float16),
               "bf16": HalfTensor(rng.integers(0, 2**16, (2, 3), dtype=np.uint16), bf16=True),
               "i8": rng.integers(-128, 128, (2, 3, 2), dtype=np.int8),
               "u64": rng.integers(0, 2**63, 2, dtype=np.uint64),
               "bool": rng.integers(0, 2, 3).astype(bool),
               "empty": np.zeros((0, 3), np.float32)}
    return _written(tensors)


def _written(tensors: dict) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.safetensors"
        write_safetensors(tensors, path, metadata={"format": "pt"})
        return path.read_bytes()


SMALL = _small_file()


def _with_header(raw: bytes, old: bytes, new: bytes) -> bytes:
    """The file with `old` replaced by `new` once in its header, the length field to fit."""
    pairs, n = _header(raw)
    blob = _serialize(pairs).replace(old, new, 1)
    return struct.pack("<Q", len(blob)) + blob + raw[8 + n:]


@given(mutations(SMALL))
@example(SMALL)
@example(SMALL[:8] + b"[" * 100_000 + SMALL[8:])   # the JSON nested too deeply for Python
@example(_with_header(SMALL, b'"data_offsets"', b'"a":NaN,"data_offsets"'))   # Python's json, not JSON
def test_safetensors_reads_or_is_refused_in_one_line(tmp_path, raw):
    path = tmp_path / "m.safetensors"
    replace_file(path, raw)
    try:
        tensors = read_safetensors(path)
    except FormatError as e:
        event(one_line(e, path))
        return
    assert_as_the_crate_reads(tensors, raw)
    event("outcome: loaded")


@given(data=st.data())
def test_model_dir_opens_or_is_refused_in_one_line(tmp_path, tiny_dir, data):
    model = tmp_path / "m"
    if not model.exists():   # one copy of the tiny model for all the cases
        shutil.copytree(tiny_dir, model)
    path = model / "model.safetensors"
    raw = (tiny_dir / "model.safetensors").read_bytes()
    raw = data.draw(mutations(raw) | st.just(raw), label="file")
    replace_file(path, raw)
    try:
        opened = open_model(str(model))
    except NibbleError as e:
        event(one_line(e, path))
        return
    assert isinstance(opened, ModelDir)
    assert_as_the_crate_reads(opened.tensors, raw)
    event("outcome: opened")
