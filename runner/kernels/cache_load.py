"""Loading a cached kernel, made cheaper: three steps of numba's load that only a compile (or
object mode) needs. A warm start of `nibble run` spent about half a second in them:
- numba refreshes its target context before it reads the cache: that imports and installs every
  typing and lowering registry, for a compile; a compile still refreshes first.
- each cached library carries, beside its machine code, its LLVM bitcode, parsed at load (about
  0.2 s for the decoder layer and the matmul) only to list the symbols the code defines and to be
  linked into a later compile. The symbols are read from the machine code's ELF symbol table; the
  bitcode is parsed when a compile links the library. Other object formats load as numba does.
- the environment of each function a kernel inlines is rebuilt around its module's globals, which
  imports numba's array and math implementations (~0.1 s). Only object mode reads those globals;
  a numba module nothing has imported yet gets an environment without them.
A cached library also brings, first, the machine code of the big libraries it calls instead of
linking them (linking.py), each unless its functions are already loaded.
They replace numba internals, so they are installed only on the numba they follow (TESTED):
another numba loads as it always does, slower to start, the same kernels.
"""
import struct
import sys

import llvmlite.binding as ll
import numba
from numba.core import caching, codegen, environment
from numba.core.runtime import rtsys

TESTED = "0.68."


def install():
    global _numba_unserialize, _numba_module_for_linking, _numba_rebuild_env
    if not numba.__version__.startswith(TESTED):
        return
    _numba_unserialize = codegen.CPUCodeLibrary._unserialize.__func__
    _numba_module_for_linking = codegen.CPUCodeLibrary._get_module_for_linking
    _numba_rebuild_env = environment._rebuild_env
    caching.Cache.load_overload = _load_overload
    codegen.CPUCodeLibrary._unserialize = classmethod(_unserialize)
    codegen.CPUCodeLibrary._get_module_for_linking = _get_module_for_linking
    environment._rebuild_env = _rebuild_env   # what the pickled cache calls, by name


def _load_overload(self, sig, target_context):
    """numba's Cache.load_overload without target_context.refresh(): machine code read from the
    cache needs only the runtime (NRT) it calls into, which the refresh would have started."""
    rtsys.initialize(target_context)
    with self._guard_against_spurious_io_errors():
        return self._load_overload(sig, target_context)


def _unserialize(cls, codegen_, state):
    """numba's CPUCodeLibrary._unserialize of a library cached as machine code, its bitcode kept
    unparsed (see _get_module_for_linking), after the code it calls (linking.py)."""
    name, kind, data = state
    symbols = elf_defined_symbols(data[0]) if kind == "object" else None
    if symbols is None:
        return _numba_unserialize(cls, codegen_, state)
    calls = data[2] if len(data) > 2 else ()
    for code in calls:
        if not all(map(codegen_._engine.is_symbol_defined, elf_defined_symbols(code, strong=True))):
            _load(codegen_, name, code, elf_defined_symbols(code))
    library = _load(codegen_, name, data[0], symbols)
    library._shared_bitcode = data[1]
    library._nibble_called = calls
    return library


def _load(codegen_, name, code, symbols):
    """A library of this machine code, loaded into the JIT (which never unloads it)."""
    library = codegen_.create_library(name)
    library.enable_object_caching()
    library._set_compiled_object(code)
    library._nibble_machine_code = code   # numba hands its copy to the JIT: linking.py reads this one
    library._finalize_final_module()
    codegen_._engine._defined_symbols |= symbols   # what numba reads from the parsed bitcode
    return library


def _get_module_for_linking(self):
    if self._shared_module is None and getattr(self, "_shared_bitcode", None) is not None:
        self._shared_module = ll.parse_bitcode(self._shared_bitcode)
    return _numba_module_for_linking(self)


def _rebuild_env(modname, consts, env_name):
    if modname in sys.modules or not modname.startswith("numba."):
        return _numba_rebuild_env(modname, consts, env_name)
    env = environment.lookup_environment(env_name)
    if env is None:   # as numba makes one, its globals all but the module's name
        env = environment.Environment({"__name__": modname})
        env.consts[:] = consts
        env.env_name = env_name
        environment.Environment._memo[env_name] = env
    return env


def is_elf(obj: bytes) -> bool:
    """Whether `obj` is a 64-bit little-endian ELF object (numba's machine code on Linux)."""
    return obj[:4] == b"\x7fELF" and obj[4:6] == b"\x02\x01"


def elf_defined_symbols(obj: bytes, strong: bool = False) -> set[str] | None:
    """The names of the functions and data a 64-bit little-endian ELF object defines (numba's
    machine code on Linux), only its global ones if `strong` (not the weak copies of what it
    linked in); None for another format."""
    if not is_elf(obj):
        return None
    section_table, = struct.unpack_from("<Q", obj, 0x28)           # Elf64_Ehdr.e_shoff
    entry_size, count = struct.unpack_from("<HH", obj, 0x3A)       # e_shentsize, e_shnum
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, section_table + i * entry_size) for i in range(count)]
    names = set()
    for _, kind, _, _, offset, size, link, _, _, sym_size in sections:
        if kind != 2:   # SHT_SYMTAB; its strings are in section `link`
            continue
        strings = sections[link][4]
        for at in range(offset + sym_size, offset + size, sym_size):   # entry 0 is the null symbol
            name, info, _, section = struct.unpack_from("<IBBH", obj, at)   # Elf64_Sym
            # defined; of no type, data or a function; if strong, of global binding
            if section != 0 and info & 0xF <= 2 and (info >> 4 == 1 or not strong):
                start = strings + name
                names.add(obj[start:obj.index(b"\0", start)].decode())
    return names
