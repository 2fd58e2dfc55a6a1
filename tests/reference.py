"""Pure-numpy reference: the oracle for every kernel and for the whole forward pass.

Written from the math (HF's modeling_llama), in float64, with no cache: each call recomputes the
whole sequence.
"""
import dataclasses
import math

import numpy as np

from nibble.formats.config import ModelConfig
from nibble.formats.half import HalfTensor


def rmsnorm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def layernorm(x, w, b, eps):
    x = x.astype(np.float64)
    centered = x - x.mean(-1, keepdims=True)
    return centered / np.sqrt((centered * centered).mean(-1, keepdims=True) + eps) * w + b


def gelu(x):
    """GELU exactly (erf), as BERT's hidden_act "gelu"."""
    return 0.5 * x * (1 + np.vectorize(math.erf)(np.asarray(x, np.float64) / math.sqrt(2)))


def silu(x):
    return x / (1 + np.exp(-x))


def gelu_tanh(x):
    """GELU's tanh approximation (PyTorch's approximate="tanh")."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def moe_mlp(h, router, w_gate, w_up, w_down, top_k, renormalize=False, top_k_first=False,
            router_bias=None, shared=None, biases=None, swiglu=None):
    """A mixture of experts' MLP on h [T, D] (HF's Qwen3MoeSparseMoeBlock and its kin): the
    router's logits (plus router_bias), softmax over them and the k most probable experts
    (renormalised over the k if asked), or if top_k_first the k largest logits and a softmax over
    those (Granite's and gpt-oss's routers); the sum of the experts' SwiGLU MLPs weighted by
    those probabilities. Stacked weights: [E, F, D], [E, D, F]. shared: (w_gate, w_up, w_down,
    gate [D] or None), an expert that sees every row, its output times sigmoid(h . gate).
    gpt-oss's experts: biases = (b_gate [E, F], b_up, b_down [E, D]), swiglu = (limit, alpha),
    its clamped gating (HF's GptOssExperts._apply_gate)."""
    h = h.astype(np.float64)
    mlp = lambda x, g, u, d: (silu(x @ g.T) * (x @ u.T)) @ d.T
    if swiglu is not None:
        limit, alpha = swiglu

        def mlp(x, g, u, d, e=None):
            gate = np.minimum(x @ g.T + biases[0][e], limit)
            up = np.clip(x @ u.T + biases[1][e], -limit, limit)
            return ((up + 1) * gate / (1 + np.exp(-alpha * gate))) @ d.T + biases[2][e]
    logits = h @ router.T + (0.0 if router_bias is None else router_bias)
    out = np.zeros_like(h)
    for t in range(len(h)):
        chosen = np.argsort(-logits[t], kind="stable")[:top_k]
        if top_k_first:
            weights = np.exp(logits[t, chosen] - logits[t, chosen].max())
            weights /= weights.sum()
        else:
            p = np.exp(logits[t] - logits[t].max())
            p /= p.sum()
            weights = p[chosen] / (p[chosen].sum() if renormalize else 1.0)
        for e, pe in sorted(zip(chosen, weights)):
            out[t] += pe * (mlp(h[t], w_gate[e], w_up[e], w_down[e]) if swiglu is None else
                            mlp(h[t], w_gate[e], w_up[e], w_down[e], e))
    if shared is not None:
        g, u, d, gate = shared
        y = mlp(h, g, u, d)
        out += y if gate is None else y / (1 + np.exp(-(h @ gate)))[:, None]
    return out


def inv_frequencies(c: ModelConfig, seq_len: int):
    """[dim/2] inverse frequencies and the factor on cos and sin for a sequence of seq_len tokens,
    written as HF's _compute_*_parameters do it, independently of runner/rope.py (dim: the
    rotated dims of a head, fewer with phi3's partial_rotary_factor)."""
    dim, base = int(c.head_dim * (c.partial_rotary_factor or 1.0)), c.rope_theta
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    s = c.rope_scaling or {"rope_type": "default"}
    kind = s["rope_type"]
    if kind == "linear":
        return inv_freq / s["factor"], 1.0
    if kind == "llama3":
        low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
        smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
            s["high_freq_factor"] - s["low_freq_factor"])
        smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(s, dim, base)
    if kind == "longrope":
        original = s["original_max_position_embeddings"]
        factor = s.get("factor") or c.max_position_embeddings / original
        attention_factor = s.get("attention_factor") or (
            1.0 if factor <= 1.0 else np.sqrt(1 + np.log(factor) / np.log(original)))
        ext_factors = np.array(s["long_factor"] if seq_len > original else s["short_factor"])
        return 1.0 / (ext_factors * base ** (np.arange(0, dim, 2) / dim)), attention_factor
    return inv_freq, 1.0


