"""A model written as a GGUF file that llama.cpp and ollama load: what gguf.py reads, in reverse.

gguf's GGUFWriter writes the file; this module says what goes in it, as llama.cpp's converter
would: the architecture and its fields from the config, the tokenizer (gguf_tokenizer.gguf_vocab),
every tensor under llama.cpp's name, llama's q/k rows permuted again for llama.cpp's RoPE, and
Llama 3's rope scaling as its rope_freqs tensor. Which GGUF type a matrix takes is the caller's
(quant/ knows what the arrays stand for): `Tensor`s in, a file out.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType, GGUFValueType as VType

from . import families
from .config import ModelConfig
from .errors import FormatError
from .gguf import BLOCK_NAMES, TOP_NAMES
from .gguf_header import split_parts
from .gguf_tokenizer import gguf_vocab
from .model_dir import ModelDir
from .tempfiles import temp_file

# The model types written and the architecture each is, llama's block with its own fields: what
# llama.cpp's llama, qwen2 and qwen3 models read of the metadata, no more (smollm3's layers
# without RoPE, phi3's and gemma3's own blocks are other architectures).
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class Tensor(NamedTuple):
    """One tensor to write: its Hugging Face name, and its data as GGUF holds it."""
    name: str
    data: np.ndarray   # float32 or float16 as stored, or uint8: a type's blocks [(E,) N, bytes per row]
                       # (or BF16's bytes)
    qtype: QType


def arch_of(config: ModelConfig) -> str:
    """The GGUF architecture a model of this config is written as, or FormatError saying which
    are written."""
    arch = ARCHS.get(config.model_type)
    if arch is None:
        raise FormatError(f"nibble writes GGUF files of {', '.join(ARCHS)} models, not {config.model_type}")
    if any(config.windows):
        raise FormatError(f"its layers attend through a sliding window, which llama.cpp's {arch} "
                          f"models do not: the answers would differ past {max(config.windows)} tokens")
    return arch


def write_gguf(model: ModelDir, tensors: Iterable[Tensor], out: Path, name: str) -> Path:
    """Write `model` (its config and tokenizer) with `tensors` as the GGUF file `out`, under the
    general.name `name`. Written beside `out` and renamed into place: `out` is whole or untouched."""
    config = model.config
    arch = arch_of(config)
    layout = families.gguf_arch(arch)
    meta = {"general.name": name, **_fields(config, arch),
            **gguf_vocab(model.tokenizer, model.tokenizer_config, config.vocab_size)}
    with temp_file(out) as (tmp, _):
        writer = gguf.GGUFWriter(tmp, arch)
        for key, value in meta.items():
            writer.add_key_value(key, value, *_types(value))
        for t in _rope_tensors(config):
            writer.add_tensor(t.name, t.data, raw_dtype=t.qtype)
        for t in tensors:
            data = _permuted(t, config) if layout.permuted_qk else t.data
            writer.add_tensor(gguf_name(t.name, layout), data, raw_dtype=t.qtype)
        _write(writer)
        os.replace(tmp, out)
    return out


def copy_gguf(path: Path, out: Path) -> Path:
    """A GGUF model (every part of a split one) written again as one file: its metadata and
    tensors as they are, byte for byte."""
    readers = [gguf.GGUFReader(part) for part in split_parts(path)]
    arch = readers[0].fields["general.architecture"].contents()
    with temp_file(out) as (tmp, _):
        writer = gguf.GGUFWriter(tmp, arch)
        for key, field in readers[0].fields.items():
            # the writer's own (alignment included: it aligns as it writes) and the parts'
            if not key.startswith(("GGUF.", "split.")) and key not in ("general.architecture", "general.alignment"):
                writer.add_key_value(key, field.contents(), field.types[0],
                                     field.types[-1] if field.types[0] == VType.ARRAY else None)
        for t in (t for reader in readers for t in reader.tensors):
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        _write(writer)
        os.replace(tmp, out)
    return out


def _write(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_name(hf: str, layout: families.GGUFArch) -> str:
    """llama.cpp's name for the Hugging Face tensor `hf` (gguf.py's names, the other way)."""
    top = {v: k for k, v in TOP_NAMES.items()}
    if hf in top:
        return top[hf]
    blocks = {v: k for k, v in (BLOCK_NAMES | dict(layout.block_names)).items()}
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 4 and ".".join(parts[3:-1]) in blocks:
        return f"blk.{parts[2]}.{blocks['.'.join(parts[3:-1])]}.{parts[-1]}"
    raise FormatError(f"tensor {hf} has no name in llama.cpp's files that nibble knows")


def _fields(c: ModelConfig, arch: str) -> dict:
    """The architecture's metadata, as convert_hf_to_gguf.py writes it for llama's block."""
    a = arch + "."
    fields = {a + "context_length": c.max_position_embeddings, a + "embedding_length": c.hidden_size,
              a + "block_count": c.num_hidden_layers, a + "feed_forward_length": c.intermediate_size,
              a + "attention.head_count": c.num_attention_heads,
              a + "attention.head_count_kv": c.num_key_value_heads,
              a + "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
              a + "attention.key_length": c.head_dim, a + "attention.value_length": c.head_dim,
              a + "rope.dimension_count": c.head_dim, a + "rope.freq_base": float(c.rope_theta),
              a + "vocab_size": c.vocab_size}
    s = c.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "linear":
        fields |= {a + "rope.scaling.type": "linear", a + "rope.scaling.factor": float(s["factor"])}
    elif kind == "yarn":
        fields |= {a + "rope.scaling.type": "yarn", a + "rope.scaling.factor": float(s["factor"]),
                   a + "rope.scaling.original_context_length": s["original_max_position_embeddings"]}
    elif kind not in ("default", "llama3"):
        raise FormatError(f"its rope scaling {kind!r} has no form in llama.cpp's {arch} files")
    return fields


def _rope_tensors(c: ModelConfig) -> list[Tensor]:
    """Llama 3's rope scaling as the per-frequency divisors llama.cpp reads (rope_freqs)."""
    s = c.rope_scaling or {}
    if s.get("rope_type", s.get("type")) != "llama3":
        return []
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    divisors = []
    for k in range(0, c.head_dim, 2):
        wavelength = 2 * math.pi * c.rope_theta ** (k / c.head_dim)
        smooth = (old / wavelength - low) / (high - low)
        divisors.append(1.0 if wavelength < old / high else factor if wavelength > old / low
                        else 1 / ((1 - smooth) / factor + smooth))
    return [Tensor("rope_freqs.weight", np.array(divisors, np.float32), QType.F32)]


