"""NaN and Inf: the kernels carry them through without raising, and a pass whose logits are not
finite stops in one NibbleError naming the part of the model where they appeared."""
import re

import numpy as np
import pytest
from numba import cuda

from nibble.formats.model_dir import write_model_dir
from nibble.quant.convert import quantize_model
from nibble.runner.kv.cache import BLOCK, Rows
from nibble.runner.kernels import cpu
from nibble.runner.loader import from_model_dir
from nibble.runner.model import NonFinite
from tests import reference
from tests.test_cli import assert_one_line_error, invoke
from tests.test_offload import narrow_model_dir
from tests.tiny import tiny_config, tiny_model_dir, tiny_tensors

LAYERS = 3


def test_rmsnorm_of_non_finite_rows_is_not_finite_and_leaves_the_others():
    """A row of zeros with eps 0 divides by zero (numba's Python error model raised
    ZeroDivisionError); a NaN row sums to NaN. Both come out non-finite, as numpy's, and the
    finite rows as the reference."""
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    x[1] = 0
    x[2, 5] = np.nan
    w = np.ones(32, np.float32)
    out = np.empty_like(x)
    cpu.rmsnorm(x, w, 0.0, out)
    with np.errstate(invalid="ignore", divide="ignore"):
        want = reference.rmsnorm(x, w, 0.0)
    assert not np.isfinite(out[1:3]).any() and not np.isfinite(want[1:3]).any()
    np.testing.assert_allclose(out[[0, 3]], want[[0, 3]], rtol=1e-5, atol=1e-5)


def test_attention_over_a_non_finite_key_is_not_finite_for_the_queries_that_see_it():
    T, H, Hkv, hd = 4, 2, 1, 8
    rng = np.random.default_rng(1)
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k, v = rng.standard_normal((2, Hkv, BLOCK, hd)).astype(np.float32)
    k[0, 2, 3] = np.inf   # the key of position 2: queries 2 and 3 see it
    ones = np.ones((Hkv, BLOCK), np.float32)
    out = np.empty_like(q)
    one_block = Rows.single(0, T, np.zeros(1))   # the cache as one block, its first T positions
    cpu.attention(q, k.swapaxes(1, 2)[None].copy(), v[None], ones[None], ones[None], one_block, 0, 1 / np.sqrt(hd),
                  np.zeros(0, np.float32), out)
    with np.errstate(invalid="ignore"):
        want = reference.attention(q.astype(np.float64), k[:, :T].transpose(1, 0, 2), v[:, :T].transpose(1, 0, 2),
                                   np.arange(T))
    assert not np.isfinite(out[2:]).all() and not np.isfinite(want[2:]).all()
    np.testing.assert_allclose(out[:2], want[:2], rtol=1e-4, atol=1e-5)


def tiny(**config):
    """The tiny llama with LAYERS layers."""
    md = tiny_model_dir()
    md.config = tiny_config(vocab_size=md.config.vocab_size, num_hidden_layers=LAYERS, **config)
    md.tensors = tiny_tensors(md.config)
    return md


def damaged(tensor="model.layers.1.mlp.down_proj.weight", value=np.nan, **config):
    """tiny() with `tensor` holding `value`: the whole tensor, or of the embedding, token 7's row."""
    md = tiny(**config)
    md.tensors[tensor][7 if tensor == "model.embed_tokens.weight" else ...] = value
    return md


@pytest.mark.parametrize("tensor,named", [
    ("model.layers.0.self_attn.q_proj.weight", "layer 0 of 3 (model.layers.0)"),
    ("model.layers.1.mlp.down_proj.weight", "layer 1 of 3 (model.layers.1)"),
    ("model.layers.2.post_attention_layernorm.weight", "layer 2 of 3 (model.layers.2)"),
    ("model.norm.weight", "the output head (model.norm, model.embed_tokens, tied)"),
])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_tensor_is_named_in_prefill_and_decode(tensor, named, value):
    model, _ = from_model_dir(damaged(tensor, value))
    for tokens in ([3, 4, 5], [3]):
        cache = model.new_cache(16)
        with pytest.raises(NonFinite, match="^" + re.escape(f"{named} produced NaN/Inf values")):
            model.forward(tokens, cache)
        assert cache.pos == 0   # the failed pass is not in the cache


