"""What sentence-transformers' files say of an embedding model beside its weights: how its tokens'
states become one vector (modules.json, the Pooling module's config.json, a Normalize module),
where it cuts a text (sentence_bert_config.json's max_seq_length), the prompts it puts before
one (config_sentence_transformers.json), and whether its vectors may be cut short (a model card
tagged as trained with Matryoshka's loss). A model without them pools as sentence-transformers
pools a plain transformers model: the mean of its tokens, not normalized."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import families
from .cross_encoder import ranks
from .errors import FormatError

# Pooling's config keys -> the mode, in the order sentence-transformers concatenates them
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# ...or named at once, as newer sentence-transformers writes it
_POOLING_NAMES = {"cls": "cls", "max": "max", "mean": "mean", "mean_sqrt_len_tokens": "mean_sqrt_len",
                  "weightedmean": "weightedmean", "lasttoken": "lasttoken"}


@dataclass(frozen=True)
class Pipeline:
    """How an embedding model turns a text into a vector, after its transformer."""
    pooling: tuple[str, ...] = ("mean",)   # modes, their vectors concatenated
    normalize: bool = False                # to unit length
    max_length: int | None = None          # tokens a text is cut to (None: the model's positions)
    prompts: dict[str, str] = field(default_factory=dict)   # name -> the text put before an input
    default_prompt: str | None = None      # the prompt used where a request names none
    include_prompt: bool = True            # the prompt's tokens pooled with the text's
    matryoshka: bool = False               # trained so that a vector's first dimensions are one too


def embeds(path: Path | None, model_type: str) -> bool:
    """Whether the model at `path` (None: in memory; of config.json's `model_type`) is an embedding
    model: an encoder's family (BERT's) that is no reranker, or a decoder with sentence-transformers'
    files (Qwen3-Embedding)."""
    if ranks(path):   # an encoder under a classifier's head: a reranker
        return False
    kind = families.of(model_type)
    return (kind is not None and kind.encoder) or (path is not None and (path / "modules.json").is_file())


def read_pipeline(path: Path) -> Pipeline:
    """The Pipeline of the model directory `path`; FormatError naming a file that says something
    nibble cannot do."""
    modules = _json(path / "modules.json", [])
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise FormatError(f"{path / 'modules.json'} is not a list of modules")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unknown:
        raise FormatError(f"{path / 'modules.json'}: nibble runs a transformer, pooling and "
                          f"normalization, not {', '.join(unknown)}")
    pooling, include_prompt = ("mean",), True
    if "Pooling" in kinds:
        config = _json(path / str(kinds["Pooling"].get("path", "")) / "config.json", {})
        pooling, include_prompt = _pooling(config, path), bool(config.get("include_prompt", True))
    settings = _json(path / "sentence_bert_config.json", {})
    max_length = settings.get("max_seq_length")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise FormatError(f"{path / 'sentence_bert_config.json'}: max_seq_length must be a positive integer")
    st = _json(path / "config_sentence_transformers.json", {})
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise FormatError(f"{path / 'config_sentence_transformers.json'}: prompts must map names to texts")
    default = st.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise FormatError(f"{path / 'config_sentence_transformers.json'}: default_prompt_name "
                          f"{default!r} is not one of its prompts")
    return Pipeline(pooling, "Normalize" in kinds, max_length, prompts, default, include_prompt,
                    _matryoshka(path / "README.md"))


def _matryoshka(card: Path) -> bool:
    """Whether the model card's front matter (its YAML header) says Matryoshka: sentence-transformers
    tags the cards it writes with their loss, loss:MatryoshkaLoss; others tag matryoshka. Read as
    text: a card's header is free-form, and a broken one still says what it says."""
    try:
        text = card.read_text(encoding="utf-8", errors="replace") if card.is_file() else ""
    except OSError:
        return False
    header = re.match(r"---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    return bool(header) and "matryoshka" in header.group(1).lower()


def pipeline_files(path: Path) -> dict[str, bytes]:
    """The files of the model directory `path` that say its Pipeline, by their path in it: what a
    copy of the model (quantized) keeps. Only modules in folders of plain names are taken."""
    names = ["modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "README.md"]
    modules = _json(path / "modules.json", [])
    for m in modules if isinstance(modules, list) else []:
        folder = m.get("path") if isinstance(m, dict) else None
        if isinstance(folder, str) and re.fullmatch(r"\w[\w.-]*", folder) and (path / folder).is_dir():
            names += [f"{folder}/{f.name}" for f in sorted((path / folder).iterdir()) if f.is_file()]
    return {name: (path / name).read_bytes() for name in names if (path / name).is_file()}


def _pooling(config: dict, path: Path) -> tuple[str, ...]:
    if not isinstance(config, dict):
        raise FormatError(f"{path}: its Pooling module's config.json is not an object")
    if isinstance(config.get("pooling_mode"), str):
        mode = _POOLING_NAMES.get(config["pooling_mode"])
        if mode is None:
            raise FormatError(f"{path}: unknown pooling_mode {config['pooling_mode']!r}")
        return (mode,)
    modes = tuple(mode for key, mode in POOLING_MODES.items() if config.get(key) is True)
    if not modes:
        raise FormatError(f"{path}: its Pooling module's config.json turns no pooling mode on")
    return modes


def _json(path: Path, default):
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FormatError(f"{path} cannot be read as JSON: {e}") from None
