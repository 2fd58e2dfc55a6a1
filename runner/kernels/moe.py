"""A mixture-of-experts MLP: a router picks k of E experts for each row, and the row's output is
their gated MLPs' outputs weighted by the router's probabilities.

The experts are stacked: each of gate, up and down is one weight with a leading expert axis
([E, F, D] and [E, D, F]: float32 arrays, or a QuantizedTensor whose arrays have that axis), and
an expert is a view of its part (`expert`). The rows are grouped by expert: an expert that several
rows are routed to is read once for them all (their rows gathered into one matrix, a prefill's
or a batch's), and one no row is routed to is not read at all: in a memory-mapped file its pages
are never touched. Each row sums its experts' outputs in the order of their indices, as
transformers' loop over the experts hit does.
"""
from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.extending import overload

from . import cpu
from .linear import Weight, gated_mlp, linear, out_features


class MoEWeights(NamedTuple):
    """The experts of one MoE MLP and their router (module level: cached kernels name the type)."""
    router: np.ndarray   # [E, D] float32: the router's logits are h @ router.T
    w_gate: Weight       # [E, F, D], stacked
    w_up: Weight         # [E, F, D]
    w_down: Weight       # [E, D, F]
    top_k: int           # experts a row is routed to
    renormalize: bool    # the k probabilities divided by their sum (softmax over all E, then top k)

    @property
    def nbytes(self) -> int:
        """Bytes a decoded token reads on average: the router, and top_k of the E experts (the
        weights held are the router and every expert)."""
        experts = sum(w.nbytes for w in self[1:4])
        return self.router.nbytes + experts * self.top_k // self.router.shape[0]


def expert(w, e):
    """Expert e of a stacked weight: a view, the weight of one expert's matrix (njit code only)."""


@overload(expert, inline="always")
def _expert_typed(w, e):
    if isinstance(w, types.Array):
        return lambda w, e: w[e]
    kind = w.instance_class   # a QuantizedTensor kind (quant_decode.KINDS): the same kind of 2-D views
    return lambda w, e: kind(w.weight[e], w.scales[e], w.biases[e], w.bits, w.group_size, w.bf16)


@njit(**cpu._jit)
def route(h, router, top_k, renormalize):
    """-> (experts [T, k] int64, probabilities [T, k] float32) of each row of h [T, D]: softmax
    over the router's logits in float32, the k largest (the lower index first among equals),
    renormalised over the k if asked."""
    T, E = h.shape[0], router.shape[0]
    logits = np.empty((T, E), np.float32)
    linear(h, router, logits, False)
    experts = np.empty((T, top_k), np.int64)
    probs = np.empty((T, top_k), np.float32)
    for t in range(T):
        row = logits[t]
        p = np.exp(row - row.max())
        p /= p.sum()
        order = np.argsort(-p, kind="mergesort")   # stable: equal probabilities by index
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
def moe_mlp(h, w, out):
    """out[T, D] = sum over each row's k experts of p * down(silu(gate(h)) * up(h)), h [T, D]."""
    T, D = h.shape
    experts, probs = route(h, w.router, w.top_k, w.renormalize)
    E = w.router.shape[0]
    F = out_features(expert(w.w_gate, 0))
    out[:] = 0
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
        gated_mlp(x, expert(w.w_gate, e), expert(w.w_up, e), mid, False)
        y = np.empty((n, D), np.float32)
        linear(mid, expert(w.w_down, e), y, False)
        for i in range(n):
            t = rows[i]
            out[t] += probs[t, slot[t, e]] * y[i]