def _yarn(s: dict, dim: int, base: float):
    factor = s["factor"]
    original = s["original_max_position_embeddings"]

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * np.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = get_mscale(factor, s["mscale"]) / get_mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = get_mscale(factor)

    def find_correction_dim(num_rotations):
        return (dim * np.log(original / (num_rotations * 2 * np.pi))) / (2 * np.log(base))

    low = find_correction_dim(s.get("beta_fast") or 32)
    high = find_correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low + (low == high) * 0.001), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2) / dim)
    extrapolation = 1 - ramp
    return (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation, attention_factor


def rope_frequencies(c: ModelConfig, positions):
    """[T, hd/2] inverse frequencies of each position and the factor on cos and sin: for position
    p, what HF uses when the sequence is p + 1 long (longrope switches factors there)."""
    per_position = [inv_frequencies(c, p + 1) for p in positions]
    return np.array([f for f, _ in per_position]), per_position[0][1]


def rotate(x, positions, inv_freq, scale=1.0):
    """x [T, H, hd] rotate-half RoPE at the given positions ([T], or [T, r/2]: each pair's own,
    as multimodal RoPE's); inv_freq [r/2] or [T, r/2] rotates the first r dims of each head and
    passes the others (partial rotary); cos and sin multiplied by `scale` (HF's
    attention_scaling)."""
    ang = (positions if positions.ndim == 2 else positions[:, None]) * inv_freq   # [T, r/2]
    cos, sin = scale * np.cos(ang)[:, None], scale * np.sin(ang)[:, None]
    half = ang.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def attention(q, k, v, positions, window=0, scale=None, sinks=None):
    """q [T, H, hd], k/v [S, Hkv, hd] for key positions 0..S-1; causal; scores times `scale`
    (default: 1 / sqrt(hd)); sinks [H]: a logit per head in every row's softmax, with no value
    (HF's gpt-oss: a column joined to the scores and dropped after the softmax)."""
    H, Hkv = q.shape[1], k.shape[1]
    k = np.repeat(k, H // Hkv, axis=1)
    v = np.repeat(v, H // Hkv, axis=1)
    s = np.einsum("thd,shd->hts", q, k) * (scale or 1 / np.sqrt(q.shape[-1]))
    keys = np.arange(k.shape[0])
    mask = keys[None, :] > positions[:, None]
    if window:
        mask |= keys[None, :] <= positions[:, None] - window
    s = np.where(mask[None], -np.inf, s)
    if sinks is not None:
        s = np.concatenate([s, np.broadcast_to(sinks[:, None, None], (*s.shape[:2], 1))], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p[..., :k.shape[0]], v)


def paged(cache, scales, table, length, keys=False):
    """[length, Hkv, hd] float64: positions 0..length-1 of one sequence, read through its block
    table from a cache [blocks, Hkv, BLOCK, hd] (keys: [blocks, Hkv, hd, BLOCK]) times its scales
    [blocks, Hkv, BLOCK]."""
    blocks = cache[table].astype(np.float64)
    if keys:
        blocks = blocks.swapaxes(2, 3)
    blocks = blocks * scales[table][..., None]   # [n, Hkv, BLOCK, hd]
    n, Hkv, block, hd = blocks.shape
    return blocks.transpose(0, 2, 1, 3).reshape(n * block, Hkv, hd)[:length]


def forward(config: ModelConfig, tensors: dict, tokens, inputs: dict | None = None) -> np.ndarray:
    """logits [T, V] for the whole sequence, float64. `inputs`, if given, receives the input
    activations [T, K] of every linear layer under its weight's name."""
    if config.model_type == "gemma3_text":
        return gemma3_forward(config, tensors, tokens, inputs)
    c = config
    W = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    H, Hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    T = len(tokens)
    pos = np.arange(T)
    inv_freq, scale = rope_frequencies(c, pos)
    # Granite's multipliers (1 for the others)
    residual = getattr(c, "residual_multiplier", 1.0)
    x = W["model.embed_tokens.weight"][np.asarray(tokens)] * getattr(c, "embedding_multiplier", 1.0)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        def lin(h, n):
            if inputs is not None:
                inputs[p + n + ".weight"] = h
            return h @ W[p + n + ".weight"].T + W.get(p + n + ".bias", 0.0)
        h = rmsnorm(x, W[p + "input_layernorm.weight"], c.rms_norm_eps)
        if p + "self_attn.qkv_proj.weight" in W:   # phi3: one matrix, its output sliced as HF does
            q, k, v = np.split(lin(h, "self_attn.qkv_proj"), [H * hd, (H + Hkv) * hd], axis=-1)
        else:
            q, k, v = (lin(h, f"self_attn.{n}_proj") for n in "qkv")
        if p + "self_attn.q_norm.weight" in W:   # RMSNorm before RoPE: over each head (qwen3) or row (olmoe)
            q_norm, k_norm = W[p + "self_attn.q_norm.weight"], W[p + "self_attn.k_norm.weight"]
            q = rmsnorm(q.reshape(-1, len(q_norm)), q_norm, c.rms_norm_eps)
            k = rmsnorm(k.reshape(-1, len(k_norm)), k_norm, c.rms_norm_eps)
        q, k, v = q.reshape(T, H, hd), k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd)
        if c.rope_layers[i]:   # smollm3's NoPE layers skip it
            q, k = rotate(q, pos, inv_freq, scale), rotate(k, pos, inv_freq, scale)
        a = attention(q, k, v, pos, c.windows[i], getattr(c, "attention_multiplier", None),
                      W.get(p + "self_attn.sinks")).reshape(T, H * hd)
        x = x + residual * lin(a, "self_attn.o_proj")
        h = rmsnorm(x, W[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        moe = _moe(c, W, p)
        if moe is not None:
            x = x + residual * moe_mlp(h, **moe)
            continue
        if p + "mlp.gate_up_proj.weight" in W:   # phi3: gate and up in one matrix, HF's chunk(2)
            gate, up = np.split(lin(h, "mlp.gate_up_proj"), 2, axis=-1)
        else:
            gate, up = lin(h, "mlp.gate_proj"), lin(h, "mlp.up_proj")
        x = x + lin(silu(gate) * up, "mlp.down_proj")
    x = rmsnorm(x, W["model.norm.weight"], c.rms_norm_eps)
    head = W["model.embed_tokens.weight"] if c.tie_word_embeddings else W["lm_head.weight"]
    return x @ head.T / getattr(c, "logits_scaling", 1.0)


def encode(config: ModelConfig, tensors: dict, tokens, types=None) -> np.ndarray:
    """BERT's last hidden states [T, D] of one text (HF's BertModel, no pooler), float64: every
    token attends to every other."""
    c = config
    W = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    T, H, hd, eps = len(tokens), c.num_attention_heads, c.head_dim, c.rms_norm_eps
    x = (W["embeddings.word_embeddings.weight"][np.asarray(tokens)] + W["embeddings.position_embeddings.weight"][:T]
         + W["embeddings.token_type_embeddings.weight"][np.zeros(T, int) if types is None else np.asarray(types)])
    x = layernorm(x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], eps)
    for i in range(c.num_hidden_layers):
        p = f"encoder.layer.{i}."
        lin = lambda h, n: h @ W[p + n + ".weight"].T + W[p + n + ".bias"]
        q, k, v = (lin(x, f"attention.self.{n}").reshape(T, H, hd) for n in ("query", "key", "value"))
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("hts,shd->thd", a / a.sum(-1, keepdims=True), v).reshape(T, H * hd)
        x = layernorm(x + lin(a, "attention.output.dense"), W[p + "attention.output.LayerNorm.weight"],
                      W[p + "attention.output.LayerNorm.bias"], eps)
        x = layernorm(x + lin(gelu(lin(x, "intermediate.dense")), "output.dense"), W[p + "output.LayerNorm.weight"],
                      W[p + "output.LayerNorm.bias"], eps)
    return x


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 experts [E, out, in/32, 16] codes and [E, out, in/32] exponents -> [E, out, in]:
    byte j of a block holds inputs 2j (low nibble) and 2j + 1 (high), each E2M1[code] * 2^(e - 127)."""
    codes = blocks.astype(np.uint8)
    values = E2M1[np.stack([codes & 15, codes >> 4], -1)].reshape(*codes.shape[:-1], 32)
    return (values * np.exp2(np.asarray(scales, np.float64) - 127)[..., None]).reshape(*codes.shape[:-2], -1)


def _moe(c: ModelConfig, W: dict, p: str) -> dict | None:
    """moe_mlp's arguments for block p's mixture of experts, as HF's modeling files name its
    tensors and read its config; None for a dense MLP."""
    k = getattr(c, "num_experts_per_tok", None)
    if c.model_type == "gpt_oss":   # interleaved gate/up columns, matrices stored [in, out]
        m = p + "mlp."
        rows = lambda name: (mxfp4(W[name + "_blocks"], W[name + "_scales"]) if name + "_blocks" in W
                             else W[name].transpose(0, 2, 1))   # [E, out, in]
        gate_up, b = rows(m + "experts.gate_up_proj"), W[m + "experts.gate_up_proj_bias"]
        return dict(router=W[m + "router.weight"], router_bias=W[m + "router.bias"], w_gate=gate_up[:, ::2],
                    w_up=gate_up[:, 1::2], w_down=rows(m + "experts.down_proj"), top_k=k,
                    top_k_first=True, biases=(b[:, ::2], b[:, 1::2], W[m + "experts.down_proj_bias"]),
                    swiglu=(c.swiglu_limit, getattr(c, "swiglu_alpha", 1.702)))
    if c.model_type in ("granitemoe", "granitemoeshared"):   # fused: gate's rows then up's; top k, then softmax
        m = p + "block_sparse_moe."
        gate, up = np.split(W[m + "input_linear.weight"], 2, axis=1)
        shared = None
        if p + "shared_mlp.input_linear.weight" in W:
            sg, su = np.split(W[p + "shared_mlp.input_linear.weight"], 2, axis=0)
            shared = (sg, su, W[p + "shared_mlp.output_linear.weight"], None)
        return dict(router=W[m + "router.layer.weight"], w_gate=gate, w_up=up, w_down=W[m + "output_linear.weight"],
                    top_k=k, top_k_first=True, shared=shared)
    module, names = "mlp.", ("gate_proj", "up_proj", "down_proj")
    if c.model_type == "mixtral":
        module, names = "block_sparse_moe.", ("w1", "w3", "w2")
    router = W.get(p + module + "gate.weight")
    if router is None:
        return None
    stacked = lambda n: np.stack([W[f"{p}{module}experts.{e}.{n}.weight"] for e in range(len(router))])
    shared = None
    if c.model_type == "qwen2_moe":
        shared = (*(W[f"{p}mlp.shared_expert.{n}.weight"] for n in names),
                  W[p + "mlp.shared_expert_gate.weight"][0])
    return dict(router=router, w_gate=stacked(names[0]), w_up=stacked(names[1]), w_down=stacked(names[2]),
                top_k=k, renormalize=c.model_type == "mixtral" or c.norm_topk_prob, shared=shared)


def gemma3_forward(c: ModelConfig, tensors: dict, tokens, inputs: dict | None = None) -> np.ndarray:
    """forward() for Gemma 3, from HF's modeling_gemma3: norms scale by (1 + w) and four of them
    wrap each block's attention and MLP, q/k norms, GELU-gated MLP, embeddings times sqrt(D) in
    the checkpoint's dtype, scores times query_pre_attn_scalar^-0.5, local RoPE in sliding layers."""
    W = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    H, Hkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    T = len(tokens)
    pos = np.arange(T)
    local = dataclasses.replace(c, rope_theta=c.rope_local_base_freq, rope_scaling=None)
    freqs = {"full_attention": rope_frequencies(c, pos), "sliding_attention": rope_frequencies(local, pos)}
    norm = lambda x, name: rmsnorm(x, 1 + W[name], eps)
    x = W["model.embed_tokens.weight"][np.asarray(tokens)] * _embed_scale(c, tensors)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        def lin(h, n):
            if inputs is not None:
                inputs[p + n + ".weight"] = h
            return h @ W[p + n + ".weight"].T
        inv_freq, scale = freqs[c.layer_types[i]]
        h = norm(x, p + "input_layernorm.weight")
        q = norm(lin(h, "self_attn.q_proj").reshape(T, H, hd), p + "self_attn.q_norm.weight")
        k = norm(lin(h, "self_attn.k_proj").reshape(T, Hkv, hd), p + "self_attn.k_norm.weight")
        q, k = rotate(q, pos, inv_freq, scale), rotate(k, pos, inv_freq, scale)
        v = lin(h, "self_attn.v_proj").reshape(T, Hkv, hd)
        a = attention(q, k, v, pos, c.windows[i], c.query_pre_attn_scalar ** -0.5).reshape(T, H * hd)
        x = x + norm(lin(a, "self_attn.o_proj"), p + "post_attention_layernorm.weight")
        h = norm(x, p + "pre_feedforward_layernorm.weight")
        mlp = lin(gelu_tanh(lin(h, "mlp.gate_proj")) * lin(h, "mlp.up_proj"), "mlp.down_proj")
        x = x + norm(mlp, p + "post_feedforward_layernorm.weight")
    x = norm(x, "model.norm.weight")
    head = W["model.embed_tokens.weight"] if c.tie_word_embeddings else W["lm_head.weight"]
    return x @ head.T


def _embed_scale(c: ModelConfig, tensors: dict) -> float:
    """sqrt(hidden_size) rounded as transformers rounds it to the weights' dtype: to 8 significant
    bits for bf16, 11 for f16, 24 for float32."""
    embed = tensors["model.embed_tokens.weight"]
    dtype = ("bfloat16" if embed.bf16 else "float16") if isinstance(embed, HalfTensor) else embed.dtype.name
    bits = {"bfloat16": 8, "float16": 11}.get(dtype, 24)
    mantissa, exponent = np.frexp(np.sqrt(c.hidden_size))
    return np.ldexp(np.round(mantissa * 2 ** bits) / 2 ** bits, exponent)


def projection_inputs(config: ModelConfig, tensors: dict, tokens) -> dict[str, np.ndarray]:
    inputs = {}
    forward(config, tensors, tokens, inputs)
    return inputs


def quantize_blocks_int8(x):
    """x float32 [T, K] -> (xq [T, K] integers in -127..127, dx float32 [T, K/32]): llama.cpp's Q8
    blocks, one scale per 32 (max |x| / 127), rounded half to even, in float32 as the kernel."""
    blocks = x.reshape(x.shape[0], -1, 32)
    top = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, np.float32(127) / top, np.float32(0)).astype(np.float32)
    xq = np.rint(blocks * inv[..., None]).reshape(x.shape)
    return xq, (top / np.float32(127)).astype(np.float32)


def int8_product(x, q, scales, biases, G):
    """x [T, K] @ W.T as the int8 kernels (decode and prefill) compute it, W = scales * q + biases by groups of G
    (q: the integers [N, K]): exact integer sums per block of 32, then sum_b s dx isum + sum_g b xs
    with xs the sums of the rounded x (dx xq), in float64: the rounded x times W."""
    T, K = x.shape
    xq, dx = quantize_blocks_int8(x)
    u = min(G, 32)   # weights summed as integers: a block, or a group of 16 (two a block)
    units = xq.reshape(T, -1, u).astype(np.int64)                                # [T, K/u, u]
    isum = np.einsum("tbk,nbk->tnb", units, q.reshape(q.shape[0], -1, u).astype(np.int64))   # exact
    s = np.repeat(scales.astype(np.float64), G // u, axis=1)                     # [N, K/u]
    dxu = np.repeat(dx.astype(np.float64), 32 // u, axis=1)                      # [T, K/u]
    xs = (units.sum(-1) * dxu).reshape(T, -1, G // u).sum(-1)                    # [T, K/G]
    return (isum * s[None] * dxu[:, None]).sum(-1) + xs @ biases.astype(np.float64).T


# --- quant/search.py's scale search, in numpy: all groups of a block at once ---

def search_affine(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, imp: np.ndarray | None,
                  nmax: int, rmin: float = -1.0, rdelta: float = 0.4, nstep: int = 5,
                  refine: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """quant.search.search_affine, all groups of x at once as numpy arrays."""
    shape = x.shape[:-1]
    g = x.shape[-1]
    x = np.asarray(x, dtype=np.float32).reshape(-1, g)                    # [N, G]
    lo = np.asarray(lo, dtype=np.float32).reshape(-1)                      # [N]
    span = np.asarray(hi, dtype=np.float32).reshape(-1) - lo               # [N]
    span[span == 0] = 1  # constant group: every level 0, bias lo
    # Fit u = (x - lo)/span in [0, 1]: levels are then round(u * f) for a scalar f per step
    # (cheap), and the closed-form sums stay well clear of float32 cancellation.
    u = (x - lo[:, None]) / span[:, None]                                  # [N, G]
    w = None if imp is None else np.ascontiguousarray(
        np.broadcast_to(np.asarray(imp, np.float32), shape + (g,)).reshape(-1, g))
    fit = _WeightedFit(u, w)

    levels = np.empty_like(u)                                              # [N, G] scratch
    cap = np.full_like(u, nmax)  # np.minimum against an array is several times faster than a scalar
    best_s = np.full_like(lo, 1 / nmax)  # min/max rounding, in units of span
    best_b = np.zeros_like(lo)
    best_err = fit.error(_levels(u, nmax, nmax, cap, levels), best_s, best_b)
    for i in range(nstep + 1):
        _keep_better(fit.solve(_levels(u, nmax + rmin + rdelta * i, nmax, cap, levels)),
                     best_s, best_b, best_err)
    for _ in range(refine):
        # Re-round onto the winner's own grid, bias included: a Lloyd step.
        safe = np.where(best_s != 0, best_s, np.float32(1))[:, None]
        np.clip(np.rint((u - best_b[:, None]) / safe), 0, nmax, out=levels)
        _keep_better(fit.solve(levels), best_s, best_b, best_err)
    return (best_s * span).reshape(shape), (best_b * span + lo).reshape(shape)


class _WeightedFit:
    """Weighted least squares of u [N, G] against integer levels l [N, G], per group."""

    def __init__(self, u: np.ndarray, w: np.ndarray | None):
        self.w = w
        self.ones = np.ones(u.shape[1], dtype=np.float32)  # row sums as BLAS matrix-vector products
        self.sw = np.float32(u.shape[1]) if w is None else w @ self.ones      # sum w      [N]
        self.wu = u if w is None else w * u                                  # w u     [N, G]
        self.swu = self.wu @ self.ones                                       # sum w u    [N]
        self.swuu = np.einsum("ij,ij->i", self.wu, u)                        # sum w u^2  [N]

    def _sums(self, l: np.ndarray):
        wl = l if self.w is None else self.w * l
        return wl @ self.ones, np.einsum("ij,ij->i", wl, l), np.einsum("ij,ij->i", self.wu, l)

    def solve(self, l: np.ndarray):
        """(s, b, E) minimising E = sum w (u - s l - b)^2; E = inf where l is degenerate."""
        sl, sll, sul = self._sums(l)
        det = self.sw * sll - sl * sl
        ok = det > 0
        det[~ok] = 1
        s = (self.sw * sul - self.swu * sl) / det
        b = (sll * self.swu - sl * sul) / det
        err = self._error(sl, sll, sul, s, b)
        err[~ok] = np.inf
        return s, b, err

    def error(self, l: np.ndarray, s: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._error(*self._sums(l), s, b)

    def _error(self, sl, sll, sul, s, b):
        # sum w (s l + b - u)^2 expanded, from sums already at hand instead of another pass.
        return (s * s * sll + 2 * s * b * sl + b * b * self.sw
                - 2 * s * sul - 2 * b * self.swu + self.swuu)


def _levels(u: np.ndarray, f: float, nmax: int, cap: np.ndarray, out: np.ndarray) -> np.ndarray:
    """round(u * f) clipped to nmax (cap: nmax everywhere), written into out; u is in [0, 1]."""
    np.multiply(u, np.float32(f), out=out)
    np.rint(out, out=out)
    if f >= nmax + 0.5:  # below that nothing rounds past the top level
        np.minimum(out, cap, out=out)
    return out


def _keep_better(candidate, best_s, best_b, best_err) -> None:
    """Overwrite the best (s, b, E) in place wherever the candidate's E is lower."""
    s, b, err = candidate
    better = err < best_err
    np.copyto(best_s, s, where=better)
    np.copyto(best_b, b, where=better)
    np.copyto(best_err, err, where=better)


def gemma3_pixels(rgb: np.ndarray, size: int) -> np.ndarray:
    """An image's RGB pixels [H, W, 3] uint8 as Gemma 3's image processor gives them to the tower:
    resized to size x size (PIL's bilinear), scaled to [-1, 1] ((x / 255 - 0.5) / 0.5), [3, size, size]."""
    from PIL import Image
    resized = np.asarray(Image.fromarray(rgb).resize((size, size), Image.Resampling.BILINEAR), np.float64)
    return ((resized / 255 - 0.5) / 0.5).transpose(2, 0, 1)


def siglip_tower(vision: dict, W: dict, pixels: np.ndarray, prefix="model.vision_tower.") -> np.ndarray:
    """A SigLIP vision tower's last hidden states [patches, D] (post-LayerNorm) of pixels [3, H, W]:
    patches through the convolution (one patch a row), learned positions, pre-LayerNorm layers of
    bidirectional attention and a GELU (tanh) MLP."""
    p, heads, eps = vision["patch_size"], vision["num_attention_heads"], vision["layer_norm_eps"]
    f = lambda name: W[prefix + name].astype(np.float64)
    C, H, Wd = pixels.shape
    gh, gw = H // p, Wd // p
    patches = pixels.reshape(C, gh, p, gw, p).transpose(1, 3, 0, 2, 4).reshape(gh * gw, C * p * p)
    conv = f("embeddings.patch_embedding.weight")
    x = patches @ conv.reshape(conv.shape[0], -1).T + f("embeddings.patch_embedding.bias")
    x = x + f("embeddings.position_embedding.weight")[:gh * gw]
    N, D = x.shape
    hd = D // heads
    for i in range(vision["num_hidden_layers"]):
        layer = lambda name: f(f"encoder.layers.{i}.{name}")
        h = layernorm(x, layer("layer_norm1.weight"), layer("layer_norm1.bias"), eps)
        q, k, v = ((h @ layer(f"self_attn.{n}_proj.weight").T + layer(f"self_attn.{n}_proj.bias"))
                   .reshape(N, heads, hd).transpose(1, 0, 2) for n in "qkv")
        scores = q @ k.transpose(0, 2, 1) * hd ** -0.5
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        att = (scores / scores.sum(-1, keepdims=True)) @ v
        x = x + att.transpose(1, 0, 2).reshape(N, D) @ layer("self_attn.out_proj.weight").T + layer("self_attn.out_proj.bias")
        h = layernorm(x, layer("layer_norm2.weight"), layer("layer_norm2.bias"), eps)
        h = gelu_tanh(h @ layer("mlp.fc1.weight").T + layer("mlp.fc1.bias"))
        x = x + h @ layer("mlp.fc2.weight").T + layer("mlp.fc2.bias")
    return layernorm(x, f("post_layernorm.weight"), f("post_layernorm.bias"), eps)


def gemma3_projector(config: dict, W: dict, hidden: np.ndarray, prefix="model.multi_modal_projector.") -> np.ndarray:
    """Gemma 3's image tokens [mm_tokens_per_image, text hidden] from the tower's states [patches, D]:
    the patch grid average-pooled to the tokens' grid, Gemma's RMSNorm (x (1 + w)), the projection."""
    vision = config["vision_config"]
    side = vision["image_size"] // vision["patch_size"]
    tokens = int(round(config["mm_tokens_per_image"] ** 0.5))
    k = side // tokens
    D = hidden.shape[1]
    pooled = hidden.reshape(tokens, k, tokens, k, D).mean(axis=(1, 3)).reshape(tokens * tokens, D)
    normed = rmsnorm(pooled, 1 + W[prefix + "mm_soft_emb_norm.weight"].astype(np.float64), vision["layer_norm_eps"])
    return normed @ W[prefix + "mm_input_projection_weight"].astype(np.float64)
