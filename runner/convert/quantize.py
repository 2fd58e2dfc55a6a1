"""`nibble quantize`: calibrate on text, quantize every linear, write the model directory."""
from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from nibble.formats import catalog, progress as status
from nibble.formats.errors import NibbleError
from nibble.formats.half import HalfTensor
from nibble.formats.model_dir import ModelDir, read_model_dir, write_model_dir
from nibble.formats.paths import quantized_dir
from nibble.formats.safetensors import TensorStream, prefetch
from nibble.formats.sentence_transformers import pipeline_files
from nibble.quant.convert import (QuantizePlan, QuantizeReport, default_calibration_text, is_mxfp4, is_quantized,
                                 quantize_vision)
from nibble.quant.open_model import open_model
from .calibrate import layer_importances
from ..embedding.encoder import Encoder
from ..model import Model
from ..models import family
from ..text.tokenizer import Tokenizer

CALIBRATION_TOKENS = 2048   # 4 windows of 512: enough for stable importances, a few seconds
# A float model quantized on first use calibrates on fewer: the importances settle long before
# 2048 tokens (the quantized model's held-out KL barely moves), and at 7B each token is seconds
FIRST_USE_CALIBRATION_TOKENS = 256
_BLOCK = re.compile(r"(?:model\.layers|encoder\.layer)\.(\d+)\.")   # a decoder's or an encoder's block's tensors


def quantize(ref: str, out: str, bits: int, group_size: int = 64, embed_bits: int | None = None,
             calib_text: str | None = None, force: bool = False, allow_requantize: bool = False,
             progress: Callable[[str, int, int], None] | None = None, integer_zeros: bool = False,
             vision: bool = False) -> QuantizeReport:
    """Quantize the model at `ref` into the directory `out`; returns the report (its model: `out`
    as written).

    The importance of each input channel comes from running the float model on `calib_text`
    (nibble's own calibration text when None). The weights stream from the input's memory map to
    the output file one matrix at a time, so a model larger than memory quantizes.
    progress(stage, done, total). integer_zeros: each bias -scale times an integer, the zero
    point vLLM's asymmetric integers hold (`nibble quantize --for vllm`; quant.affine.AffineScheme).
    vision: a vision-language model's tower quantized too (quant.convert.quantize_vision), which
    otherwise is written as stored.
    """
    if Path(out).exists() and not force:
        raise NibbleError(f"{out} already exists: choose another path or pass --force to replace it")
    model_dir = open_model(ref)
    if is_quantized(model_dir.config) and not allow_requantize:
        raise NibbleError(f"{ref} is already quantized: requantizing loses quality; "
                          "pass --allow-requantize to do it anyway")
    if is_mxfp4(model_dir.config):
        raise NibbleError(f"{ref} holds MXFP4 experts, which nibble runs as stored: "
                          "it does not requantize them")
    kept_float = {}
    if vision:
        if not model_dir.vision_tensors:
            raise NibbleError(f"{ref} has no vision tower to quantize: drop --vision")
        model_dir, kept_float = quantize_vision(model_dir, bits, group_size)
    report = _write_quantized(model_dir, out, bits=bits, group_size=group_size, embed_bits=embed_bits,
                              calib_text=calib_text, calib_tokens=CALIBRATION_TOKENS, force=force,
                              allow_requantize=allow_requantize, progress=progress, integer_zeros=integer_zeros)
    return dataclasses.replace(report, kept_float={**report.kept_float, **kept_float})


def quantized_once(ref: str, model_dir: ModelDir, bits: int) -> ModelDir:
    """The float model `model_dir` (from `ref`) quantized to `bits` in groups of 64, embedding at 8
    bits, as nibble's cache keeps it: written there on first use, calibrated on
    FIRST_USE_CALIBRATION_TOKENS, and saying so on the progress line."""
    out = quantized_dir() / catalog.copy_name(ref, model_dir.path, bits)
    if not (out / "config.json").is_file():
        start, where = time.monotonic(), ["starting"]

        def line() -> str:
            return (f"quantizing {ref} to int{bits} for this and later runs, once: "
                    f"{time.monotonic() - start:.0f} s so far, {where[0]}")

        def step(stage: str, done: int, total: int):
            where[0] = f"{stage} {done} of {total}"
            status.update(line())
        with status.ticking(line):   # the head alone takes seconds at 7B
            _write_quantized(model_dir, out, bits=bits, group_size=64, embed_bits=8, calib_text=None,
                             calib_tokens=FIRST_USE_CALIBRATION_TOKENS, force=True, allow_requantize=False,
                             progress=step)
        status.done(f"nibble: quantized {ref} to int{bits} in {time.monotonic() - start:.0f} s, into {out}; "
                    "--float runs it as stored")
    return read_model_dir(out)


