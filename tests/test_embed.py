"""Embeddings as sentence-transformers makes them: its files read (formats/sentence_transformers.py),
texts tokenized without padding and cut to the model's length, pooled in every mode, prompts,
several passes; on the bert fixture with a WordPiece tokenizer made here. The real all-MiniLM-L6-v2
is test_embed_minilm.py's."""
import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.model_dir import read_model_dir
from nibble.formats.safetensors import read_checkpoint, write_safetensors
from nibble.formats.sentence_transformers import Pipeline, read_pipeline
from nibble.quant.affine import QuantizedTensor
from nibble.runner.convert import quantize
from nibble.runner.embedding import embed
from nibble.runner.embedding.embed import Embedder, pool
from nibble.runner.embedding.encoder import Encoder
from tests import reference
from tests.test_cli import assert_one_line_error, invoke
from tests.test_transformers import DATA

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(124)]   # the fixture's 128 ids


def wordpiece(folder):
    """BERT's tokenizer pipeline (lowercase, split on spaces and punctuation, [CLS] ... [SEP]) over
    the words w0..w123."""
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.enable_padding(length=24)   # as all-MiniLM's tokenizer.json pads: the embedder must not
    tok.save(str(folder / "tokenizer.json"))


def sentence_model(tmp_path, pooling: dict | None = None, normalize=True, max_length=None, prompts=None,
                   include_prompt=True):
    """The bert fixture with a tokenizer and sentence-transformers' files."""
    folder = tmp_path / "st"
    shutil.copytree(DATA / "bert", folder)
    wordpiece(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "include_prompt": include_prompt,
         **(pooling or {"pooling_mode_mean_tokens": True})}))
    if max_length:
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length}))
    if prompts:
        (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    return folder


def decoder_model(tmp_path):
    """The qwen3 fixture saved as Qwen3-Embedding is (transformers' Qwen3Model: no `model.`, no
    head) with sentence-transformers' files: the last token pooled, normalized, a query prompt."""
    folder = tmp_path / "qwen3-embedding"
    folder.mkdir()
    shutil.copy(DATA / "qwen3" / "config.json", folder)
    tensors = read_checkpoint(DATA / "qwen3")
    write_safetensors({n.removeprefix("model."): np.asarray(t, np.float32) for n, t in tensors.items()},
                      folder / "model.safetensors")
    wordpiece(folder)
    (folder / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
         {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "w100 w101 ", "document": ""}}))
    return folder


def text(*ids):
    return " ".join(f"w{i}" for i in ids)


def want(folder, ids, modes=("mean",), normalize=True, skip=0):
    md = read_model_dir(folder)
    states = reference.encode(md.config, md.tensors, [2, *(4 + i for i in ids), 3])[skip:]
    v = pool(states, modes)
    return v / np.linalg.norm(v) if normalize else v


def test_pooling_modes_as_sentence_transformers_defines_them():
    s = np.arange(12, dtype=np.float32).reshape(4, 3) ** 1.5
    w = np.arange(1, 5)[:, None]
    expected = {"cls": s[0], "max": s.max(0), "mean": s.mean(0), "mean_sqrt_len": s.sum(0) / 2,
                "weightedmean": (s * w).sum(0) / w.sum(), "lasttoken": s[-1]}
    for mode, v in expected.items():
        np.testing.assert_allclose(pool(s, (mode,)), v, rtol=1e-6)
    np.testing.assert_allclose(pool(s, ("cls", "mean")), np.concatenate([s[0], s.mean(0)]))


def test_vectors_are_the_pooled_states_of_the_text_alone(tmp_path):
    folder = sentence_model(tmp_path)
    e = Embedder(read_model_dir(folder))
    texts = [text(1, 2, 3), text(7), text(*range(20))]
    got = e.embed(texts)
    assert got.shape == (3, 64) and e.dimensions == 64
    for vector, ids in zip(got, ([1, 2, 3], [7], list(range(20)))):
        np.testing.assert_allclose(vector, want(folder, ids), atol=1e-5)


@pytest.mark.parametrize("pooling, modes", [
    ({"pooling_mode_cls_token": True}, ("cls",)),
    ({"pooling_mode_lasttoken": True}, ("lasttoken",)),
    ({"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": True}, ("max", "mean")),
    ({"pooling_mode": "mean_sqrt_len_tokens"}, ("mean_sqrt_len",)),
])
def test_the_model_s_pooling_and_normalization(tmp_path, pooling, modes):
    folder = sentence_model(tmp_path, pooling, normalize=False)
    e = Embedder(read_model_dir(folder))
    assert e.pipeline.pooling == modes and not e.pipeline.normalize and e.dimensions == 64 * len(modes)
    np.testing.assert_allclose(e.embed([text(5, 6)])[0], want(folder, [5, 6], modes, False), atol=1e-4)


