"""LoRA adapters as PEFT saves them: adapter_config.json (rank r, lora_alpha, the modules it
targets) and adapter_model.safetensors, a pair of matrices a module: A [r, in] and B [out, r],
so that the module's weight becomes W + scale * B @ A, scale = lora_alpha / r (rsLoRA's:
lora_alpha / sqrt(r)). What an adapter does beyond that (DoRA's magnitudes, biases it trains,
whole modules it replaces, ranks that differ by module) is refused by name."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import FormatError
from .half import HalfTensor
from .safetensors import read_safetensors

PREFIX = "base_model.model."   # PEFT's names: the base model's, under its wrapper


@dataclass
class LoRA:
    path: Path
    scale: float                                        # lora_alpha / r (or / sqrt(r)), times the user's
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]     # module ("model.layers.0.self_attn.q_proj") -> (A, B)

    def delta(self, module: str) -> np.ndarray:
        """scale * B @ A: what the adapter adds to `module`'s weight, float32 [out, in]."""
        a, b = self.pairs[module]
        return (np.float32(self.scale) * (b.astype(np.float32) @ a.astype(np.float32))).astype(np.float32)


def parse_ref(text: str) -> tuple[str, float]:
    """--lora's PATH[:SCALE] -> (path, scale; 1.0 when none is given)."""
    path, _, scale = text.rpartition(":")
    if path:
        try:
            return path, float(scale)
        except ValueError:
            pass
    return text, 1.0


def read_lora(path: str | Path, scale: float = 1.0) -> LoRA:
    """The PEFT adapter in the folder `path`, its own scale times `scale`; FormatError naming what
    nibble cannot apply."""
    path = Path(path)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise FormatError(f"{path} holds no adapter_config.json: a LoRA adapter is a folder as PEFT saves it "
                          "(adapter_config.json, adapter_model.safetensors)")
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
        pairs[module] = (a, b)
    if not pairs:
        raise FormatError(f"{path}: the adapter holds no LoRA pairs")
    return LoRA(path, own * scale, pairs)
