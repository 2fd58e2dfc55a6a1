"""A vision projector GGUF (llama.cpp's `mmproj`: its CLIP layout, which convert_hf_to_gguf.py
--mmproj writes) read into what a Hugging Face checkpoint of the same model holds: the wrapper's
config (its vision_config, and what its text model and tokenizer say of images), its vision
tensors under formats/wrappers.py's names, and its image processor's settings.

Gemma 3's (projector type gemma3) and Idefics3's or SmolVLM's (idefics3). The converter adds 1 to
Gemma's projector norm (llama.cpp multiplies by it) and stores its projection in F16 [vision,
text] as HF keeps it; the rest is SigLIP's tower, name for name.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import FormatError
from .gguf import read_tensors
from .gguf_metadata import float32_decimal
from .hub import pick_mmproj

# projector type -> the wrapper's model_type
PROJECTORS = {"gemma3": "gemma3", "idefics3": "idefics3"}
# GGUF -> Hugging Face (vision_tensors' names), a block's parts
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
          "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_NAMES = {"v.patch_embd": "vision_tower.embeddings.patch_embedding",
          "v.position_embd": "vision_tower.embeddings.position_embedding",
          "v.post_ln": "vision_tower.post_layernorm",
          "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
          "mm.model.fc": "connector.modality_projection.proj"}


def read_mmproj(path: Path, text: ModelConfig, token_id) -> tuple[dict, dict, dict]:
    """-> (the wrapper's config.json, the vision tensors, the preprocessor config) of the mmproj
    at `path`, beside a text model of config `text` whose tokenizer gives token_id(text) (None
    for a token it lacks)."""
    try:
        gguf_tensors, meta = read_tensors(path)
    except FormatError as e:
        raise FormatError(f"{path.name}: {e}") from None
    kind = meta.get("clip.projector_type")
    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder"):
        raise FormatError(f"{path.name} is not a vision projector (an mmproj GGUF of llama.cpp's CLIP layout)")
    if kind not in PROJECTORS:
        raise FormatError(f"{path.name}: nibble reads gemma3 and idefics3 vision projectors, not {kind!r}")
    v = "clip.vision."
    vision = {"model_type": "siglip_vision_model", "hidden_size": meta.get(v + "embedding_length"),
              "intermediate_size": meta.get(v + "feed_forward_length"), "num_hidden_layers": meta.get(v + "block_count"),
              "num_attention_heads": meta.get(v + "attention.head_count"), "image_size": meta.get(v + "image_size"),
              "patch_size": meta.get(v + "patch_size"), "layer_norm_eps": float32_decimal(meta.get(v + "attention.layer_norm_epsilon", 1e-6))}
    tensors = {}
    for name, t in gguf_tensors.items():
        module, _, part = name.rpartition(".")
        if m := re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", module):
            hf = f"vision_tower.encoder.layers.{m[1]}.{_BLOCK.get(m[2], m[2])}" if m[2] in _BLOCK else None
        else:
            hf = _NAMES.get(module)
        if name == "mm.input_projection.weight":
            tensors["multi_modal_projector.mm_input_projection_weight"] = t
        elif hf is None:
            raise FormatError(f"{path.name}: unexpected tensor {name} in a {kind} vision projector")
        elif name == "mm.soft_emb_norm.weight":
            tensors[f"{hf}.{part}"] = np.asarray(t, np.float32) - np.float32(1)   # Gemma's 1 + w
        else:
            tensors[f"{hf}.{part}"] = t
    config = {"model_type": PROJECTORS[kind], "vision_config": vision, "text_config": {"hidden_size": text.hidden_size}}
    preprocessor = {"image_mean": list(meta.get(v + "image_mean", [0.5] * 3)),
                    "image_std": list(meta.get(v + "image_std", [0.5] * 3))}
    side = vision["image_size"] // vision["patch_size"] if vision["image_size"] and vision["patch_size"] else 0
    if kind == "gemma3":
        pooled = side // meta.get(v + "projector.scale_factor", 4)
        config |= {"mm_tokens_per_image": pooled * pooled, "boi_token_index": _id(token_id, "<start_of_image>", path),
                   "eoi_token_index": _id(token_id, "<end_of_image>", path)}
    else:
        config |= {"scale_factor": meta.get(v + "projector.scale_factor", 2), "image_token_id": _id(token_id, "<image>", path)}
        preprocessor |= {"size": {"longest_edge": meta.get(v + "preproc_image_size", 4 * vision["image_size"])},
                         "max_image_size": {"longest_edge": vision["image_size"]}}
    return config, tensors, preprocessor


def _id(token_id, token: str, path: Path) -> int:
    found = token_id(token)
    if found is None:
        raise FormatError(f"{path.name} is a vision projector for a model whose tokenizer has {token}: "
                          f"this model's has none")
    return found


def find_mmproj(model: Path) -> Path | None:
    """The vision projector beside a model's GGUF (hub.pick_mmproj), or None."""
    found = pick_mmproj([p.name for p in model.parent.glob("*.gguf")], model.name)
    return model.parent / found if found else None
