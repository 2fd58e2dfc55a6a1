"""Gemma 3's vision tower and projector, their numpy twins (tests/reference.py) against what
transformers computes (tests/data/vision/gemma3, made by tests/fixtures/make_vision_fixtures.py):
the image's pixels as its processor makes them, and the image tokens the decoder takes. The
twins are what the tower's kernels are checked against."""
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from nibble.formats.image import read_image
from tests import reference

GEMMA3 = Path(__file__).parent / "data" / "vision" / "gemma3"


def test_gemma3_pixels_are_transformers_processors():
    config = json.loads((GEMMA3 / "config.json").read_text())
    pixels = reference.gemma3_pixels(read_image(GEMMA3 / "image.png"), config["vision_config"]["image_size"])
    np.testing.assert_allclose(pixels, np.load(GEMMA3 / "pixel_values.npy"), rtol=0, atol=1e-6)


def test_gemma3_image_tokens_are_transformers():
    config = json.loads((GEMMA3 / "config.json").read_text())
    W = load_file(GEMMA3 / "vision.safetensors")
    hidden = reference.siglip_tower(config["vision_config"], W, np.load(GEMMA3 / "pixel_values.npy").astype(np.float64))
    tokens = reference.gemma3_projector(config, W, hidden)
    want = np.load(GEMMA3 / "features.npy")
    assert tokens.shape == want.shape == (config["mm_tokens_per_image"], config["text_config"]["hidden_size"])
    np.testing.assert_allclose(tokens, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