def test_texts_are_cut_to_the_model_s_length(tmp_path):
    folder = sentence_model(tmp_path, max_length=8)
    e = Embedder(read_model_dir(folder))
    ids, _, cut = e.tokenize([text(*range(30)), text(1)])
    assert len(ids[0]) == 8 and ids[0][-1] == 3 and cut == 1   # [CLS], 6 words, [SEP]
    np.testing.assert_allclose(e.embed([text(*range(30))])[0], e.embed([text(*range(6))])[0], atol=1e-6)


def test_prompts_and_pooling_without_them(tmp_path):
    prompts = {"query": "w9 w10 ", "document": ""}
    folder = sentence_model(tmp_path, prompts=prompts, include_prompt=False)
    e = Embedder(read_model_dir(folder))
    ids, skip, _ = e.tokenize([text(1)], "query")
    assert ids == [[2, 13, 14, 5, 3]] and skip == 3   # [CLS] and the prompt's two words
    np.testing.assert_allclose(e.embed([text(1)], "query")[0], want(folder, [9, 10, 1], skip=3), atol=1e-5)
    np.testing.assert_allclose(e.embed([text(1)], "document")[0], want(folder, [1]), atol=1e-5)
    with pytest.raises(NibbleError, match="no prompt named 'passage' \\(its prompts: query, document\\)"):
        e.embed(["x"], "passage")


def test_long_lists_run_in_several_passes_alike(tmp_path, monkeypatch):
    e = Embedder(read_model_dir(sentence_model(tmp_path)))
    texts = [text(*range(i, i + 5 + i % 7)) for i in range(40)]
    together = e.embed(texts)
    monkeypatch.setattr(embed, "PASS_TOKENS", 20)   # a few texts a pass
    np.testing.assert_allclose(e.embed(texts), together, atol=1e-6)


def test_a_model_without_sentence_transformers_files_pools_the_mean(tmp_path):
    folder = sentence_model(tmp_path)
    for name in ("modules.json", "1_Pooling"):
        shutil.rmtree(folder / name) if (folder / name).is_dir() else (folder / name).unlink()
    assert read_pipeline(folder) == Pipeline()
    np.testing.assert_allclose(Embedder(read_model_dir(folder)).embed([text(3, 4)])[0],
                               want(folder, [3, 4], normalize=False), atol=1e-4)


@pytest.mark.parametrize("file, content, message", [
    ("modules.json", "[{\"type\": \"sentence_transformers.models.Dense\"}]", "not Dense"),
    ("modules.json", "{", "cannot be read as JSON"),
    ("1_Pooling/config.json", "{}", "turns no pooling mode on"),
    ("1_Pooling/config.json", "{\"pooling_mode\": \"median\"}", "unknown pooling_mode 'median'"),
    ("sentence_bert_config.json", "{\"max_seq_length\": 0}", "max_seq_length must be a positive integer"),
    ("config_sentence_transformers.json", "{\"prompts\": {\"q\": 1}}", "prompts must map names to texts"),
    ("config_sentence_transformers.json", "{\"prompts\": {}, \"default_prompt_name\": \"q\"}", "'q' is not one of its prompts"),
])
def test_files_it_cannot_follow_are_one_line(tmp_path, file, content, message):
    folder = sentence_model(tmp_path)
    (folder / file).write_text(content)
    with pytest.raises(FormatError, match=message) as e:
        read_pipeline(folder)
    assert "\n" not in str(e.value)


def test_nibble_embed(tmp_path):
    folder = sentence_model(tmp_path)
    e = Embedder(read_model_dir(folder))
    r = invoke("embed", "-m", folder, text(1, 2))
    assert r.exit_code == 0, r.output
    np.testing.assert_allclose(json.loads(r.stdout), e.embed([text(1, 2)])[0], atol=1e-6)
    (tmp_path / "texts.txt").write_text(f"{text(3)}\n\n{text(4, 5)}\n")   # an empty line is a text too
    r = invoke("embed", "-m", folder, "-f", tmp_path / "texts.txt", "--npy", tmp_path / "v.npy")
    assert r.exit_code == 0 and r.stdout == ""
    np.testing.assert_allclose(np.load(tmp_path / "v.npy"), e.embed([text(3), "", text(4, 5)]), atol=1e-6)


