"""The importance matrix against squared activations computed by the numpy reference."""
import numpy as np
import pytest

from nibble.runner.convert.calibrate import layer_importances
from nibble.runner.model import Model
from tests import reference
from tests.tiny import tiny_config, tiny_tensors


def imatrix(model, tokens, ctx: int) -> dict[str, np.ndarray]:
    """Every block's importances, as nibble quantize measures them."""
    return {name: v for _, block in layer_importances(model, tokens, ctx) for name, v in block.items()}


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3"])   # phi3: keyed by its fused matrices
def test_imatrix_matches_reference_activations(model_type):
    config = tiny_config(model_type)
    tensors = tiny_tensors(config)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, 24)
    got = imatrix(Model(config, tensors), tokens, ctx=10)   # windows of 10, 10 and 4
    want = {}
    for start in (0, 10, 20):
        for name, x in reference.projection_inputs(config, tensors, tokens[start:start + 10]).items():
            want[name] = want.get(name, 0) + (x ** 2).sum(0)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name] / len(tokens), rtol=1e-4, err_msg=name)
