"""The models on disk (formats/catalog.py) and the commands over them: nibble pull, ls and rm, on
caches laid out by hand and a hub started by the test; the GGUF header reader."""
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, strategies as st

from nibble.formats import catalog, usage
from nibble.formats.errors import FormatError
from nibble.formats.gguf_header import read_gguf_header
from nibble.quant.open_model import open_model
from nibble.tui.cli.models import format_bytes
from tests.test_cli import assert_one_line_error, invoke
from tests.test_gguf import TOKENS, llama_cpp_tensors, write_gguf
from tests.test_hub import TINY_REPO, fake_hub, isolated, lay_out_snapshot   # noqa: F401 (fixtures)
from tests.tiny import tiny_config, tiny_tensors

CONFIG = tiny_config(vocab_size=len(TOKENS))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(path, llama_cpp_tensors(tiny_tensors(CONFIG), CONFIG), config=CONFIG)
    return path.read_bytes()


def gguf_repo(data: bytes) -> dict[str, bytes]:
    # Two quantizations sharing nothing, a split one, a projector and a README
    return {"README.md": b"# m", "m-Q4_K_M.gguf": data, "m-UD-Q4_K_M.gguf": data + b"\0",
            "m-Q8_0.gguf": data + b"\0\0", "mmproj-m-f16.gguf": b"vision",
            "Q6_K/m-Q6_K-00001-of-00002.gguf": data + b"1", "Q6_K/m-Q6_K-00002-of-00002.gguf": b"2"}


def test_the_gguf_header_reader_gives_what_gguf_reads(tmp_path, tiny_gguf):
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_gguf)
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["llama.block_count"] == CONFIG.num_hidden_layers
    assert {n: (t.size, t.ggml_type) for n, t in header.tensors.items()} == {
        t.name: (int(t.n_elements), int(t.tensor_type)) for t in reader.tensors}
    assert "tokenizer.ggml.tokens" not in header.metadata   # arrays are stepped over


@given(cut=st.integers(0, 4000), flip=st.integers(0, 4000), byte=st.integers(0, 255))
def test_a_damaged_gguf_header_is_a_format_error(tmp_path_factory, tiny_gguf, cut, flip, byte):
    data = bytearray(tiny_gguf[:max(cut, 0) or None])
    if flip < len(data):
        data[flip] = byte
    path = tmp_path_factory.mktemp("damaged") / "m.gguf"
    path.write_bytes(bytes(data))
    try:
        read_gguf_header(path)
    except FormatError as e:
        assert "\n" not in str(e)


def test_ls_lists_each_gguf_model_by_a_tag_that_loads_it(isolated, tiny_gguf):
    snapshot = lay_out_snapshot(isolated / "hf-hub", "org/m-GGUF", gguf_repo(tiny_gguf))
    lay_out_snapshot(isolated / "hf-hub", "org/tiny", TINY_REPO)
    models = catalog.list_cached_models()
    # Q4_K_M alone would name UD-Q4_K_M too: a tag is whole between separators
    assert [(m.ref, m.path.relative_to(snapshot).as_posix() if m.repo_id == "org/m-GGUF" else None) for m in models] == [
        ("org/m-GGUF:Q6_K", "Q6_K/m-Q6_K-00001-of-00002.gguf"), ("org/m-GGUF:Q8_0", "m-Q8_0.gguf"),
        ("org/m-GGUF:UD-Q4_K_M", "m-UD-Q4_K_M.gguf"), ("org/m-GGUF:m-Q4_K_M", "m-Q4_K_M.gguf"), ("org/tiny", None)]
    split = models[0]
    assert split.size_bytes == len(tiny_gguf) + 2
    from nibble.formats import hub
    for m in models:   # each name, typed back, loads that model from the cache
        assert hub.resolve(m.ref) == m.path
    result = invoke("ls")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "FAMILY", "PARAMETERS", "QUANTIZATION", "SIZE", "LAST", "USED"]
    params = sum(int(np.prod(w.shape)) for w in tiny_tensors(CONFIG).values())
    assert lines[2].split()[:4] == ["org/m-GGUF:Q8_0", "llama", f"{params / 1e3:.0f}K", "F32"]
    assert lines[2].endswith("just now")   # resolve() above recorded the use
    rows = json.loads(invoke("ls", "--json").stdout)
    assert rows[1]["parameters"] == params and rows[1]["format"] == "gguf" and rows[1]["last_used"]


