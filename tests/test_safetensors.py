"""The safetensors reader and writer: round trips, bf16, shards, and every malformed file."""
import json
import os
import struct

import numpy as np
import pytest

from nibble.formats.errors import FormatError
from nibble.formats.half import HalfTensor
from nibble.formats.safetensors import (TensorSpec, TensorStream, read_checkpoint, read_safetensors,
                                        read_safetensors_metadata, release, write_safetensors)
from tests.hand_safetensors import memmap_backed


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f16": rng.standard_normal((5,)).astype(np.float16),
        "i8": rng.integers(-128, 128, (2, 3, 2), dtype=np.int8),
        "u8": rng.integers(0, 256, (7,), dtype=np.uint8),
        "i32": rng.integers(-1000, 1000, (4,), dtype=np.int32),
        "u32": rng.integers(0, 2**32, (2, 2), dtype=np.uint32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def _raw_file(path, header, data=b"", length=None):
    """A hand-made safetensors file; `header` is a dict or raw bytes."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def test_round_trip_is_zero_copy_and_read_only(tmp_path):
    tensors = _tensors()
    path = tmp_path / "m.safetensors"
    write_safetensors(tensors, path, metadata={"format": "pt", "note": "hi"})
    got = read_safetensors(path)
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        np.testing.assert_array_equal(got[name], t)
        assert memmap_backed(got[name])
    with pytest.raises(ValueError):
        got["f32"][0, 0] = 1.0
    assert read_safetensors_metadata(path) == {"format": "pt", "note": "hi"}
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_all_tensors_share_one_memmap(tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors(_tensors(), path)
    got = read_safetensors(path)
    maps = set()
    for t in got.values():
        while not isinstance(t, np.memmap):
            t = t.base
        maps.add(id(t))
    assert len(maps) == 1


def test_strided_arrays_are_written_in_logical_order(tmp_path):
    # Written from the data pointer, a transpose would come back raw.
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = tmp_path / "t.safetensors"
    write_safetensors({"t": a.T, "s": a[:, ::2]}, path)
    got = read_safetensors(path)
    np.testing.assert_array_equal(got["t"], a.T)
    np.testing.assert_array_equal(got["s"], a[:, ::2])


def test_metadata_defaults_to_empty(tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors({"x": np.ones(2, np.float32)}, path)
    assert read_safetensors_metadata(path) == {}


def _bf16_file(path, bits: np.ndarray):
    bits = bits.astype("<u2")
    header = {"w": {"dtype": "BF16", "shape": list(bits.shape), "data_offsets": [0, bits.nbytes]}}
    return _raw_file(path, header, bits.tobytes())


def test_bf16_is_read_as_its_bits_without_a_copy(tmp_path):
    bits = np.arange(12).reshape(3, 4)
    t = read_safetensors(_bf16_file(tmp_path / "bf.safetensors", bits))["w"]
    assert isinstance(t, HalfTensor) and t.bf16 and t.shape == (3, 4) and t.nbytes == 24
    assert t.bits.dtype == np.uint16 and not t.bits.flags.writeable
    np.testing.assert_array_equal(t.bits, bits)
    assert memmap_backed(t.bits)   # a view of the file


def test_bf16_known_values(tmp_path):
    bits = np.array([0x3F80, 0xC000, 0x3FC0, 0x4049, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001])
    known = [1.0, -2.0, 1.5, 3.140625, np.inf, -np.inf, 0.0, -0.0, 2.0**-133]
    got = np.asarray(read_safetensors(_bf16_file(tmp_path / "bf.safetensors", bits))["w"])
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array(known, np.float32))
    assert np.signbit(got[7]) and not got.flags.writeable


def test_bf16_widens_exactly(tmp_path):
    ref = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    bits = ref.view(np.uint32) >> 16  # truncate float32 to bf16
    got = read_safetensors(_bf16_file(tmp_path / "bf.safetensors", bits))["w"].widen()
    assert got.shape == (4, 6)
    # Widening is exact: only the dropped low mantissa bits differ from the float32 source.
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32) & 0xFFFF0000)
    assert np.all(np.abs(got - ref) <= np.abs(ref) * 2**-7)  # bf16 keeps 8 significant bits


def test_bf16_and_f16_are_written_as_their_bits(tmp_path):
    bits = np.arange(0x3F00, 0x3F0C, dtype=np.uint16).reshape(3, 4)
    path = tmp_path / "h.safetensors"
    write_safetensors({"b": HalfTensor(bits, bf16=True), "h": HalfTensor(bits, bf16=False)}, path)
    got = read_safetensors(path)
    assert isinstance(got["b"], HalfTensor) and got["b"].bf16
    np.testing.assert_array_equal(got["b"].bits, bits)
    assert got["h"].dtype == np.float16   # F16 reads as numpy's float16
    np.testing.assert_array_equal(got["h"].view(np.uint16), bits)


def test_other_tools_read_what_nibble_writes(tmp_path):
    from safetensors.numpy import load_file
    tensors = _tensors()
    path = tmp_path / "m.safetensors"
    write_safetensors(tensors, path, metadata={"format": "pt"})
    got = load_file(path)
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        np.testing.assert_array_equal(got[name], t)


def test_every_tensor_starts_aligned(tmp_path):
    # odd-sized 1- and 2-byte tensors before and after 4-byte ones: laid out widest first
    tensors = {"u8": np.ones(3, np.uint8), "f32": np.ones(3, np.float32), "f16": np.ones(5, np.float16),
               "b": HalfTensor(np.ones(1, np.uint16), bf16=True), "u32": np.ones(2, np.uint32)}
    path = tmp_path / "a.safetensors"
    write_safetensors(tensors, path)
    for name, t in read_safetensors(path).items():
        a = t.bits if isinstance(t, HalfTensor) else t
        assert a.ctypes.data % a.itemsize == 0, name


def _stream(tensors: dict, order: list[str]) -> TensorStream:
    return TensorStream({n: TensorSpec(*spec) for n, spec in
                         {"a": ("F32", (2, 3)), "b": ("U32", (4,)), "c": ("F16", (3,))}.items()},
                        ((n, tensors[n]) for n in order))


STREAMED = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.uint32),
            "c": np.ones(3, np.float16)}


def test_stream_is_written_in_the_order_it_comes(tmp_path):
    path = tmp_path / "s.safetensors"
    write_safetensors(_stream(STREAMED, ["c", "a", "b"]), path)
    got = read_safetensors(path)
    for name, t in STREAMED.items():
        np.testing.assert_array_equal(got[name], t)


@pytest.mark.parametrize("order, tensors, match", [
    (["a", "b"], STREAMED, "never came: c"),
    (["a", "b", "c", "a"], STREAMED, "came twice"),
    (["a", "b", "c"], {**STREAMED, "b": np.arange(5, dtype=np.uint32)}, "'b' is .*the header says"),
    (["a", "b", "c"], {**STREAMED, "c": np.ones(3, np.float32)}, "'c' is .*the header says"),
])
def test_stream_that_breaks_its_header_leaves_nothing(tmp_path, order, tensors, match):
    with pytest.raises(ValueError, match=match):
        write_safetensors(_stream(tensors, order), tmp_path / "s.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_stream_leaves_nothing(tmp_path):
    def items():
        yield "a", STREAMED["a"]
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_safetensors(TensorStream(_stream(STREAMED, []).specs, items()), tmp_path / "s.safetensors")
    assert list(tmp_path.iterdir()) == []


def _resident_file_kb() -> int:
    """This process's resident pages that belong to mapped files (Linux)."""
    status = open("/proc/self/status").read()
    return int(status.split("RssFile:")[1].split()[0])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_release_gives_back_the_pages_of_a_read_tensor(tmp_path):
    path = tmp_path / "big.safetensors"
    big = np.arange(16 << 20, dtype=np.uint32)    # 64 MiB
    write_safetensors({"small": np.ones(3, np.float16), "big": big}, path)
    t = read_safetensors(path)["big"]
    before = _resident_file_kb()
    assert t.sum(dtype=np.uint64) == big.sum(dtype=np.uint64)   # reads every page
    assert _resident_file_kb() - before > 60 << 10
    release(t)
    assert _resident_file_kb() - before < 1 << 10
    np.testing.assert_array_equal(t, big)   # still there: read again from the file
    release(np.ones(3))   # a tensor in memory: nothing to give back


def test_empty_file_of_tensors(tmp_path):
    path = tmp_path / "e.safetensors"
    write_safetensors({"e": np.zeros((0,), np.float32)}, path)
    assert read_safetensors(path)["e"].shape == (0,)


def test_sharded_index(tmp_path):
    tensors = _tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:3],
              "model-00002-of-00002.safetensors": names[3:]}
    for shard, keys in shards.items():
        write_safetensors({k: tensors[k] for k in keys}, tmp_path / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = read_checkpoint(tmp_path)
    assert got.keys() == tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(got[k], tensors[k])


def test_sharded_index_missing_shard(tmp_path):
    write_safetensors({"a": np.ones(2, np.float32)}, tmp_path / "s1.safetensors")
    weight_map = {"a": "s1.safetensors", "b": "s2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match="s2.safetensors"):
        read_checkpoint(tmp_path)


def test_sharded_index_tensor_not_in_shard(tmp_path):
    write_safetensors({"a": np.ones(2, np.float32)}, tmp_path / "s1.safetensors")
    weight_map = {"a": "s1.safetensors", "ghost": "s1.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match="ghost"):
        read_checkpoint(tmp_path)


def test_bad_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(FormatError, match="weight_map"):
        read_checkpoint(tmp_path)


def test_checkpoint_prefers_model_safetensors_then_globs(tmp_path):
    write_safetensors({"a": np.ones(2, np.float32)}, tmp_path / "other.safetensors")
    assert list(read_checkpoint(tmp_path)) == ["a"]
    write_safetensors({"b": np.ones(2, np.float32)}, tmp_path / "model.safetensors")
    assert list(read_checkpoint(tmp_path)) == ["b"]


def test_checkpoint_duplicate_tensor_across_files(tmp_path):
    for name in ("x.safetensors", "y.safetensors"):
        write_safetensors({"a": np.ones(2, np.float32)}, tmp_path / name)
    with pytest.raises(FormatError, match="'a' is in both"):
        read_checkpoint(tmp_path)


def test_checkpoint_without_weights_names_directory(tmp_path):
    with pytest.raises(FormatError, match=str(tmp_path)):
        read_checkpoint(tmp_path)


def test_shorter_than_length_prefix(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x00\x00")
    with pytest.raises(FormatError, match="truncated"):
        read_safetensors(path)


@pytest.mark.parametrize("header, data, length, message", [
    (b"{}", b"", 1000, "past the end"),
    (b"{not json", b"", None, "not valid JSON"),
    (b"\xff\xfe", b"", None, "not valid JSON"),
    (b"[1, 2]", b"", None, "JSON object"),
    ({"a": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, bytes(2), None,
     "unsupported dtype 'F8_E4M3'; supported: BF16, BOOL, F16, F32"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), None,
     "needs 12 bytes, but data_offsets span 8"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4), None,
     "outside the data region of 4 bytes"),
    ({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}}, bytes(8), None,
     "outside the data region"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, bytes(8), None,
     "invalid data_offsets"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, bytes(8), None,
     "invalid data_offsets"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, bytes(8), None,
     "invalid data_offsets"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), None,
     "invalid shape"),
    ({"a": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "needs dtype, shape and data_offsets"),
])
def test_malformed_files_raise_format_error(tmp_path, header, data, length, message):
    path = _raw_file(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(FormatError, match=message) as e:
        read_safetensors(path)
    assert str(path) in str(e.value)


def _entry(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("header, data, message", [
    ({"a": _entry(offsets=(0, 4)), "b": _entry(offsets=(8, 12))}, bytes(12),
     r"tensor 'b' starts at byte 8 .* tensor 'a' ends at byte 4 \(gap\)"),
    ({"a": _entry(offsets=(4, 8))}, bytes(8), r"'a' starts at byte 4 .* starts at byte 0 \(gap\)"),
    ({"a": _entry(shape=(2,), offsets=(0, 8)), "b": _entry(shape=(2,), offsets=(4, 12))}, bytes(12),
     r"tensor 'b' starts at byte 4 .* tensor 'a' ends at byte 8 \(overlap\)"),
    ({"a": _entry(shape=(2,), offsets=(0, 8))}, bytes(4), "outside the data region of 4 bytes"),
    ({"a": _entry(offsets=(0, 4))}, bytes(8), "4 bytes after tensor 'a' belong to no tensor"),
    ({}, bytes(1), "1 bytes after the header belong to no tensor"),
])
def test_tensors_must_tile_the_data_region(tmp_path, header, data, message):
    path = _raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(FormatError, match=message) as e:
        read_safetensors(path)
    assert str(path) in str(e.value)


def test_empty_tensors_tile_anywhere_in_the_run(tmp_path):
    # zero-byte tensors sit between the others, as the safetensors crate allows
    header = {"a": _entry(offsets=(0, 4)), "e": _entry(shape=(0, 3), offsets=(4, 4)),
              "b": _entry(offsets=(4, 8))}
    got = read_safetensors(_raw_file(tmp_path / "e.safetensors", header, bytes(8)))
    assert got["e"].shape == (0, 3) and got["b"].shape == (1,)


def _written_by(writer: str, path):
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3, dtype=np.uint8)}
    if writer == "nibble":
        write_safetensors(tensors, path, metadata={"format": "pt"})
    else:
        from safetensors.numpy import save_file
        save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("writer", ["nibble", "safetensors"])
def test_both_writers_files_load(tmp_path, writer):
    path = tmp_path / "m.safetensors"
    tensors = _written_by(writer, path)
    got = read_safetensors(path)
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        np.testing.assert_array_equal(got[name], t)


@pytest.mark.parametrize("writer", ["nibble", "safetensors"])
@pytest.mark.parametrize("delta", [-1, 1])
def test_header_length_off_by_one_is_refused(tmp_path, writer, delta):
    # A length one short would read every tensor one byte early; one long, one byte late.
    path = tmp_path / "m.safetensors"
    _written_by(writer, path)
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", struct.unpack("<Q", raw[:8])[0] + delta)
    path.write_bytes(raw)
    with pytest.raises(FormatError) as e:
        read_safetensors(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("header, data, message", [
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
     b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', bytes(4),
     "key 'a' appears twice"),
    (b'{"a": {"dtype": "F32", "dtype": "U8", "shape": [1], "data_offsets": [0, 4]}}', bytes(4),
     "key 'dtype' appears twice"),
    ({"a": _entry(dtype=["F32"])}, bytes(4), r"unsupported dtype \['F32'\]"),
    ({"a": _entry(dtype={"F32": 1})}, bytes(4), r"unsupported dtype \{'F32': 1\}"),
    ({"a": _entry(dtype=4)}, bytes(4), "unsupported dtype 4"),
    ({"a": _entry(shape=[1] * 65)}, bytes(4), "65 dimensions; at most 32"),
    ({"a": _entry(shape=(2**64, 0), offsets=(0, 0))}, b"", "too large for any array"),
    ({"a": _entry(shape=(2**62, 1), offsets=(0, 0))}, b"", "too large for any array"),
    ({"a": _entry(shape=(-1, -4))}, bytes(4), "invalid shape"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", "nested too deeply"),
    (b'"a string"', b"", "JSON object, got str"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + b"9" * 5000 + b"]}}", bytes(4),
     "not valid JSON"),
    ('{"a": 1}'.encode("utf-16"), b"", "not valid JSON"),   # JSON, but not UTF-8
    ({"__metadata__": ["format", "pt"]}, b"", "__metadata__ must map strings"),
])
def test_absurd_headers_are_refused(tmp_path, header, data, message):
    path = _raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(FormatError, match=message) as e:
        read_safetensors(path)
    assert str(path) in str(e.value)


def test_header_over_the_crate_limit_is_refused(tmp_path):
    path = tmp_path / "big.safetensors"
    n = 100_000_001
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.truncate(8 + n)   # sparse: nothing is written
    with pytest.raises(FormatError, match="over the 100000000 bytes"):
        read_safetensors(path)


def test_bad_metadata(tmp_path):
    path = _raw_file(tmp_path / "m.safetensors", {"__metadata__": {"a": 1}})
    for read in (read_safetensors_metadata, read_safetensors):
        with pytest.raises(FormatError, match="__metadata__"):
            read(path)


def test_missing_file(tmp_path):
    with pytest.raises(FormatError, match="nope.safetensors"):
        read_safetensors(tmp_path / "nope.safetensors")


def test_write_failure_leaves_nothing_behind(tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors({"a": np.ones(2, np.float32)}, path)
    with pytest.raises(TypeError):
        write_safetensors({"a": np.zeros(2, np.float32)}, path, metadata={"bad": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
    np.testing.assert_array_equal(read_safetensors(path)["a"], np.ones(2))


def test_write_refuses_unreadable_dtype(tmp_path):
    with pytest.raises(FormatError, match="complex64"):
        write_safetensors({"c": np.zeros(2, np.complex64)}, tmp_path / "c.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_written_file_is_readable_by_others_under_the_umask(tmp_path):
    import os
    import stat
    old = os.umask(0o022)
    try:
        write_safetensors({"a": np.zeros(3, np.float32)}, tmp_path / "m.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "m.safetensors").st_mode) == 0o644
