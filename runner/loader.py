"""From a model reference to a runnable model and its tokenizer."""
from formats.load import open_model
from formats.model_dir import ModelDir
from .model import Model
from .tokenizer import Tokenizer


def load(ref: str) -> tuple[Model, Tokenizer]:
    return from_model_dir(open_model(ref))


def from_model_dir(model_dir: ModelDir) -> tuple[Model, Tokenizer]:
    return Model(model_dir.config, model_dir.tensors), Tokenizer(model_dir)
