"""Models with a known architecture's shapes and random weights, to measure speed and memory at
sizes no test machine downloads: in memory, quantized (`nibble bench --shapes llama-2-7b`), or
written to disk in bf16 (`--write-checkpoint`, for `nibble quantize` and `nibble run`). What they
say is noise; how fast they say it is what a real model of those shapes would do: the kernels
read the same bytes whatever the values are.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nibble.formats import mxfp4
from nibble.formats.config import ModelConfig
from nibble.formats.errors import NibbleError
from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import ModelDir, write_model_dir
from nibble.formats.safetensors import TensorSpec, TensorStream
from nibble.quant.convert import default_calibration_text
from ..model import Model
from ..models import family

_LLAMA_3_2 = dict(max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
SHAPES = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
    # the models' config.json; qwen3-8b as a llama block (its q/k norms are a rounding error of its time)
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, **_LLAMA_3_2),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=True, **_LLAMA_3_2),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0),
    # a token reads the attention and 8 of the 128 experts of each layer: about 3B of 30B weights
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True),
    # 4 of 32 experts a layer: about 3.6B of 21B weights a token
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128),
}
# shapes whose checkpoints store their experts in MXFP4 (OpenAI's): benched so, as they run
MXFP4_EXPERTS = {"gpt-oss-20b"}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
INIT_STD = 0.02   # of a fresh model's weights (transformers' initializer_range), so quantizing means something


def random_model(shapes: str | dict, bits: int, group_size: int = 64, seed: int = 0) -> Model:
    """A model of SHAPES[shapes] (or of the config fields given) with random `bits`-bit weights
    in MLX's layout, every matrix its own: nothing is shared that a cache could keep. The
    projections (`*_proj`, an MoE's stacked experts among them) are quantized, the experts in MXFP4
    for shapes in MXFP4_EXPERTS; a router stays float32, as `nibble quantize` leaves it."""
    c = _config(shapes, quantization={"bits": bits, "group_size": group_size})
    rng = np.random.default_rng(seed)
    tensors, mxfp4_paths = {}, {}
    for name, shape in weight_shapes(c).items():
        if len(shape) == 1:
            tensors[name] = np.ones(shape, np.float32)
            continue
        # uniform integers; scale and bias map them to [-sqrt(3/k), sqrt(3/k)]: variance 1/k,
        # so activations keep their size through the layers
        *lead, k = shape
        path = name.removesuffix(".weight")
        half_range = np.sqrt(3 / k)
        if not path.endswith("_proj") and path != "model.embed_tokens" and path != "lm_head":
            tensors[name] = rng.uniform(-half_range, half_range, shape).astype(np.float32)
            continue
        if isinstance(shapes, str) and shapes in MXFP4_EXPERTS and ".switch_mlp." in path:
            tensors |= _mxfp4_stack(rng, path, lead, k, half_range)
            mxfp4_paths[path] = {"bits": 4, "group_size": 32}
            continue
        scale = np.float16(2 * half_range / (2 ** bits - 1))
        tensors[name] = rng.integers(0, 2 ** 32, (*lead, k * bits // 32), dtype=np.uint32)
        tensors[f"{path}.scales"] = np.full((*lead, k // group_size), scale, np.float16)
        tensors[f"{path}.biases"] = np.full((*lead, k // group_size), -half_range, np.float16)
    return Model(dataclasses.replace(c, quantization={**c.quantization, **mxfp4_paths}), tensors)


def _mxfp4_stack(rng: np.random.Generator, path: str, lead: list[int], k: int, half_range: float) -> dict:
    """Random MXFP4 codes (formats.mxfp4) for matrices [*lead, k], their largest values about
    half_range, with the tensors read_linear takes for them."""
    e = np.full((*lead, k // 32), 127 + int(np.floor(np.log2(half_range / 6))), np.uint8)
    scales, biases = mxfp4.scales_biases(e, path)
    return {f"{path}.weight": rng.integers(0, 2 ** 32, (*lead, k // 8), dtype=np.uint32),
            f"{path}.scales": scales, f"{path}.biases": biases, f"{path}.values": mxfp4.LEVELS}


def write_random_checkpoint(shapes: str | dict, out: str | os.PathLike, seed: int = 0) -> Path:
    """Write a llama model directory of SHAPES[shapes] (or of the config fields given) with random
    bf16 weights, one tensor at a time: Llama-2-7B's 13.5 GB are written holding one matrix.

    The matrices are normal with std INIT_STD and the norms 1, as a fresh model is initialised;
    the tokenizer is a byte-level BPE trained on nibble's calibration text, with ChatML's chat
    template, so that `nibble quantize` and `nibble run` take it as they take a real model.
    """
    c = _config(shapes, extra={"torch_dtype": "bfloat16"})
    tokenizer = byte_level_tokenizer(default_calibration_text(), c.vocab_size)
    if tokenizer.get_vocab_size() > c.vocab_size:   # 256 bytes and 3 special tokens at least
        raise NibbleError(f"a vocabulary of {c.vocab_size} is too small for a byte-level tokenizer")
    eos = tokenizer.token_to_id("<|im_end|>")
    c = dataclasses.replace(c, eos_token_id=eos)
    specs = {name: TensorSpec("BF16", shape) for name, shape in weight_shapes(c).items()}
    rng = np.random.default_rng(seed)
    model = ModelDir(path=None, config=c, tensors={}, tokenizer=tokenizer,
                     tokenizer_config={"chat_template": CHATML, "eos_token": "<|im_end|>",
                                       "add_bos_token": False},
                     generation_config={"eos_token_id": eos})
    tensors = ((name, _random_bf16(rng, spec.shape)) for name, spec in specs.items())
    return write_model_dir(model, out, tensors=TensorStream(specs, tensors))


def byte_level_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """Byte-level BPE with ChatML's special tokens (ids 0-2: <|endoftext|>, <|im_start|>,
    <|im_end|>) trained on `text`, up to `vocab_size` entries (fewer if the text runs out of pairs)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    return tok


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model (no biases; lm_head unless tied to the embedding) by Hugging
    Face name, in a checkpoint's order, its blocks' as its family says (block_shapes)."""
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        shapes |= family(c).block_shapes(c, i)
    head = {} if c.tie_word_embeddings else {"lm_head.weight": (c.vocab_size, c.hidden_size)}
    return shapes | {"model.norm.weight": (c.hidden_size,)} | head


def _config(shapes: str | dict, extra: dict | None = None, **fields) -> ModelConfig:
    """A llama config (or the model_type the shapes name) of the shapes and fields given."""
    if isinstance(shapes, str):
        if shapes not in SHAPES:
            raise NibbleError(f"unknown shapes {shapes!r}: choose {', '.join(SHAPES)}")
        shapes = SHAPES[shapes]
    return ModelConfig.from_dict({"model_type": "llama", **shapes, **fields, **(extra or {})})


def _random_bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> HalfTensor:
    """Normal(0, INIT_STD) values, or ones for a norm (1-D), as bf16: the top half of each float32
    (truncated, which random values do not mind). Made in blocks of rows, so that a matrix
    takes its own 2 bytes a value and little more."""
    if len(shape) == 1:
        return HalfTensor(np.full(shape, 0x3F80, np.uint16), bf16=True)   # 1.0
    bits = np.empty(shape, np.uint16)
    rows = bits.reshape(-1, shape[-1])   # stacked experts' rows one after another
    step = max(1, (1 << 22) // shape[-1])
    for r in range(0, len(rows), step):
        block = rng.standard_normal((min(step, len(rows) - r), shape[-1]), np.float32)
        block *= INIT_STD
        rows[r:r + step] = block.view(np.uint32) >> 16
    return HalfTensor(bits, bf16=True)
