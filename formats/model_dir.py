"""A Hugging Face model directory: config.json, generation_config.json, tokenizer files, weights."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tokenizers

from .config import ModelConfig
from .errors import FormatError
from .half import HalfTensor
from .safetensors import TensorStream, read_checkpoint, write_safetensors
from .tempfiles import locked, sibling, temp_dir
from .wrappers import text_tensors, vision_tensors, wrapped


@dataclass
class ModelDir:
    """Everything a model reference resolves to, whatever file format it came from."""
    path: Path | None                 # where it was read from (None: built in memory)
    config: ModelConfig
    tensors: dict[str, np.ndarray | HalfTensor]   # Hugging Face names -> read-only arrays (memmap
                                                  # views when possible; bf16: a HalfTensor)
    tokenizer: tokenizers.Tokenizer
    tokenizer_config: dict = field(default_factory=dict)    # chat_template, bos_token, eos_token, add_bos_token
    generation_config: dict = field(default_factory=dict)   # eos_token_id, sampling defaults
    # a vision-language checkpoint's whole config.json and its vision tower's and projector's
    # tensors (formats/wrappers.py's names); None and {} for a text model
    vision_config: dict | None = None
    vision_tensors: dict = field(default_factory=dict)
    preprocessor_config: dict = field(default_factory=dict)   # its image processor's settings
    conversation: list[dict] = field(default_factory=list)    # what every chat starts with (a preset's)


def read_model_dir(path: str | os.PathLike) -> ModelDir:
    """Read a Hugging Face model directory (or the directory holding a given .safetensors file).

    Needs config.json, tokenizer.json and safetensors weights; generation_config.json,
    tokenizer_config.json and chat_template.jinja are optional. Raises FormatError naming the
    file that is missing or broken.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        path = path.parent
    if not path.is_dir():
        raise FormatError(f"{path} is not a model directory (expected a folder with config.json)")
    raw_config = _read_json(path / "config.json")
    config = ModelConfig.from_dict(raw_config)
    tensors = read_checkpoint(path)
    vision = vision_tensors(raw_config, tensors)
    tokenizer_config = _read_json(path / "tokenizer_config.json", optional=True)
    # Special tokens may be AddedToken dicts ({"content": "<s>", "lstrip": ...}): keep the text.
    for key, value in tokenizer_config.items():
        if key.endswith("_token") and isinstance(value, dict) and "content" in value:
            tokenizer_config[key] = value["content"]
    template = path / "chat_template.jinja"
    if "chat_template" not in tokenizer_config and template.is_file():
        tokenizer_config["chat_template"] = template.read_text(encoding="utf-8")
    if "chat_template" not in tokenizer_config:   # a multimodal processor's (SmolVLM's)
        tokenizer_config |= {k: v for k, v in _read_json(path / "chat_template.json", optional=True).items()
                             if k == "chat_template"}
    return ModelDir(
        path=path,
        config=config,
        tensors=text_tensors(raw_config, tensors),
        tokenizer=_read_tokenizer(path / "tokenizer.json"),
        tokenizer_config=tokenizer_config,
        generation_config=_read_json(path / "generation_config.json", optional=True),
        vision_config=raw_config if vision else None,
        vision_tensors=vision,
        preprocessor_config=_read_json(path / "preprocessor_config.json", optional=True) if vision else {},
    )


def write_model_dir(model: ModelDir, out: str | os.PathLike, force: bool = False,
                    tensors: TensorStream | None = None, files: dict[str, bytes] | None = None) -> Path:
    """Write `model` as a Hugging Face model directory at `out` and return its path.

    `tensors`, if given, are the weights instead of model.tensors, made one at a time as they
    are written (a model larger than memory). `files`: more files by their path in the folder
    (an embedding model's sentence-transformers files). Everything is written into a temporary sibling
    first and renamed into place, so `out` is either complete or untouched; what a killed write
    left in out's folder is removed first (formats/tempfiles.py). An existing `out` is refused
    unless `force`, which replaces it.
    """
    out = Path(out)
    if out.exists() and not force:
        raise FormatError(f"cannot write to {out}: it already exists. "
                          f"Delete it, choose another path, or overwrite it with force")
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = model.tensors if tensors is None else tensors
    config = model.config.to_dict()
    if model.vision_config is not None:   # the text model back inside its wrapper, beside its vision
        config, tensors = wrapped(model.vision_config, config, tensors, model.vision_tensors)
    with temp_dir(out) as tmp:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", model.generation_config)
        _write_json(tmp / "tokenizer_config.json", model.tokenizer_config)
        if model.preprocessor_config:
            _write_json(tmp / "preprocessor_config.json", model.preprocessor_config)
        model.tokenizer.save(str(tmp / "tokenizer.json"))
        for name, data in (files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
        # "format": "pt" is what transformers checks for before it will load the file.
        write_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        _swap_into_place(tmp, out)
    return out


def _read_json(path: Path, optional: bool = False) -> dict:
    if optional and not path.exists():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError(f"{path} is missing; is {path.parent} a Hugging Face model "
                          f"directory?") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise FormatError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


def _read_tokenizer(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise FormatError(f"{path} is missing; nibble needs a fast tokenizer (tokenizer.json)")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception
        raise FormatError(f"{path} cannot be loaded as a tokenizer: {e}") from None


def _write_json(path: Path, d: dict) -> None:
    path.write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _swap_into_place(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an existing `out` is moved aside first and deleted only after."""
    if not out.exists():
        new.rename(out)
        return
    old = sibling(out, "old")
    with locked(out):   # out of the way but not a leftover: a cleaner must leave it alone
        out.rename(old)
        try:
            new.rename(out)
        except BaseException:
            old.rename(out)
            raise
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
