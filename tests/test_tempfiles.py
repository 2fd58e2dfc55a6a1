"""Temporaries of killed runs: removed by the next writer into the folder, a live run's never."""
import os
import signal
import subprocess
import sys

import numpy as np

from nibble.formats.model_dir import read_model_dir, write_model_dir
from nibble.formats.safetensors import read_safetensors, write_safetensors
from nibble.formats.tempfiles import remove_leftovers, sibling, temp_dir, temp_file
from tests.tiny import tiny_model_dir

# A writer in another process: makes a temporary beside argv[1] with 2 MB in it, says where, waits.
HOLDER = """
import sys, time
from pathlib import Path
from nibble.formats.tempfiles import temp_dir, temp_file
dest = Path(sys.argv[1])
if sys.argv[2] == "dir":
    with temp_dir(dest) as tmp:
        (tmp / "model.safetensors").write_bytes(bytes(2_000_000))
        print(tmp, flush=True)
        time.sleep(60)
else:
    with temp_file(dest) as (tmp, f):
        f.write(bytes(2_000_000))
        f.flush()
        print(tmp, flush=True)
        time.sleep(60)
"""


def holder(dest, kind="dir"):
    """A live writer process and its temporary."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(dest), kind], stdout=subprocess.PIPE, text=True)
    return p, type(dest)(p.stdout.readline().strip())


def kill(p):
    p.send_signal(signal.SIGKILL)
    p.wait()
    p.stdout.close()


def test_a_live_writers_temporary_survives_and_a_dead_ones_is_removed(tmp_path, capsys):
    live, live_tmp = holder(tmp_path / "a")
    dead, dead_tmp = holder(tmp_path / "b")
    kill(dead)
    try:
        found = remove_leftovers(tmp_path)
        assert live_tmp.is_dir() and (live_tmp / "model.safetensors").stat().st_size == 2_000_000
    finally:
        kill(live)
    assert [(f.path, f.kind, f.nbytes) for f in found] == [(dead_tmp, "directory", 2_000_000)]
    assert not dead_tmp.exists()
    err = capsys.readouterr().err
    assert err == (f"nibble: removed a leftover temporary directory from an interrupted write: "
                   f"{dead_tmp}, 2 MB\n")
    remove_leftovers(tmp_path)   # now the other one's writer is dead too
    assert not live_tmp.exists() and os.listdir(tmp_path) == []


def test_this_processs_own_temporaries_are_live_too(tmp_path, capsys):
    with temp_dir(tmp_path / "m") as d, temp_file(tmp_path / "w.safetensors") as (f, _):
        assert remove_leftovers(tmp_path) == [] and d.is_dir() and f.is_file()
    assert os.listdir(tmp_path) == [] and capsys.readouterr().err == ""


def test_writing_a_model_removes_a_killed_writes_leftover_and_says_so(tmp_path, capsys):
    out = tmp_path / "model"
    p, tmp = holder(out)
    kill(p)
    write_model_dir(tiny_model_dir(), out)
    assert not tmp.exists() and sorted(os.listdir(tmp_path)) == ["model"]
    assert read_model_dir(out).config.model_type == "llama"
    assert f"removed a leftover temporary directory from an interrupted write: {tmp}, 2 MB" in capsys.readouterr().err


def test_writing_safetensors_removes_a_killed_writes_temporary_file(tmp_path, capsys):
    path = tmp_path / "w.safetensors"
    p, tmp = holder(path, "file")
    kill(p)
    write_safetensors({"x": np.arange(3, dtype=np.float32)}, path)
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"] and read_safetensors(path)["x"].tolist() == [0, 1, 2]
    assert f"temporary file from an interrupted write: {tmp}, 2 MB" in capsys.readouterr().err


def test_a_replace_killed_between_its_renames_is_put_back(tmp_path, capsys):
    out = tmp_path / "model"
    old = sibling(out, "old")   # the old model, out of the way; its writer died before the new one came
    old.mkdir()
    (old / "config.json").write_text("{}")
    found = remove_leftovers(tmp_path)
    assert [f.restored for f in found] == [out] and (out / "config.json").read_text() == "{}"
    assert f"put back {out} from an interrupted replace ({old.name})" in capsys.readouterr().err


def test_an_old_replaced_model_and_an_old_nibbles_fetch_directory_are_removed(tmp_path):
    (tmp_path / "model").mkdir()
    old = sibling(tmp_path / "model", "old")
    old.mkdir()
    fetch = tmp_path / ".smollm2-fetch-k3x_9a2b"   # tempfile.TemporaryDirectory's, before the locks
    fetch.mkdir()
    (fetch / "x.whl").write_bytes(bytes(1500))
    unrelated = [tmp_path / ".cache", tmp_path / "notes.tmp", tmp_path / ".model.12345678.tmp.bak"]
    for path in unrelated:
        path.write_text("")
    found = remove_leftovers(tmp_path)
    assert sorted(f.path for f in found) == sorted([fetch, old])
    assert sorted(os.listdir(tmp_path)) == sorted(["model", *(p.name for p in unrelated)])


def test_a_link_named_like_a_temporary_is_left_alone(tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    link = sibling(tmp_path / "model", "tmp")
    link.symlink_to(target)
    assert remove_leftovers(tmp_path) == [] and link.is_symlink() and target.is_dir()


def test_a_temporary_that_is_not_renamed_is_removed_at_the_end(tmp_path):
    try:
        with temp_dir(tmp_path / "m") as d:
            (d / "half-written").write_text("x")
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert os.listdir(tmp_path) == []
