"""Checkpoints whose tensors are named otherwise than a text model's own, read into its names.

Multimodal checkpoints (a family's `wrappers`: Gemma 3's Gemma3ForConditionalGeneration, model_type
"gemma3", wraps a gemma3_text model in a vision tower and a projector; Idefics3's and SmolVLM's, a
llama one in a tower and a connector; Qwen2.5-VL's a qwen2 one in a tower that ends in its patch
merger). Its config.json nests the text model's config under `text_config` (or, as transformers 4
wrote Qwen2.5-VL's, keeps it at the top level beside vision_config), and its checkpoint prefixes
the text model's tensors (or, Qwen2.5-VL's on the hub, keeps a causal LM's names); both are read
here into what a text-only checkpoint says. The vision tower's and the projector's
tensors are read apart (vision_tensors), under one set of names whichever transformers saved them.

A decoder saved without its head (transformers' Qwen3Model, as Qwen3-Embedding is: embed_tokens,
layers.*, norm) lacks the `model.` its causal LM's names have; a BERT saved inside a task model
(BertForMaskedLM: bert.embeddings, bert.encoder) has `bert.` where BertModel's names have nothing.
"""
from __future__ import annotations

import itertools

from . import families
from .errors import FormatError
from .safetensors import TensorStream, tensor_spec
from .values import OBJECT

# Outer fields a text_config may leave out: the wrapper's then hold for the text model (mlx-lm and
# mlx-vlm write `quantization` at the top level; checkpoints on the hub keep their eos there).
_INHERITED = ("bos_token_id", "eos_token_id", "pad_token_id", "quantization", "quantization_config",
              "dtype", "torch_dtype")

# Where a wrapper's checkpoint keeps its text model's tensors -> their text-only names:
# language_model.model.* and language_model.lm_head.* (transformers 4; transformers 5.23 saves
# these names too, and mlx-vlm), or model.language_model.* and lm_head.* (transformers 5's
# module names).
_TEXT_PREFIXES = {"model.language_model.": "model.", "lm_head.": "lm_head.",
                  "language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                  "model.text_model.": "model.",
                  **{f"model.{part}": f"model.{part}" for part in ("embed_tokens.", "layers.", "norm.")}}
# the bodies of encoders saved under a task head (BertForSequenceClassification's, XLM-RoBERTa's)
_ENCODER_BODIES = ("bert.", "roberta.")
# Wrappers whose head transformers ties unless config.json says otherwise (Gemma3Config's default;
# Idefics3Config's is untied)
_TIED = {"gemma3"}
# Where transformers 5 keeps a wrapper's text model and vision tower (wrapped() writes them there)
_BODIES = {"gemma3": ("model.language_model.", "model.vision_tower."),
           "idefics3": ("model.text_model.", "model.vision_model."), "smolvlm": ("model.text_model.", "model.vision_model."),
           "qwen2_5_vl": ("model.language_model.", "model.visual."), "qwen3_vl": ("model.language_model.", "model.visual.")}


# Where a wrapper's checkpoint keeps its vision tower and projector -> the names runner/vision reads
# (transformers 4 and mlx-vlm: vision_tower.vision_model.*; transformers 5: model.vision_tower.*)
_VISION_PREFIXES = {"model.vision_tower.vision_model.": "vision_tower.", "vision_tower.vision_model.": "vision_tower.",
                    "model.vision_tower.": "vision_tower.", "vision_tower.": "vision_tower.",
                    "model.vision_model.": "vision_tower.", "model.visual.": "vision_tower.",
                    "visual.": "vision_tower.",
                    "model.multi_modal_projector.": "multi_modal_projector.",
                    "multi_modal_projector.": "multi_modal_projector.", "model.connector.": "connector."}


def is_wrapper(model_type) -> bool:
    """Whether `model_type` is a wrapper's, around a text model nibble runs."""
    return isinstance(model_type, str) and families.wrapped(model_type) is not None


