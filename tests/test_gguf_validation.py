"""A damaged GGUF ends in one FormatError naming the file and the tensor or key, never a
traceback, a numpy warning or NaN weights: one test per rule (tests/test_fuzz_gguf.py fuzzes the
rest)."""

import re

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.gguf import import_gguf
from nibble.quant.gguf_import import import_gguf_model
from tests import test_gguf
from tests.test_gguf import F16_FIELDS, _f16, granite_meta, llama_cpp_tensors, random_blocks, write_gguf
from tests.tiny import tiny_config, tiny_tensors

pytestmark = pytest.mark.filterwarnings("error")   # a numpy RuntimeWarning fails the test


@pytest.fixture
def tiny_gguf(tmp_path):
    config = tiny_config(vocab_size=263)   # len(test_gguf.TOKENS)
    tensors = llama_cpp_tensors(tiny_tensors(config), config)
    return write_gguf(tmp_path / "m.gguf", tensors, config=config,
                      meta={"tokenizer.ggml.add_bos_token": (False, gguf.GGUFValueType.BOOL)})


def edit(path, change):
    """change(reader) writes into the file through the reader's read-write memory map."""
    reader = gguf.GGUFReader(path, "r+")
    change(reader)
    reader.data.flush()
    del reader
    return path


def set_offset(reader, index, offset):
    reader.tensors[index].field.parts[5][0] = offset   # the tensor-table entry's data offset


def tensor_name(path, index) -> str:
    return re.escape(gguf.GGUFReader(path).tensors[index].name)


def test_unaligned_offset(tiny_gguf):
    name = tensor_name(tiny_gguf, 1)
    edit(tiny_gguf, lambda r: set_offset(r, 1, int(r.tensors[1].field.parts[5][0]) + 4))
    with pytest.raises(FormatError, match=rf"m\.gguf: GGUF tensor {name} starts at offset \d+, "
                                          r"not a multiple of general\.alignment \(32\)"):
        import_gguf(tiny_gguf)


def test_offset_past_the_end(tiny_gguf):
    name = tensor_name(tiny_gguf, 2)
    edit(tiny_gguf, lambda r: set_offset(r, 2, 1 << 20))
    with pytest.raises(FormatError, match=rf"m\.gguf: GGUF tensor {name} ends at byte \d+, past "
                                          r"the end of the file"):
        import_gguf(tiny_gguf)


def test_overlapping_tensors(tiny_gguf):
    edit(tiny_gguf, lambda r: set_offset(r, 1, int(r.tensors[0].field.parts[5][0])))
    with pytest.raises(FormatError, match=r"m\.gguf: GGUF tensors \S+ and \S+ overlap"):
        import_gguf(tiny_gguf)


def test_metadata_string_not_utf8(tiny_gguf):
    def damage(reader):
        reader.fields["tokenizer.chat_template"].parts[-1][0] = 0xFF
    edit(tiny_gguf, damage)
    with pytest.raises(FormatError,
                       match=r"m\.gguf: not a readable GGUF file \(UnicodeDecodeError"):
        import_gguf(tiny_gguf)


def test_merge_of_a_token_not_in_the_vocabulary(tiny_gguf):
    def damage(reader):   # the merge "h e" becomes "h x": the token "hx" is not in the vocabulary
        merges = reader.fields["tokenizer.ggml.merges"]
        merges.parts[merges.data[1]][-1] = ord("x")
    edit(tiny_gguf, damage)
    with pytest.raises(FormatError, match=r"m\.gguf: GGUF tokenizer\.ggml\.tokens and tokenizer\."
                                          r"ggml\.merges .*Token `hx` out of vocabulary"):
        import_gguf(tiny_gguf)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_non_finite_float_weights(tmp_path, dtype):
    w = np.ones((8, 32), dtype)
    w[3, 5] = np.inf
    path = write_gguf(tmp_path / "f.gguf", {"blk.0.ffn_up.weight": w})
    with pytest.raises(FormatError, match=r"f\.gguf: GGUF tensor blk\.0\.ffn_up\.weight holds NaN"):
        import_gguf(path)


def test_non_finite_bf16_weights(tmp_path):
    bits = np.full((8, 32), 0x3F80, np.uint16)   # 1.0
    bits[0, 0] = 0x7FC0                           # NaN
    path = write_gguf(tmp_path / "b.gguf",
                      {"blk.0.ffn_up.weight": (bits.view(np.uint8), QType.BF16)})
    with pytest.raises(FormatError, match=r"blk\.0\.ffn_up\.weight holds NaN"):
        import_gguf(path)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_1, QType.Q4_K, QType.Q5_K, QType.Q6_K])
