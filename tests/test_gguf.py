"""GGUF import: tensors (repacked exactly, or read as float), names, the q/k un-permute and the
config, on synthetic files and SmolLM2."""

import re
import warnings

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from tokenizers import pre_tokenizers

import nibble.formats.gguf as fg
from nibble.formats import gguf_blocks
from nibble.formats.errors import FormatError
from nibble.formats.gguf import import_gguf
from nibble.formats.half import HalfTensor
from nibble.quant.affine import QuantizedTensor, dequantize
from nibble.quant.convert import read_linear
from tests.tiny import tiny_config, tiny_tensors


# HF name pieces -> llama.cpp's, written out here independently of formats/gguf.py.
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}

BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"] + BYTES + ["Ġt", "he", "Ġthe"]
TYPES = [3, 3, 3, 4] + [1] * (len(BYTES) + 3)   # CONTROL x3, USER_DEFINED, NORMAL
MERGES = ["Ġ t", "h e", "Ġt he"]


@pytest.fixture(scope="module")
def smollm2_path(smollm2_gguf):
    return smollm2_gguf


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return import_gguf(smollm2_gguf).model


@pytest.fixture(scope="module")
def smollm2_float(smollm2_gguf):
    return import_gguf(smollm2_gguf, repack_blocks=False).model


def permute(w, n_head, n_head_kv=None):
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes q and k."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{BLOCK[module]}.{kind}"


def write_gguf(path, tensors, arch="llama", config=None, meta=None, tokenizer="gpt2", split_max_tensors=0):
    """A GGUF file: `tensors` maps GGUF names to float arrays or (raw bytes, type) pairs; split
    into parts of split_max_tensors each (as convert_hf_to_gguf.py --split-max-tensors), if given."""
    c = config or tiny_config(vocab_size=len(TOKENS))
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages[0]['content'] }}")
    for key, value in (meta or {}).items():
        w.add_key_value(key, value[0], value[1])
    return written(w, tensors, path)


def written(w: gguf.GGUFWriter, tensors: dict, path):
    """`w` with `tensors` (arrays, or (raw data, GGML type) pairs) added, written to `path` and closed."""
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_tensors(hf: dict, config, permuted=True) -> dict:
    """HF tensors as convert_hf_to_gguf.py stores them: renamed, q and k permuted for llama."""
    out = {}
    for name, w in hf.items():
        if permuted and "q_proj" in name:
            w = permute(w, config.num_attention_heads, config.num_attention_heads)
        elif permuted and "k_proj" in name:
            w = permute(w, config.num_attention_heads, config.num_key_value_heads)
        out[gguf_name(name)] = w
    return out


def moe_tensors(config, experts: int, width: int, stack=lambda name, w: w, seed=0) -> dict:
    """A qwen3moe model as convert_hf_to_gguf.py writes it: qwen3's attention and norms, and in
    every block a router [E, D] and the experts stacked: gate and up [E, F, D], down [E, D, F]
    (numpy's order; `stack` makes each float stack what the file holds: an array or (raw, type))."""
    rng = np.random.default_rng(seed)
    D = config.hidden_size
    out = {n: w for n, w in llama_cpp_tensors(tiny_tensors(config, seed), config, permuted=False).items()
           if n.split(".")[-2] not in ("ffn_gate", "ffn_up", "ffn_down")}   # qwen3's dense MLP
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    for i in range(config.num_hidden_layers):
        out[f"blk.{i}.ffn_gate_inp.weight"] = w(experts, D)
        for kind, shape in (("gate", (experts, width, D)), ("up", (experts, width, D)), ("down", (experts, D, width))):
            name = f"blk.{i}.ffn_{kind}_exps.weight"
            out[name] = stack(name, w(*shape))
    return out


def moe_meta(experts: int, used: int, width: int) -> dict:
    return {f"qwen3moe.{k}": (v, gguf.GGUFValueType.UINT32) for k, v in
            (("expert_count", experts), ("expert_used_count", used), ("expert_feed_forward_length", width))}


def random_stack(rng, w: np.ndarray, qtype) -> tuple[np.ndarray, QType]:
    """Random valid blocks of `qtype` for a stack of w's shape [E, N, K]: bytes [E, N, row bytes]."""
    E, N, K = w.shape
    return random_blocks(rng, E * N, K, qtype, (-3, -2)).reshape(E, N, -1), qtype


