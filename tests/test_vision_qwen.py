"""Qwen2.5-VL's and Qwen3-VL's vision against transformers (tests/data/vision/qwen2_5_vl and
qwen3_vl, made by tests/fixtures/make_vision_fixtures.py): the processor's patches of two images
of other shapes than square, the tower's tokens (2D RoPE; Qwen2.5-VL's windows cut at the
image's edges and a full-attention block; Qwen3-VL's learned positions resized to each image and
its deepstack mergers), the prompt's ids through Qwen2-VL's chat template, and the logits of that
prompt with multimodal RoPE (Qwen3-VL's interleaved, and its deepstack rows added in the first
decoder layers): in one pass, in chunks, a token at a time, and as one sequence of a batch beside
another."""
import json
from pathlib import Path

import numpy as np
import pytest

from nibble.formats.image import open_image
from nibble.runner.text.image_ids import whole_images
from nibble.runner.text.reasoning import chat_prompt
from nibble.runner.vision.base import for_template, with_images
from tests.test_vision import relative_error, runnable

QWEN = Path(__file__).parent / "data" / "vision" / "qwen2_5_vl"
QWEN3 = Path(__file__).parent / "data" / "vision" / "qwen3_vl"
FAMILIES = pytest.mark.parametrize("folder", [QWEN, QWEN3], ids=["qwen2_5_vl", "qwen3_vl"])


def pictures():
    return [open_image(QWEN / "image1.png"), open_image(QWEN / "image2.png")]


def prompt(model, tokenizer) -> list[int]:
    """The fixture's conversation (an image, text, an image) through nibble's template and tokenizer."""
    first, second = pictures()
    messages = [{"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": "What is in these?"},
                                             {"type": "image", "image": second}]}]
    messages, images = for_template(model.vision, messages)
    text, _ = chat_prompt(tokenizer, messages)
    placed, digests = with_images(model.vision, text, images)
    return tokenizer.encode(placed, images=digests)


@FAMILIES
def test_patches_and_image_tokens_are_transformers(folder):
    model, _ = runnable(folder)
    vision = model.vision
    images = pictures()
    patches = np.concatenate([vision.pixels(p).reshape(-1, 3 * 2 * 4 * 4) for p in images])
    np.testing.assert_allclose(patches, np.load(folder / "pixel_values.npy"), rtol=0, atol=1e-6)
    assert [vision.grid(p) for p in images] == [(5, 6), (7, 4)]   # image_grid_thw [1, 10, 12], [1, 14, 8] merged 2 x 2
    want = np.load(folder / "features.npy")
    got = np.concatenate(vision.encode(images))
    assert relative_error(got[:, :64], want) < 1e-5 and len(got) == len(want) == 30 + 28
    if folder == QWEN3:   # the rows deepstack adds after the first two decoder layers
        deep = np.load(folder / "deepstack.npy")
        assert got.shape == (58, 3 * 64) and all(relative_error(got[:, 64 * (i + 1):64 * (i + 2)], deep[i]) < 1e-5
                                                 for i in range(2))
    alone, = vision.encode(images[1:])   # windows and attention stay inside each image
    np.testing.assert_allclose(alone, got[30:], rtol=0, atol=1e-6 * np.abs(want).max())


@FAMILIES
def test_prompt_and_logits_are_transformers(folder):
    model, tokenizer = runnable(folder)
    ids = prompt(model, tokenizer)
    image_token = json.loads((folder / "config.json").read_text())["image_token_id"]
    assert [t if t >= 0 else image_token for t in ids] == np.load(folder / "tokens.npy").tolist()
    want = np.load(folder / "logits.npy")
    assert relative_error(model.forward(ids, model.new_cache(), all_logits=True), want) < 1e-4
    if folder == QWEN3:   # deepstack's rows matter
        model.vision.deep = lambda tokens: []
        assert relative_error(model.forward(ids, model.new_cache(), all_logits=True), want) > 1e-2


@FAMILIES
def test_rope_positions_follow_the_images_in_chunks_and_token_by_token(folder):
    """Text after an image turns by the image's longer side, not its tokens: so chunks (never
    cutting an image) and single tokens, which read the earlier images from the sequence's ids,
    give transformers' logits; RoPE by cache position does not."""
    model, tokenizer = runnable(folder)
    ids, want = prompt(model, tokenizer), np.load(folder / "logits.npy")
    cache, got = model.new_cache(), []
    while cache.pos < len(ids) - 6:
        end = whole_images(ids, cache.pos, min(cache.pos + 7, len(ids) - 6))
        got.append(model.forward(ids[cache.pos:end], cache, all_logits=True))
    while cache.pos < len(ids):
        got.append(model.forward(ids[cache.pos:cache.pos + 1], cache, all_logits=True))
    assert relative_error(np.concatenate(got), want) < 1e-4
    model.vision.placed = lambda tokens, rows, ids: rows   # every row turned by its cache position
    plain = model.forward(ids, model.new_cache(), all_logits=True)
    assert relative_error(plain[-5:], want[-5:]) > 1e-2