def test_a_quantized_directory_counts_its_packed_weights(isolated):
    from nibble.formats.model_dir import write_model_dir
    from nibble.quant.convert import quantize_model
    from tests.tiny import tiny_model_dir
    model = tiny_model_dir()
    params = sum(int(np.prod(np.shape(w))) for w in model.tensors.values())
    out = write_model_dir(quantize_model(model, 4, 32, embed_bits=8, method="rtn").model,
                          isolated / "nibble" / "models" / "smollm2")
    details = catalog.describe(out)
    assert (details.family, details.parameters, details.quantization) == ("llama", params, "int4 g32")
    assert [m.ref for m in catalog.list_cached_models()] == ["smollm2"]


def test_last_use_is_recorded_by_resolve_and_never_fails_a_run(isolated, monkeypatch):
    snapshot = lay_out_snapshot(isolated / "hf-hub", "org/tiny", TINY_REPO)
    from nibble.formats import hub
    assert usage.last_used(snapshot) is None
    hub.resolve("org/tiny", record=False)
    assert usage.last_used(snapshot) is None
    hub.resolve("org/tiny")
    assert usage.last_used(snapshot) is not None
    blocker = isolated / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NIBBLE_HOME", str(blocker))   # its used/ folder cannot be made, even by root
    assert hub.resolve("org/tiny") == snapshot


def test_rm_removes_one_gguf_model_and_keeps_the_others(isolated, tiny_gguf):
    repo = isolated / "hf-hub" / "models--org--m-GGUF"
    lay_out_snapshot(isolated / "hf-hub", "org/m-GGUF", gguf_repo(tiny_gguf))
    before = {p.name for p in (repo / "blobs").iterdir()}
    result = invoke("rm", "org/m-GGUF:q6_k", "-y")   # any spelling resolve() takes
    assert result.exit_code == 0, result.output
    assert result.stdout == f"removed org/m-GGUF:Q6_K: {format_bytes(len(tiny_gguf) + 2)} freed\n"
    assert [m.ref for m in catalog.list_cached_models()] == [
        "org/m-GGUF:Q8_0", "org/m-GGUF:UD-Q4_K_M", "org/m-GGUF:m-Q4_K_M"]
    assert len(before) - len(list((repo / "blobs").iterdir())) == 2
    assert not any((repo / "snapshots").glob("*/Q6_K"))   # the folder it left empty
    for ref in ["hf.co/org/m-GGUF:Q8_0", "org/m-GGUF:UD-Q4_K_M"]:   # then Q4_K_M names one
        assert invoke("rm", ref, "-y").exit_code == 0
    # The last model: huggingface_hub deletes the revision, README and all
    path = catalog.list_cached_models()[0].path
    result = invoke("rm", str(path), "-y")
    assert result.exit_code == 0 and not repo.exists()
    assert catalog.list_cached_models() == []


def test_rm_of_a_safetensors_repo_and_of_an_alias(isolated):
    lay_out_snapshot(isolated / "hf-hub", "org/tiny", TINY_REPO)
    own = isolated / "nibble" / "models" / "smollm2"
    own.mkdir(parents=True)
    (own / "config.json").write_text("{}")
    result = invoke("rm", "org/tiny", "-y")
    assert result.stdout == f"removed org/tiny: {sum(map(len, TINY_REPO.values()))} B freed\n"
    assert invoke("rm", "smollm2", "-y").stdout == "removed smollm2: 2 B freed\n"
    assert not own.exists() and catalog.list_cached_models() == []


