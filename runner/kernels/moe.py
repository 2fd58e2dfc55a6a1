"""A mixture-of-experts MLP: a router picks k of E experts for each row, and the row's output is
their gated MLPs' outputs weighted by the router's probabilities.

The experts are stacked: each of gate, up and down is one weight with a leading expert axis
([E, F, D] and [E, D, F]: float32 arrays, or a QuantizedTensor whose arrays have that axis), and
an expert is a view of its part (`expert`). The rows are grouped by expert: an expert that several
rows are routed to is read once for them all (their rows gathered into one matrix, a prefill's
or a batch's), and one no row is routed to is not read at all: in a memory-mapped file its pages
are never touched. Each row sums its experts' outputs in the order of their indices, as
transformers' loop over the experts hit does.

Routers differ by family: softmax over all E logits and then the k largest (renormalised over
the k or not: Qwen, Mixtral, OLMoE), or the k largest logits and then a softmax over those
(Granite, gpt-oss), with a bias on the logits or not. A shared expert (Qwen2-MoE, Granite's
shared variant) sees every row, its output weighted by a sigmoid gate or not. gpt-oss's experts
have biases and gate with a clamped SwiGLU: (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g), g
= min(gate, limit).
"""
from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.extending import overload

from . import cpu, quant_decode
from .linear import Weight, gated_mlp, linear, out_features


class SharedExpert(NamedTuple):
    """An expert every row goes through, beside the routed ones."""
    w_gate: Weight       # [F, D]
    w_up: Weight         # [F, D]
    w_down: Weight       # [D, F]
    gate: np.ndarray     # [D] float32: its output times sigmoid(h . gate); shape (0,): no gate

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self)


