"""SmolVLM's kind (Idefics3) as a GGUF and llama.cpp's mmproj beside it, against transformers: the
tiny fixture tests/data/vision/idefics3 converted by llama.cpp's own converter into
tests/data/vision/idefics3-gguf (tests/fixtures/make_vision_gguf.py --family idefics3)."""
import json
from pathlib import Path

import numpy as np
import pytest

from nibble.formats.gguf_mmproj import read_mmproj
from nibble.formats.image import open_image
from nibble.formats.safetensors import read_checkpoint
from nibble.formats.wrappers import vision_tensors
from nibble.quant.open_model import open_model
from nibble.runner.loader import from_model_dir
from nibble.runner.text.image_ids import image_ids
from tests.test_vision import relative_error

IDEFICS3 = Path(__file__).parent / "data" / "vision" / "idefics3"
GGUF = Path(__file__).parent / "data" / "vision" / "idefics3-gguf"


def test_an_idefics3_mmproj_holds_the_checkpoint_s_tower_and_processor():
    """The converter writes the tower and the connector name for name in F32: read back under
    wrappers' names they are the safetensors fixture's, bit for bit; the processor's sizes and the
    image token come from the mmproj's metadata and the text model's tokenizer."""
    model_dir = open_model(str(GGUF / "model-f32.gguf"))
    raw = json.loads((IDEFICS3 / "config.json").read_text())
    want = vision_tensors(raw, read_checkpoint(IDEFICS3))
    assert sorted(model_dir.vision_tensors) == sorted(want)
    for name, tensor in want.items():
        np.testing.assert_array_equal(np.asarray(model_dir.vision_tensors[name]), np.asarray(tensor), err_msg=name)
    config = model_dir.vision_config
    assert config["model_type"] == "idefics3" and config["scale_factor"] == raw["scale_factor"]
    assert config["image_token_id"] == raw["image_token_id"]
    vision = {k: config["vision_config"][k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                      "num_attention_heads", "image_size", "patch_size")}
    assert vision == {k: raw["vision_config"][k] for k in vision}
    assert config["vision_config"]["layer_norm_eps"] == raw["vision_config"]["layer_norm_eps"]
    processor = json.loads((IDEFICS3 / "preprocessor_config.json").read_text())
    for key in ("size", "max_image_size", "image_mean", "image_std"):
        assert model_dir.preprocessor_config[key] == processor[key], key


def test_an_idefics3_gguf_with_its_mmproj_reads_images_as_transformers_does():
    """Tiles, image tokens, the prompt's ids (the GGUF's tokenizer, llama.cpp's ids) and logits as
    transformers' Idefics3 makes them from the checkpoint the GGUFs were converted from."""
    model, tokenizer = from_model_dir(open_model(str(GGUF / "model-f32.gguf")))
    assert model.vision is not None and model.vision.marker == "<image>"
    picture = open_image(IDEFICS3 / "image.png")
    # the processor's five frames: 2 x 2 tiles of the image made 64 x 64, then all of it at 32 x 32
    np.testing.assert_allclose(model.vision.pixels(picture), np.load(IDEFICS3 / "pixel_values.npy"), rtol=0, atol=1e-6)
    want = np.load(IDEFICS3 / "features.npy")
    rows, = model.vision.encode([picture])
    assert rows.shape == want.shape == (5 * 4, 64) and relative_error(rows, want) < 1e-5
    text = model.vision.place((IDEFICS3 / "prompt.txt").read_text(), [picture])
    ids = tokenizer.encode(text, images={picture.digest})
    image_token = json.loads((IDEFICS3 / "config.json").read_text())["image_token_id"]
    assert [t if t >= 0 else image_token for t in ids] == np.load(IDEFICS3 / "tokens.npy").tolist()
    assert [t for t in ids if t < 0] == image_ids(picture.digest, 5 * 4)
    got = model.forward(ids, model.new_cache(), all_logits=True)
    assert relative_error(got, np.load(IDEFICS3 / "logits.npy")) < 1e-4


def test_run_an_idefics3_gguf_with_an_image(tmp_path, monkeypatch):
    """From the command line: the GGUF's chat template (SmolVLM's) places the image's tiles."""
    from tests.test_cli import invoke
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))
    r = invoke("run", "-m", GGUF / "model-f32.gguf", "--temp", "0", "-n", "2", "-i", IDEFICS3 / "image.png",
               "What is it?")
    assert r.exit_code == 0, r.output
    assert int(r.stderr.splitlines()[-1].split()[1]) > 5 * 4   # five tiles of 4 tokens, and the text


def test_read_mmproj_refuses_a_text_model_without_the_image_token(tmp_path):
    """An Idefics3 mmproj beside a text model whose tokenizer has no <image>: one line, naming it."""
    from nibble.formats.config import ModelConfig
    from nibble.formats.errors import FormatError
    text = ModelConfig.from_dict(json.loads((IDEFICS3 / "config.json").read_text())["text_config"])
    with pytest.raises(FormatError, match="<image>"):
        read_mmproj(GGUF / "mmproj-f32.gguf", text, lambda token: None)
