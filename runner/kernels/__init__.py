"""Numba kernels."""
