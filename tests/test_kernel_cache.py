"""Compiled kernels are cached under nibble's cache directory, per version of the kernel sources."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nibble.formats.model_dir import write_model_dir
from nibble.runner.kernels.layer import decoder_layer
from tests.hand_safetensors import write_safetensors_by_hand
from tests.kernel_caches import cache_without
from tests.test_target import needs_avx2
from tests.tiny import TEXT, tiny_model_dir

ROOT = Path(__file__).parent.parent

RUN_A_KERNEL = """
import numpy as np
from nibble.runner.kernels import cpu
x = np.ones((1, 8), np.float32)
cpu.rmsnorm(x, np.ones(8, np.float32), 1e-5, x)
"""


def _env(home: Path) -> dict:
    """This environment's, with nibble's cache in `home` and this CPU's own kernels (NIBBLE_CPU unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "NIBBLE_CPU")}
    return env | {"NIBBLE_HOME": str(home)}


def test_kernels_are_cached_per_version_of_their_sources(tmp_path):
    stale = tmp_path / "numba" / "0123456789abcdef"           # the cache of older kernel sources
    stale.mkdir(parents=True)
    (stale / "cpu.rmsnorm-1.py311.nbi").write_bytes(b"old")
    run = lambda code: subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), cwd=ROOT, check=True)
    run("import nibble.runner.kernels")
    assert list((tmp_path / "numba").iterdir()) == [stale]    # importing leaves the cache alone
    run(RUN_A_KERNEL)                                           # compiling deletes the older cache
    (current,) = (tmp_path / "numba").iterdir()
    assert current.name != stale.name and len(current.name) == 16
    assert any(p.name.startswith("cpu.rmsnorm") and p.suffix == ".nbi" for p in current.rglob("*"))


@needs_avx2
def test_kernels_without_avx512_keep_a_folder_of_their_own(tmp_path):
    """NIBBLE_CPU=avx2's kernels and this CPU's own are cached side by side: a compile deletes the
    older folders of its own kind only, so runs with and without NIBBLE_CPU keep each other's."""
    stale, stale_avx2 = tmp_path / "numba" / "0123456789abcdef", tmp_path / "numba" / "avx2-0123456789abcdef"
    for folder in (stale, stale_avx2):
        folder.mkdir(parents=True)
    env = {k: v for k, v in _env(tmp_path).items() if not k.startswith("NUMBA_CPU")}
    run = lambda **more: subprocess.run([sys.executable, "-c", RUN_A_KERNEL], env=env | more, cwd=ROOT, check=True)
    run(NIBBLE_CPU="avx2")
    (avx2,) = set((tmp_path / "numba").iterdir()) - {stale}
    assert avx2.name.startswith("avx2-") and avx2 != stale_avx2 and stale.is_dir()
    run(NIBBLE_CPU="")                                           # unset: this CPU's own
    (own,) = set((tmp_path / "numba").iterdir()) - {avx2}
    assert own != stale and len(own.name) == 16 and own.name != avx2.name[5:] and avx2.is_dir()
    assert any(p.name.startswith("cpu.rmsnorm") and p.suffix == ".nbi" for p in avx2.rglob("*"))


@pytest.mark.slow
def test_a_cache_shared_by_model_types_and_dtypes_loads_in_fresh_processes(tmp_path):
    """The decoder layer compiled for qwen2 in a process that loaded the other kernels from the
    cache was cached without what starts numba's thread pool: every later qwen2 run died with
    SIGSEGV. Each run here is a fresh process on one shared cache, which starts with this
    session's kernels but the layers': each model's layer is compiled in such a process, then
    loaded by the next run of that model."""
    cache_without(tmp_path / "home", decoder_layer)
    models = {"llama f32": write_model_dir(tiny_model_dir("llama"), tmp_path / "llama"),
              "qwen2 f32": write_model_dir(tiny_model_dir("qwen2"), tmp_path / "qwen2")}
    qwen2 = tiny_model_dir("qwen2")
    models["qwen2 bf16"] = write_model_dir(qwen2, tmp_path / "qwen2-bf16")
    write_safetensors_by_hand(qwen2.tensors, models["qwen2 bf16"] / "model.safetensors", bf16=lambda name: True)
    text = tmp_path / "text.txt"
    text.write_text(TEXT[:len(TEXT) // 2], encoding="utf-8")
    ppl = {}
    for name in ["llama f32", "qwen2 f32", "qwen2 bf16", "qwen2 f32", "qwen2 bf16"]:
        run = subprocess.run([sys.executable, "-m", "nibble.tui.cli.main", "perplexity", str(text),
                              "-m", str(models[name]), "--ctx", "32", "--json"],
                             env=_env(tmp_path / "home"), cwd=ROOT, capture_output=True, text=True)
        assert run.returncode == 0, f"{name}: exit {run.returncode}\n{run.stderr[-2000:]}"
        ppl.setdefault(name, []).append(json.loads(run.stdout)["ppl"])
    assert all(math.isfinite(p) for runs in ppl.values() for p in runs)
    assert ppl["qwen2 f32"][0] == ppl["qwen2 f32"][1] and ppl["qwen2 bf16"][0] == ppl["qwen2 bf16"][1]
    assert ppl["qwen2 bf16"][0] != ppl["qwen2 f32"][0]      # the bf16 weights were read as such


def test_cached_machine_code_names_the_symbols_numba_reads_from_its_bitcode():
    """cache_load reads them from the ELF symbol table, not from the bitcode (parsed only to link)."""
    import llvmlite.binding as ll
    from nibble.runner.kernels import cpu
    from nibble.runner.kernels.cache_load import elf_defined_symbols
    x = np.ones((1, 8), np.float32)
    cpu.rmsnorm(x, np.ones(8, np.float32), 1e-5, x)              # compiled and cached, or loaded
    cache = cpu.rmsnorm._cache._cache_file
    data_files = cache._load_index().values()      # one per signature cached
    assert data_files
    for data_file in data_files:
        # the CompileResult's library: its machine code, bitcode and the code it calls (linking.py)
        _, kind, (machine_code, bitcode, *_) = cache._load_data(data_file)[0]
        module = ll.parse_bitcode(bitcode)
        defined = {v.name for values in (module.functions, module.global_variables) for v in values
                   if not v.is_declaration}
        assert kind == "object" and defined and elf_defined_symbols(machine_code) == defined
        assert elf_defined_symbols(b"\xcf\xfa\xed\xfe" + machine_code[4:]) is None   # Mach-O: numba's way
