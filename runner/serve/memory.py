"""How much memory a model would take once loaded, from its files' headers and sizes, and how much
the machine has free: a server checks one against the other before it loads a model."""
from __future__ import annotations

import json
from pathlib import Path

from nibble.formats.catalog import describe, size_on_disk
from nibble.formats.gguf_header import read_gguf_header
from ..kv.cache import BLOCK, blocks_for
from ..loader import AUTO_QUANT_PARAMS, QUANT_BITS

# Bits a weight takes once quantized by as_quantized: 4 or 8, and a 16-bit scale and bias per group of 64.
_GROUP_BITS = 2 * 16 / 64
_KV_BYTES = {"f32": 4, "int8": 1}


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes the kernel could give without swapping (Linux's MemAvailable), or None where it
    does not say: then there is nothing to check against."""
    try:
        for line in meminfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                return int(value.split()[0]) * 1024   # in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def model_bytes(path: Path, quant: str | None, positions: int, kv_type: str) -> int:
    """The model at `path` (what hub.resolve gives) as it would run: its weights (a float model's
    after the quantization as_quantized gives it, else its files' size) and a KV cache of
    `positions` positions for all replies (at most the model's context a reply, see positions_for)."""
    details = describe(path)
    weights = size_on_disk(path)
    quantized = details.format == "gguf" or details.quantization.startswith("int")
    if not quantized and details.parameters:
        bits = QUANT_BITS.get(quant) or (4 if quant is None and details.parameters > AUTO_QUANT_PARAMS else None)
        if bits:
            weights = int(details.parameters * (bits + _GROUP_BITS) / 8)
    layers, kv_heads, head_dim, _ = kv_shape(path)
    # per position and layer: keys and values, and a float32 scale each per head (HostKV)
    per_position = layers * 2 * kv_heads * (head_dim * _KV_BYTES[kv_type] + 4)
    return weights + blocks_for(positions) * BLOCK * per_position


def positions_for(path: Path, parallel: int, ctx: int, cache_tokens: int | None) -> int:
    """The KV positions an engine allocates for this model: every reply's whole context (at most the
    model's), or --cache-tokens if more."""
    return max(cache_tokens or 0, parallel * min(ctx, kv_shape(path)[3]))


def kv_shape(path: Path) -> tuple[int, int, int, int]:
    """(layers, KV heads, head size, context) from a directory's config.json or a GGUF's header."""
    if path.suffix == ".gguf":
        meta = read_gguf_header(path).metadata
        arch = meta.get("general.architecture")
        at = lambda key, default=None: meta.get(f"{arch}.{key}", default)
        heads = at("attention.head_count", 1)
        head_dim = at("attention.key_length") or at("embedding_length", 0) // max(heads, 1)
        return at("block_count", 0), at("attention.head_count_kv", heads), head_dim, at("context_length", 0)
    folder = path if path.is_dir() else path.parent
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)   # a multimodal checkpoint's text model (formats/wrappers.py)
    heads = config.get("num_attention_heads", 1)
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // max(heads, 1)
    return (config.get("num_hidden_layers", 0), config.get("num_key_value_heads") or heads, head_dim,
            config.get("max_position_embeddings", 0))
