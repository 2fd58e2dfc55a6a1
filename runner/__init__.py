"""Running a model: kernels, KV cache, sampling, generation and the CLI.

Two calls run a model:

    model, tokenizer = runner.load("smollm2")
    for r in runner.stream_generate(model, tokenizer, tokenizer.prompt("Hi")): print(r.text, end="")
"""
from .generate import GenerationResponse, generate_step, stream_generate
from .load import load

__all__ = ["GenerationResponse", "generate_step", "load", "stream_generate"]
