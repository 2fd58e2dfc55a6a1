"""Gemma 3's vision against transformers (tests/data/vision/gemma3, made by
tests/fixtures/make_vision_fixtures.py): the image's pixels as its processor makes them, the image
tokens its tower and projector make (the numpy twins of tests/reference.py, and nibble's kernels),
and the logits of a prompt holding two images (float and quantized), in one pass or in chunks."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from nibble.formats.config import ModelConfig
from nibble.formats.image import open_image, read_image
from nibble.formats.model_dir import ModelDir, read_model_dir
from nibble.formats.safetensors import read_checkpoint
from nibble.formats.wrappers import text_tensors, vision_tensors
from nibble.quant.affine import dequantize
from nibble.quant.convert import quantize_model, read_linear
from nibble.runner.model import Model
from nibble.runner.text.tokenizer import Tokenizer
from nibble.runner.text.image_ids import INDEX_BITS, image_ids, key_of, whole_images
from nibble.runner.vision import vision_of
from tests import reference

GEMMA3 = Path(__file__).parent / "data" / "vision" / "gemma3"
IDEFICS3 = Path(__file__).parent / "data" / "vision" / "idefics3"
IMAGE_TOKEN = 299   # the fixture's config.image_token_index


def config() -> dict:
    return json.loads((GEMMA3 / "config.json").read_text())


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def runnable(folder: Path, bits: int | None = None, dequantized: bool = False) -> tuple[Model, Tokenizer | None]:
    """A fixture as nibble runs it (and its tokenizer, where it has one), its decoder quantized to
    `bits` (None: float), or those quantized weights made float again (`dequantized`)."""
    if (folder / "tokenizer.json").is_file():
        model_dir = read_model_dir(folder)
    else:
        raw, tensors = json.loads((folder / "config.json").read_text()), read_checkpoint(folder)
        model_dir = ModelDir(None, ModelConfig.from_dict(raw), text_tensors(raw, tensors), tokenizer=None,
                             vision_config=raw, vision_tensors=vision_tensors(raw, tensors))
    if bits:
        model_dir = quantize_model(model_dir, bits, 64, method="rtn").model   # the suite's usual groups
    if dequantized:
        q, floats = model_dir.config.quantization, dict(model_dir.tensors)
        for path in [n.removesuffix(".scales") for n in floats if n.endswith(".scales")]:
            floats[f"{path}.weight"] = dequantize(read_linear(model_dir.tensors, q, path))
            del floats[f"{path}.scales"], floats[f"{path}.biases"]
        model_dir = dataclasses.replace(model_dir, config=dataclasses.replace(model_dir.config, quantization=None),
                                        tensors=floats)
    model = Model(model_dir.config, model_dir.tensors)
    tokenizer = Tokenizer(model_dir) if model_dir.tokenizer is not None else None
    model.vision = vision_of(model_dir, tokenizer.tokenizer.id_to_token if tokenizer else lambda id: f"<token {id}>")
    return model, tokenizer


def gemma3(bits: int | None = None, dequantized: bool = False) -> Model:
    return runnable(GEMMA3, bits, dequantized)[0]


def prompt(model: Model) -> list[int]:
    """The fixture's tokens, each run of image tokens the ids of its image (the two images held)."""
    pictures = [open_image(GEMMA3 / "image.png"), open_image(GEMMA3 / "image2.png")]
    model.vision.place(model.vision.marker * 2, pictures)
    ids, runs = [], iter(pictures)
    for t in np.load(GEMMA3 / "tokens.npy").tolist():
        if t == IMAGE_TOKEN and (not ids or ids[-1] >= 0):
            ids += image_ids(next(runs).digest, 4)
        elif t != IMAGE_TOKEN:
            ids.append(t)
    return ids


def test_gemma3_pixels_are_transformers_processors():
    pixels = reference.gemma3_pixels(read_image(GEMMA3 / "image.png"), config()["vision_config"]["image_size"])
    np.testing.assert_allclose(pixels, np.load(GEMMA3 / "pixel_values.npy"), rtol=0, atol=1e-6)
    vision = gemma3().vision
    np.testing.assert_allclose(vision.pixels(open_image(GEMMA3 / "image.png")), pixels, rtol=0, atol=1e-6)


