"""One call from a model reference to everything in it."""
from .gguf import import_gguf
from .hub import resolve
from .model_dir import ModelDir, read_model_dir


def open_model(ref: str) -> ModelDir:
    """A directory, .safetensors or .gguf file, hub id or alias -> its ModelDir."""
    path = resolve(ref)
    return import_gguf(path) if path.suffix == ".gguf" else read_model_dir(path)