@pytest.mark.parametrize("repack_blocks", [True, False])
@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_non_finite_block_scales(tmp_path, qtype, repack_blocks, value):
    raw = random_blocks(np.random.default_rng(0), 4, 256, qtype)
    d = F16_FIELDS[qtype][0]   # the first block's scale d
    raw[2, d:d + 2] = _f16([value])[0]
    path = write_gguf(tmp_path / "q.gguf", {"blk.0.ffn_up.weight": (raw, qtype)})
    with pytest.raises(FormatError, match=r"blk\.0\.ffn_up\.weight holds NaN or infinite"):
        import_gguf(path, repack_blocks=repack_blocks)


def zero_heads(reader):
    reader.fields["llama.attention.head_count"].parts[-1][0] = 0


def bool_as_uint8(reader):   # the type of add_bos_token's one byte (False): a BOOL becomes a UINT8
    reader.fields["tokenizer.ggml.add_bos_token"].parts[2][0] = gguf.GGUFValueType.UINT8


@pytest.mark.parametrize("damage, message", [
    (zero_heads, "llama.attention.head_count is 0, not a positive integer"),
    (bool_as_uint8, "tokenizer.ggml.add_bos_token is 0, not a boolean"),
])
def test_metadata_value_of_the_wrong_kind(tiny_gguf, damage, message):
    edit(tiny_gguf, damage)
    with pytest.raises(FormatError, match=rf"m\.gguf: GGUF metadata {re.escape(message)}"):
        import_gguf(tiny_gguf)


MOE = tiny_config("qwen3", vocab_size=263, num_hidden_layers=1)   # D 64; 3 experts of F 32 below


def one_fewer_expert(t):
    t["blk.0.ffn_up_exps.weight"] = t["blk.0.ffn_up_exps.weight"][:2]


def down_transposed(t):
    t["blk.0.ffn_down_exps.weight"] = t["blk.0.ffn_down_exps.weight"].transpose(0, 2, 1).copy()


def no_down(t):
    del t["blk.0.ffn_down_exps.weight"]


def no_router(t):
    del t["blk.0.ffn_gate_inp.weight"]


@pytest.mark.parametrize("damage, meta, message", [
    (one_fewer_expert, (3, 2, 32), "GGUF tensor blk.0.ffn_up_exps.weight is [64, 32, 2], not [embedding_length "
                                   "64, expert_feed_forward_length 32, expert_count 3]"),
    (down_transposed, (3, 2, 32), "GGUF tensor blk.0.ffn_down_exps.weight is [64, 32, 3], not "
                                  "[expert_feed_forward_length 32, embedding_length 64, expert_count 3]"),
    (None, (3, 2, 16), "GGUF tensor blk.0.ffn_gate_exps.weight is [64, 32, 3], not [embedding_length 64, "
                       "expert_feed_forward_length 16, expert_count 3]"),
    (None, (4, 2, 32), "GGUF tensor blk.0.ffn_gate_inp.weight is [64, 3], not [embedding_length 64, "
                       "expert_count 4]"),
    (no_down, (3, 2, 32), "GGUF block 0 has experts but no blk.0.ffn_down_exps.weight: a mixture of "
                          "experts needs its router (ffn_gate_inp) and gate, up and down experts"),
    (no_router, (3, 2, 32), "GGUF block 0 has experts but no blk.0.ffn_gate_inp.weight"),
    (None, (3, 4, 32), "GGUF metadata qwen3moe.expert_used_count 4 is more than the 3 experts"),
    (None, (0, 2, 32), "GGUF metadata qwen3moe.expert_count is 0, not a positive integer"),
])
def test_experts_of_the_wrong_shape_or_count(tmp_path, damage, meta, message):
    tensors = test_gguf.moe_tensors(MOE, 3, 32)
    if damage:
        damage(tensors)
    path = write_gguf(tmp_path / "moe.gguf", tensors, "qwen3moe", MOE, test_gguf.moe_meta(*meta))
    with pytest.raises(FormatError, match=rf"^\S*moe\.gguf: {re.escape(message)}"):
        import_gguf(path)


U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32