@pytest.mark.parametrize("ref,match", [
    ("org/absent", "no model org/absent in nibble's cache or the Hugging Face cache"),
    ("smollm2", "no model smollm2"),
    ("org/tiny:Q8_0", "no model org/tiny:Q8_0"),
    ("a b/../c::", "no model a b/../c::"),
])
def test_rm_of_what_is_not_cached_is_one_line(isolated, ref, match):
    lay_out_snapshot(isolated / "hf-hub", "org/tiny", TINY_REPO)
    assert_one_line_error(invoke("rm", ref, "-y"), 1, match)


def test_rm_refuses_a_path_outside_the_caches(isolated, tmp_path_factory):
    outside = tmp_path_factory.mktemp("mine") / "model.gguf"
    outside.write_bytes(b"x")
    assert_one_line_error(invoke("rm", str(outside), "-y"), 1, "is not in nibble's cache or the Hugging Face cache")
    assert outside.exists()


def test_pull_downloads_once_and_says_where(fake_hub, isolated, tiny_gguf, monkeypatch):
    fake = fake_hub({"org/m-GGUF": {"m-Q8_0.gguf": tiny_gguf, "m-Q4_0.gguf": b"other"}})
    result = invoke("pull", "org/m-GGUF:Q8_0")
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith("org/m-GGUF:Q8_0: llama ") and " F32, " in line and line.endswith("m-Q8_0.gguf")
    assert [m.ref for m in catalog.list_cached_models()] == ["org/m-GGUF:Q8_0"]
    assert usage.last_used(catalog.list_cached_models()[0].path) is None   # a pull is not a use
    fake.requests.clear()
    assert invoke("pull", "org/m-GGUF:Q8_0").stdout == result.stdout and fake.requests == []


def test_pull_quantizes_a_float_model_as_its_first_run_would(isolated, tiny_dir, monkeypatch):
    from nibble.runner import loader
    lay_out_snapshot(isolated / "hf-hub", "org/tiny", {p.name: p.read_bytes() for p in tiny_dir.iterdir()})
    assert " int4 g64 copy" not in invoke("pull", "org/tiny").stdout   # under 1B weights: runs as stored
    monkeypatch.setattr(loader, "AUTO_QUANT_PARAMS", 1000)               # the tiny model has more
    result = invoke("pull", "org/tiny")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("org/tiny: llama ") and " f32 + int4 g64 copy, " in result.stdout
    assert "quantized org/tiny to int4" in result.stderr
    [model] = catalog.list_cached_models()
    assert len(model.copies) == 1 and usage.last_used(model.path) is None
    again = invoke("pull", "org/tiny")   # the copy is there: not quantized again
    assert again.stdout == result.stdout and "quantiz" not in again.stderr
    result = invoke("pull", str(tiny_dir))   # a path outside the caches: its copy in nibble's
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{tiny_dir}: llama ") and " f32 + int4 g64 copy, " in result.stdout


def test_pull_of_a_path_checks_it(isolated, tiny_gguf):
    path = isolated / "m.gguf"
    path.write_bytes(tiny_gguf)
    assert invoke("pull", str(path)).stdout.startswith(f"{path}: llama ")
    (isolated / "bad.gguf").write_bytes(tiny_gguf[:100])
    assert_one_line_error(invoke("pull", str(isolated / "bad.gguf")), 1, "truncated or damaged")
    assert_one_line_error(invoke("pull", "nothing-here"), 1, "no model at nothing-here")


def test_ps_without_a_server_is_one_line():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # bound, not listening: refused
        assert_one_line_error(invoke("ps", "--port", port), 1, f"no nibble serve at http://127.0.0.1:{port}")


def test_a_cache_path_that_is_no_model(isolated):
    (isolated / "nibble" / "models").mkdir(parents=True)
    assert_one_line_error(invoke("rm", str(isolated / "nibble" / "models"), "-y"), 1, "no model")
    assert os.path.isdir(isolated / "nibble" / "models")


