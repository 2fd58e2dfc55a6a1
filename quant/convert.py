"""The quantize command's library side: a float ModelDir in, an MLX-layout quantized ModelDir out.

Each quantized linear `P` becomes `P.weight` (packed uint32), `P.scales` and `P.biases`, and
config.json gains mlx-lm's `"quantization": {"group_size", "bits", "mode"}`, with a per-module
entry such as `"model.embed_tokens": {"group_size": 64, "bits": 8}` where a layer differs from
the default. mlx-lm reads the result, and `read_linear` reads mlx-lm's checkpoints back.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import ModelDir

from .affine import AffineScheme, QuantizedTensor, dequantize, quantize, reconstruction_error

EMBEDDING = "model.embed_tokens"
HEAD = "lm_head"
# Module paths of the decoder's linears: model.layers.<i>.self_attn.q_proj, ...mlp.down_proj
_LAYER_LINEAR = re.compile(r"model\.layers\.\d+\.\w+\.\w+_proj")


@dataclass
class QuantizeReport:
    """What quantize_model made, and how faithful it is."""
    model: ModelDir                # the quantized model, ready for write_model_dir
    errors: dict[str, float]       # quantized weight name -> relative RMS error (imatrix-weighted)
    kept_float: dict[str, str]     # weight name of a matrix left in float -> why
    bytes_before: int              # all tensors, as held in memory
    bytes_after: int
    params: int                    # weights in the float model

    @property
    def bits_per_weight(self) -> float:
        """Bits per weight of the whole model, as mlx-lm reports it (norms and biases included)."""
        return self.bytes_after * 8 / self.params


def is_quantized(config: ModelConfig) -> bool:
    """True when config.json says the weights are quantized (mlx-lm's `quantization` key)."""
    return bool(config.quantization)


def quantize_model(model: ModelDir, bits: int, group_size: int,
                   imatrix: dict[str, np.ndarray] | None = None, embed_bits: int | None = None,
                   method: str = "search", allow_requantize: bool = False,
                   progress: Callable[[str, int, int], None] | None = None) -> QuantizeReport:
    """Quantize every linear of a float model to `bits` with one scale and bias per `group_size`.

    The linears are the decoder layers' `*_proj` matrices, the embedding (which also serves as
    the output head when the embeddings are tied) and `lm_head`. The embedding and `lm_head` use
    `embed_bits` if given. imatrix maps a weight name (`model.layers.0.mlp.up_proj.weight`) to
    its importance per input channel [in]; the embedding, a lookup table, gets none. A matrix
    whose rows do not split into whole groups stays float (as in mlx-lm) and is reported.
    progress(name, done, total) is called after each matrix. An already quantized model is
    refused unless allow_requantize, which dequantizes it first. Returns a report holding the
    new ModelDir; `model` is not changed.
    """
    scheme = AffineScheme(bits, group_size)
    embed_scheme = AffineScheme(embed_bits, group_size) if embed_bits is not None else scheme
    tensors = _float_tensors(model, allow_requantize)
    imatrix = _check_imatrix_names(imatrix or {}, tensors)

    def scheme_of(path: str) -> AffineScheme:
        return embed_scheme if path in (EMBEDDING, HEAD) else scheme

    out, errors, kept_float = _quantize_each(tensors, _linear_paths(tensors), scheme_of, imatrix,
                                             method, progress)
    overrides = ({path: {"group_size": group_size, "bits": embed_bits} for path in (EMBEDDING, HEAD)
                  if f"{path}.weight" in errors} if embed_scheme != scheme else {})
    quantization = {"group_size": group_size, "bits": bits, "mode": "affine", **overrides}
    return QuantizeReport(
        model=_with_quantization(model, out, quantization),
        errors=errors, kept_float=kept_float,
        bytes_before=sum(t.nbytes for t in model.tensors.values()),
        bytes_after=sum(t.nbytes for t in out.values()),
        params=sum(t.size for t in tensors.values()))


def quantize_linears(model: ModelDir, paths: list[str], scheme: AffineScheme) -> QuantizeReport:
    """Quantize the float matrices of the modules at `paths`, and only those, by rounding to
    nearest: a model's other modules stay as they are, quantized or not (a GGUF import's matrices
    in types nibble cannot repack, for one). The new ones get per-module entries in
    `quantization` where `scheme` is not the model's default (or it becomes the default of a float
    model). A matrix whose rows do not split into whole groups stays float and is reported.
    """
    tensors = model.tensors
    unknown = [p for p in paths if f"{p}.weight" not in tensors or f"{p}.scales" in tensors]
    if unknown:
        raise NibbleError(f"no float matrix to quantize at {', '.join(unknown[:3])}")
    out, errors, kept_float = _quantize_each(tensors, paths, lambda path: scheme, {}, "rtn", None)
    default = model.config.quantization or {"group_size": scheme.group_size, "bits": scheme.bits,
                                            "mode": "affine"}
    overrides = ({} if AffineScheme(default["bits"], default["group_size"]) == scheme else
                 {p: {"group_size": scheme.group_size, "bits": scheme.bits}
                  for p in paths if f"{p}.weight" in errors})
    return QuantizeReport(
        model=_with_quantization(model, out, {**default, **overrides}),
        errors=errors, kept_float=kept_float,
        bytes_before=sum(t.nbytes for t in tensors.values()),
        bytes_after=sum(t.nbytes for t in out.values()),
        params=count_params(tensors, model.config.quantization))


def count_params(tensors: dict[str, np.ndarray | HalfTensor], quantization: dict | None) -> int:
    """Weights in a model, a quantized matrix counted as the float matrix it stands for."""
    n = 0
    for name, t in tensors.items():
        path, kind = name.rsplit(".", 1)
        affine = kind in ("weight", "scales", "biases")
        scheme = _scheme_for(quantization, tensors, path) if affine else None
        if scheme is None:
            n += t.size
        elif kind == "weight":
            n += t.shape[0] * t.shape[1] * 32 // scheme.bits
    return n


def read_linear(tensors: dict[str, np.ndarray | HalfTensor], quantization: dict | None,
                path: str) -> np.ndarray | HalfTensor | QuantizedTensor:
    """The weights of the linear (or embedding) at module path `path`, e.g. `lm_head`.

    Returns the float matrix `{path}.weight` (bf16: a HalfTensor) when the module is not
    quantized, else its QuantizedTensor as stored. Follows mlx-lm: a per-path entry in
    `quantization` decides (a dict of settings, or false for float); otherwise the module is
    quantized with the defaults exactly when `{path}.scales` exists. Raises FormatError naming
    the tensor when pieces are missing or their shapes disagree.
    """
    scheme = _scheme_for(quantization, tensors, path)
    if scheme is None:
        if f"{path}.weight" not in tensors:
            raise FormatError(f"the model has no tensor {path}.weight")
        return tensors[f"{path}.weight"]
    names = [f"{path}.{k}" for k in ("weight", "scales", "biases")]
    missing = [name for name in names if name not in tensors]
    if missing:
        raise FormatError(f"quantized module {path} is missing {', '.join(missing)}")
    qt = QuantizedTensor(*(tensors[name] for name in names), scheme.bits, scheme.group_size)
    _check_layout(qt, path)
    return qt


def default_calibration_text() -> str:
    """The text shipped with nibble to measure activations for the importance matrix.

    About 30 KB of varied English: prose, dialogue, lists, numbers, code and markup.
    """
    return resources.files("nibble.quant").joinpath("calibration.txt").read_text(encoding="utf-8")


def _quantize_each(tensors: dict, paths: list[str], scheme_of: Callable[[str], AffineScheme],
                   imatrix: dict[str, np.ndarray], method: str,
                   progress: Callable[[str, int, int], None] | None) -> tuple[dict, dict, dict]:
    """Quantize the float matrix of each module path -> (all tensors, errors, kept_float)."""
    out = dict(tensors)
    errors, kept_float = {}, {}
    for done, path in enumerate(paths, 1):
        name = f"{path}.weight"
        w = np.asarray(tensors[name])  # [out, in]; bf16 widened to float32, one matrix at a time
        s = scheme_of(path)
        if w.shape[1] % s.group_size:
            kept_float[name] = (f"row length {w.shape[1]} is not a multiple of the group size "
                                f"{s.group_size}")
        else:
            imp = None if path == EMBEDDING else imatrix.get(name)
            try:
                qt = quantize(w, s, imp, method)
            except NibbleError as e:
                raise NibbleError(f"{name}: {e}") from None
            del out[name]
            out |= {name: qt.weight, f"{path}.scales": qt.scales, f"{path}.biases": qt.biases}
            errors[name] = reconstruction_error(w, qt, imp)
        if progress is not None:
            progress(name, done, len(paths))
    return out, errors, kept_float


def _with_quantization(model: ModelDir, tensors: dict, quantization: dict) -> ModelDir:
    # mlx-lm writes the same dict under both keys (the second is what the Hub shows).
    extra = {**model.config.extra, "quantization_config": dict(quantization)}
    config = dataclasses.replace(model.config, quantization=quantization, extra=extra)
    return dataclasses.replace(model, path=None, config=config, tensors=tensors)


def _linear_paths(tensors: dict[str, np.ndarray]) -> list[str]:
    """Module paths of the matrices to quantize, in the checkpoint's order."""
    paths = []
    for name, t in tensors.items():
        path = name.removesuffix(".weight")
        if (name.endswith(".weight") and t.ndim == 2
                and (path in (EMBEDDING, HEAD) or _LAYER_LINEAR.fullmatch(path))):
            paths.append(path)
    return paths


def _float_tensors(model: ModelDir, allow_requantize: bool) -> dict[str, np.ndarray]:
    """The model's tensors with every quantized module dequantized to float32."""
    q = model.config.quantization
    if not q:
        return model.tensors
    if not allow_requantize:
        raise NibbleError(f"the model is already quantized ({q.get('bits')}-bit, group size "
                          f"{q.get('group_size')}); quantize the original float model instead, "
                          f"or allow requantizing, which dequantizes first and compounds the error")
    out = dict(model.tensors)
    for name in model.tensors:
        if name.endswith(".scales"):
            path = name.removesuffix(".scales")
            qt = read_linear(model.tensors, q, path)
            del out[f"{path}.scales"], out[f"{path}.biases"]
            out[f"{path}.weight"] = dequantize(qt)
    return out


def _check_imatrix_names(imatrix: dict[str, np.ndarray],
                         tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # Tied models have no lm_head tensor, but a calibration run may still measure its input.
    unknown = [k for k in imatrix if k not in tensors and k != f"{HEAD}.weight"]
    if unknown:
        raise NibbleError(f"importance matrix names tensors the model does not have: "
                          f"{', '.join(unknown[:3])}; keys must be weight names such as "
                          f"model.layers.0.mlp.up_proj.weight")
    return imatrix


def _scheme_for(quantization: dict | None, tensors: dict[str, np.ndarray],
                path: str) -> AffineScheme | None:
    if not quantization:
        return None
    settings = quantization.get(path)
    if settings is False:
        return None
    if settings is None:
        if f"{path}.scales" not in tensors:
            return None
        settings = quantization
    elif not isinstance(settings, dict):
        raise FormatError(f"config.json: quantization[{path!r}] must be an object or false, "
                          f"got {settings!r}")
    mode = settings.get("mode", quantization.get("mode", "affine"))
    if mode != "affine":
        raise FormatError(f"{path} uses {mode!r} quantization; nibble reads only MLX's affine mode")
    bits = settings.get("bits", quantization.get("bits"))
    group_size = settings.get("group_size", quantization.get("group_size"))
    try:
        return AffineScheme(bits, group_size)
    except NibbleError as e:
        raise FormatError(f"{path}: {e}; nibble reads 4- and 8-bit affine models") from None


def _check_layout(qt: QuantizedTensor, path: str) -> None:
    w = qt.weight
    if w.dtype != np.uint32 or w.ndim != 2:
        raise FormatError(f"{path}.weight should be a uint32 matrix of packed "
                          f"{qt.bits}-bit values, got {w.dtype} of shape {w.shape}")
    expected = qt.groups_shape
    for name, t in (("scales", qt.scales), ("biases", qt.biases)):
        if t.shape != expected:
            raise FormatError(f"{path}.{name} has shape {t.shape}, but {path}.weight {w.shape} "
                              f"at {qt.bits} bits and group size {qt.group_size} needs "
                              f"{expected}")
        if not (isinstance(t, HalfTensor) or np.issubdtype(t.dtype, np.floating)):
            raise FormatError(f"{path}.{name} should be float16, bfloat16 or float32, "
                              f"got {t.dtype}")