@FAMILIES
def test_a_batch_turns_each_sequence_by_its_own_images(folder):
    """forward_batch, as the engine runs it: a sequence's last token decoded beside another
    sequence's prompt, each turned by the images of its own ids."""
    from nibble.runner.kv.cache import Rows
    model, tokenizer = runnable(folder)
    ids, want = prompt(model, tokenizer), np.load(folder / "logits.npy")
    pool = model.new_pool(16)
    n = len(ids) - 1
    blocks = -(-len(ids) // 16)
    tables = [list(range(blocks)), list(range(blocks, 2 * blocks))]
    model.forward_batch(ids[:n], Rows.of(np.arange(n), np.zeros(n), tables), pool, [n - 1], [ids])
    other = ids[:20]
    tokens = [ids[n], *other]
    rows = Rows.of([n, *range(20)], [0] + [1] * 20, tables)
    logits = model.forward_batch(tokens, rows, pool, [0, 20], [ids, other])
    assert relative_error(logits[:1], want[n:]) < 1e-4
    assert relative_error(logits[1:], want[19:20]) < 1e-4


@pytest.mark.parametrize("folder, bits", [(QWEN, 8), (QWEN3, 4)], ids=["qwen2_5_vl-int8", "qwen3_vl-int4"])
def test_quantized_decoder_is_its_float_twin(folder, bits):
    """The decoder's kernels are Llama's, quantized as every family's (test_vision.py runs both
    widths on Gemma 3 and Idefics3): a width each here, with multimodal RoPE."""
    (model, tokenizer), (twin, twin_tokenizer) = runnable(folder, bits), runnable(folder, bits, dequantized=True)
    got = model.forward(prompt(model, tokenizer), model.new_cache(), all_logits=True)
    want = twin.forward(prompt(twin, twin_tokenizer), twin.new_cache(), all_logits=True)
    assert relative_error(got, want) < 3e-2
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_a_large_image_is_at_most_1280_tokens():
    """As ollama bounds them, whatever the processor's max_pixels allows (transformers' default:
    16384 tokens, past the default context)."""
    import io

    from PIL import Image

    from nibble.formats.model_dir import read_model_dir
    from nibble.runner.vision.qwen2_5_vl import MAX_TOKENS, Qwen25VLVision
    folder = read_model_dir(QWEN)
    vision = Qwen25VLVision(folder.vision_config, folder.vision_tensors, None, str, {"max_pixels": 10 ** 9})
    png = io.BytesIO()
    Image.new("RGB", (3000, 2000), (200, 100, 50)).save(png, "PNG")
    rows, cols = vision.grid(open_image(png.getvalue(), "photo.png"))
    assert rows * cols <= MAX_TOKENS == 1280 and rows * cols > 0.9 * MAX_TOKENS and abs(cols / rows - 1.5) < 0.1


def test_run_and_bench_an_image(qwen_vl_dir):
    from tests.test_cli import invoke
    r = invoke("bench", "-m", qwen_vl_dir, "--image", QWEN / "image1.png", "-r", "1", "--json")
    assert r.exit_code == 0, r.output
    figures = json.loads(r.stdout)
    assert (figures["width"], figures["height"], figures["tokens"]) == (80, 60, 30)
    r = invoke("run", "-m", qwen_vl_dir, "--temp", "0", "-n", "3", "-i", QWEN / "image1.png", "-i", QWEN / "image2.png",
               "What is in these?")
    assert r.exit_code == 0, r.output
    assert int(r.stderr.splitlines()[-1].split()[1]) > 30 + 28   # the prompt: its text and both images' tokens


@FAMILIES
def test_a_gguf_with_its_mmproj_is_transformers(folder):
    """llama.cpp's converter's files (tests/fixtures/make_vision_gguf.py): the text model as
    qwen2vl or qwen3vl, its RoPE sections in rope.dimension_sections; the mmproj's patch
    convolution cut into its two frames and Qwen2.5-VL's q, k, v apart, joined again. The mmproj
    keeps neither the processor's bounds nor the windows' size (libmtmd's 112 pixels): the
    fixture's are set."""
    from nibble.quant.open_model import open_model
    from nibble.runner.model import Model
    from nibble.runner.text.tokenizer import Tokenizer
    from nibble.runner.vision import vision_of
    model_dir = open_model(folder.parent / f"{folder.name}-gguf" / "model-f32.gguf")
    assert model_dir.vision_config["model_type"] == folder.name
    model, tokenizer = Model(model_dir.config, model_dir.tensors), Tokenizer(model_dir)
    model.vision = vision_of(model_dir, tokenizer.tokenizer.id_to_token)
    model.vision.min_pixels, model.vision.max_pixels = 64, 48 * 48
    if folder == QWEN:
        assert model.vision.window == 112 // (4 * 2)
        model.vision.window = 2
    ids = prompt(model, tokenizer)
    assert relative_error(model.forward(ids, model.new_cache(), all_logits=True), np.load(folder / "logits.npy")) < 1e-4