def test_list_cached_models(isolated):
    snapshot = lay_out_snapshot(isolated / "hf-hub", "org/tiny", TINY_REPO)
    pinned = lay_out_snapshot(isolated / "hf-hub", "org/pinned", TINY_REPO, ref="v2")
    lay_out_snapshot(isolated / "hf-hub", "org/configonly", {"config.json": b"{}"})
    own = isolated / "nibble" / "models" / "smollm2"
    own.mkdir(parents=True)
    (own / "config.json").write_text("{}")
    (isolated / "nibble" / "models" / ".smollm2-fetch-x").mkdir()   # a fetch in progress
    models = catalog.list_cached_models()
    assert [(m.ref, m.path) for m in models] == [
        ("smollm2", own), (f"org/pinned@{pinned.name}", pinned), ("org/tiny", snapshot)]
    assert models[-1].size_bytes == sum(len(data) for data in TINY_REPO.values())


def test_list_cached_models_empty():
    assert catalog.list_cached_models() == []


def test_quantized_copies_are_listed_and_removed_with_their_model(isolated):
    """A float model's copy quantized on first use shows in its row (ls), goes with it (rm), and
    can be removed alone by its path; a copy whose model is gone is listed by its path."""
    snapshot = lay_out_snapshot(isolated / "hf-hub", "org/tiny", TINY_REPO)
    quantized = isolated / "nibble" / "quantized"

    def copy(name: str, bits: int) -> str:
        d = quantized / name
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"model_type": "llama",
                                                   "quantization": {"bits": bits, "group_size": 64}}))
        (d / "model.safetensors").write_bytes(TINY_REPO["model.safetensors"])
        return str(d)

    int4, int8 = copy(catalog.copy_name("org/tiny", snapshot, 4), 4), copy(catalog.copy_name("org/tiny", snapshot, 8), 8)
    orphan = copy("gone-0123456789ab-int4", 4)
    copy("writing-0123456789ab-int4", 4)
    os.remove(quantized / "writing-0123456789ab-int4" / "config.json")   # a write in progress
    models = catalog.list_cached_models()
    assert [(m.ref, m.copies) for m in models] == [("org/tiny", tuple(map(Path, (int4, int8)))), (orphan, ())]
    size = sum(map(len, TINY_REPO.values()))
    lines = invoke("ls").stdout.splitlines()
    copies = sum(catalog.size_on_disk(Path(c)) for c in (int4, int8))
    assert lines[1].startswith("org/tiny ") and " + int4 g64 copy + int8 g64 copy " in lines[1], lines
    assert f" {format_bytes(size + copies)} " in lines[1] and lines[2].startswith(f"{orphan} "), lines
    row = json.loads(invoke("ls", "--json").stdout)[0]
    assert [(c["quantization"], c["path"]) for c in row["copies"]] == [("int4 g64", int4), ("int8 g64", int8)]

    assert invoke("rm", int8, "-y").stdout.startswith(f"removed {int8}: ")   # the copy alone
    assert os.path.isdir(snapshot) and not os.path.exists(int8)
    result = invoke("rm", "org/tiny", "-y")
    assert result.stdout.startswith("removed org/tiny and its quantized copy: ")
    assert not os.path.exists(int4) and not os.path.exists(snapshot)
    assert [m.ref for m in catalog.list_cached_models()] == [orphan]
    assert invoke("rm", orphan, "-y").exit_code == 0 and catalog.list_cached_models() == []


def test_the_copy_first_use_writes_is_the_one_ls_finds(isolated, tiny_dir):
    """loader.as_quantized's copy of a hub model is listed under the model (the same identity)."""
    from nibble.runner import loader
    snapshot = lay_out_snapshot(isolated / "hf-hub", "org/tiny", {f.name: f.read_bytes() for f in tiny_dir.iterdir()})
    loader.as_quantized("org/tiny", open_model("org/tiny"), "int8")
    [model] = catalog.list_cached_models()
    assert model.path == snapshot and len(model.copies) == 1
    assert catalog.describe(model.copies[0]).quantization == "int8 g64"
