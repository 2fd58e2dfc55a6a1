"""The mixture-of-experts MLP (runner/kernels/moe.py) against its numpy twin."""
from pathlib import Path

import numpy as np
import pytest

from nibble.quant.affine import AffineScheme, dequantize, quantize
from nibble.runner.kernels import moe
from nibble.runner.kernels.linear import prepare, read_only
from nibble.runner.models import switch_layers
from tests import reference

E, D, F = 8, 64, 32
NOT_COLLECTING = np.zeros((0, 0))   # act_sq when not calibrating
# MoEWeights' last fields for experts without biases, gating with plain SwiGLU
PLAIN = (np.zeros((0, 0), np.float32),) * 3 + (np.float32(0), np.float32(0))


def experts(rng):
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return w(E, D), w(E, F, D), w(E, F, D), w(E, D, F)


def stacked(ws: np.ndarray, bits: int):
    """Each expert quantized on its own, their arrays stacked: the kind of weight a quantized MoE
    model holds, and its float values."""
    quantized = [quantize(w, AffineScheme(bits, 32), method="rtn") for w in ws]
    parts = [prepare(q) for q in quantized]
    kind, p = type(parts[0]), parts[0]
    # read-only, as prepare and a model's loader give every weight (the kernels' type says so)
    return (read_only(kind(*(np.stack([getattr(q, f) for q in parts]) for f in ("weight", "scales", "biases")),
                           p.bits, p.group_size, p.bf16)),
            np.stack([dequantize(q) for q in quantized]))


# (top_k, top_k_first, renormalize, router bias, shared expert, gpt-oss's experts): Qwen3-MoE and
# Mixtral, OLMoE and Qwen2-MoE (a gated shared expert), Granite's router and its shared variant,
# gpt-oss's router and experts (biases, the clamped SwiGLU)
ROUTERS = [(2, False, True, False, None, False), (3, False, False, False, "gated", False),
           (2, True, False, False, "plain", False), (3, True, False, True, None, True)]


def weights(rng, top_k, top_k_first, renormalize, bias, shared, clamped=False):
    """-> (MoEWeights, the twin's keyword arguments) of random float experts."""
    router, gate, up, down = experts(rng)
    router_bias = rng.standard_normal(E).astype(np.float32) if bias else np.zeros(0, np.float32)
    twin = dict(top_k=top_k, renormalize=renormalize, top_k_first=top_k_first,
                router_bias=router_bias if bias else None)
    kept = None
    if shared:
        w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        sg, su, sd = w(48, D), w(48, D), w(D, 48)
        g = w(D) if shared == "gated" else np.zeros(0, np.float32)
        kept = moe.SharedExpert(sg, su, sd, g)
        twin["shared"] = (sg, su, sd, g if shared == "gated" else None)
    kind = PLAIN
    if clamped:   # limit 1.5: about half the gate and up values get clamped
        b = lambda *shape: (rng.standard_normal(shape) * 0.5).astype(np.float32)
        kind = (b(E, F), b(E, F), b(E, D), np.float32(1.5), np.float32(1.702))
        twin |= dict(biases=kind[:3], swiglu=(1.5, 1.702))
    return (moe.MoEWeights(router, router_bias, gate, up, down, top_k, top_k_first, renormalize, kept, *kind),
            dict(router=router, w_gate=gate, w_up=up, w_down=down, **twin))


