"""A first run answers on a first run's kinds of weights (quant_decode.FIRST_KINDS: one x row a pass,
no prefill tiles) while the full kernels compile in a background process, taken up once it ends."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from nibble.quant.affine import QuantizedTensor
from nibble.runner.kernels import quant_decode
from nibble.runner.kernels.cpu import SMALL
from nibble.runner.kernels.layer import decoder_layer
from nibble.runner.kernels.linear import linear, prepare, qmatvec
from tests.kernel_caches import cache_without
from tests.test_quant_kernels import mlx_weight

rng = np.random.default_rng(5)


# 4 and 8 bits, groups of one block of x and of several: (4, 64) is also the tiny model's int4,
# which the background test below runs on
@pytest.mark.parametrize("bits,G", [(4, 64), (8, 32)])
def test_a_first_runs_kind_decodes_each_row_as_the_full_kernels_do(bits, G):
    """Bit for bit: rows of x alone or several at once (the full kernels' passes of four and two
    are the same arithmetic as one), and past SMALL rows, where the full kernels would prefill,
    each row as the full kernels decode it alone."""
    N, K = 37, 4 * G
    w = prepare(QuantizedTensor(*mlx_weight(N, K, bits, G), bits, G))
    first = quant_decode.first_kind(w)
    assert type(first).FIRST and not type(w).FIRST and first.weight is w.weight
    x = rng.standard_normal((SMALL + 5, K)).astype(np.float32)
    for B in (1, 3, SMALL, SMALL + 5):
        out, full = np.empty((B, N), np.float32), np.empty((B, N), np.float32)
        linear(x[:B], first, out, False)
        for r in range(B):   # each row alone through the full kernels: decode
            qmatvec(x[r:r + 1], w, full[r:r + 1], False)
        np.testing.assert_array_equal(out, full)


SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from nibble.runner.loader import load
    from nibble.runner.kernels.cpu import SMALL

    model, _ = load(sys.argv[1], "int4", background=True)
    stage = model.stages[0]
    cache = model.new_cache(64)
    model.forward(np.arange(1, SMALL + 5), cache)   # a prompt: more rows than decode takes
    (kernels,) = stage._kernels.values()
    assert kernels.first, "a first run answers on its first kinds"
    assert all(type(w).FIRST for w in (kernels.layers[0].wq, kernels.head))
    pos = cache.pos
    on_first = model.forward([7], cache)
    model.background.process.wait()
    assert model.background.process.returncode == 0
    cache.truncate(pos)   # the same token at the same place, now on the full kernels
    on_full = model.forward([7], cache)
    (kernels,) = stage._kernels.values()
    assert not kernels.first and not type(kernels.layers[0].wq).FIRST, "the full kernels once compiled"
    np.testing.assert_array_equal(on_first, on_full)   # a decoded token: the same arithmetic
    print("ok")
""")


def test_no_background_where_it_is_turned_off(tiny_dir, monkeypatch):
    from nibble.runner.loader import load
    monkeypatch.setenv("NIBBLE_BACKGROUND_COMPILE", "0")
    model, _ = load(str(tiny_dir), "int4", background=True)
    assert not model.background.wanted()
    model.forward(np.arange(1, 5), model.new_cache(16))
    assert model.background.process is None
    (kernels,) = model.stages[0]._kernels.values()
    assert not kernels.first


@pytest.mark.slow
def test_the_full_kernels_compile_in_the_background_and_are_taken_up(tmp_path, tiny_dir):
    """A cache without the layer's kernels (a first run, as stages.py tells one): the first pass
    runs on the first run's kinds and starts the background process; once it has ended, the next
    pass runs on the full kernels (the layer's loaded from the cache it filled), and a decoded
    token's logits are the same on both. The kernels the layer calls are this session's, left in
    the cache (the test above compiled them): the background compiles the layer itself, and
    finds the rest, as it finds whatever is cached on a user's first run."""
    cache_without(tmp_path, decoder_layer)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env |= {"NIBBLE_HOME": str(tmp_path), "NIBBLE_BACKGROUND_COMPILE": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_dir)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "the rest compile in the background" in done.stderr
