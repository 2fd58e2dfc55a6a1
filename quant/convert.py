"""The quantize command's library side: a float ModelDir in, an MLX-layout quantized ModelDir out.

Each quantized linear `P` becomes `P.weight` (packed uint32), `P.scales` and `P.biases`, and
config.json gains mlx-lm's `"quantization": {"group_size", "bits", "mode"}`, with a per-module
entry such as `"model.embed_tokens": {"group_size": 64, "bits": 8}` where a layer differs from
the default. mlx-lm reads the result, and `read_linear` reads mlx-lm's checkpoints back.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib import resources

import numpy as np

from nibble.formats import superblocks
from nibble.formats.config import ModelConfig
from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import ModelDir
from nibble.formats.safetensors import TensorSpec, release, tensor_spec

from .affine import AffineScheme, QuantizedTensor, dequantize, quantize, reconstruction_error

# The token embeddings: a decoder's, and an encoder's (BERT's)
EMBEDDINGS = ("model.embed_tokens", "embeddings.word_embeddings")
HEAD = "lm_head"
# Module paths of the blocks' linears: a decoder's model.layers.<i>.self_attn.q_proj,
# ...mlp.down_proj, ...mlp.shared_expert.up_proj, ...shared_mlp.input_linear (Granite's); an
# encoder's encoder.layer.<i>.attention.self.query, ...attention.output.dense, ...intermediate.dense,
# ...output.dense (BERT's)
_LAYER_LINEAR = re.compile(r"model\.layers\.\d+\.[\w.]+_(proj|linear)"
                           r"|encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|(attention\.output|intermediate|output)\.dense)")


@dataclass(frozen=True)
class ExpertStack:
    """The matrices of a mixture's experts written as one stacked weight [E, N, K], as MLX's
    switch_mlp holds them (the runner's families say which: runner/models/): made of the
    checkpoint's tensors `sources`, which it replaces; `matrices(tensors)` yields each expert's
    float32 [N, K] in turn."""
    sources: tuple[str, ...]
    shape: tuple[int, int, int]
    matrices: Callable[[dict], Iterator[np.ndarray]]


@dataclass
class QuantizeReport:
    """What quantize_model made, and how faithful it is."""
    model: ModelDir                # the quantized model: in memory, or as nibble quantize wrote it
    errors: dict[str, float]       # quantized weight name -> relative RMS error (imatrix-weighted)
    kept_float: dict[str, str]     # weight name of a matrix left in float -> why
    bytes_before: int              # all tensors, as held in memory
    bytes_after: int
    params: int                    # weights in the float model
    plain_experts: int = 0         # experts quantized without importances: calibration rarely reached them

    @property
    def bits_per_weight(self) -> float:
        """Bits per weight of the whole model, as mlx-lm reports it (norms and biases included)."""
        return self.bytes_after * 8 / self.params


def is_quantized(config: ModelConfig) -> bool:
    """True when config.json says the weights are quantized: mlx-lm's `quantization` key, or a
    checkpoint whose experts are MXFP4 (OpenAI's gpt-oss, run as stored)."""
    return bool(config.quantization) or is_mxfp4(config)


def is_mxfp4(config: ModelConfig) -> bool:
    """Whether config.json's quantization_config says MXFP4 (transformers' spelling)."""
    q = config.extra.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def quantize_model(model: ModelDir, bits: int, group_size: int,
                   imatrix: dict[str, np.ndarray] | None = None, embed_bits: int | None = None,
                   method: str = "search", allow_requantize: bool = False,
                   progress: Callable[[str, int, int], None] | None = None,
                   stacks: dict[str, ExpertStack] | None = None, integer_zeros: bool = False) -> QuantizeReport:
    """Quantize every linear of a float model to `bits` with one scale and bias per `group_size`.

    The linears are the decoder layers' `*_proj` matrices, the embedding (which also serves as
    the output head when the embeddings are tied) and `lm_head`. The embedding and `lm_head` use
    `embed_bits` if given. imatrix maps a weight name (`model.layers.0.mlp.up_proj.weight`) to
    its importance per input channel [in]; the embedding, a lookup table, gets none. A matrix
    whose rows do not split into whole groups stays float (as in mlx-lm) and is reported.
    progress(name, done, total) is called after each matrix. An already quantized model is
    refused unless allow_requantize, which dequantizes it first. `stacks` (output weight name ->
    ExpertStack): a mixture's experts, each stack quantized expert by expert (its importances
    [E, K] in imatrix; an expert's row of zeros: plain weighting) and written stacked. Returns a
    report holding the new ModelDir, all in memory (QuantizePlan streams it to a file instead);
    `model` is not changed. integer_zeros: see AffineScheme.
    """
    plan = QuantizePlan(model, bits, group_size, imatrix, embed_bits, method, allow_requantize, stacks,
                        integer_zeros=integer_zeros)
    tensors = dict(plan.tensors(progress))
    return plan.report(dataclasses.replace(model, path=None, config=plan.config, tensors=tensors))


class QuantizePlan:
    """quantize_model's work, planned before any weight is read: the quantized model's config and
    every tensor's dtype and shape (`specs`, fixed by the scheme), then the tensors themselves one
    matrix at a time (`tensors`), so that a model larger than memory streams into its file.
    Importances can come as they are measured (add_importances), each before its matrix's turn.
    measure=False skips the report's errors (another pass over every weight). integer_zeros:
    biases that are -scale times an integer (AffineScheme), for engines that hold zero points."""

    def __init__(self, model: ModelDir, bits: int, group_size: int,
                 imatrix: dict[str, np.ndarray] | None = None, embed_bits: int | None = None,
                 method: str = "search", allow_requantize: bool = False,
                 stacks: dict[str, ExpertStack] | None = None, measure: bool = True,
                 integer_zeros: bool = False):
        scheme = AffineScheme(bits, group_size, integer_zeros)
        embed_scheme = AffineScheme(embed_bits, group_size, integer_zeros) if embed_bits is not None else scheme
        self.model, self.method = model, method
        # name -> float tensor, or a QuantizedTensor to requantize (dequantized when its turn comes)
        self.source = _float_tensors(model, allow_requantize)
        # the stacks whose rows split into whole groups (the others' sources stay as they are), by
        # their first source: where they are written (Granite's gate and up share theirs)
        self.stacks: dict[str, list[tuple[str, ExpertStack]]] = {}
        for name, stack in (stacks or {}).items():
            if not _misfit(stack.shape, scheme):
                self.stacks.setdefault(stack.sources[0], []).append((name, stack))
        fitting = [pair for pairs in self.stacks.values() for pair in pairs]
        self.consumed = {src for _, stack in fitting for src in stack.sources}
        self.stacked = [name for name, _ in fitting]
        self.imatrix: dict[str, np.ndarray] = {}
        self.add_importances(imatrix or {})
        self.linears = [p for p in _linear_paths(self.source) if f"{p}.weight" not in self.consumed]
        self.schemes: dict[str, AffineScheme] = {}   # module path -> scheme, of those quantized
        self.kept_float: dict[str, str] = {}         # weight name of a matrix left in float -> why
        overrides = {}
        for path in self.linears:
            s = embed_scheme if path in (*EMBEDDINGS, HEAD) else scheme
            misfit = _misfit(self.source[f"{path}.weight"].shape, s)
            if misfit:
                self.kept_float[f"{path}.weight"] = misfit
            else:
                self.schemes[path] = s
                if s != scheme:
                    overrides[path] = {"group_size": s.group_size, "bits": s.bits}
        quantization = {"group_size": group_size, "bits": bits, "mode": "affine", **overrides}
        self.config = _quantized_config(model.config, quantization)
        self.specs: dict[str, TensorSpec] = {}   # each quantized weight replaced by its three parts
        for name, t in self.source.items():
            s = self._scheme(name)
            if name in self.stacks:
                for out, stack in self.stacks[name]:
                    self.specs |= _quantized_specs(out, stack, scheme)
            elif name in self.consumed:
                continue
            elif s is not None:
                self.specs |= _quantized_specs(name, t, s)
            else:
                self.specs[name] = (TensorSpec("F32", t.shape) if isinstance(t, QuantizedTensor)
                                    else tensor_spec(t))
        self.errors: dict[str, float] = {}   # quantized weight name -> relative RMS error, filled by tensors()
        self.measure = measure
        self.scheme = scheme
        self.plain_experts = 0   # experts of the stacks quantized without importances, counted by tensors()
        self.done = 0            # linears made so far

    def add_importances(self, imatrix: dict[str, np.ndarray]) -> None:
        """Importances (weight name -> [in], or [E, in] for a stack) for matrices not yet made."""
        self.imatrix |= _check_imatrix_names(imatrix, self.source, self.stacked)

    def tensors(self, progress: Callable[[str, int, int], None] | None = None,
                names: Iterable[str] | None = None) -> Iterator[tuple[str, np.ndarray | HalfTensor]]:
        """(name, tensor) for every name in `specs` made of the source tensors `names` (all of
        them, in order, when None), quantizing one matrix at a time; what a tensor held of the
        input's memory map is given back once its turn is over (see release). Fills `errors`
        (if measuring); progress(name, done, total) after each linear."""
        total = len(self.linears) + sum(map(len, self.stacks.values()))
        for name in self.source if names is None else names:
            t, s = self.source[name], self._scheme(name)
            for out, stack in self.stacks.get(name, ()):
                qt = self._quantize_stack(out, stack)
                yield from zip(_parts(out), (qt.weight, qt.scales, qt.biases))
                for src in stack.sources:
                    release(self.source[src])
                self.done += 1
                if progress is not None:
                    progress(out, self.done, total)
            if name in self.consumed:
                continue
            if s is None:
                yield name, dequantize(t) if isinstance(t, QuantizedTensor) else t
            else:
                qt = self._quantize(name, t, s)
                yield from zip(_parts(name), (qt.weight, qt.scales, qt.biases))
            for a in (t.weight, t.scales, t.biases) if isinstance(t, QuantizedTensor) else (t,):
                release(a)
            if s is not None or name in self.kept_float:
                self.done += 1
                if progress is not None:
                    progress(name, self.done, total)

    def report(self, model: ModelDir) -> QuantizeReport:
        """The report on `model`, the quantized model made of `tensors()`."""
        return QuantizeReport(
            model=model, errors=self.errors, kept_float=self.kept_float,
            bytes_before=sum(t.nbytes for t in self.model.tensors.values()),
            bytes_after=sum(spec.nbytes for spec in self.specs.values()),
            params=sum(math.prod(t.shape) for t in self.source.values()), plain_experts=self.plain_experts)

    def _scheme(self, name: str) -> AffineScheme | None:
        """The scheme of weight `name`, None when it stays float."""
        return self.schemes.get(name.removesuffix(".weight")) if name.endswith(".weight") else None

    def _quantize_stack(self, name: str, stack: ExpertStack) -> QuantizedTensor:
        """The experts of `stack` quantized one by one (each with its row of the importances, or
        plainly where that row is zeros), stacked."""
        imp = self.imatrix.get(name)
        parts, errors = [], []
        for e, w in enumerate(stack.matrices(self.model.tensors)):
            if w.shape != stack.shape[1:]:
                raise NibbleError(f"{stack.sources[min(e, len(stack.sources) - 1)]}: expert {e}'s matrix is "
                                  f"{w.shape[0]}x{w.shape[1]}, the config needs {stack.shape[1]}x{stack.shape[2]}")
            row = None if imp is None or not imp[e].any() else imp[e]
            self.plain_experts += imp is not None and row is None
            qt, err = _quantized(f"{name}[{e}]", w, self.scheme, row, self.method, self.measure)
            parts.append(qt)
            errors.append(err)
        if self.measure:
            self.errors[name] = float(np.sqrt(np.mean(np.square(errors))))
        return QuantizedTensor(*(np.stack([getattr(q, f) for q in parts]) for f in ("weight", "scales", "biases")),
                               self.scheme.bits, self.scheme.group_size)

    def _quantize(self, name: str, t, s: AffineScheme) -> QuantizedTensor:
        w = dequantize(t) if isinstance(t, QuantizedTensor) else np.asarray(t)  # [out, in] float32
        imp = None if name.removesuffix(".weight") in EMBEDDINGS else self.imatrix.get(name)
        qt, err = _quantized(name, w, s, imp, self.method, self.measure)
        if self.measure:
            self.errors[name] = err
        return qt


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
    out, errors, kept_float = dict(tensors), {}, {}
    for path in paths:
        name = f"{path}.weight"
        w = np.asarray(tensors[name])   # [out, in] float32 (bf16 widened), one matrix at a time
        if misfit := _misfit(w.shape, scheme):
            kept_float[name] = misfit
            continue
        qt, errors[name] = _quantized(name, w, scheme, None, "rtn")
        del out[name]
        out |= dict(zip(_parts(name), (qt.weight, qt.scales, qt.biases)))
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


# A vision tower's matrices (formats/wrappers.py's names): its blocks' projections and MLP
_TOWER_LINEAR = re.compile(r"vision_tower\.encoder\.layers\.\d+\.(self_attn\.\w+_proj|mlp\.fc\d)\.weight")


def quantize_vision(model: ModelDir, bits: int, group_size: int, method: str = "search") -> tuple[ModelDir, dict[str, str]]:
    """A vision-language model with its tower's matrices quantized too, as the decoder's default
    scheme (`bits`, `group_size`: the tower reads config.quantization); its patch embedding,
    positions, norms and projector as stored. -> (the model, each matrix kept in float and why)."""
    scheme = AffineScheme(bits, group_size)
    out, kept_float = dict(model.vision_tensors), {}
    for name, t in model.vision_tensors.items():
        if not _TOWER_LINEAR.fullmatch(name):
            continue
        w = t.widen() if isinstance(t, HalfTensor) else np.asarray(t, np.float32)
        if misfit := _misfit(w.shape, scheme):
            kept_float[name] = misfit
            continue
        qt, _ = _quantized(name, w, scheme, None, method, measure=False)
        del out[name]
        out |= dict(zip(_parts(name), (qt.weight, qt.scales, qt.biases)))
    return dataclasses.replace(model, vision_tensors=out), kept_float


def count_params(tensors: dict[str, np.ndarray | HalfTensor], quantization: dict | None) -> int:
    """Weights in a model, a quantized matrix counted as the float matrix it stands for."""
    n = 0
    for name, t in tensors.items():
        path, kind = name.rsplit(".", 1)
        affine = kind in ("weight", "scales", "biases", "values", "high")
        scheme = _scheme_for(quantization, tensors, path) if affine else None
        if scheme is None:
            n += t.size
        elif kind == "weight":
            n += math.prod(t.shape) * 32 // scheme.bits   # stacked experts' too
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
    values = tensors.get(f"{path}.values")   # a table of levels (QuantizedTensor.values)
    high = tensors.get(f"{path}.high")       # high planes (QuantizedTensor.high)
    qt = QuantizedTensor(*(tensors[name] for name in names), scheme.bits, scheme.group_size,
                         values=None if values is None else np.asarray(values),
                         high=None if high is None else np.asarray(high))
    _check_layout(qt, path)
    return qt


def default_calibration_text() -> str:
    """The text shipped with nibble to measure activations for the importance matrix.

    About 30 KB of varied English: prose, dialogue, lists, numbers, code and markup.
    """
    return resources.files("nibble.quant").joinpath("calibration.txt").read_text(encoding="utf-8")


def _parts(name: str) -> tuple[str, str, str]:
    """The names of a quantized weight's packed integers, scales and biases."""
    path = name.removesuffix(".weight")
    return name, f"{path}.scales", f"{path}.biases"


def _misfit(shape: tuple, s: AffineScheme) -> str:
    """Why a matrix of `shape` ([out, in], or experts' [E, out, in]) cannot be quantized with
    scheme s, or "" when it can."""
    n = shape[-1]
    return f"row length {n} is not a multiple of the group size {s.group_size}" if n % s.group_size else ""


def _quantized_specs(name: str, t, s: AffineScheme) -> dict[str, TensorSpec]:
    """The specs of weight `name` quantized with s: a matrix [out, in], or stacked [E, out, in]."""
    *lead, n = t.shape
    groups = TensorSpec("F32" if s.integer_zeros else "F16", (*lead, n // s.group_size))
    weight, scales, biases = _parts(name)
    return {weight: TensorSpec("U32", (*lead, n * s.bits // 32)), scales: groups, biases: groups}


def _quantized(name: str, w: np.ndarray, s: AffineScheme, imp: np.ndarray | None,
               method: str, measure: bool = True) -> tuple[QuantizedTensor, float | None]:
    """Float matrix `name` quantized, and its relative reconstruction error (None unless
    `measure`)."""
    try:
        qt = quantize(w, s, imp, method)
    except NibbleError as e:
        raise NibbleError(f"{name}: {e}") from None
    return qt, reconstruction_error(w, qt, imp) if measure else None


def _quantized_config(config: ModelConfig, quantization: dict) -> ModelConfig:
    # mlx-lm writes the same dict under both keys (the second is what the Hub shows).
    extra = {**config.extra, "quantization_config": dict(quantization)}
    return dataclasses.replace(config, quantization=quantization, extra=extra)


def _with_quantization(model: ModelDir, tensors: dict, quantization: dict) -> ModelDir:
    return dataclasses.replace(model, path=None, config=_quantized_config(model.config, quantization),
                               tensors=tensors)


def _linear_paths(tensors: dict) -> list[str]:
    """Module paths of the matrices to quantize, in the checkpoint's order."""
    paths = []
    for name, t in tensors.items():
        path = name.removesuffix(".weight")
        if (name.endswith(".weight") and len(t.shape) == 2
                and (path in (*EMBEDDINGS, HEAD) or _LAYER_LINEAR.fullmatch(path))):
            paths.append(path)
    return paths


def _float_tensors(model: ModelDir, allow_requantize: bool) -> dict:
    """The model's tensors, each quantized module as one QuantizedTensor under its weight's name
    (dequantized only when its turn comes: the model may not fit in memory as float32)."""
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
            out.pop(f"{path}.values", None)
            out.pop(f"{path}.high", None)
            out[f"{path}.weight"] = qt
    return out


def _check_imatrix_names(imatrix: dict[str, np.ndarray], tensors: dict[str, np.ndarray],
                         stacked: list[str]) -> dict[str, np.ndarray]:
    # Tied models have no lm_head tensor, but a calibration run may still measure its input.
    unknown = [k for k in imatrix if k not in tensors and k not in stacked and k != f"{HEAD}.weight"]
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
    stacked = w.ndim == 3   # experts, one matrix each
    if w.dtype != np.uint32 or (w.ndim != 2 and not stacked):
        raise FormatError(f"{path}.weight should be a uint32 matrix of packed "
                          f"{qt.bits}-bit values (or experts' matrices stacked), got {w.dtype} of shape {w.shape}")
    if qt.values is not None and (qt.values.dtype != np.uint8 or qt.values.shape != (16,) or qt.bits != 4
                                  or qt.group_size != 32):
        raise FormatError(f"{path}.values should be 16 uint8 levels of 4-bit weights in groups of 32, got "
                          f"{qt.values.dtype} of shape {qt.values.shape} for {qt.bits}-bit weights in groups of "
                          f"{qt.group_size}")
    problem = qt.planes_problem()
    if problem:
        raise FormatError(f"{path}.high: {problem}")
    expected = qt.groups_shape
    for name, t in (("scales", qt.scales), ("biases", qt.biases)):
        if t.shape != expected:
            raise FormatError(f"{path}.{name} has shape {t.shape}, but {path}.weight {w.shape} "
                              f"at {qt.bits} bits and group size {qt.group_size} needs "
                              f"{expected}")
        if superblocks.is_two_level(t):
            if qt.group_size > 32 or t.dtype != qt.scales.dtype:
                raise FormatError(f"{path}.{name} in two levels should be bytes of the scales' dtype (uint8, "
                                  f"or int8 with a sign), in groups of 32 or 16, got {t.dtype} in groups of "
                                  f"{qt.group_size}")
        elif not (isinstance(t, HalfTensor) or np.issubdtype(t.dtype, np.floating)):
            raise FormatError(f"{path}.{name} should be float16, bfloat16 or float32, "
                              f"got {t.dtype}")