def test_a_non_finite_embedding_row_is_named_when_its_token_comes():
    model, _ = from_model_dir(damaged("model.embed_tokens.weight", np.inf, tie_word_embeddings=False))
    cache = model.new_cache(16)
    model.forward([3, 4], cache)   # other tokens run
    with pytest.raises(NonFinite, match=r"^the embedding \(model.embed_tokens\) produced NaN/Inf"):
        model.forward([7], cache)


def test_a_non_finite_row_of_a_tied_embedding_is_named_as_the_output_head():
    """Tied, the embedding is also the output head: every pass's logits hold token 7's inf."""
    model, _ = from_model_dir(damaged("model.embed_tokens.weight", np.inf))
    with pytest.raises(NonFinite, match=r"^the output head \(model.norm, model.embed_tokens, tied\)"):
        model.forward([3, 4], model.new_cache(16))


def test_an_int4_model_with_nan_scales_names_the_layer():
    md = quantize_model(tiny(), 4, 32).model
    md.tensors["model.layers.2.self_attn.v_proj.scales"][...] = np.nan
    model, _ = from_model_dir(md)
    for tokens in ([3, 4, 5], [3]):
        with pytest.raises(NonFinite, match=r"^layer 2 of 3 \(model.layers.2\)"):
            model.forward(tokens, model.new_cache(16))


@pytest.fixture(scope="module")
def nan_dir(tmp_path_factory):
    path = write_model_dir(damaged(), tmp_path_factory.mktemp("nan") / "model")
    # A command that compiles kernels says so on stderr, beside its error: compiled here, once,
    # whatever ran before in this process, the commands under test print their error alone.
    for temp in ("0.8", "0"):
        invoke("run", "-m", path, "-n", 4, "--temp", temp, "Hello")
    return path


def test_run_perplexity_and_bench_end_in_one_line(nan_dir, tmp_path):
    named = "layer 1 of 3 (model.layers.1) produced NaN/Inf values"
    assert_one_line_error(invoke("run", "-m", nan_dir, "-n", 4, "Hello"), match=named)
    assert_one_line_error(invoke("run", "-m", nan_dir, "-n", 4, "--temp", 0, "Hello"), match=named)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    for decode in ([], ["--decode"]):
        r = invoke("perplexity", text, "-m", nan_dir, "--ctx", 16, "--chunks", 1, *decode)
        assert r.exit_code == 1 and named in r.stderr and "Traceback" not in r.stderr, r.output
    assert_one_line_error(invoke("bench", "-m", nan_dir, "-p", 4, "-n", 2, "-r", 1), match=named)


@pytest.mark.slow
@pytest.mark.skipif(not cuda.is_available(), reason="no CUDA GPU (NUMBA_ENABLE_CUDASIM=1 simulates one)")
@pytest.mark.filterwarnings("ignore:Simulator timings are bogus", "ignore:invalid value encountered")
@pytest.mark.parametrize("gpu_layers", [1, -1])   # the head on the CPU, then on the GPU
def test_the_gpu_stage_names_the_layer(gpu_layers, simulated_gpu):
    md = narrow_model_dir(vocab_size=64)
    md.tensors["model.layers.1.mlp.down_proj.weight"][...] = np.inf
    model, _ = from_model_dir(md)
    model.offload_layers(gpu_layers, 16)
    for tokens in ([5, 17, 40], [5]):   # prefill, and decode (a CUDA graph on a real GPU)
        with pytest.raises(NonFinite, match=r"^layer 1 of 2 \(model.layers.1\)"):
            model.forward(tokens, model.new_cache(16))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])   # Textual runs on asyncio
async def test_the_chat_app_says_which_layer_and_goes_on(tmp_path, monkeypatch, anyio_backend):
    """The app's first pass (loading the kernels) meets the NaN: a notification, no crash."""
    from tests.tui_helpers import make_app, notes, wait_for
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))
    app = make_app(from_model_dir(damaged()), model="nan")
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.loading is None, what="the failure")
        assert any("Could not load nan: layer 1 of 3 (model.layers.1) produced NaN/Inf values" in n
                   for n in notes(app)), notes(app)