def test_gemma3_image_tokens_are_transformers():
    c = config()
    W = {f"model.{k}": v for k, v in vision_tensors(c, read_checkpoint(GEMMA3)).items()}
    hidden = reference.siglip_tower(c["vision_config"], W, np.load(GEMMA3 / "pixel_values.npy").astype(np.float64))
    tokens = reference.gemma3_projector(c, W, hidden)
    want = np.load(GEMMA3 / "features.npy")
    assert tokens.shape == want.shape == (c["mm_tokens_per_image"], c["text_config"]["hidden_size"])
    np.testing.assert_allclose(tokens, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # nibble's kernels, the image alone and beside another in one pass of the tower
    vision = gemma3().vision
    picture = open_image(GEMMA3 / "image.png")
    alone, = vision.encode([picture])
    assert relative_error(alone, want) < 1e-5
    beside = vision.encode([open_image(GEMMA3 / "image2.png"), picture])[1]
    np.testing.assert_allclose(beside, alone, rtol=0, atol=1e-6 * np.abs(want).max())


def test_gemma3_logits_with_images_are_transformers():
    """Both images' tokens see each other in both layers, the sliding one (a window of 3) too."""
    model = gemma3()
    got = model.forward(prompt(model), model.new_cache(), all_logits=True)
    assert relative_error(got, np.load(GEMMA3 / "logits.npy")) < 1e-4


@pytest.mark.parametrize("folder", [GEMMA3, IDEFICS3], ids=["gemma3", "idefics3"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_with_images_is_its_float_twin(folder, bits):
    """A quantized decoder (the tower as stored) against the same weights made float again: what
    is left is the kernels' rounding of activations to int8 (test_transformers' bound for it)."""
    ask = prompt if folder == GEMMA3 else idefics3_prompt
    (model, tokenizer), (twin, _) = runnable(folder, bits), runnable(folder, bits, dequantized=True)
    got = model.forward(ask(model) if tokenizer is None else ask(model, tokenizer), model.new_cache(), all_logits=True)
    want = twin.forward(ask(twin) if tokenizer is None else ask(twin, tokenizer), twin.new_cache(), all_logits=True)
    assert relative_error(got, want) < 3e-2
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9   # a tiny random model's close calls aside


def test_gemma3_prompt_in_chunks_keeps_images_whole():
    model = gemma3()
    ids = prompt(model)
    want = np.load(GEMMA3 / "logits.npy")
    cache, got = model.new_cache(), []
    while cache.pos < len(ids):   # chunks of 5 that would cut both images
        end = whole_images(ids, cache.pos, min(cache.pos + 5, len(ids)))
        got.append(model.forward(ids[cache.pos:end], cache, all_logits=True))
    assert relative_error(np.concatenate(got), want) < 1e-4


def test_gemma3_images_see_each_others_tokens():
    """The test above tells: with an image's tokens attending causally, the logits part from
    transformers'."""
    model = gemma3()
    ids = prompt(model)
    model.vision.bidirectional = False
    got = model.forward(ids, model.new_cache(), all_logits=True)
    assert relative_error(got, np.load(GEMMA3 / "logits.npy")) > 1e-2


# ---- Idefics3 (SmolVLM): tiles, pixel shuffle, a causal decoder ----

def idefics3_prompt(model: Model, tokenizer: Tokenizer) -> list[int]:
    """The fixture's prompt, its <image> placed by nibble's vision and tokenized by nibble."""
    picture = open_image(IDEFICS3 / "image.png")
    text = model.vision.place((IDEFICS3 / "prompt.txt").read_text(), [picture])
    return tokenizer.encode(text, images={picture.digest})


def test_idefics3_tiles_tokens_and_logits_are_transformers():
    model, tokenizer = runnable(IDEFICS3)
    picture = open_image(IDEFICS3 / "image.png")
    # the processor's five frames: 2 x 2 tiles of the image made 64 x 64, then all of it at 32 x 32
    np.testing.assert_allclose(model.vision.pixels(picture), np.load(IDEFICS3 / "pixel_values.npy"), rtol=0, atol=1e-6)
    want = np.load(IDEFICS3 / "features.npy")
    rows, = model.vision.encode([picture])
    assert rows.shape == want.shape == (5 * 4, 64) and relative_error(rows, want) < 1e-5
    ids = idefics3_prompt(model, tokenizer)
    image_token = json.loads((IDEFICS3 / "config.json").read_text())["image_token_id"]
    assert [t if t >= 0 else image_token for t in ids] == np.load(IDEFICS3 / "tokens.npy").tolist()
    assert ids[ids.index(-1 - (key_of(picture.digest) << INDEX_BITS)):][:4] == image_ids(picture.digest, 4)
    got = model.forward(ids, model.new_cache(), all_logits=True)
    assert relative_error(got, np.load(IDEFICS3 / "logits.npy")) < 1e-4


# ---- a prompt with images, from the command line to the model ----

def test_a_prompt_s_images_become_their_tokens_where_the_template_put_them(vision_dir):
    from nibble.runner.loader import load
    from nibble.runner.text.reasoning import chat_prompt
    from nibble.runner.text.template import build_messages
    from nibble.runner.vision.base import for_template, with_images
    model, tokenizer = load(str(vision_dir), quant="float")
    pictures = [open_image(GEMMA3 / "image.png"), open_image(GEMMA3 / "image2.png")]
    messages = build_messages("Tell them apart", None, pictures)
    assert for_template(model.vision, messages) == (messages, pictures)
    text, _ = chat_prompt(tokenizer, messages)
    placed, digests = with_images(model.vision, text, pictures)
    ids = tokenizer.encode(placed, images=digests)
    boi, eoi = (tokenizer.tokenizer.token_to_id(t) for t in ("<start_of_image>", "<end_of_image>"))
    starts = [i for i, t in enumerate(ids) if t == boi]
    assert len(starts) == 2 and [ids[s + 5] for s in starts] == [eoi, eoi]
    for s, picture in zip(starts, pictures):
        assert ids[s + 1:s + 5] == image_ids(picture.digest, 4)
    # Gemma3Processor's text around each image
    assert placed.count("\n\n<start_of_image>\ue000") == 2
    assert placed.count("\ue001<end_of_image>\n\n") == 2
    # a tag typed in a message is text, and one whose image this prompt did not bring too
    assert min(tokenizer.encode(placed)) >= 0
    assert min(tokenizer.encode(placed, images={pictures[0].digest})[starts[1]:]) >= 0


def test_a_kept_prefix_runs_no_image_through_the_tower_again(vision_dir, monkeypatch):
    from nibble.runner.generation.generate import stream_generate
    from nibble.runner.loader import load
    from nibble.runner.vision.base import with_images
    from nibble.runner.text.reasoning import chat_prompt
    from nibble.runner.text.template import build_messages
    model, tokenizer = load(str(vision_dir), quant="float")
    encoded = []
    encode = model.vision.encode
    monkeypatch.setattr(model.vision, "encode", lambda pictures: encoded.append(len(pictures)) or encode(pictures))
    picture = open_image(GEMMA3 / "image.png")
    cache = model.new_cache(256)
    replies = []
    for question in ("What is this?", "And its colours?"):
        messages = build_messages(question, None, [picture])
        text, digests = with_images(model.vision, chat_prompt(tokenizer, messages)[0], [picture])
        ids = tokenizer.encode(text, images=digests)
        replies.append(list(stream_generate(model, tokenizer, ids, max_tokens=2, cache=cache)))
    assert encoded == [1]   # the second prompt's image was in the prefix the cache kept


def test_run_with_images(vision_dir, monkeypatch, tmp_path):
    from tests.test_cli import invoke
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))
    args = ["run", "-m", vision_dir, "--temp", "0", "-n", "3", "--kv-disk", "1G",
            "--image", GEMMA3 / "image.png", "-i", GEMMA3 / "image2.png", "What differs?"]
    first, second = invoke(*args), invoke(*args)
    assert first.exit_code == second.exit_code == 0, first.output + second.output
    assert second.stdout == first.stdout
    assert "from the disk cache" in second.stderr.splitlines()[-1]
    swapped = invoke(*args[:-5], "-i", GEMMA3 / "image2.png", "-i", GEMMA3 / "image.png", "What differs?")
    assert swapped.exit_code == 0
    cached = lambda r: int(r.stderr.splitlines()[-1].split("(")[1].split()[0])
    assert cached(swapped) < cached(second)   # the other order is another prompt after the first image


@pytest.mark.parametrize("image, match", [
    ("README.md", "is not an image"), ("no-such.png", "no such file"), ("tests", "is a folder")])
def test_run_refuses_a_bad_image_in_one_line_before_loading(vision_dir, image, match):
    from tests.test_cli import assert_one_line_error, invoke
    assert_one_line_error(invoke("run", "-m", "no-such-model", "-i", image, "Hi"), match=match)


def test_run_image_on_a_text_model_or_raw(tiny_dir):
    from tests.test_cli import assert_one_line_error, invoke
    assert_one_line_error(invoke("run", "-m", tiny_dir, "-i", GEMMA3 / "image.png", "Hi"), match="reads no images")
    assert_one_line_error(invoke("run", "-m", tiny_dir, "--raw", "-i", GEMMA3 / "image.png", "Hi"), code=2,
                          match="--raw")


@pytest.mark.parametrize("fixture", ["vision_dir", "smolvlm_dir", "qwen_vl_dir"])
def test_a_quantized_copy_keeps_its_vision(fixture, request, tmp_path, monkeypatch):
    """nibble quantize, and run's quantizing at load, write the decoder quantized beside the tower
    as stored, under the wrapper's names (and its image processor's settings): the copy reads
    images as the float model does."""
    from tests.test_cli import invoke
    vision_dir = request.getfixturevalue(fixture)
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))
    out = tmp_path / "int4"
    r = invoke("quantize", vision_dir, "-o", out, "--bits", "4", "--group-size", "32")
    assert r.exit_code == 0, r.output
    copy = read_model_dir(out)
    original = read_model_dir(vision_dir)
    assert copy.config.quantization["bits"] == 4 and copy.vision_tensors.keys() == original.vision_tensors.keys()
    assert copy.preprocessor_config == original.preprocessor_config
    ask = ["--temp", "0", "-n", "3", "-i", GEMMA3 / "image.png", "What is it?"]
    for model in (out, vision_dir):
        r = invoke("run", "-m", model, *(["--quant", "int4"] if model == vision_dir else []), *ask)
        assert r.exit_code == 0, r.output
        assert int(r.stderr.splitlines()[-1].split()[1]) > 4   # the prompt: its text and the image's 4 tokens