def test_permute_reference_order():
    # Two heads of size 4: rope pairs (0, 2) and (1, 3) become adjacent rows in llama.cpp's layout.
    rows = np.arange(8, dtype=np.float32)[:, None]
    assert permute(rows, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert fg._unpermute(permute(rows, 2), 2, "q")[:, 0].tolist() == list(range(8))


def test_llama_roundtrip_undoes_the_permutation(tmp_path):
    config = tiny_config(vocab_size=len(TOKENS), tie_word_embeddings=False)
    hf = tiny_tensors(config)
    md = import_gguf(write_gguf(tmp_path / "m.gguf", llama_cpp_tensors(hf, config), config=config)).model
    assert md.tensors.keys() == hf.keys()
    for name, w in hf.items():
        np.testing.assert_array_equal(md.tensors[name], w, err_msg=name)
        assert md.tensors[name].dtype == np.float32 and not md.tensors[name].flags.writeable
    c = md.config
    assert (c.model_type, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == ("llama", 64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (1e-5, 10000.0, 256)
    assert (c.vocab_size, c.tie_word_embeddings, c.rope_scaling) == (len(TOKENS), False, None)
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)
    assert md.generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    assert md.path == tmp_path / "m.gguf"


@pytest.mark.parametrize("given", [1, 3])
def test_a_split_model_reads_as_one(tmp_path, given):
    """Any part of a model gguf-split wrote names the whole: its tensors are those of all parts."""
    config = tiny_config(vocab_size=len(TOKENS))
    hf = tiny_tensors(config)
    write_gguf(tmp_path / "m.gguf", llama_cpp_tensors(hf, config), config=config, split_max_tensors=7)
    parts = sorted(tmp_path.glob("m-*-of-00003.gguf"))
    assert len(parts) == 3
    md = import_gguf(parts[given - 1]).model
    assert md.tensors.keys() == hf.keys()
    for name, w in hf.items():
        np.testing.assert_array_equal(md.tensors[name], w, err_msg=name)


@pytest.mark.parametrize("damage,match", [
    (lambda parts: parts[1].unlink(), "m-00002-of-00003.gguf, part of the split model m-00001-of-00003.gguf, is missing"),
    (lambda parts: (parts[1].rename(parts[0].with_name("x")), parts[2].rename(parts[1]),
                    parts[0].with_name("x").rename(parts[2])), "m-00002-of-00003.gguf holds split.no 2"),
    (lambda parts: [p.rename(p.with_name(p.name.replace("of-00003", "of-00002"))) for p in parts[:2]],
     "its metadata says it is 3 part(s) of a model, its name 2"),
])
def test_a_split_model_with_a_part_missing_or_misnamed(tmp_path, damage, match):
    config = tiny_config(vocab_size=len(TOKENS))
    write_gguf(tmp_path / "m.gguf", llama_cpp_tensors(tiny_tensors(config), config), config=config,
               split_max_tensors=7)
    damage(sorted(tmp_path.glob("m-*.gguf")))
    with pytest.raises(FormatError, match=re.escape(match)):
        import_gguf(tmp_path / "m-00001-of-00003.gguf" if (tmp_path / "m-00001-of-00003.gguf").exists()
                    else tmp_path / "m-00001-of-00002.gguf")


def test_qwen2_is_not_permuted_and_keeps_biases(tmp_path):
    config = tiny_config("qwen2", vocab_size=len(TOKENS))
    hf = tiny_tensors(config)
    assert "model.layers.0.self_attn.q_proj.bias" in hf
    path = write_gguf(tmp_path / "q.gguf", llama_cpp_tensors(hf, config, permuted=False), "qwen2", config)
    md = import_gguf(path).model
    assert md.tensors.keys() == hf.keys()
    for name, w in hf.items():
        np.testing.assert_array_equal(md.tensors[name], w, err_msg=name)
    assert md.config.model_type == "qwen2" and md.config.attention_bias
    assert not md.config.tie_word_embeddings and "lm_head.weight" in md.tensors


def test_qwen3_keeps_its_q_k_norms_and_head_dim(tmp_path):
    config = tiny_config("qwen3", vocab_size=len(TOKENS))
    hf = tiny_tensors(config)
    path = write_gguf(tmp_path / "q.gguf", llama_cpp_tensors(hf, config, permuted=False), "qwen3", config)
    md = import_gguf(path).model
    assert md.tensors.keys() == hf.keys()
    for name, w in hf.items():
        np.testing.assert_array_equal(md.tensors[name], w, err_msg=name)
    assert (md.config.model_type, md.config.head_dim, md.config.attention_bias) == ("qwen3", 32, False)


def _f16(x):
    return np.asarray(x, np.float16).view(np.uint8).reshape(*np.shape(x), 2)


def numpy_dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    """ggml's block formats, from ggml-quants.c's dequantize_row_*: 32 weights per block."""
    blocks = raw.reshape(raw.shape[0], -1, {QType.Q8_0: 34, QType.Q4_0: 18, QType.Q4_1: 20}[qtype])
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)          # [rows, nb, 1]
    if qtype == QType.Q8_0:
        x = d * blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    else:
        qs = blocks[..., 4:] if qtype == QType.Q4_1 else blocks[..., 2:]     # 16 bytes
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)  # low nibbles first
        if qtype == QType.Q4_1:
            x = d * q + blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        else:
            x = d * (q - 8)
    return x.reshape(raw.shape[0], -1)


