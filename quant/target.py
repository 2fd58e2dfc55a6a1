"""The CPU the kernels compile for: this one, as numba does by default, or with NIBBLE_CPU=avx2 this
one without AVX-512: the instructions a laptop's CPU lacks taken away, so that a CPU that has them
runs (and the tests check) the path such a laptop takes: prefill_int8's AVX2 byte dot products,
loops vectorized without AVX-512's registers and masks. Its other instructions (AVX2, FMA, F16C
among them) and its name, which LLVM tunes for, stay.

Numba makes its one target machine when the first jitted function is made (decorated), from
numba.config's CPU_NAME and CPU_FEATURES: this module is imported first by every module that
makes one, the quantizer's search here and runner's kernels, so that the choice holds whichever
of them a program imports first. It lives in quant, the lowest layer that uses numba.
"""
import os

import numba
from llvmlite import binding as llvm

from nibble.formats.errors import NibbleError

CHOICES = ("avx2",)
_AVX2 = ("avx2", "fma", "f16c")   # what the kernels' vector code needs of a CPU without AVX-512


def choice() -> str | None:
    """NIBBLE_CPU: None where unset or empty (this CPU's own instructions), else one of CHOICES;
    any other value is a NibbleError naming them."""
    value = os.environ.get("NIBBLE_CPU", "")
    if value and value not in CHOICES:
        raise NibbleError(f"NIBBLE_CPU={value!r} is not a CPU nibble compiles for: set NIBBLE_CPU=avx2 "
                          f"(this CPU without AVX-512) or leave it unset (this CPU's own instructions)")
    return value or None


def features():
    """The instruction sets numba compiles for, as llvmlite's FeatureMap: this CPU's, less AVX-512's
    under NIBBLE_CPU=avx2; None where the user's NUMBA_CPU_NAME names another CPU than this one."""
    if CHOICE:
        return _FORCED
    return None if numba.config.CPU_NAME else llvm.get_host_cpu_features()


def _is_avx512(feature: str) -> bool:
    """Whether LLVM's feature `feature` is a part of AVX-512 (avx512f, avx512vnni, ..., amx-avx512)
    or implies one (AVX10; EVEX's 512-bit forms, in the LLVMs that name them); sha512 is not."""
    return "avx512" in feature or feature.startswith(("avx10", "evex512"))


def _compile_for(chosen: str | None):
    """numba.config set to compile for `chosen` (None: left as it is); the features it compiles for."""
    if chosen is None:
        return None
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES is not None:
        raise NibbleError(f"NIBBLE_CPU={chosen} and NUMBA_CPU_NAME or NUMBA_CPU_FEATURES both say which CPU to "
                          f"compile for: unset one of them")
    forced = llvm.get_host_cpu_features()
    if missing := [f.upper() for f in _AVX2 if not forced.get(f)]:
        raise NibbleError(f"NIBBLE_CPU={chosen}: this CPU has no {', '.join(missing)}; unset NIBBLE_CPU")
    for name in forced:
        if _is_avx512(name):
            forced[name] = False
    numba.config.CPU_NAME = llvm.get_host_cpu_name()
    numba.config.CPU_FEATURES = forced.flatten()
    return forced


CHOICE = choice()
_FORCED = _compile_for(CHOICE)