def test_bench_times_the_tower_over_an_image(vision_dir):
    from tests.test_cli import invoke
    r = invoke("bench", "-m", vision_dir, "--image", GEMMA3 / "image.png", "-r", "1", "--json")
    assert r.exit_code == 0, r.output
    figures = json.loads(r.stdout)
    assert (figures["width"], figures["height"], figures["tokens"], figures["repeats"]) == (80, 60, 4, 1)
    assert figures["encode_s"] > 0 and figures["preprocess_s"] > 0


def test_bench_image_on_a_text_model(tiny_dir):
    from tests.test_cli import assert_one_line_error, invoke
    assert_one_line_error(invoke("bench", "-m", tiny_dir, "--image", GEMMA3 / "image.png"), match="reads no images")


def test_smolvlm_runs_with_or_without_an_image(smolvlm_dir):
    """SmolVLM's template reads every message's content as parts: a text-only prompt too."""
    from tests.test_cli import invoke
    with_image = invoke("run", "-m", smolvlm_dir, "--temp", "0", "-n", "3", "-i", IDEFICS3 / "image.png", "What is it?")
    text_only = invoke("run", "-m", smolvlm_dir, "--temp", "0", "-n", "3", "-s", "Be brief.", "Hello")
    assert with_image.exit_code == text_only.exit_code == 0, with_image.output + text_only.output
    prompt_tokens = lambda r: int(r.stderr.splitlines()[-1].split()[1])
    assert prompt_tokens(with_image) > 5 * 4 and prompt_tokens(text_only) > 0   # the image: five tiles of 4 tokens


