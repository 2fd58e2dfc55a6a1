"""The mixture-of-experts MLP (runner/kernels/moe.py) against its numpy twin."""
import numpy as np
import pytest

from nibble.quant.affine import AffineScheme, dequantize, quantize
from nibble.runner.kernels import moe
from nibble.runner.kernels.linear import prepare
from tests import reference

E, D, F = 8, 64, 32


def experts(rng):
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return w(E, D), w(E, F, D), w(E, F, D), w(E, D, F)


def stacked(ws: np.ndarray, bits: int):
    """Each expert quantized on its own, their arrays stacked: the kind of weight a quantized MoE
    model holds, and its float values."""
    quantized = [quantize(w, AffineScheme(bits, 32), method="rtn") for w in ws]
    parts = [prepare(q) for q in quantized]
    kind, p = type(parts[0]), parts[0]
    return (kind(*(np.stack([getattr(q, f) for q in parts]) for f in ("weight", "scales", "biases")),
                 p.bits, p.group_size, p.bf16),
            np.stack([dequantize(q) for q in quantized]))


@pytest.mark.parametrize("T", [1, 3, 40])                       # decode, a few rows, a prefill
@pytest.mark.parametrize("top_k, renormalize", [(2, True), (3, False)])
def test_float_experts_match_the_twin(T, top_k, renormalize):
    rng = np.random.default_rng(T)
    router, gate, up, down = experts(rng)
    h = rng.standard_normal((T, D)).astype(np.float32)
    out = np.empty_like(h)
    moe.moe_mlp(h, moe.MoEWeights(router, gate, up, down, top_k, renormalize), out)
    np.testing.assert_allclose(out, reference.moe_mlp(h, router, gate, up, down, top_k, renormalize),
                               rtol=1e-4, atol=1e-5)


def test_routing_picks_the_most_probable_and_renormalises():
    rng = np.random.default_rng(0)
    router = rng.standard_normal((E, D)).astype(np.float32)
    h = rng.standard_normal((5, D)).astype(np.float32)
    experts_, probs = moe.route(h, router, 3, True)
    logits = h.astype(np.float64) @ router.T.astype(np.float64)
    np.testing.assert_array_equal(experts_, np.argsort(-logits, kind="stable")[:, :3])
    np.testing.assert_allclose(probs.sum(1), 1, rtol=1e-6)


@pytest.mark.parametrize("T", [1, 40])
def test_quantized_experts_match_the_twin_of_their_values(T):
    """Stacked int4 experts: each expert's view runs the dense kernels, which round x to integers
    (int8 where the CPU multiplies bytes): close to the float twin of the same weights."""
    rng = np.random.default_rng(5)
    router, gate, up, down = experts(rng)
    (qgate, fgate), (qup, fup), (qdown, fdown) = stacked(gate, 4), stacked(up, 4), stacked(down, 4)
    h = rng.standard_normal((T, D)).astype(np.float32)
    out = np.empty_like(h)
    moe.moe_mlp(h, moe.MoEWeights(router, qgate, qup, qdown, 2, True), out)
    want = reference.moe_mlp(h, router, fgate, fup, fdown, 2, True)
    np.testing.assert_allclose(out, want, rtol=0.05, atol=0.02 * np.abs(want).max())