def _write_quantized(model_dir: ModelDir, out, *, bits: int, group_size: int, embed_bits: int | None,
                     calib_text: str | None, calib_tokens: int, force: bool, allow_requantize: bool,
                     progress: Callable[[str, int, int], None] | None, integer_zeros: bool = False) -> QuantizeReport:
    # measure=False: nothing prints the errors, and measuring them takes a quarter of quantizing
    plan = QuantizePlan(model_dir, bits, group_size, embed_bits=embed_bits, allow_requantize=allow_requantize,
                        stacks=family(model_dir.config).stacks(model_dir.config, model_dir.tensors), measure=False,
                        integer_zeros=integer_zeros)
    if is_quantized(model_dir.config):   # requantizing: no float model to calibrate
        tensors = plan.tensors(progress=progress and (lambda name, done, total: progress("quantizing", done, total)))
    else:
        tensors = calibrated_tensors(plan, model_dir, calibration_tokens(model_dir, calib_text, calib_tokens),
                                     progress=progress and (lambda done, total: progress("layer", done, total)))
    write_model_dir(dataclasses.replace(model_dir, path=None, config=plan.config, tensors={}), out,
                    force=force, tensors=TensorStream(plan.specs, tensors),
                    files=pipeline_files(model_dir.path) if model_dir.path else None)
    return plan.report(read_model_dir(out))


def calibrated_tensors(plan: QuantizePlan, model_dir: ModelDir, tokens: list[int],
                       progress: Callable[[int, int], None] | None = None
                       ) -> Iterator[tuple[str, np.ndarray | HalfTensor]]:
    """plan's tensors, a block's matrices made right after the float model has run the calibration
    `tokens` through that block, while its weights are still in memory: a checkpoint larger than
    memory is read from disk once, not once to calibrate and again to quantize. Then the tensors
    outside the blocks (the embedding, the head: quantized without importances). progress(done,
    total) after each block."""
    blocks: dict[int, list[str]] = {}
    rest = []
    for name in plan.source:
        if m := _BLOCK.match(name):
            blocks.setdefault(int(m[1]), []).append(name)
        else:
            rest.append(name)
    c, t = model_dir.config, model_dir.tensors   # calibration runs the blocks alone: no head
    model = Encoder(c, t) if family(c).encoder else Model(c, t, head=False)
    for i, importances in layer_importances(model, tokens, min(512, model.config.max_position_embeddings)):
        plan.add_importances(importances)
        for name in blocks.get(i + 1, ()):   # read from disk while this block is quantized
            prefetch(plan.source[name])
        yield from plan.tensors(names=blocks.pop(i, ()))
        if progress:
            progress(i + 1, model.config.num_hidden_layers)
    yield from plan.tensors(names=[name for names in blocks.values() for name in names] + rest)


def calibration_tokens(model_dir: ModelDir, calib_text: str | None = None, n: int = CALIBRATION_TOKENS) -> list[int]:
    """The first `n` tokens of `calib_text` (nibble's own calibration text when None)."""
    text = default_calibration_text() if calib_text is None else calib_text
    if not text.strip():
        raise NibbleError("the calibration text is empty: give a file with some text in it")
    return Tokenizer(model_dir).encode(text, add_bos=False)[:n]


def read_calibration_file(path: str) -> str:
    """The text of a --calib file: UTF-8 and not empty."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise NibbleError(f"{path} is not UTF-8 text: give a text file for --calib") from None
    if "\x00" in text or not text.strip():
        raise NibbleError(f"{path} is {'empty' if not text.strip() else 'not text'}: "
                          "give a text file for --calib")
    return text