# ---- GGUF: a model's file and its vision projector (llama.cpp's mmproj) beside it ----

GGUF = Path(__file__).parent / "data" / "vision" / "gemma3-gguf"


def test_a_gguf_with_its_mmproj_reads_images_as_transformers_does():
    """tests/fixtures/make_vision_gguf.py converted the fixture with llama.cpp's converter: the
    tower's tensors are the checkpoint's, the projection rounded to F16 as the converter stores it."""
    from nibble.quant.open_model import open_model
    from nibble.runner.loader import from_model_dir
    model, tokenizer = from_model_dir(open_model(str(GGUF / "model-f32.gguf")))
    assert model.vision is not None and model.vision.marker == "<start_of_image>"
    rows, = model.vision.encode([open_image(GEMMA3 / "image.png")])
    assert relative_error(rows, np.load(GEMMA3 / "features.npy")) < 1e-3


def test_run_a_gguf_with_an_image(tmp_path, monkeypatch):
    from tests.test_cli import invoke
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))
    r = invoke("run", "-m", GGUF / "model-f32.gguf", "--temp", "0", "-n", "2", "-i", GEMMA3 / "image.png", "What is it?")
    assert r.exit_code == 0, r.output
    assert int(r.stderr.splitlines()[-1].split()[1]) > 4


