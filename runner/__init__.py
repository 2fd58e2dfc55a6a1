"""Running a model: kernels, KV cache, sampling, generation and the CLI."""
