"""kill -9 during a streaming reply, a few times (tests/durability.py; `python -m tests.durability`
runs 20 and prints the figures)."""
import pytest

from tests import durability


@pytest.mark.slow
def test_a_killed_apps_reply_is_kept_as_far_as_it_was_written(tmp_path):
    kills = durability.run(3, seed=1, home=tmp_path, tokens=60)
    for k in kills:
        assert k.prefix and k.finish in ("interrupted", None) and 0 <= k.stored <= k.generated
    assert any(k.finish == "interrupted" for k in kills)
