"""From a model reference to a runnable model and its tokenizer."""
import dataclasses
from collections.abc import Sequence

from nibble.formats import presets
from nibble.formats.catalog import identity
from nibble.formats.cross_encoder import ranks
from nibble.formats.errors import NibbleError
from nibble.formats.hub import ALIASES, resolve
from nibble.formats.lora import LoRA, parse_ref, read_lora
from nibble.formats.model_dir import ModelDir
from nibble.formats.sentence_transformers import embeds
from nibble.quant.convert import count_params, is_quantized
from nibble.quant.open_model import open_model
from .background import Background
from .generation.draft import DraftModel
from .model import Model
from .settings import model_sampling
from .convert.quantize import quantized_once
from .text.template import ChatTemplate
from .text.tokenizer import Tokenizer
from .vision import vision_of

QUANT_BITS = {"int8": 8, "int4": 4}
AUTO_QUANT_PARAMS = 1_000_000_000


def load(ref: str, quant: str | None = None, gpu_layers: int = 0, require_gpu: bool = False,
         ctx_size: int | None = None, background: bool = False, loras: Sequence[LoRA] = ()) -> tuple[Model, Tokenizer]:
    """The model at `ref`, a float one quantized as `quant` says (see as_quantized).

    gpu_layers: run the last N layers on the GPU (-1: all; see Model.offload_layers, which plans
    for a KV cache of `ctx_size` positions). The line to show the user (no GPU, or only some layers
    fit) is in model.offload_note; require_gpu raises NoGPU instead of running on the CPU.
    background: on a first run, answer on kernels that compile quickly while the full ones compile
    in the background (runner/background.py): what the commands that answer people ask for.
    loras: adapters run beside the weights they target, unmerged (Model's); on the CPU only."""
    model_dir = open_model(ref)
    if embeds(model_dir.path, model_dir.config.model_type):   # before a first use quantizes it
        raise NibbleError(f"{ref} is an embedding model: it computes vectors of texts (nibble embed), "
                          "it does not generate")
    if ranks(model_dir.path):
        raise NibbleError(f"{ref} is a reranker: it scores documents for a query (nibble rerank), it does not generate")
    running = as_quantized(ref, model_dir, quant)
    if preset := presets.find(ref):
        running = with_preset(running, preset)
        loras = [*preset_adapters(preset), *loras]
    model, tokenizer = from_model_dir(running, loras)
    if background and running.path is not None and not loras:   # the background compiles the model's own kernels
        model.background = Background(running.path, as_stored=not is_quantized(running.config))
    if loras and (gpu_layers or require_gpu):
        raise NibbleError("a LoRA adapter runs on the CPU: drop -ngl (or merge it: nibble merge)")
    model.offload_layers(gpu_layers, ctx_size, require_gpu)
    return model, tokenizer


def load_draft(ref: str, quant: str | None, tokenizer: Tokenizer, ctx: int) -> DraftModel:
    """The model at `ref` as a draft model for the one `tokenizer` is of (runner/generation/draft.py):
    NibbleError unless their vocabularies are the same, id for id."""
    model, theirs = load(ref, quant, ctx_size=ctx)
    if theirs.tokenizer.get_vocab() != tokenizer.tokenizer.get_vocab():
        raise NibbleError(f"the draft model {ref} has another vocabulary than the model's: a draft model shares its "
                          "tokenizer (a smaller model of the same family: Qwen2.5-0.5B for Qwen2.5-7B)")
    return DraftModel(model, min(ctx, model.config.max_position_embeddings))


def with_preset(model_dir: ModelDir, preset: presets.Preset) -> ModelDir:
    """The model as `preset` runs it: its sampling settings over the model's defaults, its chat
    template, and the system prompt and messages its conversations start with."""
    config = dict(model_dir.tokenizer_config)
    if preset.template is not None:
        config["chat_template"] = preset.template
    generation = {**model_dir.generation_config, **preset.parameters}
    if "temperature" in preset.parameters:   # the preset's temperature, whatever do_sample said
        generation.pop("do_sample", None)
    return dataclasses.replace(model_dir, generation_config=generation, tokenizer_config=config,
                               conversation=preset.conversation())


def preset_adapters(preset: presets.Preset) -> list[LoRA]:
    """The LoRA adapters a preset's ADAPTER lines name, read."""
    return [read_lora(*parse_ref(ref)) for ref in preset.adapters]


def check_preset(name: str, preset: presets.Preset):
    """NibbleError unless `preset` can be kept as `name`: a name of its own, settings a model could
    have, a template that reads, a model that is there (fetched once, as -m would)."""
    presets.check_name(name)
    if name in ALIASES:   # -m NAME would run the preset, never the model again
        raise NibbleError(f"{name} is the alias of a model: name the preset otherwise")
    if preset.source == name:
        raise NibbleError(f"the preset {name} cannot be made from itself")
    _, note = model_sampling(preset.parameters)
    if note:
        raise NibbleError(note.replace("ignored in the model's generation_config.json (nibble's defaults apply)",
                                       "the preset's settings"))
    if preset.template is not None:
        ChatTemplate.from_tokenizer_config({"chat_template": preset.template})
    resolve(preset.source)
    preset_adapters(preset)


def as_quantized(ref: str, model_dir: ModelDir, quant: str | None) -> ModelDir:
    """`model_dir` as it runs: quant "int8" or "int4" quantizes a float model, "float" keeps it as
    stored, None quantizes to int4 a float model of more than AUTO_QUANT_PARAMS weights (int4 is
    what the kernels are made for: a 16-bit 8B model reads 16 GB a token). Quantized once, then kept
    in nibble's cache (quantize.quantized_once)."""
    if quant not in (None, "float", *QUANT_BITS):
        raise NibbleError(f"unknown quantization {quant!r}: choose int8, int4 or float")
    if is_quantized(model_dir.config):
        if quant in QUANT_BITS:
            raise NibbleError(f"{ref} is already quantized: drop --quant")
        return model_dir
    if quant is None and count_params(model_dir.tensors, None) > AUTO_QUANT_PARAMS:
        quant = "int4"
    if quant in QUANT_BITS:
        return quantized_once(ref, model_dir, QUANT_BITS[quant])
    return model_dir


def from_model_dir(model_dir: ModelDir, loras: Sequence[LoRA] = ()) -> tuple[Model, Tokenizer]:
    source = identity(model_dir.path) if model_dir.path is not None else None   # adapters: Model.prefix_root
    model = Model(model_dir.config, model_dir.tensors, source=source, loras=loras)
    tokenizer = Tokenizer(model_dir)
    model.vision = vision_of(model_dir, tokenizer.tokenizer.id_to_token)
    return model, tokenizer