def text_config(d: dict) -> dict:
    """The config.json dict of the text model inside the wrapper config `d`."""
    wrapper, inner = d["model_type"], families.wrapped(d["model_type"])
    nested = d.get("text_config")
    OBJECT.check("config.json: text_config", nested or {})
    if nested is None:   # transformers 4's Qwen2.5-VL: the text model's fields beside vision_config
        nested = {k: v for k, v in d.items() if k not in ("model_type", "vision_config")}
    text = {"model_type": inner, **nested}
    if text["model_type"] == f"{wrapper}_text":   # transformers 5's name for it (qwen2_5_vl_text)
        text["model_type"] = inner
    if text["model_type"] != inner:
        raise FormatError(f"config.json: a {wrapper!r} wrapper around a {text['model_type']!r} text "
                          f"model in text_config: nibble runs the {inner!r} in {wrapper!r}")
    text |= {k: d[k] for k in _INHERITED if k in d and k not in text}
    # transformers 5 ties the head by the wrapper's flag (Gemma3Config's default: tied), not the
    # text_config's
    text["tie_word_embeddings"] = d.get("tie_word_embeddings", wrapper in _TIED)
    return text


def text_tensors(d: dict, tensors: dict) -> dict:
    """The tensors nibble runs of a checkpoint whose config.json is `d`: a wrapper's text model's,
    under a text-only checkpoint's names (the same arrays: nothing is copied), without the vision
    tower's and the projector's; a base model's under its causal LM's names; any other checkpoint's
    as they are."""
    if not is_wrapper(d.get("model_type")):
        if "embed_tokens.weight" in tensors and "model.embed_tokens.weight" not in tensors:
            return {name if name.startswith("lm_head.") else f"model.{name}": t for name, t in tensors.items()}
        body = next((p for p in _ENCODER_BODIES if f"{p}embeddings.word_embeddings.weight" in tensors), None)
        if body is not None:   # an encoder under a task's head: its body's, and a classifier's head
            return {name.removeprefix(body): t for name, t in tensors.items()
                    if name.startswith((body, "classifier."))}
        return tensors
    text = {}
    for name, t in tensors.items():
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            text[_TEXT_PREFIXES[prefix] + name[len(prefix):]] = t
    if not text:
        raise FormatError(f"the checkpoint holds no text model tensors (expected names starting "
                          f"with {' or '.join(_TEXT_PREFIXES)})")
    return text


def vision_tensors(d: dict, tensors: dict) -> dict:
    """A wrapper checkpoint's vision tower and projector tensors (the same arrays) under
    vision_tower.* and multi_modal_projector.*; {} for any other checkpoint, or a wrapper saved
    without them."""
    if not is_wrapper(d.get("model_type")):
        return {}
    out = {}
    for name, t in tensors.items():
        prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            out[_VISION_PREFIXES[prefix] + name[len(prefix):]] = t
    return out


def wrapped(d: dict, text: dict, tensors: dict | TensorStream, vision: dict) -> tuple[dict, dict | TensorStream]:
    """A wrapper checkpoint (its config.json `d`) written again around its text model (`text`, the
    text config as nibble holds it, and `tensors` under a text-only checkpoint's names) and its
    `vision` tensors (vision_tensors' names): the config.json and tensors to write, under
    transformers 5's names, which text_tensors and vision_tensors read back. What the text config
    held that nibble does not (Qwen2.5-VL's mrope_section, which its vision reads) is kept."""
    inner = {**text_config(d), **text, "model_type": families.wrapped(d["model_type"])}
    flat = "text_config" not in d   # transformers 4's Qwen2.5-VL: the text fields nest now
    config = {**{k: v for k, v in d.items() if (k not in _INHERITED or k == "tie_word_embeddings")
                 and (not flat or k in ("model_type", "vision_config") or k not in inner)},
              "text_config": inner, "tie_word_embeddings": text.get("tie_word_embeddings", d["model_type"] in _TIED)}
    body, tower = _BODIES[d["model_type"]]
    rename = lambda name: name if name.startswith("lm_head.") else body + name.removeprefix("model.")
    outer = {(tower + name.removeprefix("vision_tower.") if name.startswith("vision_tower.") else "model." + name): t
             for name, t in vision.items()}
    if isinstance(tensors, TensorStream):
        specs = {rename(n): s for n, s in tensors.specs.items()} | {n: tensor_spec(t) for n, t in outer.items()}
        items = itertools.chain(((rename(n), t) for n, t in tensors.items), outer.items())
        return config, TensorStream(specs, items)
    return config, {rename(n): t for n, t in tensors.items()} | outer