def _permuted(t: Tensor, c: ModelConfig) -> np.ndarray:
    """q/k rows (weights and biases) in llama.cpp's order: each head's two RoPE halves
    interleaved, as convert_hf_to_gguf.py's permute() does (gguf._unpermute's inverse)."""
    heads = {"self_attn.q_proj": c.num_attention_heads, "self_attn.k_proj": c.num_key_value_heads}
    n_head = next((n for module, n in heads.items() if f".{module}." in t.name), None)
    if n_head is None:
        return t.data
    rows = t.data.shape[0]
    return (t.data.reshape(n_head, 2, rows // n_head // 2, *t.data.shape[1:])
            .swapaxes(1, 2)
            .reshape(t.data.shape))


def _types(value) -> tuple[VType, VType | None]:
    """The GGUF value type llama.cpp reads a key of this Python value as (and an array's items')."""
    if isinstance(value, list):
        item = {str: VType.STRING, float: VType.FLOAT32}.get(type(value[0]) if value else int, VType.INT32)
        return VType.ARRAY, item
    for kind, vtype in ((bool, VType.BOOL), (int, VType.UINT32), (float, VType.FLOAT32), (str, VType.STRING)):
        if isinstance(value, kind):
            return vtype, None
    raise TypeError(f"no GGUF value type for {value!r}")
