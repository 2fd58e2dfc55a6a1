"""Reranking as sentence-transformers' CrossEncoder scores (formats/cross_encoder.py,
runner/embedding/rerank.py): tests/data/rerank/'s tiny random rerankers of every kind, each with
the ids, logits and scores its reference gave (tests/fixtures/make_rerank_fixtures.py)."""
import json
import shutil

import numpy as np
import pytest

from nibble.formats.cross_encoder import ranks
from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.model_dir import read_model_dir
from nibble.formats.sentence_transformers import embeds
from nibble.runner.embedding.encoder import Encoder
from nibble.runner.embedding.rerank import Reranker
from tests.test_cli import assert_one_line_error, invoke
from tests.test_transformers import DATA as TRANSFORMERS

DATA = TRANSFORMERS.parent / "rerank"
KINDS = ["bert", "xlm-roberta", "qwen3-reranker", "qwen3-seq-cls"]


def reference(kind: str) -> dict:
    return json.loads((DATA / kind / "scores.json").read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_scores_equal_the_references(kind):
    """The same ids (a pair cut longest first to the tokenizer's length, or inside Qwen3-Reranker's
    prompt), logits within 1e-4 of CrossEncoder's (the card's for Qwen3-Reranker), every pair of
    the request in one pass, and the scores through the model's activation."""
    want = reference(kind)
    reranker = Reranker(read_model_dir(DATA / kind))
    pairs = reranker.pairs(want["query"], want["documents"])
    assert pairs.ids == want["ids"]
    assert pairs.cut == (0 if kind == "qwen3-reranker" else 3)
    logits = reranker.logits(pairs.ids, pairs.types)
    np.testing.assert_allclose(logits, want["logits"], atol=1e-4)
    np.testing.assert_allclose(reranker.scores(logits), want["scores"], atol=1e-4)
    np.testing.assert_allclose(reranker.rerank(want["query"], want["documents"]), want["scores"], atol=1e-4)


def test_a_pair_alone_scores_as_in_a_pass_of_many():
    want = reference("bert")
    reranker = Reranker(read_model_dir(DATA / "bert"))
    together = reranker.rerank(want["query"], want["documents"])
    alone = [reranker.rerank(want["query"], [d])[0] for d in want["documents"]]
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_bert_reads_the_documents_as_token_type_1():
    want = reference("bert")
    pairs = Reranker(read_model_dir(DATA / "bert")).pairs(want["query"], want["documents"][-1:])
    first_sep = pairs.ids[0].index(3)
    assert pairs.types[0] == [0] * (first_sep + 1) + [1] * (len(pairs.ids[0]) - first_sep - 1)


def test_an_instruction_goes_to_qwen3_reranker_only():
    want = reference("qwen3-reranker")
    reranker = Reranker(read_model_dir(DATA / "qwen3-reranker"))
    told = reranker.tokenizer.decode(reranker.pairs("q", ["d"], "Find code")[0][0])
    assert "<Instruct>: Find code\n<Query>: q\n<Document>: d" in told
    assert reranker.pairs("q", ["d"], "Find code").ids != reranker.pairs("q", ["d"]).ids
    with pytest.raises(NibbleError, match="takes no instruction"):
        Reranker(read_model_dir(DATA / "bert")).pairs(want["query"], ["d"], "Find code")


def test_xlm_roberta_positions_start_after_the_padding_id():
    """42 positions, pad id 1: a text takes at most 40 tokens, its first at row 2."""
    encoder = Encoder(read_model_dir(DATA / "xlm-roberta").config, read_model_dir(DATA / "xlm-roberta").tensors)
    assert encoder.longest == 40
    with pytest.raises(NibbleError, match="1 to 40 tokens"):
        encoder.encode([[0] * 41])


def test_what_is_a_reranker(tmp_path):
    """A classifier's architectures or Qwen3-Reranker's card say so; an embedding model, a causal LM
    without the card, a model in memory are none."""
    assert all(ranks(DATA / k) for k in KINDS)
    assert not embeds(DATA / "bert", "bert")
    assert not ranks(TRANSFORMERS / "bert") and embeds(TRANSFORMERS / "bert", "bert")
    assert not ranks(TRANSFORMERS / "qwen3") and not ranks(None)
    plain = tmp_path / "plain"
    shutil.copytree(DATA / "qwen3-reranker", plain)
    (plain / "README.md").write_text("# Qwen3-0.6B\n")
    assert not ranks(plain)
    with pytest.raises(NibbleError, match="is not a reranker"):
        Reranker(read_model_dir(plain), "plain")


@pytest.mark.parametrize("change, message", [
    ({"id2label": {"0": "no", "1": "yes"}}, "a classifier of 2 labels"),
    ({"id2label": None, "num_labels": 3}, "a classifier of 3 labels"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}, "not 'torch.nn.modules"),
])
def test_a_classifier_it_cannot_rank_with_is_said(tmp_path, change, message):
    folder = tmp_path / "m"
    shutil.copytree(DATA / "bert", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(FormatError, match=message):
        Reranker(read_model_dir(folder))


def test_an_identity_activation_reports_the_logits(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(DATA / "bert", folder)
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(config))
    want = reference("bert")
    np.testing.assert_allclose(Reranker(read_model_dir(folder)).rerank(want["query"], want["documents"]),
                               want["logits"], atol=1e-4)


def test_nibble_rerank_prints_the_documents_best_first(tmp_path):
    want = reference("bert")
    documents = tmp_path / "documents.txt"
    documents.write_text("\n".join(want["documents"]) + "\n\n")   # a blank line is no document
    r = invoke("rerank", want["query"], "-m", DATA / "bert", "-f", documents, "--json")
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    order = np.argsort(-np.array(want["scores"]), kind="stable")
    assert [x["index"] for x in lines] == order.tolist() and [x["text"] for x in lines] == [want["documents"][i] for i in order]
    np.testing.assert_allclose([x["score"] for x in lines], np.array(want["scores"])[order], atol=1e-5)
    assert "3 of 4 documents cut to 40 tokens" in r.stderr
    top = invoke("rerank", want["query"], "-m", DATA / "bert", "-f", documents, "--top", "1")
    assert top.exit_code == 0 and top.stdout == f"{want['scores'][order[0]]:.4f}  {want['documents'][order[0]]}\n"
    assert_one_line_error(invoke("rerank", "q", "-m", TRANSFORMERS / "bert", "-f", documents), 1, "is not a reranker")
    assert_one_line_error(invoke("run", "-m", DATA / "bert", "hi"), 1, "is a reranker: it scores documents")


def test_nibble_bench_times_batches_of_pairs_for_a_reranker():
    r = invoke("bench", "-m", DATA / "xlm-roberta", "--parallel", "3", "-p", "6", "--json")
    assert r.exit_code == 0, r.output
    figures = json.loads(r.stdout)
    assert figures["kind"] == "rerank" and figures["texts"] == 3 and figures["tokens"] == 6 and figures["texts_per_s"] > 0


def test_qwen3_reranker_as_llama_cpp_converts_it_scores_alike(tmp_path):
    """The GGUF file llama.cpp's converter writes (pooling type RANK, the rows of "yes" and "no" as
    cls.output, the prompt as its "rerank" template): the card's ids and logits, and so quantized."""
    from nibble.quant.open_model import open_model
    from nibble.runner.loader import as_quantized
    want, path = reference("qwen3-reranker"), DATA / "qwen3-reranker.gguf"
    assert ranks(path) and not ranks(DATA.parent / "gguf" / "smollm3.gguf")
    reranker = Reranker(open_model(str(path)))
    pairs = reranker.pairs(want["query"], want["documents"])
    assert pairs.ids == want["ids"]
    np.testing.assert_allclose(reranker.logits(pairs.ids, pairs.types), want["logits"], atol=1e-4)
    told = reranker.tokenizer.decode(reranker.pairs("q", ["d"], "Find code").ids[0])
    assert "<Instruct>: Find code\n<Query>: q\n<Document>: d" in told
    # an int8 copy says nothing of ranking: how it scores comes from the file it was made from
    quantized = as_quantized(str(path), open_model(str(path)), "int8")
    with pytest.raises(NibbleError, match="is not a reranker"):
        Reranker(quantized)
    close = Reranker(quantized, source=path).logits(pairs.ids, pairs.types)   # int8's error: 0.052 at most
    np.testing.assert_allclose(close, want["logits"], atol=0.1)
    assert close.argmax() == np.argmax(want["logits"])
