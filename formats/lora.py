"""LoRA adapters as PEFT saves them: adapter_config.json (rank r, lora_alpha, the modules it
targets) and adapter_model.safetensors, a pair of matrices a module: A [r, in] and B [out, r],
so that the module's weight becomes W + scale * B @ A, scale = lora_alpha / r (rsLoRA's:
lora_alpha / sqrt(r)), times the user's. What an adapter does beyond that (DoRA's magnitudes, biases it trains,
whole modules it replaces, ranks that differ by module) is refused by name.

Or a GGUF file as llama.cpp's convert_lora_to_gguf.py writes one (general.type "adapter",
adapter.type "lora", adapter.lora.alpha): the same pairs under llama.cpp's names
(blk.0.attn_q.weight.lora_a, .lora_b), scaled as llama.cpp does, alpha / r (its r each pair's).
A llama file's q and k B rows are in llama.cpp's RoPE order, as its converter permutes the
weights' rows; the file holds no head counts to undo that by, so LoRA.for_model() does, with the
model's."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import families
from .config import ModelConfig
from .errors import FormatError
from .gguf import _hf_name, _unpermute, read_tensors
from .gguf_header import read_gguf_header
from .half import HalfTensor
from .safetensors import read_safetensors

PREFIX = "base_model.model."   # PEFT's names: the base model's, under its wrapper
MAX_SCALE = 100.0   # of a user's scale, either sign: past it an adapter only overflows float32


@dataclass
class LoRA:
    path: Path
    scale: float   # the user's (--lora PATH:SCALE); 0: loaded, not applied until a request asks
    # module ("model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r] times lora_alpha / r), float32
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]
    # module -> its GGUF lora_b, whose rows are still in llama.cpp's RoPE order (for_model)
    rope_rows: dict[str, str] = field(default_factory=dict)

    def for_model(self, config: ModelConfig) -> LoRA:
        """This adapter with every B in Hugging Face's row order, a llama GGUF's q and k put back
        by `config`'s head counts as formats/gguf.py puts back a q/k weight's."""
        if not self.rope_rows:
            return self
        pairs = dict(self.pairs)
        for module, name in self.rope_rows.items():
            n_head = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            try:
                pairs[module] = pairs[module][0], _unpermute(pairs[module][1], n_head, name)
            except FormatError as e:
                raise FormatError(f"{self.path}: {e} (an adapter of another model?)") from None
        return dataclasses.replace(self, pairs=pairs, rope_rows={})

    def delta(self, module: str) -> np.ndarray:
        """What the adapter adds to `module`'s weight at its scale, float32 [out, in]."""
        if module in self.rope_rows:   # a programming error: the rows would land on the wrong heads
            raise ValueError(f"{self.path}: {module}'s rows are llama.cpp's: for_model() first")
        a, b = self.pairs[module]
        return (np.float32(self.scale) * (b.astype(np.float32) @ a.astype(np.float32))).astype(np.float32)


def parse_ref(text: str) -> tuple[str, float]:
    """--lora's PATH[:SCALE] -> (path, scale; 1.0 when none is given)."""
    path, _, scale = text.rpartition(":")
    if path:
        try:
            value = float(scale)
        except ValueError:
            return text, 1.0
        if not abs(value) <= MAX_SCALE:
            raise FormatError(f"{text}: an adapter's scale is a number from -{MAX_SCALE:g} to {MAX_SCALE:g}")
        return path, value
    return text, 1.0


