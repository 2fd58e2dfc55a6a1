"""The KV cache's disk tier: blocks kept on disk when hashed, read back by a pool of another
process (a new pool here, a new engine, a second `nibble run`), byte for byte and with the same
replies; a damaged or torn file deleted, never used; a folder per model, KV type and nibble; the
bound kept, least recently used first; a writer killed with kill -9, again and again."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from nibble.runner.kv.blocks import BlockPool
from nibble.runner.kv.cache import BLOCK, KVCache
from nibble.runner.generation.decoding import Request
from nibble.runner.generation.engine import Engine
from nibble.runner.generation.generate import stream_generate
from nibble.runner.kv.disk import DiskBlocks, fingerprint, open_disk, parse_size
from nibble.runner.loader import load
from nibble.runner.generation.sample import make_sampler
from nibble.runner.serve.models import EngineOptions
from nibble.runner.generation.session import ChatSession
from nibble.runner.settings import SamplerSettings
from tests.test_cli import assert_one_line_error, invoke
from tests.serving import serving
from tests.test_engine import Collector

ROOT = Path(__file__).parent.parent
GREEDY = SamplerSettings(temperature=0)
CTX = 256
GIB = 1 << 30


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(str(tiny_dir))


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))   # the disk tier's folder; the kernels' is set already
    return tmp_path


def prompt(tok, n=70):
    """n ids of text: 4 full blocks and a part of one for n = 70."""
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 40)
    return ids[:n]


def pool_on_disk(model, limit=GIB, kv_type="f32"):
    kv = model.new_pool(2 * CTX // BLOCK, kv_type)
    return BlockPool(kv, open_disk(model.source, kv, limit))


def admitted(pool, ids):
    """A sequence of CTX positions on `pool`, put on `ids` as the engine admits a request."""
    cache = KVCache.on_pool(pool.kv, CTX)
    pool.admit(cache, ids, CTX)
    return cache


def reply(model, tok, ids, cache):
    """The greedy reply to ids on `cache` (which may hold a prefix of them)."""
    return "".join(r.text for r in stream_generate(model, tok, ids, sampler=make_sampler(GREEDY, tok),
                                                    max_tokens=8, cache=cache))


def run_once(tiny, ids):
    """A reply on a fresh pool with a disk tier, its blocks committed as they would be at its end."""
    model, tok = tiny
    pool = pool_on_disk(model)
    cache = admitted(pool, ids)
    text = reply(model, tok, ids, cache)
    pool.commit(cache)
    return pool, cache.blocks, text


def test_blocks_kept_on_disk_are_read_back_by_a_new_pool_byte_for_byte(tiny, home):
    model, tok = tiny
    ids = prompt(tok)
    first, seq, text = run_once(tiny, ids)
    folder = first.disk.folder
    assert folder.parent == home / "kv" and len(list(folder.glob("*.kv"))) == (len(ids) + 8 - 1) // BLOCK

    pool = pool_on_disk(model)          # another process's, as after a restart
    cache = admitted(pool, ids)
    again = cache.blocks
    assert again.cached == again.from_disk == 4 * BLOCK and cache.pos == 4 * BLOCK
    for mine, theirs in zip(again.blocks[:4], seq.blocks[:4]):
        assert [bytes(v) for v in pool._views(mine)] == [bytes(v) for v in first._views(theirs)]
    assert reply(model, tok, ids, cache) == text   # as if it had prefilled them


def test_a_second_engine_serves_the_prefix_from_disk_with_the_same_reply(tiny, home):
    """The server restarted: a request seen before prefills only what the disk has not."""
    model, tok = tiny
    ids = prompt(tok, 60)

    def served():
        engine = Engine(model, tok, parallel=2, ctx=CTX, kv_disk=GIB)
        engine.start()
        try:
            c = Collector()
            engine.submit(Request(ids, GREEDY, 8), c)
            return c.text(), c.last().usage
        finally:
            engine.close()

    text, usage = served()
    assert usage.cached_tokens == usage.disk_tokens == 0
    again, usage = served()
    assert again == text and usage.cached_tokens == usage.disk_tokens == 3 * BLOCK


@pytest.mark.parametrize("damage", ["a payload byte", "the header's hash", "cut short", "empty"])
def test_a_damaged_block_is_deleted_and_never_used(tiny, home, damage):
    model, tok = tiny
    ids = prompt(tok)
    first, seq, text = run_once(tiny, ids)
    second = first.disk.path(seq.hashes[1])
    data = bytearray(second.read_bytes())
    if damage == "a payload byte":
        data[-100] ^= 1
    elif damage == "the header's hash":
        data[30] ^= 1
    elif damage == "cut short":
        del data[len(data) // 2:]
    else:
        data.clear()
    second.write_bytes(data)

    pool = pool_on_disk(model)
    cache = admitted(pool, ids)
    again = cache.blocks
    assert again.cached == again.from_disk == BLOCK   # the first block; the rest leads through the damaged one
    assert not second.exists()
    assert len(pool.cached) == 2 and len(pool.by_hash) == 3   # the two read whole past it kept as cache
    assert reply(model, tok, ids, cache) == text


def test_a_block_is_looked_for_only_under_its_own_model_kv_type_and_nibble(tiny, home):
    model, tok = tiny
    kv = model.new_pool(4)
    assert fingerprint(model.source, kv) == fingerprint(model.source, model.new_pool(8))   # any size of pool
    assert fingerprint(model.source, kv) != fingerprint("another model", kv)
    assert fingerprint(model.source, kv) != fingerprint(model.source, model.new_pool(4, "int8"))
    ids = prompt(tok)
    run_once(tiny, ids)
    pool = pool_on_disk(model, kv_type="int8")
    assert pool.sequence(ids).cached == 0 and pool.disk.folder != pool_on_disk(model).disk.folder


def test_no_disk_tier_where_it_is_off_or_the_weights_have_no_files(tiny, home):
    model, _ = tiny
    kv = model.new_pool(4)
    assert open_disk(model.source, kv, 0) is None and open_disk(None, kv, GIB) is None
    assert not (home / "kv").exists()


def test_a_cache_folder_that_cannot_be_made_leaves_the_model_running_without_the_tier(tiny_dir, home):
    (home / "kv").write_text("a file where the folder would be")
    r = invoke("run", "-m", tiny_dir, "--temp", "0", "-n", "3", "--kv-disk", "1G", "Tell me about the fox. " * 6)
    assert r.exit_code == 0 and "disk cache" not in r.stderr, r.output


def test_the_bound_is_kept_least_recently_used_first(home):
    views = [memoryview(np.full(1000, i, np.uint8)) for i in range(3)]
    disk = DiskBlocks(home / "kv" / "model", limit=2500)
    a, b, c = (bytes([i]) * 16 for i in range(3))
    disk.save(a, views[:1])
    os.utime(disk.path(a), ns=(1, 1))
    disk.save(b, views[1:2])
    os.utime(disk.path(b), ns=(2, 2))
    got = memoryview(bytearray(1000))
    assert disk.load(a, [got]) and bytes(got) == bytes(views[0])   # a used: now the most recent
    disk.save(c, views[2:])   # over the bound: b, the least recently used, goes
    assert a in disk and b not in disk and c in disk


@pytest.mark.parametrize("text,size", [("8G", 8 * GIB), ("500M", 500 << 20), ("0", 0), ("1.5k", 1536),
                                       ("2GiB", 2 * GIB), (" 3 gb ", 3 * GIB), ("12345", 12345)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "lots", "-1G", "1X", "nan", "inf", "1e999G", "8 G B"])
def test_a_bad_size_is_one_line(text):
    assert_one_line_error(invoke("run", "--kv-disk", text, "Hi"), code=2, match="--kv-disk")


def test_nibble_run_twice_reads_the_prompt_back_from_disk(tiny_dir, home):
    question = "Tell me about the quick brown fox. " * 8
    first = invoke("run", "-m", tiny_dir, "--temp", "0", "-n", "6", question, env={"NIBBLE_KV_DISK": "1G"})
    second = invoke("run", "-m", tiny_dir, "--temp", "0", "-n", "6", "--kv-disk", "1G", question)
    assert first.exit_code == second.exit_code == 0, first.output + second.output
    assert "disk cache" not in first.stderr and second.stdout == first.stdout
    assert "from the disk cache" in second.stderr.splitlines()[-1]
    off = invoke("run", "-m", tiny_dir, "--temp", "0", "-n", "6", "--kv-disk", "0", question)
    assert off.stdout == first.stdout and "disk cache" not in off.stderr


# A writer of blocks, each a hash and bytes that follow from it, saying each one saved.
WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from pathlib import Path
    from nibble.runner.kv.disk import DiskBlocks
    disk = DiskBlocks(Path(sys.argv[1]), limit=1 << 30)
    for i in range(int(sys.argv[2]), 10**9):
        h = i.to_bytes(16, "little")
        disk.save(h, [memoryview(np.full(200_000, i % 251, np.uint8)), memoryview(np.arange(5000, dtype=np.uint8))])
        print(i, flush=True)
""")


