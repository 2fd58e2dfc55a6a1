"""Perplexity and KL divergence on tiny models, against values computed exactly in float64."""
import json

import numpy as np
import pytest

from nibble.formats.model_dir import write_model_dir
from nibble.quant.convert import quantize_model
from nibble.runner.loader import from_model_dir
from nibble.runner.measure.perplexity import evaluate
from tests import reference
from tests.test_cli import assert_one_line_error, invoke
from tests.tiny import TEXT, tiny_model_dir

CTX = 16


def exact_logp(model_dir, tokens):
    """float64 log-probabilities of each window, from the numpy reference."""
    out = []
    for window in tokens.reshape(-1, CTX):
        logits = reference.forward(model_dir.config, model_dir.tensors, window)[:-1]
        logits -= logits.max(-1, keepdims=True)
        out.append(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two tiny models that differ only in their weights' seed."""
    return tiny_model_dir(seed=0), tiny_model_dir(seed=1)


def test_perplexity_and_kl_match_exact_values(two_models, tmp_path):
    base_dir, other_dir = two_models
    base, tok = from_model_dir(base_dir)
    other, _ = from_model_dir(other_dir)
    tokens = np.array(tok.encode(TEXT, add_bos=False))[:4 * CTX]
    targets = tokens.reshape(-1, CTX)[:, 1:].reshape(-1)
    p = exact_logp(base_dir, tokens)
    q = exact_logp(other_dir, tokens)

    saved = tmp_path / "base.logprobs"
    r = evaluate(base, tokens, ctx=CTX, save_logits=str(saved))
    assert r.windows == 4 and r.tokens == 4 * (CTX - 1)
    assert r.ppl == pytest.approx(np.exp(-p[np.arange(len(targets)), targets].mean()), rel=1e-5)

    same = evaluate(base, tokens, ctx=CTX, kl_base=str(saved))
    assert same.kl_mean < 1e-6 and same.top1_agree == 1.0

    kl = (np.exp(p) * (p - q)).sum(-1)
    r = evaluate(other, tokens, ctx=CTX, kl_base=str(saved))
    assert r.kl_mean == pytest.approx(kl.mean(), rel=1e-3)
    assert r.kl_median == pytest.approx(np.median(kl), rel=1e-3)
    assert r.top1_agree == pytest.approx((p.argmax(-1) == q.argmax(-1)).mean())
    assert [f.name for f in tmp_path.iterdir()] == ["base.logprobs"]   # no temporary file left


# the kinds of test_threads' models, also held in memory: the layers compiled for them serve these
@pytest.mark.parametrize("bits,group", [(None, None), (8, 64), (4, 32)])
def test_decode_path_scores_like_the_batch_path(two_models, bits, group):
    """--decode runs each window one token at a time: the same model, other kernels (for
    quantized weights, integer dot products on activations rounded to 16 bits)."""
    model_dir = two_models[0] if bits is None else quantize_model(two_models[0], bits, group).model
    model, tok = from_model_dir(model_dir)
    tokens = np.array(tok.encode(TEXT, add_bos=False))[:2 * CTX]
    batch = evaluate(model, tokens, ctx=CTX)
    decode = evaluate(model, tokens, ctx=CTX, decode=True)
    assert decode.tokens == batch.tokens
    assert decode.ppl == pytest.approx(batch.ppl, rel=1e-5 if bits is None else 1e-3)


def test_cli_perplexity_with_kl_base(two_models, tmp_path):
    base_dir = write_model_dir(two_models[0], tmp_path / "base")
    other_dir = write_model_dir(two_models[1], tmp_path / "other")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    saved = tmp_path / "base.logprobs"
    r = invoke("perplexity", text, "-m", base_dir, "--ctx", CTX, "--save-logits", saved)
    assert r.exit_code == 0 and r.stdout.startswith("perplexity ")
    r = invoke("perplexity", text, "-m", other_dir, "--ctx", CTX, "--kl-base", saved, "--json")
    figures = json.loads(r.stdout)
    assert figures["kl_mean"] > 0 and 0 <= figures["top1_agree"] <= 1
    r = invoke("perplexity", text, "-m", other_dir, "--ctx", CTX, "--kl-base", saved, "--decode", "--json")
    assert json.loads(r.stdout)["kl_mean"] == pytest.approx(figures["kl_mean"], rel=1e-4)
    # Another --ctx makes other windows: the saved file does not fit them.
    r = invoke("perplexity", text, "-m", other_dir, "--ctx", CTX * 2, "--kl-base", saved)
    assert_one_line_error(r, match="saved from other text")
    # A damaged file: a header length of 2**63, a header that is not JSON, a body cut short.
    data = saved.read_bytes()
    magic = data.index(b"{") - 8
    header_end = magic + 8 + int.from_bytes(data[magic:magic + 8], "little")
    damaged = tmp_path / "damaged.logprobs"
    for bad, why in [(data[:magic] + (1 << 63).to_bytes(8, "little") + data[magic + 8:], "damaged"),
                     (data[:magic + 8] + b"\xff" * (header_end - magic - 8) + data[header_end:], "damaged"),
                     (data[:-10], "cut short")]:
        damaged.write_bytes(bad)
        r = invoke("perplexity", text, "-m", other_dir, "--ctx", CTX, "--kl-base", damaged)
        assert_one_line_error(r, match=why)
    short = tmp_path / "short.txt"
    short.write_text("Hello.")
    assert_one_line_error(invoke("perplexity", short, "-m", base_dir, "--ctx", 64), match="shorter than one window")
