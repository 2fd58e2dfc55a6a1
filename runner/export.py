"""`nibble export`: a model nibble runs handed to another engine as a GGUF file (llama.cpp,
ollama, LM Studio), its weights exactly as nibble runs them where a GGUF type holds them.

A GGUF model goes back as it came, byte for byte; a model of nibble's own layout through
formats/gguf_export.py (its int4 as Q4_1, the rest rounded again to Q8_0), and where anything was
rounded again, how far the export's next-token distributions are from nibble's model (the mean
KL divergence over a few windows of nibble's calibration text).
"""
from __future__ import annotations

import dataclasses
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nibble.formats.errors import NibbleError
from nibble.formats.gguf_export import arch_of, copy_gguf, write_gguf
from nibble.formats.model_dir import write_model_dir
from nibble.quant.convert import default_calibration_text
from nibble.quant.export import compressed_tensors, gguf_tensors
from nibble.quant.open_model import open_model

from .loader import from_model_dir, load
from .measure.perplexity import evaluate

KL_WINDOWS, KL_CTX = 2, 256   # what the KL of a rounded-again export is measured on


@dataclass
class Exported:
    """What an export wrote."""
    path: Path
    tensors: int
    again: dict[str, str] = field(default_factory=dict)   # matrix -> what became of it, where rounded again
    kl: float | None = None   # mean KL(nibble's model || the export), nats, where anything was
    hint: str = ""            # how to export without rounding again, where there is a way

    def __str__(self) -> str:
        nbytes = sum(f.stat().st_size for f in self.path.rglob("*")) if self.path.is_dir() else self.path.stat().st_size
        size = f"wrote {self.path} ({self.tensors} tensors, {nbytes / 1e6:.1f} MB)"
        if not self.again:
            return f"{size}: every weight as nibble runs it"
        kinds = "; ".join(f"{n} {kind}" for kind, n in Counter(self.again.values()).items())
        kl = "" if self.kl is None else f"; KL against nibble's model {self.kl:.6f} nats a token"
        return f"{size}: rounded again: {kinds}; the rest as nibble runs them{kl}{self.hint}"


def export_gguf(ref: str, out: str | Path, force: bool = False, measure: bool = True) -> Exported:
    """Write the model at `ref` as the GGUF file `out` (refused if it exists, unless `force`);
    measure: where weights were rounded again, the KL of the export against nibble's model."""
    out = Path(out)
    if out.suffix != ".gguf":
        raise NibbleError(f"{out}: a GGUF file's name ends in .gguf (llama.cpp and ollama look for it)")
    model = open_model(ref)
    with _writing(out, force):
        out.parent.mkdir(parents=True, exist_ok=True)
        if model.path is not None and model.path.suffix == ".gguf":
            copy_gguf(model.path, out)
            return Exported(out, len(model.tensors))
        arch_of(model.config)   # before any matrix is rounded: a model it cannot write, refused at once
        tensors, again = gguf_tensors(model)
        write_gguf(model, tensors, out, model.path.name if model.path is not None else "model")
    exported = Exported(out, len(tensors), again)
    if again and measure:
        exported.kl = _kl(model, lambda: load(str(out))[0])
    return exported


@contextmanager
def _writing(out: Path, force: bool):
    """Around an export's write: an existing `out` refused unless `force`, a failing write one line."""
    if out.exists() and not force:
        raise NibbleError(f"{out} already exists: choose another path, or replace it with --force")
    try:
        yield
    except OSError as e:
        raise NibbleError(f"cannot write {out}: {e.strerror or e}") from None


def _kl(model, exported) -> float:
    """Mean KL divergence of the next-token distributions of the export (as `exported()` loads
    it) from nibble's model's."""
    ours, tokenizer = from_model_dir(model)
    tokens = tokenizer.encode(default_calibration_text())[:KL_WINDOWS * KL_CTX]
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "logprobs")
        evaluate(ours, tokens, KL_CTX, KL_WINDOWS, save_logits=base)
        theirs = exported()
        return evaluate(theirs, tokens, KL_CTX, KL_WINDOWS, kl_base=base).kl_mean


def export_compressed(ref: str, out: str | Path, force: bool = False, measure: bool = True) -> Exported:
    """Write the model at `ref` in compressed-tensors' layout (vLLM, SGLang) as the directory
    `out` (refused if it exists, unless `force`); measure: where weights were rounded again, the KL
    of the export against nibble's model."""
    out = Path(out)
    model = open_model(ref)
    with _writing(out, force):
        tensors, config, again, as_run = compressed_tensors(model)
        extra = {k: v for k, v in model.config.extra.items() if k != "quantization_config"}
        written = dataclasses.replace(model, config=dataclasses.replace(
            model.config, quantization=None, extra={**extra, "quantization_config": config, "torch_dtype": "float16"}))
        write_model_dir(written, out, force=force, tensors=tensors)
    exported = Exported(out, len(tensors), again, hint=" (nibble quantize --for vllm quantizes a float model "
                        "with integer zero points, which this format holds exactly)" if again else "")
    if again and measure:
        # the export as nibble would run it: the rounded matrices in nibble's layout
        exported.kl = _kl(model, lambda: from_model_dir(dataclasses.replace(
            model, path=None, tensors={**model.tensors, **as_run}))[0])
    return exported
