"""A decoded block as one parallel region (kernels/team.py) against decoder_layer's region a
kernel: the same bits, in the residual stream and in the cache, whatever the threads."""
import dataclasses

import numba
import numpy as np
import pytest

from nibble.quant.affine import AffineScheme, quantize
from nibble.quant.convert import quantize_model
from nibble.runner.kv.cache import BLOCK, HostKV, Rows
from nibble.runner.kernels import linear, team
from nibble.runner.kernels.layer import decoder_layer
from nibble.runner.model import Model
from tests.tiny import tiny_model_dir

pytestmark = pytest.mark.skipif(not linear.int8_activations(),
                                reason="the team decodes where the CPU multiplies bytes (int8 activations)")

# each row's sequence, position and the positions it is given (a decoded row past a split of 256
# keys, a decoded row, a prompt's three rows in one pass)
SEQ = np.array([0, 1, 2, 2, 2])
POS = np.array([300, 5, 40, 41, 42])


def _built(model_type):
    """The tiny model of model_type, 4-bit, with room for its rows' positions (its own holds 256)."""
    md = tiny_model_dir(model_type)
    md = dataclasses.replace(md, config=dataclasses.replace(md.config, max_position_embeddings=512))
    q = quantize_model(md, 4, 64).model
    return Model(q.config, q.tensors), md.tensors


def _random_cache(model, dtype, rng):
    c = model.config
    blocks = 3 * (512 // BLOCK)
    kv = HostKV.allocate(1, c.num_key_value_heads, blocks, c.head_dim, dtype)
    for a in (kv.k, kv.v):
        if dtype == np.int8:
            a[...] = rng.integers(-127, 128, a.shape)
        else:
            a[...] = rng.standard_normal(a.shape)
    kv.k_scale[...] = rng.uniform(0.005, 0.02, kv.k_scale.shape) if dtype == np.int8 else 1
    kv.v_scale[...] = rng.uniform(0.005, 0.02, kv.v_scale.shape) if dtype == np.int8 else 1
    return kv


def _run(layer, model, i, x, kv, rows, one_region):
    """Block i on x: team.decode_layer, or decoder_layer a region a kernel (collecting the
    projections' inputs keeps it to those)."""
    c = model.config
    args = (x, layer, kv.layer(0), rows, *model.ropes[i], c.rms_norm_eps, c.windows[i])
    if one_region:
        _one_region(*args)
    else:
        decoder_layer(*args, np.zeros((4, 4 * c.hidden_size + c.intermediate_size)))


@numba.njit
def _one_region(x, w, kv, rows, cos, sin, eps, window):
    """team.decode_layer, which only kernels call (it compiles without a wrapper for Python)."""
    team.decode_layer(x, w, kv, rows, cos, sin, eps, window)


def _variant(layer, floats, i, head_dim, variant):
    """The block's weights as the variant has them: kinds that round their inputs apart (v and up
    8-bit), or Granite's and gpt-oss's extras (a residual scale, an output bias, sinks)."""
    if variant == "mixed kinds":
        p = f"model.layers.{i}."
        w8 = lambda name: linear.prepare(quantize(floats[p + name + ".weight"], AffineScheme(8, 32), method="rtn"))
        return layer._replace(wv=w8("self_attn.v_proj"), w_up=w8("mlp.up_proj"))
    if variant == "extras":
        rng = np.random.default_rng(3)
        D, heads = layer.input_norm.shape[0], layer.wq.shape[0] // head_dim
        return layer._replace(residual_scale=np.float32(0.5), bo=rng.standard_normal(D).astype(np.float32),
                              sinks=rng.standard_normal(heads).astype(np.float32))
    return layer


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("model_type,variant,kv_dtype", [
    ("llama", "plain", np.float32), ("qwen2", "plain", np.float32), ("qwen3", "plain", np.float32),
    ("mistral", "plain", np.float32), ("llama", "mixed kinds", np.float32), ("llama", "extras", np.float32),
    ("llama", "plain", np.int8)])
def test_one_region_gives_the_kernels_bits(model_type, variant, kv_dtype, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("one core")
    model, floats = _built(model_type)
    rng = np.random.default_rng(0)
    tables = np.arange(3 * (512 // BLOCK), dtype=np.int32).reshape(3, -1)
    rows = Rows.of(POS, SEQ, tables)
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        for i, layer in enumerate(model.layers):
            layer = _variant(layer, floats, i, model.config.head_dim, variant)
            x = rng.standard_normal((len(POS), model.config.hidden_size)).astype(np.float32)
            kv = _random_cache(model, kv_dtype, rng)
            kernels, region = HostKV(*(a.copy() for a in (kv.k, kv.v, kv.k_scale, kv.v_scale))), kv
            want, got = x.copy(), x.copy()
            _run(layer, model, i, want, kernels, rows, one_region=False)
            _run(layer, model, i, got, region, rows, one_region=True)
            assert np.array_equal(got, want)
            for a, b in zip((region.k, region.v, region.k_scale, region.v_scale),
                            (kernels.k, kernels.v, kernels.k_scale, kernels.v_scale)):
                assert np.array_equal(a, b)
            assert not np.array_equal(got, x)
    finally:
        numba.set_num_threads(before)


def test_decoded_blocks_run_as_one_region():
    """decoder_layer hands a few rows of a quantized block to the team, and keeps the rest
    (a prompt's many rows, collecting) to its kernels."""
    from numba import types
    model, _ = _built("llama")
    layer = model.layers[0]
    typed = lambda v: numba.typeof(v)
    c = model.config
    args = [typed(a) for a in (np.zeros((1, c.hidden_size), np.float32), layer, model.new_cache(64).pool.parts[0].layer(0),
                                Rows.of([0], [0], np.zeros((1, 4), np.int32)), *model.ropes[0], c.rms_norm_eps,
                                c.windows[0], np.zeros((0, 0)))]
    chosen = team._decoded_in_one_region_typed(*args)
    assert "decode_layer" in chosen.__code__.co_names
    floats = [typed(np.zeros((2, 2), np.float32)) if isinstance(t, types.BaseNamedTuple) else t for t in args[1]]
    assert "decode_layer" not in team._decoded_in_one_region_typed(
        args[0], types.NamedTuple(floats, type(layer)), *args[2:]).__code__.co_names
