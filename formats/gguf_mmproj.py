"""A vision projector GGUF (llama.cpp's `mmproj`: its CLIP layout, which convert_hf_to_gguf.py
--mmproj writes) read into what a Hugging Face checkpoint of the same model holds: the wrapper's
config (its vision_config, and what its text model and tokenizer say of images), its vision
tensors under formats/wrappers.py's names, and its image processor's settings.

Gemma 3's (projector type gemma3) and Idefics3's or SmolVLM's (idefics3). The converter adds 1 to
Gemma's projector norm (llama.cpp multiplies by it) and stores its projection in F16 [vision,
text] as HF keeps it; the rest is SigLIP's tower, name for name.

Qwen2.5-VL's (qwen2.5vl_merger) and Qwen3-VL's (qwen3vl_merger): the converter cuts the patch
convolution into its two frames (weight, weight.1) and Qwen2.5-VL's q/k/v apart, joined again
here; the file keeps neither the windows' size, as a rule (Qwen2.5-VL's is 112 pixels in every
release, and libmtmd's default), nor the processor's bounds (transformers' defaults, under
nibble's own bound). The text model's
multimodal RoPE sections come from its GGUF (rope.dimension_sections: the text config's
mrope_section).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import FormatError
from .gguf import read_tensors
from .gguf_metadata import float32_decimal
from .half import HalfTensor
from .hub import pick_mmproj

# projector type -> the wrapper's model_type
PROJECTORS = {"gemma3": "gemma3", "idefics3": "idefics3", "qwen2.5vl_merger": "qwen2_5_vl", "qwen3vl_merger": "qwen3_vl"}
# the Qwens' blocks: GGUF -> Hugging Face (after vision_tower.blocks.N.), by family
_QWEN_BLOCK = {"attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QWEN3_BLOCK = _QWEN_BLOCK | {"ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_QWEN_NAMES = {"qwen2_5_vl": {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"},
               "qwen3_vl": {"v.post_ln": "merger.norm", "mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2",
                            "v.position_embd": "pos_embed", "v.patch_embd": "patch_embed.proj"}}
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
        raise FormatError(f"{path.name}: nibble reads {', '.join(PROJECTORS)} vision projectors, not {kind!r}")
    if PROJECTORS[kind] in _QWEN_NAMES:
        return _read_qwen(path, PROJECTORS[kind], gguf_tensors, meta, text, token_id)
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


def _read_qwen(path: Path, family: str, gguf_tensors: dict, meta: dict, text: ModelConfig, token_id) -> tuple[dict, dict, dict]:
    """read_mmproj of a Qwen2.5-VL's or Qwen3-VL's projector."""
    v = "clip.vision."
    depth = meta.get(v + "block_count")
    vision = {"hidden_size": meta.get(v + "embedding_length"), "intermediate_size": meta.get(v + "feed_forward_length"),
              "num_heads": meta.get(v + "attention.head_count"), "depth": depth, "patch_size": meta.get(v + "patch_size"),
              "spatial_merge_size": meta.get(v + "spatial_merge_size", 2), "temporal_patch_size": 2,
              "out_hidden_size": text.hidden_size}
    if not isinstance(depth, int) or depth < 1:
        raise FormatError(f"{path.name}: clip.vision.block_count must be a positive count, not {depth!r}")
    deep = [i for i, on in enumerate(meta.get(v + "is_deepstack_layers", [])) if on]
    if family == "qwen2_5_vl":
        every = meta.get(v + "n_wa_pattern")
        if not isinstance(every, int) or every < 1:
            raise FormatError(f"{path.name}: a qwen2.5vl projector needs clip.vision.n_wa_pattern, not {every!r}")
        vision |= {"window_size": meta.get(v + "window_size", 112),   # libmtmd's default too
                   "fullatt_block_indexes": [i for i in range(depth) if (i + 1) % every == 0]}
    else:
        table = gguf_tensors.get("v.position_embd.weight")
        vision |= {"deepstack_visual_indexes": deep, "num_position_embeddings": 0 if table is None else len(table)}
    names, block = _QWEN_NAMES[family], _QWEN3_BLOCK if family == "qwen3_vl" else _QWEN_BLOCK
    tensors, parts = {}, {}
    for name, t in gguf_tensors.items():
        module, _, part = name.rpartition(".")
        if name == "v.patch_embd.weight.1":   # the second frame's convolution
            parts.setdefault("vision_tower.patch_embed.proj.weight", {})[1] = t
            continue
        if m := re.fullmatch(r"v\.blk\.(\d+)\.attn_([qkv])", module):
            parts.setdefault(f"vision_tower.blocks.{m[1]}.attn.qkv.{part}", {})["qkv".index(m[2])] = t
            continue
        if m := re.fullmatch(r"v\.deepstack\.(\d+)\.(norm|fc1|fc2)", module):
            j = deep.index(int(m[1])) if int(m[1]) in deep else None
            hf = None if j is None else f"deepstack_merger_list.{j}.{ {'norm': 'norm', 'fc1': 'linear_fc1', 'fc2': 'linear_fc2'}[m[2]]}"
        elif m := re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", module):
            hf = f"blocks.{m[1]}.{block[m[2]]}" if m[2] in block else None
        elif name == "v.patch_embd.weight":
            parts.setdefault("vision_tower.patch_embed.proj.weight", {})[0] = t
            continue
        else:
            hf = names.get(module)
        if hf is None:
            raise FormatError(f"{path.name}: unexpected tensor {name} in a {family} vision projector")
        tensors[f"vision_tower.{hf}.{part}"] = t
    for name, pieces in parts.items():
        count = 2 if "patch_embed" in name else 3
        if sorted(pieces) != list(range(count)):
            raise FormatError(f"{path.name}: {name} is missing some of its {count} parts")
        # the patch convolution [D, C, p, p] x 2 -> [D, C, 2, p, p]; q, k, v -> qkv
        tensors[name] = _joined([pieces[i] for i in range(count)], 2 if "patch_embed" in name else None)
    heads = text.num_attention_heads
    config = {"model_type": family, "vision_config": vision, "image_token_id": _id(token_id, "<|image_pad|>", path),
              "text_config": {"hidden_size": text.hidden_size, "num_attention_heads": heads, "head_dim": text.head_dim,
                              "rope_parameters": {"mrope_section": text.extra.get("mrope_section")}}}
    preprocessor = {"image_mean": list(meta.get(v + "image_mean", [0.48145466, 0.4578275, 0.40821073])),
                    "image_std": list(meta.get(v + "image_std", [0.26862954, 0.26130258, 0.27577711]))}
    return config, tensors, preprocessor


def _joined(pieces: list, axis: int | None):
    """Tensors stacked on a new `axis`, or (None) joined along their first, in their own type (a
    BF16 file's are HalfTensors: their bits joined)."""
    join = np.concatenate if axis is None else lambda arrays: np.stack(arrays, axis=axis)
    if all(isinstance(p, HalfTensor) for p in pieces):
        return HalfTensor(join([p.bits for p in pieces]), pieces[0].bf16)
    return join([np.asarray(p, np.float32) if isinstance(p, HalfTensor) else p for p in pieces])


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
