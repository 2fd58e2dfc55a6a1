"""Running a model: kernels, model families, the KV cache, generation, serving and measuring.

Two calls run a model:

    from nibble.runner import load, stream_generate
    model, tokenizer = load("qwen3-1.7b")
    for r in stream_generate(model, tokenizer, tokenizer.prompt("Hi")): print(r.text, end="")
"""
import importlib

from . import models   # the families: the file readers in formats/ know them by their table

_EXPORTS = {"load": ".loader", "stream_generate": ".generation.generate",
            "GenerationResponse": ".generation.generate"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    # Imported on first use, so that `nibble --help` does not wait for Numba.
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
