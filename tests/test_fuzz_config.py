"""Fuzzing config.json: every field nibble reads given wrong types, zeros, negatives, huge values,
NaN, bools for ints, strings and nested junk, and rope_parameters, layer_types and text_config
blocks of every shape, through ModelConfig.from_dict. Each case ends in a config or one line of
NibbleError; a config accepted keeps its promises, and one small enough runs a forward pass."""

import numpy as np
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from nibble.formats import families
from nibble.formats.config import FIELDS, LAYER_TYPES, ROPE_FIELDS, ROPE_TYPES, ModelConfig
from nibble.formats.errors import NibbleError
from nibble.runner.model import Model
from tests.tiny import tiny_config, tiny_tensors

pytestmark = pytest.mark.fuzz

# A valid config.json of each model type, as nibble writes it: the cases are mutations of these.
BASES = {t: tiny_config(t).to_dict() for t in families.model_types()}

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 9),
    st.sampled_from([2**31, 2**40, 10**9, 2**63, -(2**63), 10**30]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.sampled_from([*ROPE_TYPES, *LAYER_TYPES, *families.model_types(), "gemma3", "su", "silu", "type"]))
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=4) | st.sampled_from(list(ROPE_FIELDS)), inner,
                                      max_size=4), max_leaves=8)
# Near-valid blocks reach the checks behind the type checks: a rope block of a known type with
# some fields (valid numbers or junk), layer types of any length, per-layer flags.
ROPE_BLOCK = st.builds(lambda kind, fields: {"rope_type": kind, **fields},
                       st.sampled_from([*ROPE_TYPES, "su", "yarn"]),
                       st.dictionaries(st.sampled_from([*ROPE_FIELDS, "type", "rope_theta"]),
                                       st.floats(0.5, 64) | st.integers(1, 64) | JUNK
                                       | st.lists(st.floats(0.5, 4), min_size=1, max_size=12),
                                       max_size=5))
BLOCKS = st.one_of(ROPE_BLOCK, st.dictionaries(st.sampled_from(LAYER_TYPES), ROPE_BLOCK | JUNK, max_size=2),
                   st.lists(st.sampled_from(LAYER_TYPES), max_size=5), st.lists(st.integers(0, 1), max_size=5))
VALUES = st.one_of(SCALARS, JUNK, BLOCKS)
KEYS = st.sampled_from([*FIELDS, "model_type", "rope_parameters", "text_config", "no_rope_layer_interval",
                        "hidden_act", "hidden_activation", "mlp_bias", "torch_dtype"])


@st.composite
def configs(draw) -> dict:
    """A base config with fields replaced and removed, sometimes in a gemma3 wrapper."""
    model_type = draw(st.sampled_from(sorted(BASES)))
    d = dict(BASES[model_type])
    for key in draw(st.sets(st.sampled_from(sorted(d)), max_size=2)):
        del d[key]
    d |= draw(st.dictionaries(KEYS, VALUES, max_size=4))
    if draw(st.booleans()) and draw(st.booleans()):
        d = {"model_type": "gemma3", "text_config": d, **draw(st.dictionaries(KEYS, VALUES, max_size=2))}
    return d


def check_promises(c: ModelConfig) -> None:
    """What the model code takes for granted of a config that passed the checks."""
    L = c.num_hidden_layers
    assert min(c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim, L) > 0
    assert c.num_attention_heads % c.num_key_value_heads == 0
    assert 2 <= c.rotary_dim <= c.head_dim and c.rotary_dim % 2 == 0
    assert len(c.rope_layers) == len(c.windows) == L
    assert all(isinstance(w, int) and w >= -1 for w in c.windows)   # -1: bidirectional (an encoder)
    assert c.rope_scaling is None or c.rope_scaling["rope_type"] in ROPE_TYPES
    assert all(isinstance(i, int) for i in c.eos_ids)


def cheap(c: ModelConfig) -> bool:
    """Small enough to build and run: the tiny model's sizes, give or take."""
    hd, D = c.head_dim, c.hidden_size
    weights = c.vocab_size * D + c.num_hidden_layers * (
        D * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 3 * D * c.intermediate_size)
    return weights <= 1 << 20 and c.max_position_embeddings * c.rotary_dim <= 1 << 20


def run_forward(c: ModelConfig) -> str:
    """A forward pass of up to three tokens through random weights of the config's shapes."""
    try:
        model = Model(c, tiny_tensors(c))
    except NibbleError as e:   # e.g. quantization settings that the float weights do not have
        assert "\n" not in str(e)
        return f"refused at load: {type(e).__name__}"
    with np.errstate(all="ignore"):   # absurd but valid numbers (eps, theta) may give inf logits
        tokens = np.arange(min(3, c.max_position_embeddings)) % c.vocab_size
        logits = model.forward(tokens, model.new_cache(8))
    assert logits.shape == (1, c.vocab_size)
    return "ran" if np.isfinite(logits).all() else "ran: non-finite logits"


@given(configs())
@example({**BASES["llama"], "num_key_value_heads": 0})
@example({**BASES["llama"], "num_hidden_layers": -1})
@example({**BASES["llama"], "hidden_size": 2, "head_dim": None})
@example({**BASES["llama"], "max_position_embeddings": 2**40})
@example({**BASES["llama"], "rope_parameters": {"rope_type": "linear", "factor": "2"}})
@example({**BASES["llama"], "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                "high_freq_factor": 4.0}})
@example({**BASES["llama"], "rope_theta": 1, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
@example({**BASES["phi3"], "partial_rotary_factor": 0.01})
@example({**BASES["llama"], "model_type": ["llama"]})
@example({"model_type": "gemma3", "text_config": "gemma3_text"})
@example({**BASES["gemma3_text"], "rope_parameters": {"sliding_attention": 10000.0}})
@example({**BASES["smollm3"], "no_rope_layers": None, "no_rope_layer_interval": 0})
@example({**BASES["gemma3_text"], "layer_types": None, "sliding_window_pattern": None})
@example({**BASES["gemma3_text"], "query_pre_attn_scalar": None})
@example({**BASES["phi3"], "original_max_position_embeddings": 1})
@example({**BASES["gemma3_text"], "max_position_embeddings": 1})
@example({**BASES["llama"], "rms_norm_eps": 1e-50})   # 0 in float32
@example({**BASES["llama"], "rms_norm_eps": 2**63})    # an int the kernels cannot take
def test_config_loads_or_is_refused_in_one_line(d):
    try:
        c = ModelConfig.from_dict(d)
    except NibbleError as e:
        assert "\n" not in str(e)
        event(f"outcome: {type(e).__name__}")
        return
    check_promises(c)
    event(f"outcome: accepted, {run_forward(c) if cheap(c) else 'too large to run'}")