# Byte offsets of each block type's float16 fields (d, and m or dmin), from ggml-common.h.
F16_FIELDS = {QType.Q4_0: [0], QType.Q4_1: [0, 2], QType.Q5_0: [0], QType.Q5_1: [0, 2],
              QType.Q8_0: [0], QType.Q4_K: [0, 2], QType.Q5_K: [0, 2], QType.Q6_K: [208], QType.IQ4_NL: [0],
              QType.IQ4_XS: [0], QType.Q2_K: [80, 82], QType.Q3_K: [108], QType.IQ3_S: [0]}
# The block types repacked as integers, not through a table of levels (tests/test_gguf_levels.py)
UNIFORM = [t for t, kind in gguf_blocks.BLOCK_TYPES.items() if kind.values is None]


def random_blocks(rng, rows, cols, qtype, exponents=(-3, -1.3)) -> np.ndarray:
    """Valid blocks of any type: random bytes, with float16 fields of random sign and magnitude
    10**exponents (finite)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    nb = cols // block_size
    raw = rng.integers(0, 256, (rows, nb, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        x = rng.choice([-1, 1], (rows, nb)) * 10 ** rng.uniform(*exponents, (rows, nb))
        raw[..., offset:offset + 2] = _f16(x)
    return raw.reshape(rows, nb * type_size)


@pytest.mark.parametrize("qtype", [QType.IQ2_XXS, QType.IQ3_S, QType.IQ2_XS])
def test_grid_types_are_dequantized(tmp_path, qtype):
    # the IQ types decode through lookup tables that gguf builds on first use
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (4, 256 // block_size * type_size), dtype=np.uint8)
    for row in raw.reshape(-1, type_size):
        row[:2] = _f16([0.01])[0]   # each block's scale d first
    path = write_gguf(tmp_path / "iq.gguf", {"blk.0.ffn_up.weight": (raw, qtype)})
    w = import_gguf(path).model.tensors["model.layers.0.mlp.up_proj.weight"]
    np.testing.assert_array_equal(w, gguf.quants.dequantize(raw, qtype).reshape(4, 256))


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1])
def test_block_types_match_numpy(tmp_path, monkeypatch, qtype):
    monkeypatch.setattr(fg, "_DEQUANT_STEP", 5 * 64)   # several steps, the last one short
    raw = random_blocks(np.random.default_rng(0), 24, 64, qtype)
    path = write_gguf(tmp_path / "b.gguf", {"blk.0.ffn_up.weight": (raw, qtype)})
    md = import_gguf(path, repack_blocks=False).model
    w = md.tensors["model.layers.0.mlp.up_proj.weight"]
    assert w.shape == (24, 64)
    np.testing.assert_array_equal(w, numpy_dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K])
def test_k_quants_match_the_gguf_package(tmp_path, monkeypatch, qtype):
    # No independent decoder here: this checks the stepping and the shapes around gguf's own.
    monkeypatch.setattr(fg, "_DEQUANT_STEP", 3 * 256)
    raw = random_blocks(np.random.default_rng(1), 8, 512, qtype, (-3, -2))
    path = write_gguf(tmp_path / "k.gguf", {"blk.0.ffn_down.weight": (raw, qtype)})
    imported = import_gguf(path, repack_blocks=False)
    w = imported.model.tensors["model.layers.0.mlp.down_proj.weight"]
    assert w.shape == (8, 512) and w.dtype == np.float32
    np.testing.assert_array_equal(w, gguf.quants.dequantize(raw, qtype))
    assert imported.dequantized == ["model.layers.0.mlp.down_proj"]


@pytest.mark.parametrize("qtype", UNIFORM)
@pytest.mark.parametrize("exponents", [(-3, -1.3), (-7, 4.5)], ids=["usual", "wide"])
def test_repack_is_exact(tmp_path, monkeypatch, qtype, exponents):
    """The repacked matrix, dequantized by nibble, is gguf's dequantization bit for bit. "wide"
    scales overflow float16 once multiplied (-8d, -128d): those tensors keep float32 scales."""
    monkeypatch.setattr(gguf_blocks, "_STEP", 5 * 512)   # several steps, the last one short
    raw = random_blocks(np.random.default_rng(2), 24, 512, qtype, exponents)
    imported = import_gguf(write_gguf(tmp_path / "r.gguf", {"blk.0.ffn_up.weight": (raw, qtype)}))
    md = imported.model
    if qtype in (QType.Q3_K, QType.Q6_K) and exponents == (-7, 4.5):   # a d whose -4 d or -32 d is no float16
        assert imported.dequantized == ["model.layers.0.mlp.up_proj"]
        np.testing.assert_array_equal(md.tensors["model.layers.0.mlp.up_proj.weight"],
                                      gguf.quants.dequantize(raw, qtype))
        return
    qt = read_linear(md.tensors, md.config.quantization, "model.layers.0.mlp.up_proj")
    kind = gguf_blocks.BLOCK_TYPES[qtype]
    assert (qt.bits, qt.group_size, qt.shape) == (kind.bits, kind.group_size, (24, 512))
    # Q5's fifth bit, Q6_K's fifth and sixth, in planes beside 4-bit words
    assert qt.integer_bits == {QType.Q5_0: 5, QType.Q5_1: 5, QType.Q5_K: 5, QType.Q6_K: 6}.get(qtype, qt.bits)
    signed = qtype in (QType.Q3_K, QType.Q6_K)
    expected = gguf.quants.dequantize(raw, qtype)
    assert np.isfinite(expected).all()
    assert np.array_equal(dequantize(qt), expected)
    if qtype in (QType.Q4_K, QType.Q5_K):   # the file's two levels: 10 bytes a super-block
        assert qt.scales.shape == qt.biases.shape == (24, 2, 10) and qt.scales.dtype == np.uint8
    elif kind.group_size == 16:   # a float16 and 16 sub-block scales a super-block
        assert qt.scales.shape == qt.biases.shape == (24, 2, 18)
        assert qt.scales.dtype == (np.int8 if signed else np.uint8)
    elif exponents == (-3, -1.3):
        assert qt.scales.dtype == qt.biases.dtype == np.float16   # as few bytes as the GGUF's
    assert imported.types == {"model.layers.0.mlp.up_proj.weight": qtype} and not imported.dequantized


@pytest.mark.parametrize("qtype", [*UNIFORM, QType.IQ3_S])
def test_stacked_experts_are_exact(tmp_path, monkeypatch, qtype):
    """A mixture of experts' stacks [E, N, K] repacked with the leading expert axis on weight,
    scales and biases (a K-quant's two levels too), each expert's matrix gguf's dequantization bit
    for bit; a type not repacked dequantized as a whole; the router float32."""
    monkeypatch.setattr(gguf_blocks, "_STEP", 3 * 256)   # steps that cross from expert to expert
    config = tiny_config("qwen3", vocab_size=len(TOKENS), hidden_size=256, num_hidden_layers=1)
    rng = np.random.default_rng(4)
    raw = moe_tensors(config, 3, 256, lambda name, w: random_stack(rng, w, qtype))
    imported = import_gguf(write_gguf(tmp_path / "moe.gguf", raw, "qwen3moe", config, moe_meta(3, 2, 256)))
    md, p = imported.model, "model.layers.0.mlp."
    assert md.config.model_type == "qwen3_moe"
    np.testing.assert_array_equal(md.tensors[p + "gate.weight"], raw["blk.0.ffn_gate_inp.weight"])
    repacked = qtype in gguf_blocks.BLOCK_TYPES
    for kind in ("gate", "up", "down"):
        path, (data, _) = f"{p}switch_mlp.{kind}_proj", raw[f"blk.0.ffn_{kind}_exps.weight"]
        want = gguf.quants.dequantize(data, qtype)   # [3, 256, 256]
        assert imported.types[f"{path}.weight"] == qtype
        if not repacked:
            assert md.tensors[f"{path}.weight"].dtype == np.float32 and path in imported.dequantized
            np.testing.assert_array_equal(md.tensors[f"{path}.weight"], want)
            continue
        qt = read_linear(md.tensors, md.config.quantization, path)
        assert qt.weight.shape[0] == 3 and qt.shape == (256, 256)
        if gguf_blocks.BLOCK_TYPES[qtype].two_level:
            assert qt.scales.shape == qt.biases.shape == (3, 256, 1, 2 + 256 // qt.group_size)
        for e in range(3):
            one = QuantizedTensor(qt.weight[e], qt.scales[e], qt.biases[e], qt.bits, qt.group_size,
                                  high=None if qt.high is None else qt.high[e])
            np.testing.assert_array_equal(dequantize(one), want[e], err_msg=f"{path} expert {e}")
    assert (imported.dequantized == []) == repacked


def test_repacked_q_k_are_unpermuted(tmp_path):
    # q/k/v Q8_0 and the rest Q4_0: the commonest width is the default, the others get entries.
    config = tiny_config(vocab_size=len(TOKENS), tie_word_embeddings=False)
    hf = tiny_tensors(config)
    raw = {}
    for name, w in llama_cpp_tensors(hf, config).items():
        qtype = QType.Q8_0 if ".attn_q." in name or ".attn_k." in name or ".attn_v." in name else QType.Q4_0
        raw[name] = (gguf.quants.quantize(w, qtype), qtype) if w.ndim == 2 else w
    md = import_gguf(write_gguf(tmp_path / "qk.gguf", raw, config=config)).model
    q = md.config.quantization
    assert (q["bits"], q["group_size"], q["mode"]) == (4, 32, "affine")
    assert {k for k in q if k.startswith("model.")} == {
        f"model.layers.{i}.self_attn.{m}_proj" for i in range(2) for m in "qkv"}
    assert all(q[k] == {"group_size": 32, "bits": 8} for k in q if k.startswith("model."))
    for name, w in hf.items():
        if w.ndim == 1:
            np.testing.assert_array_equal(md.tensors[name], w, err_msg=name)
            continue
        path = name.removesuffix(".weight")
        got = dequantize(read_linear(md.tensors, q, path))
        if "q_proj" in name:
            got = permute(got, config.num_attention_heads)
        elif "k_proj" in name:
            got = permute(got, config.num_attention_heads, config.num_key_value_heads)
        data, qtype = raw[gguf_name(name)]
        np.testing.assert_array_equal(got, gguf.quants.dequantize(data, qtype), err_msg=name)
        assert not md.tensors[name].flags.writeable


def test_float_types(tmp_path):
    # F32 and F16 are the file's memory map; BF16 a HalfTensor of it: nothing widened.
    rng = np.random.default_rng(2)
    f32 = rng.standard_normal((6, 32)).astype(np.float32)
    bf16 = (f32.view(np.uint32) & 0xFFFF0000).view(np.float32)     # exactly representable
    tensors = {"blk.0.ffn_up.weight": f32, "blk.0.ffn_gate.weight": f32.astype(np.float16),
               "blk.0.ffn_down.weight": ((bf16.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8),
                                         QType.BF16)}
    imported = import_gguf(write_gguf(tmp_path / "f.gguf", tensors))
    md, p = imported.model, "model.layers.0.mlp."
    assert md.tensors[p + "up_proj.weight"].dtype == np.float32
    np.testing.assert_array_equal(md.tensors[p + "up_proj.weight"], f32)
    assert md.tensors[p + "gate_proj.weight"].dtype == np.float16
    np.testing.assert_array_equal(md.tensors[p + "gate_proj.weight"], f32.astype(np.float16))
    down = md.tensors[p + "down_proj.weight"]
    assert isinstance(down, HalfTensor) and down.bf16
    np.testing.assert_array_equal(down.widen(), bf16)
    assert md.config.quantization is None and imported.dequantized == []


def test_unsupported_tensor_type(tmp_path):
    path = write_gguf(tmp_path / "i32.gguf", {"blk.0.ffn_up.weight": np.ones((4, 32), np.int32)})
    with pytest.raises(FormatError, match=r"blk\.0\.ffn_up\.weight has type I32.*Q4_1.*IQ4_XS"):
        import_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", {"token_embd.weight": np.ones((4, 8), np.float32)}, arch="gemma2")
    with pytest.raises(FormatError, match="unsupported GGUF architecture 'gemma2'.*llama"):
        import_gguf(path)


def test_unsupported_tokenizer(tmp_path):
    wpm = write_gguf(tmp_path / "wpm.gguf", {}, tokenizer="bert")   # WordPiece
    with pytest.raises(FormatError, match="tokenizer model 'bert'"):
        import_gguf(wpm)


def test_unknown_tensor(tmp_path):
    # a shared expert's gate (qwen2moe's) in a llama file: llama has none
    odd = write_gguf(tmp_path / "odd.gguf", {"blk.0.ffn_gate_inp_shexp.weight": np.ones(8, np.float32)})
    with pytest.raises(FormatError, match="GGUF tensor blk.0.ffn_gate_inp_shexp.weight has no Hugging Face counterpart"):
        import_gguf(odd)


def granite_meta(**values) -> dict:
    """granitemoe's metadata: 3 experts, 2 used, a shared expert 64 wide, logit_scale 2; `values`
    (after "granitemoe.") laid over it, None to leave one out."""
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    meta = {"expert_count": (3, u32), "expert_used_count": (2, u32),
            "expert_shared_feed_forward_length": (64, u32), "logit_scale": (2.0, f32)}
    meta |= {k.replace("__", "."): v for k, v in values.items()}
    return {f"granitemoe.{k}": v for k, v in meta.items() if v is not None}


@pytest.mark.parametrize("gate, up", [(QType.Q8_0, QType.Q8_0), (QType.Q4_K, QType.Q4_K), (QType.Q8_0, QType.Q4_0),
                                      (QType.Q8_0, QType.F32), (QType.F16, QType.F16)])
def test_a_matrix_the_converter_split_is_joined(tmp_path, gate, up):
    """granitemoeshared's shared gate and up, which the converter writes apart, one matrix again,
    gate's rows first: as stored where both are stored alike (repacked to one width and kind of
    scales, one float type), else float32, listed as dequantized (quant requantizes it)."""
    rng = np.random.default_rng(5)
    tensors, values = {}, {}
    for kind, qtype in (("up", up), ("gate", gate)):   # the file's order is not the rows'
        w = rng.standard_normal((64, 256)).astype(np.float16 if qtype == QType.F16 else np.float32)
        t = w if qtype in fg.FLOAT_TYPES else (random_blocks(rng, 64, 256, qtype), qtype)
        tensors[f"blk.0.ffn_{kind}_shexp.weight"] = t
        values[kind] = w.astype(np.float32) if qtype in fg.FLOAT_TYPES else gguf.quants.dequantize(*t)
    imported = import_gguf(write_gguf(tmp_path / "g.gguf", tensors, "granitemoe", meta=granite_meta()))
    md, path = imported.model, "model.layers.0.shared_mlp.input_linear"
    want = np.concatenate([values["gate"], values["up"]])
    assert md.config.model_type == "granitemoeshared" and imported.types[f"{path}.weight"] == gate
    if gate == up and gate in gguf_blocks.BLOCK_TYPES:
        np.testing.assert_array_equal(dequantize(read_linear(md.tensors, md.config.quantization, path)), want)
        assert imported.dequantized == []
    else:
        got = md.tensors[f"{path}.weight"]
        assert isinstance(got, np.ndarray) and got.dtype == (np.float16 if gate == QType.F16 else np.float32)
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
        assert imported.dequantized == ([path] if gate != QType.F16 else [])
        assert not got.flags.writeable


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(FormatError, match="not a readable GGUF"):
        import_gguf(tmp_path / "x.gguf")
    with pytest.raises(FormatError, match="no such"):
        import_gguf(tmp_path / "missing.gguf")


def llama3_rope_factors(theta, head_dim, factor, low=1.0, high=4.0, old_ctx=8192):
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    config = tiny_config(vocab_size=len(TOKENS), rope_theta=500000.0, hidden_size=256,
                         num_attention_heads=2, num_key_value_heads=1)   # head_dim 128, as in Llama 3
    factors = llama3_rope_factors(500000.0, 128, 32.0)
    path = write_gguf(tmp_path / "l3.gguf", {"rope_freqs.weight": factors}, config=config)
    md = import_gguf(path).model
    assert md.config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in md.tensors
    other = llama3_rope_factors(500000.0, 128, 8.0, high=2.0)   # not Llama 3's settings
    odd = write_gguf(tmp_path / "odd.gguf", {"rope_freqs.weight": other}, config=config)
    with pytest.raises(FormatError, match="rope_freqs"):
        import_gguf(odd)
    zeros = write_gguf(tmp_path / "zeros.gguf", {"rope_freqs.weight": np.zeros_like(factors)}, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # one line, no numpy warning (found by the GGUF fuzz target)
        with pytest.raises(FormatError, match="rope_freqs.weight holds 0 as its largest divisor"):
            import_gguf(zeros)


def test_linear_rope_scaling_and_eot(tmp_path):
    meta = {"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
            "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32),
            "tokenizer.ggml.eot_token_id": (0, gguf.GGUFValueType.UINT32)}
    md = import_gguf(write_gguf(tmp_path / "lin.gguf", {}, meta=meta)).model
    assert md.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert md.config.tie_word_embeddings   # no output.weight in the file
    assert md.generation_config["eos_token_id"] == [2, 0]


# ---- the real model (Q4_1 weights, one Q8_0 embedding) ----

@pytest.mark.slow
def test_smollm2_config(smollm2_float):
    # Figures of the model llama.cpp was measured on (tests/data/README.md).
    smollm2 = smollm2_float
    c = smollm2.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == ("llama", 30, 576, 9)
    assert (c.num_key_value_heads, c.head_dim, c.intermediate_size, c.vocab_size) == (3, 64, 1536, 49152)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (100000.0, 1e-5, True)
    assert (c.max_position_embeddings, c.bos_token_id, c.eos_token_id) == (8192, 1, 2)
    assert smollm2.generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    tc = smollm2.tokenizer_config
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert tc["chat_template"].startswith("{% for message in messages %}")
    assert len(smollm2.tensors) == 2 + 9 * 30 and "lm_head.weight" not in smollm2.tensors
    assert smollm2.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert smollm2.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert smollm2.tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


@pytest.mark.slow
def test_smollm2_tensors_match_numpy(smollm2_float, smollm2_path):
    smollm2 = smollm2_float
    raw = {t.name: t for t in gguf.GGUFReader(smollm2_path).tensors}
    for name, hf, qtype in [("token_embd.weight", "model.embed_tokens.weight", QType.Q8_0),
                            ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", QType.Q4_1),
                            ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight", QType.Q4_1)]:
        assert raw[name].tensor_type == qtype
        expected = numpy_dequantize(np.asarray(raw[name].data), qtype)
        np.testing.assert_array_equal(smollm2.tensors[hf], expected, err_msg=name)
    q = numpy_dequantize(np.asarray(raw["blk.3.attn_q.weight"].data), QType.Q4_1)
    np.testing.assert_array_equal(permute(smollm2.tensors["model.layers.3.self_attn.q_proj.weight"], 9), q)
    k = numpy_dequantize(np.asarray(raw["blk.3.attn_k.weight"].data), QType.Q4_1)
    np.testing.assert_array_equal(permute(smollm2.tensors["model.layers.3.self_attn.k_proj.weight"], 9, 3), k)


@pytest.mark.slow
def test_smollm2_repacked_is_the_float_import(smollm2, smollm2_float):
    # Q4_1 -> int4 g32 and Q8_0 -> int8 g32 (float16 scales and biases), the same numbers.
    assert smollm2.config.quantization == {"group_size": 32, "bits": 4, "mode": "affine",
                                           "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert len(smollm2.tensors) == 1 + 2 * 30 + 3 * (1 + 7 * 30)   # norms; 3 arrays a matrix
    for name, w in smollm2_float.tensors.items():
        path = name.removesuffix(".weight")
        if w.ndim == 1:
            assert np.array_equal(smollm2.tensors[name], w), name
            continue
        qt = read_linear(smollm2.tensors, smollm2.config.quantization, path)
        assert qt.scales.dtype == np.float16 and np.array_equal(dequantize(qt), w), name
    # What the file held, in the same bytes: 5 bits a weight at 4 bits, 9 at 8 (a Q8_0 has 8.5).
    nbytes = sum(t.nbytes for t in smollm2.tensors.values())
    assert abs(nbytes - smollm2_float.path.stat().st_size) < 0.01 * nbytes