def read_lora(path: str | Path, scale: float = 1.0) -> LoRA:
    """The PEFT adapter in the folder `path`, or the GGUF one in the file `path` (.gguf), at the
    user's `scale`; FormatError naming what nibble cannot apply."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return _read_gguf(path, scale)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise FormatError(f"{path} holds no adapter_config.json: a LoRA adapter is a folder as PEFT saves it "
                          "(adapter_config.json, adapter_model.safetensors) or a .gguf file as llama.cpp's "
                          "convert_lora_to_gguf.py writes it")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FormatError(f"{config_file} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise FormatError(f"{config_file}: a {config.get('peft_type') if isinstance(config, dict) else 'non'} "
                          "adapter; nibble applies LoRA's")
    for key, why in (("use_dora", "DoRA's magnitudes"), ("fan_in_fan_out", "weights stored transposed (GPT-2's)"),
                     ("modules_to_save", "whole modules it replaces"), ("rank_pattern", "ranks that differ by module"),
                     ("alpha_pattern", "alphas that differ by module")):
        if config.get(key):
            raise FormatError(f"{config_file}: {key}: nibble applies no {why}")
    if config.get("bias", "none") != "none":
        raise FormatError(f"{config_file}: bias {config['bias']!r}: nibble applies no biases an adapter trains")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not (isinstance(r, int) and r > 0 and isinstance(alpha, (int, float)) and math.isfinite(alpha)):
        raise FormatError(f"{config_file}: r must be a positive integer and lora_alpha a number")
    own = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise FormatError(f"{path} holds no adapter_model.safetensors")
    tensors = read_safetensors(weights)
    pairs, found = {}, {}
    for name, t in tensors.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.weight"
            if name.endswith(marker):
                found.setdefault(name.removeprefix(PREFIX).removesuffix(marker), {})[part] = \
                    t.widen() if isinstance(t, HalfTensor) else np.asarray(t, np.float32)
                break
        else:
            raise FormatError(f"{path}: tensor {name} is no LoRA pair's (lora_A, lora_B)")
    for module, ab in found.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise FormatError(f"{path}: {module} has {', '.join(ab)} without its pair")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise FormatError(f"{path}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
                              f"of rank {r}")
        pairs[module] = (np.ascontiguousarray(a, np.float32), (np.float32(own) * b).astype(np.float32))
    if not pairs:
        raise FormatError(f"{path}: the adapter holds no LoRA pairs")
    return LoRA(path, scale, pairs)


def _read_gguf(path: Path, scale: float) -> LoRA:
    """The LoRA adapter in the GGUF file `path`: its pairs under Hugging Face's names, each B times
    alpha / r; its q and k B rows left in llama.cpp's order where the architecture permutes them."""
    if not path.is_file():
        raise FormatError(f"{path}: no such GGUF file")
    meta = read_gguf_header(path).metadata   # a model's header is said no to before its tensors are read
    arch, kind = meta.get("general.architecture"), meta.get("general.type")
    if arch == "controlvector":   # llama.cpp's cvector-generator's, which names no general.type
        raise FormatError(f"{path}: a control vector, not a LoRA adapter: nibble applies no control vectors")
    if kind != "adapter":
        raise FormatError(f"{path}: a GGUF of general.type {kind!r}, not a LoRA adapter ('adapter')")
    if meta.get("adapter.type") != "lora":
        raise FormatError(f"{path}: adapter.type {meta.get('adapter.type')!r}: nibble applies LoRA adapters ('lora')")
    layout = families.gguf_arch(arch) if isinstance(arch, str) else None
    if layout is None:
        raise FormatError(f"{path}: unsupported GGUF architecture {arch!r}; nibble imports "
                          f"{', '.join(families.gguf_archs())}")
    # llama.cpp reads a missing alpha as 0, and an alpha of 0 as B unscaled
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
        raise FormatError(f"{path}: adapter.lora.alpha must be a number, not {alpha!r}")
    try:
        tensors, meta = read_tensors(path)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None
    if "adapter.alora.invocation_tokens" in meta:   # an array: the header leaves it out
        raise FormatError(f"{path}: adapter.alora.invocation_tokens: nibble applies no activated LoRA "
                          "(an adapter that waits for its invocation tokens)")
    found = {}   # GGUF weight -> {"lora_a": A, "lora_b": B}
    for name, t in tensors.items():
        weight, _, part = name.rpartition(".")
        if part not in ("lora_a", "lora_b"):   # mergekit's norms, which llama.cpp skips
            raise FormatError(f"{path}: tensor {name} is no LoRA pair's (.lora_a, .lora_b): nibble applies "
                              "no whole tensors an adapter replaces")
        found.setdefault(weight, {})[part] = t.widen() if isinstance(t, HalfTensor) else np.asarray(t, np.float32)
    pairs, rope_rows = {}, {}
    for weight, ab in found.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise FormatError(f"{path}: {weight} has {', '.join(ab)} without its pair")
        if weight == "token_embd.weight":   # its A and B are flipped (mergekit's new tokens)
            raise FormatError(f"{path}: {weight}: nibble applies no adapter to the token embeddings")
        try:
            module = _hf_name(weight, layout).removesuffix(".weight")
        except FormatError as e:
            raise FormatError(f"{path}: {e}") from None
        if module in pairs:   # a matrix llama.cpp splits into several (layout.fused)
            raise FormatError(f"{path}: {weight} is part of {module}, which another pair changes too: "
                              "nibble applies no adapter to a matrix llama.cpp splits")
        a, b = ab["lora_a"], ab["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or not a.shape[0]:
            raise FormatError(f"{path}: {weight}'s lora_a {list(a.shape)} and lora_b {list(b.shape)} are not "
                              "A [r, in] and B [out, r] of one rank r")
        r = a.shape[0]
        own = alpha / r if alpha else 1.0
        pairs[module] = (np.ascontiguousarray(a, np.float32), (np.float32(own) * b).astype(np.float32))
        if layout.permuted_qk and weight.split(".")[-2] in ("attn_q", "attn_k"):
            rope_rows[module] = f"{weight}.lora_b"
    if not pairs:
        raise FormatError(f"{path}: the adapter holds no LoRA pairs")
    return LoRA(path, scale, pairs, rope_rows)
