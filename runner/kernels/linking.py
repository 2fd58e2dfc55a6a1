"""Big compiled code is called where it already is, not linked again into each kernel that calls it.

numba links into a kernel the LLVM code of every function it calls, and optimizes and turns the
whole into machine code again: decode's matrix kernel (15-20 s to compile on its own) again in
each of the wrappers between it and the decoder layer, and in the layer. Code too big for LLVM
to inline into its callers gains nothing from that. Here a kernel links in only the libraries of
at most BIG bytes of bitcode; it calls the others by name, and the JIT resolves the names to the
machine code already loaded in this process.

A kernel read from the cache in another process must find the code it calls there too: its cache
entry carries the machine code of every library it calls (and what those call, deepest first),
and each is loaded before the kernel unless its functions are already defined (cache_load.py).

It replaces numba internals, so it is installed only on the numba it follows (TESTED), at a
process's first compile; another numba links as it always does, slower to compile.
"""
from __future__ import annotations

import numba
from numba.core import codegen, compiler, environment, event

from .cache_load import elf_defined_symbols, is_elf
from .compile_time import TESTED, AtFirstCompile

BIG = 40_000   # bytes of a library's bitcode above which its callers call it instead of linking it


def install():
    if numba.__version__.startswith(TESTED):
        event.register("numba:compile", AtFirstCompile(_install))


def _install():
    codegen.CPUCodeLibrary.finalize = _finalize
    codegen.CPUCodeLibrary._verify_declare_only_symbols = _verify_declare_only_symbols
    codegen.CPUCodeLibrary.serialize_using_object_code = _serialize_using_object_code
    compiler.CompileResult._find_referenced_environments = _find_referenced_environments


def called(library) -> tuple[bytes, ...]:
    """The machine code of the libraries `library` calls instead of linking them, deepest first."""
    return getattr(library, "_nibble_called", ())


def machine_code(library) -> bytes | None:
    """A finalized library's ELF object code (None in another format, or where numba kept none)."""
    code = getattr(library, "_nibble_machine_code", None)   # one read from the cache (cache_load.py)
    if code is None and library._object_caching_enabled:
        code = library._compiled_object
    return code if code is not None and is_elf(code) else None


def _bitcode_size(library) -> int:
    size = getattr(library, "_nibble_bitcode_size", None)
    if size is None:
        bitcode = getattr(library, "_shared_bitcode", None)   # one read from the cache, not parsed
        size = len(bitcode) if bitcode is not None else len(library._get_module_for_linking().as_bitcode())
        library._nibble_bitcode_size = size
    return size


def _finalize(self):
    """numba's CPUCodeLibrary.finalize, the big libraries called rather than linked in."""
    codegen.require_global_compiler_lock()
    self._codegen._check_llvm_bugs()
    self._raise_if_finalized()
    calls = {}   # machine code -> None: an ordered set, deepest first
    seen = set()
    for library in self._linking_libraries:
        if library in seen:
            continue
        seen.add(library)
        self._reload_init.update(library._reload_init)
        calls.update(dict.fromkeys(called(library)))   # linked in or called, its code calls these
        code = machine_code(library) if _bitcode_size(library) > BIG else None
        if code is not None:
            calls[code] = None
        else:
            self._final_module.link_in(library._get_module_for_linking(), preserve=True)
    self._nibble_called = tuple(calls)
    self._optimize_final_module()
    self._final_module.verify()
    self._finalize_final_module()


def _verify_declare_only_symbols(self):
    """numba's check that every numba function declared is defined, here or by the code called."""
    engine = self._codegen._engine
    for fn in self._final_module.functions:
        if fn.is_declaration and fn.name.startswith("_ZN5numba") and not engine.is_symbol_defined(fn.name):
            raise AssertionError(f"Symbol {fn.name} not linked properly")


def _serialize_using_object_code(self):
    """numba's: (name, 'object', (machine code, bitcode for linking)), and the code it calls."""
    self._ensure_finalized()
    return self.name, "object", (self._get_compiled_object(), self._get_module_for_linking().as_bitcode(),
                                 called(self))


def _find_referenced_environments(self):
    """numba's, and the environments of the code called: a cached kernel sets them when loaded."""
    envs = _numba_find_referenced_environments(self)
    names = {env.env_name for env in envs}
    for code in called(self.library):
        for name in sorted(elf_defined_symbols(code)):
            if name.startswith("_ZN08NumbaEnv") and name not in names:
                env = environment.lookup_environment(name)
                if env is not None and env.can_cache():
                    names.add(name)
                    envs.append(env)
    return envs


_numba_find_referenced_environments = compiler.CompileResult._find_referenced_environments