def test_a_bad_mmproj_beside_a_gguf_is_one_line(tmp_path, monkeypatch):
    import shutil
    from tests.test_cli import assert_one_line_error, invoke
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path / "home"))
    shutil.copy(GGUF / "model-f32.gguf", tmp_path / "model-f32.gguf")
    (tmp_path / "mmproj-f16.gguf").write_bytes(b"GGUF not really")
    assert_one_line_error(invoke("run", "-m", tmp_path / "model-f32.gguf", "Hi"), match="mmproj-f16.gguf")
    shutil.copy(GGUF / "model-f32.gguf", tmp_path / "mmproj-f16.gguf")   # a model, not a projector
    assert_one_line_error(invoke("run", "-m", tmp_path / "model-f32.gguf", "Hi"), match="is not a vision projector")


def test_quantize_vision_quantizes_the_tower_too(vision_dir, tiny_dir, tmp_path, monkeypatch):
    """--vision: the tower's matrices at the decoder's scheme, where their rows split into whole
    groups (SigLIP's MLP here: 48 inputs, not whole groups of 32, stays float and is named)."""
    from tests.test_cli import invoke
    from nibble.runner.loader import from_model_dir
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))
    out = tmp_path / "int4"
    r = invoke("quantize", vision_dir, "-o", out, "--bits", "4", "--group-size", "32", "--vision")
    assert r.exit_code == 0, r.output
    assert "kept in float: vision_tower.encoder.layers.0.mlp.fc2.weight (row length 48" in r.stderr
    copy = read_model_dir(out)
    assert "vision_tower.encoder.layers.1.self_attn.q_proj.scales" in copy.vision_tensors
    assert "vision_tower.encoder.layers.1.mlp.fc2.scales" not in copy.vision_tensors
    model, _ = from_model_dir(copy)
    picture = open_image(GEMMA3 / "image.png")
    rows, = model.vision.encode([picture])
    # against the same tower on those weights made float again: what is left is the activations' rounding
    q, floats = copy.config.quantization, dict(copy.vision_tensors)
    for path in [n.removesuffix(".scales") for n in floats if n.endswith(".scales")]:
        floats[f"{path}.weight"] = dequantize(read_linear(copy.vision_tensors, q, path))
        del floats[f"{path}.scales"], floats[f"{path}.biases"]
    twin = vision_of(dataclasses.replace(copy, vision_tensors=floats), lambda id: f"<token {id}>")
    assert relative_error(rows, twin.encode([picture])[0]) < 3e-2
    r = invoke("quantize", tiny_dir, "-o", tmp_path / "q", "--bits", "4", "--vision")
    assert r.exit_code == 1 and "no vision tower" in r.stderr
