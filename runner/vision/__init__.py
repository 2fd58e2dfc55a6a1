"""Vision: what a vision-language model makes of the images in a prompt. A family's vision is one
class in a module of its own (gemma3.py, idefics3.py, qwen2_5_vl.py, qwen3_vl.py), on the machinery of base.py, with its tower
(siglip.py: SigLIP's), as runner/models/ holds the text families."""


def vision_of(model_dir, token_text):
    """The vision of a vision-language checkpoint (a ModelDir whose vision_tensors it holds), or
    None for a text model. token_text(id): the tokenizer's text of a token id."""
    if not model_dir.vision_tensors:
        return None
    from nibble.formats.errors import UnsupportedModel
    from .gemma3 import Gemma3Vision
    from .idefics3 import Idefics3Vision
    from .qwen2_5_vl import Qwen25VLVision
    from .qwen3_vl import Qwen3VLVision
    kind, c = model_dir.vision_config.get("model_type"), model_dir.vision_config
    if kind == "gemma3":
        return Gemma3Vision(c, model_dir.vision_tensors, model_dir.config.quantization, token_text)
    if kind in ("idefics3", "smolvlm"):
        return Idefics3Vision(c, model_dir.vision_tensors, model_dir.config.quantization, token_text,
                              model_dir.preprocessor_config)
    if kind in ("qwen2_5_vl", "qwen3_vl"):
        family = Qwen25VLVision if kind == "qwen2_5_vl" else Qwen3VLVision
        return family(c, model_dir.vision_tensors, model_dir.config.quantization, token_text, model_dir.preprocessor_config)
    raise UnsupportedModel(f"nibble reads no images with a {kind!r} model's vision tower")