def counts(arch: str, experts: int, used: int, **more) -> dict:
    return {f"{arch}.{k}": (v, U32) for k, v in dict(expert_count=experts, expert_used_count=used, **more).items()}


@pytest.mark.parametrize("arch, meta, message", [
    ("qwen2moe", counts("qwen2moe", 8, 2, expert_shared_feed_forward_length=0),
     "GGUF metadata qwen2moe.expert_shared_feed_forward_length is 0, not a positive integer"),
    ("llama", counts("llama", 4, 5), "GGUF metadata llama.expert_used_count 5 is more than the 4 experts"),
    ("olmoe", {}, "GGUF metadata olmoe.expert_count is 0, not a positive integer"),
    ("granitemoe", granite_meta(logit_scale=None),
     "GGUF metadata has no granitemoe.logit_scale: llama.cpp's granitemoe divides the logits by it"),
    ("granitemoe", granite_meta(logit_scale=(0.0, F32)),
     "GGUF metadata granitemoe.logit_scale is 0.0, not a finite number above 0"),
    ("granitemoe", granite_meta(residual_scale=(-0.5, F32)),
     "GGUF metadata granitemoe.residual_scale is -0.5, not a finite number above 0"),
    ("granitemoe", granite_meta(attention__scale=("x", gguf.GGUFValueType.STRING)),
     "GGUF metadata granitemoe.attention.scale is 'x', not a finite number above 0"),
    ("granitemoe", granite_meta(expert_shared_feed_forward_length=(-1, gguf.GGUFValueType.INT32)),
     "GGUF metadata granitemoe.expert_shared_feed_forward_length is -1, not a non-negative integer"),
])
def test_moe_metadata_of_the_wrong_kind(tmp_path, arch, meta, message):
    path = write_gguf(tmp_path / "moe.gguf", {}, arch, meta=meta)
    with pytest.raises(FormatError, match=rf"^\S*moe\.gguf: {re.escape(message)}$"):
        import_gguf(path)


GATE, UP = "blk.0.ffn_gate_shexp.weight", "blk.0.ffn_up_shexp.weight"
JOINED = f"Hugging Face's shared_mlp.input_linear is the rows of {GATE} and {UP}"


@pytest.mark.parametrize("shapes, message", [
    ({GATE: (64, 64)}, f"GGUF block 0 has no {UP}: {JOINED}"),
    ({UP: (64, 64)}, f"GGUF block 0 has no {GATE}: {JOINED}"),
    ({GATE: (64, 64), UP: (64, 32)}, f"GGUF tensors {GATE} and {UP} are [64, 64] and [32, 64]: not the rows of one "
                                     f"matrix (shared_mlp.input_linear)"),
    ({GATE: (64, 64), UP: (64,)}, f"GGUF tensors {GATE} and {UP} are [64, 64] and [64]: not the rows of one matrix "
                                  f"(shared_mlp.input_linear)"),
])
def test_the_parts_of_a_split_matrix_missing_or_unlike(tmp_path, shapes, message):
    tensors = {name: np.ones(shape, np.float32) for name, shape in shapes.items()}
    path = write_gguf(tmp_path / "g.gguf", tensors, "granitemoe", meta=granite_meta())
    with pytest.raises(FormatError, match=rf"^\S*g\.gguf: {re.escape(message)}$"):
        import_gguf(path)


def test_token_types_not_one_per_token(tmp_path, monkeypatch):
    monkeypatch.setattr(test_gguf, "TYPES", test_gguf.TYPES[:-1])
    path = write_gguf(tmp_path / "m.gguf", {})
    with pytest.raises(FormatError, match=r"m\.gguf: GGUF metadata tokenizer\.ggml\.token_type "
                                          r"has 262 entries for 263 tokens"):
        import_gguf(path)


def test_weights_too_large_to_requantize(tmp_path):
    # IQ3_S is requantized to int8 with float16 scales: weights near 10**7 do not fit them
    raw = random_blocks(np.random.default_rng(0), 4, 256, QType.IQ3_S, exponents=(4.5, 4.8))
    path = write_gguf(tmp_path / "q.gguf", {"blk.0.ffn_up.weight": (raw, QType.IQ3_S)})
    with pytest.raises(NibbleError, match=r"q\.gguf: model\.layers\.0\.mlp\.up_proj\.weight: weights "
                                          r"that are not finite, or too large for float16"):
        import_gguf_model(path)