class MoEWeights(NamedTuple):
    """The experts of one MoE MLP and their router (module level: cached kernels name the type)."""
    router: np.ndarray       # [E, D] float32: the router's logits are h @ router.T
    router_bias: np.ndarray  # [E] float32, added to the logits; shape (0,): none
    w_gate: Weight           # [E, F, D], stacked
    w_up: Weight             # [E, F, D]
    w_down: Weight           # [E, D, F]
    top_k: int               # experts a row is routed to
    top_k_first: bool        # the k largest logits, then a softmax over them (else softmax, then k)
    renormalize: bool        # softmax first: the k probabilities divided by their sum
    shared: SharedExpert | None
    b_gate: np.ndarray       # [E, F] float32, each expert's biases (gpt-oss); shape (0, 0): none
    b_up: np.ndarray         # [E, F]
    b_down: np.ndarray       # [E, D]
    swiglu_limit: np.float32   # gpt-oss's clamped SwiGLU; 0: plain SiLU(gate) * up
    swiglu_alpha: np.float32

    @property
    def nbytes(self) -> int:
        """Bytes a decoded token reads on average: the router, the shared expert and top_k of the
        E experts (the weights held are the router and every expert)."""
        experts = sum(w.nbytes for w in (self.w_gate, self.w_up, self.w_down, self.b_gate, self.b_up, self.b_down))
        shared = 0 if self.shared is None else self.shared.nbytes
        return (self.router.nbytes + self.router_bias.nbytes + shared
                + experts * self.top_k // self.router.shape[0])


def expert(w, e):
    """Expert e of a stacked weight: a view, the weight of one expert's matrix (njit code only)."""


@overload(expert, inline="always")
def _expert_typed(w, e):
    if isinstance(w, types.Array):
        return lambda w, e: w[e]
    if isinstance(w, types.NoneType):   # a QuantizedTensor's high planes where it has none
        return lambda w, e: None
    kind = w.instance_class   # a QuantizedTensor kind (quant_decode.KINDS): the same kind of 2-D views
    return lambda w, e: kind(w.weight[e], w.scales[e], w.biases[e], w.bits, w.group_size, w.bf16, w.values,
                             expert(w.high, e))


@njit(**cpu._jit)
def route(h, router, bias, top_k, top_k_first, renormalize):
    """-> (experts [T, k] int64, probabilities [T, k] float32) of each row of h [T, D], in float32
    (MoEWeights says which way); among equal logits the lower index first."""
    T, E = h.shape[0], router.shape[0]
    logits = np.empty((T, E), np.float32)
    linear(h, router, logits, False)
    if bias.shape[0]:
        logits += bias
    experts = np.empty((T, top_k), np.int64)
    probs = np.empty((T, top_k), np.float32)
    for t in range(T):
        row = logits[t]
        order = np.argsort(-row, kind="mergesort")   # stable: equal logits by index
        if top_k_first:
            top = row[order[0]]
            total = np.float32(0.0)
            for j in range(top_k):
                experts[t, j] = order[j]
                probs[t, j] = np.exp(row[order[j]] - top)
                total += probs[t, j]
            for j in range(top_k):
                probs[t, j] /= total
            continue
        p = np.exp(row - row[order[0]])
        p /= p.sum()
        total = np.float32(0.0)
        for j in range(top_k):
            experts[t, j] = order[j]
            probs[t, j] = p[order[j]]
            total += probs[t, j]
        if renormalize:
            for j in range(top_k):
                probs[t, j] /= total
    return experts, probs


@njit(**cpu._jit)
def moe_mlp(h, w, out, act_sq):
    """out[T, D] = sum over each row's k experts of p * down(silu(gate(h)) * up(h)), h [T, D],
    plus the shared expert's output if there is one.

    act_sq (calibration: shape (0, 0) when not collecting), the rows after the attention's and
    the MLP input's (layer.decoder_layer): 3, the shared expert's down input; 4 + 2e and 5 + 2e,
    expert e's gate/up input and down input over the rows routed to it; 4 + 2E, the number of
    rows routed to each expert."""
    experts, probs = route(h, w.router, w.router_bias, w.top_k, w.top_k_first, w.renormalize)
    out[:] = 0
    if not (h.shape[0] == 1 and act_sq.shape[0] == 0 and decode_routed(h, w, experts[0], probs[0], out)):
        _by_expert(h, w, experts, probs, out, act_sq)
    add_shared(h, w.shared, out, act_sq)


@njit(**cpu._jit, **cpu.INNER)
def _by_expert(h, w, experts, probs, out, act_sq):
    """out += each row's experts' outputs, the rows grouped by expert: each expert routed to
    read once for all its rows."""
    T, D = h.shape
    E = w.router.shape[0]
    F = out_features(expert(w.w_gate, 0))
    # slot[t, e]: where expert e is in row t's list (-1: not routed), so that each row adds its
    # experts' outputs in the order of their indices
    slot = np.full((T, E), -1, np.int64)
    for t in range(T):
        for j in range(w.top_k):
            slot[t, experts[t, j]] = j
    for e in range(E):
        n = 0
        for t in range(T):
            n += slot[t, e] >= 0
        if n == 0:
            continue
        rows = np.empty(n, np.int64)
        n = 0
        for t in range(T):
            if slot[t, e] >= 0:
                rows[n] = t
                n += 1
        x = np.empty((n, D), np.float32)
        for i in range(n):
            x[i] = h[rows[i]]
        mid = np.empty((n, F), np.float32)
        if w.swiglu_limit > 0:
            _clamped_swiglu(x, w, e, mid)
        else:
            gated_mlp(x, expert(w.w_gate, e), expert(w.w_up, e), mid, False)
        if act_sq.shape[0] > 0:
            cpu.add_squares(x, act_sq[4 + 2 * e])
            cpu.add_squares(mid, act_sq[5 + 2 * e])
            act_sq[4 + 2 * E, e] += n
        y = np.empty((n, D), np.float32)
        linear(mid, expert(w.w_down, e), y, False)
        if w.b_down.shape[0]:
            y += w.b_down[e]
        for i in range(n):
            t = rows[i]
            out[t] += probs[t, slot[t, e]] * y[i]


@njit(**cpu._jit, **cpu.INNER)
def _clamped_swiglu(x, w, e, mid):
    """mid = gpt-oss's gating of expert e on rows x: gate and up with their biases, clamped."""
    up = np.empty_like(mid)
    linear(x, expert(w.w_gate, e), mid, False)
    linear(x, expert(w.w_up, e), up, False)
    _clamp(mid, up, w, np.full(mid.shape[0], e, np.int64))


@njit(**cpu._jit, **cpu.INNER)
def _clamp(g, up, w, experts):
    """g = gpt-oss's clamped SwiGLU of gate g and up, row i of expert experts[i] (its biases)."""
    limit, alpha, one = w.swiglu_limit, w.swiglu_alpha, np.float32(1.0)
    for i in range(g.shape[0]):
        e = experts[i]
        for f in range(g.shape[1]):
            a = min(g[i, f] + w.b_gate[e, f], limit)
            u = min(max(up[i, f] + w.b_up[e, f], -limit), limit)
            g[i, f] = (u + one) * a / (one + np.exp(-alpha * a))


def decode_routed(h, w, experts, probs, out):
    """out[0] = moe_mlp's sum over one row's experts, h [1, D], each of gate, up and down for all
    k experts in one parallel loop (quant_decode.expert_products), and True; False (nothing done)
    for experts not stored quantized (njit code only)."""


@overload(decode_routed, inline="always", jit_options=cpu._jit)
def _decode_routed_typed(h, w, experts, probs, out):
    kinds, field = tuple(quant_decode.KINDS.values()), dict(zip(w.fields, w.types))
    if not all(isinstance(field[m], types.BaseNamedTuple) and issubclass(field[m].instance_class, kinds)
               for m in ("w_gate", "w_up", "w_down")):
        return lambda h, w, experts, probs, out: False

    def decode(h, w, experts, probs, out):
        _decode_experts(h, w, experts, probs, out)
        return True
    return decode


@njit(**cpu._jit, **cpu.INNER)
def _decode_experts(h, w, experts, probs, out):
    k, D = experts.shape[0], h.shape[1]
    F = out_features(expert(w.w_gate, 0))
    g, up, y = np.empty((k, F), np.float32), np.empty((k, F), np.float32), np.empty((k, D), np.float32)
    _expert_products(h, w.w_gate, experts, bool(False), g)
    _expert_products(h, w.w_up, experts, bool(False), up)
    if w.swiglu_limit > 0:
        _clamp(g, up, w, experts)
    else:
        cpu.silu_mul(g, up)
    _expert_products(g, w.w_down, experts, bool(True), y)
    for j in np.argsort(experts):   # in the order of the experts' indices, as moe_mlp sums them
        if w.b_down.shape[0]:
            y[j] += w.b_down[experts[j]]
        out[0] += probs[j] * y[j]


@njit(inline="always", **cpu._jit)
def _expert_products(x, w, experts, own_x, out):
    quant_decode.expert_products(quant_decode.round_rows(x, w.group_size, w.bits), x, w, experts, own_x, out)


def add_shared(h, shared, out, act_sq):
    """out += the shared expert's output on h, if there is one (njit code only)."""


@overload(add_shared, inline="always", jit_options=cpu._jit)
def _add_shared_typed(h, shared, out, act_sq):
    if isinstance(shared, types.NoneType):
        return lambda h, shared, out, act_sq: None

    def add(h, shared, out, act_sq):
        T, D = h.shape
        mid = np.empty((T, out_features(shared.w_gate)), np.float32)
        gated_mlp(h, shared.w_gate, shared.w_up, mid, False)
        if act_sq.shape[0] > 0:
            cpu.add_squares(mid, act_sq[3])
        y = np.empty((T, D), np.float32)
        linear(mid, shared.w_down, y, False)
        if shared.gate.shape[0]:
            for t in range(T):
                g = np.float32(0.0)
                for d in range(D):
                    g += h[t, d] * shared.gate[d]
                y[t] *= np.float32(1.0) / (np.float32(1.0) + np.exp(-g))
        out += y
    return add