def test_an_encoder_quantizes_calibrated_on_its_own_blocks_and_keeps_its_pipeline(tmp_path, monkeypatch):
    folder = sentence_model(tmp_path, max_length=16, prompts={"query": "w7: "})
    texts = [text(1, 2, 3), text(*range(20, 40)), text(9)]
    want = Embedder(read_model_dir(folder)).embed(texts, "query")
    measured = []
    real = quantize.layer_importances

    def spied(model, tokens, ctx):
        for i, importances in real(model, tokens, ctx):
            measured.append((i, sorted(importances)))
            yield i, importances
    monkeypatch.setattr(quantize, "layer_importances", spied)
    quantize.quantize(str(folder), tmp_path / "q8", 8)
    blocks = [(i, sorted(f"encoder.layer.{i}.{m}.weight" for m in ("attention.self.query", "attention.self.key",
                                                                     "attention.self.value", "attention.output.dense",
                                                                     "intermediate.dense", "output.dense")))
              for i in range(2)]
    assert measured == blocks
    q = Embedder(read_model_dir(tmp_path / "q8"))
    assert isinstance(q.encoder.layers[1].w_in, QuantizedTensor) and q.encoder.layers[1].w_in.bits == 8
    assert isinstance(q.encoder.embeddings.words, QuantizedTensor)
    assert q.pipeline == read_pipeline(folder) and q.max_length == 16   # its sentence-transformers files, copied
    assert (q.embed(texts, "query") * want).sum(1).min() > 0.999


@pytest.mark.parametrize("args, code, message", [
    (["x", "-f", "texts.txt"], 2, "give TEXT or -f FILE, not both"),
    (["x", "--prompt", "query"], 1, "no prompt named 'query'"),
    (["x", "--dimensions", "8"], 1, "were not trained to be cut short"),
    (["-f", "missing.txt"], 1, "missing.txt"),
])
def test_nibble_embed_refuses_in_one_line(tmp_path, monkeypatch, args, code, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts.txt").write_text("a\n")
    assert_one_line_error(invoke("embed", "-m", sentence_model(tmp_path), *args), code, message)


def test_a_decoder_with_sentence_transformers_files_embeds_its_last_token(tmp_path):
    folder = decoder_model(tmp_path)
    e = Embedder(read_model_dir(folder))
    assert e.pipeline.pooling == ("lasttoken",) and e.max_length == 64 and e.dimensions == 64
    ids = [2, 104, 105, 5, 6, 7, 3]   # [CLS], the prompt's two words, the text's three, [SEP]
    assert e.tokenize([text(1, 2, 3)], "query").ids == [ids]
    [states] = Encoder(read_model_dir(folder).config, read_model_dir(folder).tensors).encode([ids])
    np.testing.assert_allclose(e.embed([text(1, 2, 3)], "query")[0], states[-1] / np.linalg.norm(states[-1]),
                               atol=1e-6)
    r = invoke("embed", "-m", folder, "--prompt", "query", text(1, 2, 3))
    assert r.exit_code == 0, r.output
    np.testing.assert_allclose(json.loads(r.stdout), e.embed([text(1, 2, 3)], "query")[0], atol=1e-6)


def test_nibble_bench_times_batches_of_texts_for_an_embedding_model(tmp_path):
    folder = sentence_model(tmp_path, max_length=16)
    r = invoke("bench", "-m", folder, "--parallel", "3", "-p", "6", "--json")
    assert r.exit_code == 0, r.output
    figures = json.loads(r.stdout)
    assert figures["texts"] == 3 and figures["tokens"] == 6 and figures["texts_per_s"] > 0
    assert_one_line_error(invoke("bench", "-m", folder, "-p", "17"), 1, "this model takes at most 16 tokens a text")


@pytest.mark.parametrize("model", [decoder_model, sentence_model])
def test_an_embedding_model_does_not_generate(tmp_path, model):
    assert_one_line_error(invoke("run", "-m", model(tmp_path), "hello"), 1,
                          "is an embedding model: it computes vectors of texts (nibble embed)")


def test_a_model_that_generates_does_not_embed(tiny_dir):
    assert_one_line_error(invoke("embed", "-m", tiny_dir, "hello"), 1,
                          "is a llama model, which generates text: nibble embeds with embedding models")