@pytest.mark.parametrize("T", [1, 3, 40])                       # decode, a few rows, a prefill
@pytest.mark.parametrize("router", ROUTERS)
def test_float_experts_match_the_twin(T, router):
    rng = np.random.default_rng(T)
    w, twin = weights(rng, *router)
    h = rng.standard_normal((T, D)).astype(np.float32)
    out = np.empty_like(h)
    moe.moe_mlp(h, w, out, NOT_COLLECTING)
    np.testing.assert_allclose(out, reference.moe_mlp(h, **twin), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("top_k_first", [False, True])
def test_routing_picks_the_largest_logits_and_their_probabilities_sum_to_one(top_k_first):
    rng = np.random.default_rng(0)
    router = rng.standard_normal((E, D)).astype(np.float32)
    bias = rng.standard_normal(E).astype(np.float32)
    h = rng.standard_normal((5, D)).astype(np.float32)
    experts_, probs = moe.route(h, router, bias, 3, top_k_first, True)
    logits = h.astype(np.float64) @ router.T.astype(np.float64) + bias
    np.testing.assert_array_equal(experts_, np.argsort(-logits, kind="stable")[:, :3])
    np.testing.assert_allclose(probs.sum(1), 1, rtol=1e-6)


def test_without_renormalising_the_probabilities_are_the_softmax_over_all():
    rng = np.random.default_rng(1)
    router = rng.standard_normal((E, D)).astype(np.float32)
    h = rng.standard_normal((5, D)).astype(np.float32)
    experts_, probs = moe.route(h, router, np.zeros(0, np.float32), 3, False, False)
    logits = h.astype(np.float64) @ router.T.astype(np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(probs, np.take_along_axis(p, experts_, 1), rtol=1e-5)


def test_equal_logits_pick_the_lower_index():
    router = np.zeros((E, D), np.float32)   # every logit 0
    h = np.ones((2, D), np.float32)
    for top_k_first in (False, True):
        experts_, probs = moe.route(h, router, np.zeros(0, np.float32), 3, top_k_first, True)
        np.testing.assert_array_equal(experts_, [[0, 1, 2]] * 2)
        np.testing.assert_allclose(probs, 1 / 3, rtol=1e-6)


@pytest.mark.parametrize("T", [1, 40])
@pytest.mark.parametrize("router", [ROUTERS[0], ROUTERS[3]])   # plain experts, gpt-oss's
def test_quantized_experts_match_the_twin_of_their_values(T, router):
    """Stacked int4 experts: each expert's view runs the dense kernels, which round x to integers
    (int8 where the CPU multiplies bytes): close to the float twin of the same weights."""
    rng = np.random.default_rng(5)
    w, twin = weights(rng, *router)
    (qgate, twin["w_gate"]), (qup, twin["w_up"]), (qdown, twin["w_down"]) = (
        stacked(w.w_gate, 4), stacked(w.w_up, 4), stacked(w.w_down, 4))
    h = rng.standard_normal((T, D)).astype(np.float32)
    out = np.empty_like(h)
    moe.moe_mlp(h, w._replace(w_gate=qgate, w_up=qup, w_down=qdown), out, NOT_COLLECTING)
    want = reference.moe_mlp(h, **twin)
    np.testing.assert_allclose(out, want, rtol=0.05, atol=0.02 * np.abs(want).max())


def test_stacked_experts_run_as_stored_and_as_one_tensor_each():
    """A quantized MoE checkpoint holds its experts as MLX does, stacked (mlp.switch_mlp.*: kept in
    the file's memory, no copy), or one tensor an expert (mlp.experts.N.*: stacked at load): the
    same logits, bit for bit (the qwen3-moe fixture, its experts quantized to 4 bits)."""
    import dataclasses
    import json

    from nibble.formats.config import ModelConfig
    from nibble.formats.safetensors import read_checkpoint
    from nibble.runner.model import Model

    folder = Path(__file__).parent / "data" / "transformers" / "qwen3-moe"
    config = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    config = dataclasses.replace(config, quantization={"group_size": 32, "bits": 4, "mode": "affine"})
    floats = {k: (v.widen() if hasattr(v, "widen") else v) for k, v in read_checkpoint(folder).items()}
    each, stacked = {}, {}
    for name, t in floats.items():
        if ".mlp.experts." not in name:
            each[name] = stacked[name] = t
            continue
        qt = quantize(t, AffineScheme(4, 32), method="rtn")
        path = name.removesuffix(".weight")
        each |= {f"{path}.weight": qt.weight, f"{path}.scales": qt.scales, f"{path}.biases": qt.biases}
    for layer in (0, 2):   # the sparse layers
        E = sum(1 for k in each if k.startswith(f"model.layers.{layer}.mlp.experts.") and k.endswith("gate_proj.weight"))
        for m in ("gate_proj", "up_proj", "down_proj"):
            for part in ("weight", "scales", "biases"):
                stacked[f"model.layers.{layer}.mlp.switch_mlp.{m}.{part}"] = np.stack(
                    [each[f"model.layers.{layer}.mlp.experts.{e}.{m}.{part}"] for e in range(E)])
    tokens = np.load(folder / "tokens.npy")
    logits = []
    for tensors in (each, stacked):
        model = Model(config, tensors)
        logits.append(model.forward(tokens, model.new_cache(64), all_logits=True))
    np.testing.assert_array_equal(logits[0], logits[1])
    gate = Model(config, stacked).layers[0].moe.w_gate
    assert np.shares_memory(gate.weight, stacked["model.layers.0.mlp.switch_mlp.gate_proj.weight"])


def test_calibration_sums_each_experts_inputs_over_the_rows_routed_to_it():
    """act_sq's mixture rows (moe.moe_mlp): expert e's gate/up and down inputs summed squared over
    the rows routed to it, the count of those rows, and the shared expert's down input."""
    rng = np.random.default_rng(7)
    w, twin = weights(rng, 3, False, False, False, "gated")
    T = 20
    h = rng.standard_normal((T, D)).astype(np.float32)
    act_sq = np.zeros((5 + 2 * E, max(D, F, 48)))
    moe.moe_mlp(h, w, np.empty_like(h), act_sq)
    chosen, _ = moe.route(h, w.router, w.router_bias, 3, False, False)
    x = h.astype(np.float64)
    mid = lambda rows, g, u: reference.silu(rows @ g.T) * (rows @ u.T)
    for e in range(E):
        rows = x[(chosen == e).any(1)]
        assert act_sq[4 + 2 * E, e] == len(rows)
        np.testing.assert_allclose(act_sq[4 + 2 * e, :D], (rows ** 2).sum(0), rtol=1e-5)
        np.testing.assert_allclose(act_sq[5 + 2 * e, :F], (mid(rows, w.w_gate[e], w.w_up[e]) ** 2).sum(0),
                                   rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(act_sq[3, :48], (mid(x, w.shared.w_gate, w.shared.w_up) ** 2).sum(0), rtol=1e-3)
    assert not act_sq[:3].any()   # the attention's and the MLP input's rows are the block's




def moe_model_dir(name: str):
    """The transformers fixture `name` (its config and every weight but the embedding and head)
    with the tiny tokenizer's vocabulary and random rows for it: a model nibble quantize can
    calibrate on text."""
    import dataclasses
    import json

    from nibble.formats.config import ModelConfig
    from nibble.formats.safetensors import read_checkpoint
    from tests.tiny import tiny_model_dir

    tiny = tiny_model_dir()
    folder = Path(__file__).parent / "data" / "transformers" / name
    raw = json.loads((folder / "config.json").read_text()) | {"vocab_size": tiny.config.vocab_size}
    rng = np.random.default_rng(0)
    tensors = {k: (v.widen() if hasattr(v, "widen") else v) for k, v in read_checkpoint(folder).items()}
    tensors |= {n: (rng.standard_normal((raw["vocab_size"], raw["hidden_size"])) / 8).astype(np.float32)
                for n in ("model.embed_tokens.weight", "lm_head.weight")}
    return dataclasses.replace(tiny, config=ModelConfig.from_dict(raw), tensors=tensors)


@pytest.mark.parametrize("name", ["qwen2-moe", "granitemoeshared", "gpt-oss"])
def test_quantize_writes_stacked_experts_weighted_by_the_rows_routed_to_each(name, tmp_path):
    """nibble quantize of an MoE checkpoint: each expert's matrices quantized with the importances
    of the rows calibration routed to it (plainly where too few were, and the command says how
    many), written stacked as MLX's switch_mlp (from one tensor an expert, Granite's fused pair or
    gpt-oss's interleaved [in, out] stacks); a shared expert quantized as a dense matrix; the
    result reads back."""
    from nibble.formats.model_dir import read_model_dir, write_model_dir
    from tests.test_calibrate import imatrix
    from nibble.runner.model import Model
    from nibble.runner.models import family
    from nibble.runner.text.tokenizer import Tokenizer
    from tests.test_cli import invoke

    md = moe_model_dir(name)
    text = "The sky, the sea and the capital of France."
    (tmp_path / "calib.txt").write_text(text)   # short: some experts are reached too rarely
    r = invoke("quantize", write_model_dir(md, tmp_path / name), "-o", tmp_path / "q", "--bits", 8,
               "--group-size", 32, "--calib", tmp_path / "calib.txt")
    assert r.exit_code == 0, r.output
    out = read_model_dir(tmp_path / "q").tensors
    # what stays float: the routers (and Qwen2-MoE's shared expert gate), and the matrices whose
    # rows do not split into groups of 32 (the fixtures' 48-wide shared experts), named on stderr
    float_matrices = {k for k, t in out.items() if k.endswith(".weight") and t.ndim > 1 and t.dtype != np.uint32}
    kept = {line.split()[3] for line in r.stderr.splitlines() if line.startswith("kept in float: ")}
    assert float_matrices == kept | {k for k in out if k.endswith(("router.weight", "mlp.gate.weight",
                                                                    "router.layer.weight", "shared_expert_gate.weight"))}
    assert not [k for k in out if ".experts." in k and not k.endswith("_bias")]   # gpt-oss's biases stay
    if name != "gpt-oss":
        shared = "mlp.shared_expert.gate_proj" if name == "qwen2-moe" else "shared_mlp.input_linear"
        assert out[f"model.layers.0.{shared}.weight"].dtype == np.uint32

    # the importances as quantize measured them, in windows of the model's 64 positions
    tokens = Tokenizer(md).encode(text, add_bos=False)
    measured = imatrix(Model(md.config, md.tensors), tokens, 64)
    stacks = family(md.config).stacks(md.config, md.tensors)
    assert len(stacks) == 3 * md.config.num_hidden_layers
    plain = 0
    for stack_name, stack in stacks.items():
        imp = measured[stack_name]
        for e, w in enumerate(stack.matrices(md.tensors)):
            want = quantize(w, AffineScheme(8, 32), imp[e] if imp[e].any() else None)
            path = stack_name.removesuffix(".weight")
            for part in ("weight", "scales", "biases"):
                np.testing.assert_array_equal(out[f"{path}.{part}"][e], getattr(want, part))
            plain += not imp[e].any()
    assert 0 < plain < 3 * md.config.num_hidden_layers * switch_layers.experts(md.config)   # both kinds tested
    assert f"{plain} experts' matrices were quantized without importances" in r.stderr

    # it reads back: the stacks where the family looks for them (the kernels on stacked int8
    # experts are test_gguf_archs' and this file's twins' to run)
    quantized = read_model_dir(tmp_path / "q")
    layer = Model(quantized.config, quantized.tensors).layers[0]
    assert layer.moe.w_down.bits == 8 and layer.moe.w_down.weight.shape[0] == switch_layers.experts(md.config)


@pytest.mark.parametrize("router", [ROUTERS[1], ROUTERS[3]])   # a shared expert; gpt-oss's experts
def test_one_row_reads_its_experts_in_one_loop_as_a_batch_reads_each(router):
    """A decoded token's k experts run in one parallel loop a matrix (their rows side by side);
    a batch groups its rows by expert and runs each expert on its own: each row alone gives what
    it gives among the batch, bit for bit (the same integer dot products, summed alike)."""
    rng = np.random.default_rng(2)
    w, _ = weights(rng, *router)
    w = w._replace(w_gate=stacked(w.w_gate, 4)[0], w_up=stacked(w.w_up, 4)[0], w_down=stacked(w.w_down, 4)[0])
    h = rng.standard_normal((6, D)).astype(np.float32)
    batch, alone = np.empty_like(h), np.empty_like(h)
    moe.moe_mlp(h, w, batch, NOT_COLLECTING)
    for t in range(len(h)):
        moe.moe_mlp(h[t:t + 1], w, alone[t:t + 1], NOT_COLLECTING)
    np.testing.assert_array_equal(alone, batch)