@pytest.mark.slow
def test_a_writer_killed_twenty_times_leaves_only_whole_blocks(tmp_path):
    folder = tmp_path / "kv" / "model"
    for round in range(20):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(1000 * round)], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
        for _ in range(round % 4 + 1):   # killed after some whole blocks, in the middle of another
            writer.stdout.readline()
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
    disk = DiskBlocks(folder, limit=1 << 30)   # as the next process opens it
    assert not [p for p in folder.iterdir() if not p.name.endswith(".kv")]   # the killed writers' temporaries gone
    names = sorted(folder.glob("*.kv"))
    assert len(names) >= 20
    for path in names:
        i = int.from_bytes(bytes.fromhex(path.stem), "little")
        got = [memoryview(bytearray(200_000)), memoryview(bytearray(5000))]
        assert disk.load(bytes.fromhex(path.stem), got)
        assert bytes(got[0]) == bytes([i % 251]) * 200_000
        assert bytes(got[1]) == np.arange(5000, dtype=np.uint8).tobytes()


def test_a_chat_reopened_after_a_restart_prefills_only_what_the_disk_has_not(tiny, home):
    model, tok = tiny
    first = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog. " * 6}]
    said = "".join(c.text for c in ChatSession(model, tok, ctx=CTX, pool=pool_on_disk(model)).reply(
        first, GREEDY, max_tokens=8))
    then = first + [{"role": "assistant", "content": said}, {"role": "user", "content": "And then?"}]
    reopened = list(ChatSession(model, tok, ctx=CTX, pool=pool_on_disk(model)).reply(then, GREEDY, max_tokens=8))
    stats = reopened[-1].stats
    held = len(ChatSession(model, tok, ctx=CTX).fit(first, 8)[0]) // BLOCK * BLOCK   # the first prompt's full blocks
    assert stats.reused == stats.from_disk >= held > 0 and stats.prefilled == stats.prompt_tokens - stats.reused
    alone = ChatSession(model, tok, ctx=CTX).reply(then, GREEDY, max_tokens=8)   # no pool, no disk
    assert "".join(c.text for c in reopened) == "".join(c.text for c in alone)


def test_a_restarted_server_serves_the_prefix_from_disk_and_says_so(tiny_dir, home):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Numba compiles Python, said the fox. " * 5}],
            "max_tokens": 6, "temperature": 0}
    replies = []
    for _ in range(2):   # the server, then the server restarted
        with serving(tiny_dir, "tiny", EngineOptions(parallel=2, queue=4, ctx=CTX, kv_disk=GIB)) as running:
            status, _, raw = running.post("/v1/chat/completions", body)
            assert status == 200, raw
            replies.append(json.loads(raw))
    before, after = (r["usage"]["prompt_tokens_details"] for r in replies)
    assert before == {"cached_tokens": 0, "disk_tokens": 0}
    assert after["cached_tokens"] == after["disk_tokens"] == (replies[1]["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]
