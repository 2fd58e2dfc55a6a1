"""Model directories: reading the Hugging Face layout, and writing it back atomically."""
import json

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from nibble.formats import model_dir as md
from nibble.formats.config import ModelConfig
from nibble.formats.errors import FormatError
from nibble.formats.model_dir import ModelDir, read_model_dir, write_model_dir
from nibble.formats.safetensors import read_safetensors_metadata
from tests.hand_safetensors import memmap_backed

CONFIG = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "vocab_size": 6, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _tokenizer() -> tokenizers.Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "!": 5}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _model() -> ModelDir:
    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((6, 8)).astype(np.float32),
               "model.norm.weight": np.ones(8, np.float16)}
    return ModelDir(path=None, config=ModelConfig.from_dict(CONFIG), tensors=tensors,
                    tokenizer=_tokenizer(),
                    tokenizer_config={"bos_token": "<s>", "eos_token": "</s>",
                                      "add_bos_token": True, "chat_template": TEMPLATE},
                    generation_config={"eos_token_id": 2, "temperature": 0.6})


def _check_same(got: ModelDir, want: ModelDir):
    assert got.config == want.config
    assert got.tokenizer_config == want.tokenizer_config
    assert got.generation_config == want.generation_config
    assert got.tokenizer.encode("hello world !").ids == want.tokenizer.encode("hello world !").ids
    assert got.tensors.keys() == want.tensors.keys()
    for k, t in want.tensors.items():
        assert got.tensors[k].dtype == t.dtype
        np.testing.assert_array_equal(got.tensors[k], t)


def test_round_trip(tmp_path):
    model = _model()
    out = write_model_dir(model, tmp_path / "m")
    assert out == tmp_path / "m"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    assert read_safetensors_metadata(out / "model.safetensors") == {"format": "pt"}
    got = read_model_dir(out)
    assert got.path == out
    assert got.config.extra == {"torch_dtype": "bfloat16"}  # unknown keys survive
    _check_same(got, model)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_read_from_a_safetensors_file_path(tmp_path):
    out = write_model_dir(_model(), tmp_path / "m")
    assert read_model_dir(out / "model.safetensors").path == out


def test_refuses_existing_out(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FormatError, match="already exists"):
        write_model_dir(_model(), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_force_replaces_existing_out(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    write_model_dir(_model(), out, force=True)
    assert not (out / "stale.txt").exists()
    _check_same(read_model_dir(out), _model())
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_no_temp_dir_left_after_failure(tmp_path, monkeypatch, exc):
    def boom(*args, **kwargs):
        raise exc("disk full")
    monkeypatch.setattr(md, "write_safetensors", boom)
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(exc):
        write_model_dir(_model(), out, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # the old out is untouched


def test_token_dicts_and_chat_template_file(tmp_path):
    model = _model()
    model.tokenizer_config = {"bos_token": {"content": "<s>", "lstrip": False},
                              "eos_token": "</s>", "add_bos_token": False}
    out = write_model_dir(model, tmp_path / "m")
    (out / "chat_template.jinja").write_text(TEMPLATE)
    got = read_model_dir(out)
    assert got.tokenizer_config == {"bos_token": "<s>", "eos_token": "</s>",
                                    "add_bos_token": False, "chat_template": TEMPLATE}


def test_chat_template_in_config_wins_over_file(tmp_path):
    out = write_model_dir(_model(), tmp_path / "m")
    (out / "chat_template.jinja").write_text("other")
    assert read_model_dir(out).tokenizer_config["chat_template"] == TEMPLATE


def test_optional_files_may_be_missing(tmp_path):
    out = write_model_dir(_model(), tmp_path / "m")
    (out / "generation_config.json").unlink()
    (out / "tokenizer_config.json").unlink()
    got = read_model_dir(out)
    assert got.generation_config == {} and got.tokenizer_config == {}


@pytest.mark.parametrize("name, content, message", [
    ("config.json", None, "config.json is missing"),
    ("config.json", "{oops", "config.json is not valid JSON"),
    ("config.json", "[]", "config.json must hold a JSON object"),
    ("generation_config.json", "{oops", "generation_config.json is not valid JSON"),
    ("tokenizer_config.json", "{oops", "tokenizer_config.json is not valid JSON"),
    ("tokenizer.json", None, "tokenizer.json is missing"),
    ("tokenizer.json", '{"model": 3}', "tokenizer.json cannot be loaded"),
    ("model.safetensors", None, "no weights found"),
])
def test_broken_files_raise_format_error(tmp_path, name, content, message):
    out = write_model_dir(_model(), tmp_path / "m")
    if content is None:
        (out / name).unlink()
    else:
        (out / name).write_text(content)
    with pytest.raises(FormatError, match=message) as e:
        read_model_dir(out)
    assert str(out) in str(e.value)


def test_not_a_directory(tmp_path):
    with pytest.raises(FormatError, match="not a model directory"):
        read_model_dir(tmp_path / "nowhere")


def test_bad_config_values_are_format_errors(tmp_path):
    out = write_model_dir(_model(), tmp_path / "m")
    (out / "config.json").write_text(json.dumps({**CONFIG, "model_type": "gpt2"}))
    with pytest.raises(FormatError, match="unsupported architecture 'gpt2'"):
        read_model_dir(out)


def test_force_over_the_directory_its_tensors_are_mapped_from(tmp_path):
    # Rewriting a model in place: the old files stay mapped until the swap is done.
    out = write_model_dir(_model(), tmp_path / "m")
    got = read_model_dir(out)
    write_model_dir(got, out, force=True)
    _check_same(read_model_dir(out), _model())
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


GEMMA3_TEXT = {"model_type": "gemma3_text", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 6}


@pytest.mark.parametrize("model, head", [("model.language_model.", "lm_head."),   # transformers 5's modules
                                         ("language_model.model.", "language_model.lm_head.")])  # as saved
def test_a_gemma3_wrapper_reads_as_its_text_model(tmp_path, model, head):
    """Gemma3ForConditionalGeneration: the text model's tensors under their text-only names, the
    same arrays; the vision tower and the projector left out."""
    out = write_model_dir(_model(), tmp_path / "m")
    rng = np.random.default_rng(0)
    tensors = {model + "embed_tokens.weight": rng.standard_normal((6, 8)).astype(np.float32),
               head + "weight": rng.standard_normal((6, 8)).astype(np.float32),
               "vision_tower.vision_model.post_layernorm.weight": np.ones(4, np.float32),
               "multi_modal_projector.mm_input_projection_weight": np.ones((4, 8), np.float32)}
    md.write_safetensors(tensors, out / "model.safetensors")
    wrapper = {"model_type": "gemma3", "text_config": GEMMA3_TEXT, "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(wrapper))
    got = read_model_dir(out)
    assert got.config.model_type == "gemma3_text" and not got.config.tie_word_embeddings
    assert sorted(got.tensors) == ["lm_head.weight", "model.embed_tokens.weight"]
    np.testing.assert_array_equal(got.tensors["lm_head.weight"], tensors[head + "weight"])
    assert memmap_backed(got.tensors["lm_head.weight"])
    (out / "model.safetensors").unlink()
    md.write_safetensors({"vision_tower.x": np.ones(2, np.float32)}, out / "model.safetensors")
    with pytest.raises(FormatError, match="holds no text model tensors \\(expected names starting with "
                                          "model.language_model. or lm_head. or"):
        read_model_dir(out)
