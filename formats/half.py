"""A 16-bit float tensor kept as its bits: bfloat16, which numpy has no dtype for, and float16,
which numba's CPU target cannot take. The one place that knows how to widen them to float32.

A safetensors BF16 tensor is read as one of these, a view of the file (no copy); the runner
hands float16 matrices to the kernels as one too, and the kernels widen on the fly.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class HalfTensor(NamedTuple):
    """bfloat16 or float16 values by their bits: a named tuple of an array and a flag, so numba
    takes it as it is. numpy sees the float32 array it stands for (np.asarray widens: a copy)."""
    bits: np.ndarray   # uint16, the tensor's shape: the top half of a float32 (bf16) or IEEE half
    bf16: bool         # True: bfloat16; False: float16

    @classmethod
    def of_float16(cls, a: np.ndarray) -> HalfTensor:
        """A float16 array as a HalfTensor of the same memory (no copy)."""
        return cls(a.view(np.uint16), False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    @property
    def ndim(self) -> int:
        return self.bits.ndim

    @property
    def size(self) -> int:
        return self.bits.size

    @property
    def nbytes(self) -> int:
        """Bytes held (and read by a product with it): 2 a value."""
        return self.bits.nbytes

    def widen(self) -> np.ndarray:
        """The float32 values (exact: every bf16 and f16 value is a float32), read-only."""
        if self.bf16:   # bf16 is the top half of a float32: shift the bits up and reinterpret
            wide = (self.bits.astype(np.uint32) << 16).view(np.float32)
        else:
            wide = self.bits.view(np.float16).astype(np.float32)
        wide.flags.writeable = False
        return wide

    def __array__(self, dtype=None, copy=None):
        wide = self.widen()
        return wide if dtype is None else wide.astype(dtype, copy=False)

