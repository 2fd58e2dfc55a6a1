"""A long step's progress line: in place on a terminal, plain lines elsewhere, the chat app's own
way when it asks; and the kernels' compile said through it."""
import contextlib
import io
import threading
from types import SimpleNamespace

import pytest

from nibble.formats import progress
from nibble.runner.kernels import compiling, cpu


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_sees_one_line_rewritten_then_its_last_word(monkeypatch):
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    progress.update("importing a.gguf: 1 of 3 tensors")
    progress.update("importing a.gguf: 3 of 3 tensors")
    progress.done("imported a.gguf")
    assert err.getvalue() == ("\r\x1b[Kimporting a.gguf: 1 of 3 tensors\r\x1b[Kimporting a.gguf: 3 of 3 tensors"
                              "\r\x1b[Kimported a.gguf\n")


def test_a_cleared_line_leaves_nothing_on_a_terminal(monkeypatch):
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    progress.update("importing a.gguf: 1 of 3 tensors")
    progress.clear()
    assert err.getvalue().endswith("\r\x1b[K") and "\n" not in err.getvalue()


@pytest.mark.parametrize("every,lines", [(1e9, []), (0.0, ["step 1", "step 2"])])
def test_a_log_gets_plain_lines_only_once_a_step_lasts(monkeypatch, every, lines):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(progress, "PLAIN_EVERY", every)
    progress.update("step 1")
    progress.update("step 2")
    progress.done("done")
    assert err.getvalue().splitlines() == lines + ["done"]


@pytest.mark.parametrize("fails", [True, False])
def test_a_step_leaves_the_next_one_to_start_afresh(monkeypatch, fails):
    """A step ends without its last word, by an error or not; the next step's first update, long
    after, is still a first update, which a log does not get."""
    err, clock = io.StringIO(), SimpleNamespace(now=0.0)
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock.now)
    with pytest.raises(ValueError) if fails else contextlib.nullcontext(), progress.step():
        progress.update("importing a.gguf: reading its metadata")
        if fails:
            raise ValueError
    clock.now = 10 * progress.PLAIN_EVERY
    progress.update("importing b.gguf: reading its metadata")
    assert err.getvalue() == ""


def test_ticking_says_the_state_at_once_and_again_until_the_block_ends(monkeypatch):
    """Each tick shows what say() gives then; the ticking thread is gone once the block ends."""
    seen, calls = [], []
    ticked = threading.Event()

    def say():
        calls.append(len(calls))
        if len(calls) == 3:
            ticked.set()
        return f"quantizing: {len(calls)}"
    with progress.shown_by(seen.append):
        with progress.ticking(say, every=0.001):
            assert ticked.wait(60)
    assert seen[:3] == ["quantizing: 1", "quantizing: 2", "quantizing: 3"]
    assert "nibble-progress" not in [t.name for t in threading.enumerate()]


def test_shown_by_takes_every_update_while_inside(monkeypatch):
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    seen = []
    with progress.shown_by(seen.append):
        progress.update("a")
        progress.done("b")
    progress.done("c")
    assert seen == ["a", "b"] and err.getvalue() == "c\n"


def test_the_compile_says_which_kernel_and_then_how_long_once():
    seen = []
    compiles = compiling._Compiles()
    event = SimpleNamespace(data={"dispatcher": cpu.attention})
    with progress.shown_by(seen.append):
        compiles.finish()   # nothing compiled: nothing to say
        assert seen == []
        compiles.on_start(event)
        compiles.on_end(event)
        compiles.finish()
        compiles.finish()
    assert "compiling the kernels for this CPU" in seen[0] and "now attention" in seen[0]
    assert seen[-1].startswith("compiled the kernels for this CPU in ") and len(seen) == 2


def test_a_compile_nobody_ends_is_ended_once_idle(monkeypatch):
    """The library and tests never call finish(): once nothing compiles, the line is cleared, and a
    later step's first update is a first one again (a log gets nothing yet)."""
    err, clock = io.StringIO(), SimpleNamespace(now=0.0)
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(compiling, "TICK", 0.001)
    compiles = compiling._Compiles()
    event = SimpleNamespace(data={"dispatcher": cpu.attention})
    others = set(threading.enumerate())
    compiles.on_start(event)
    [ticker] = set(threading.enumerate()) - others
    compiles.on_end(event)
    clock.now = compiling.IDLE + 1
    ticker.join(60)
    assert not ticker.is_alive()
    clock.now += 10 * progress.PLAIN_EVERY
    before = err.getvalue()
    progress.update("importing a.gguf: reading its metadata")
    assert err.getvalue() == before


def test_named_steps_say_which_of_how_many_and_the_time_left_at_the_pace_so_far(monkeypatch):
    monkeypatch.setattr(compiling, "machine_pace", lambda: 1.5)   # this machine half as slow again as the reference
    steps = compiling.Steps([("the matrix kernels", 10.0), ("the layer", 20.0)])
    steps.began = steps.step_began = 100.0
    assert steps.left(104.0) == 41.0   # nothing done yet: as expected, at the machine's pace
    assert steps.say(104.0) == "4 s so far, about 41 s left; step 1 of 2, the matrix kernels"
    steps.done, steps.step_began = 1, 120.0   # the first step took twice as long as expected
    assert steps.left(125.0) == 35.0
    assert steps.say(125.0) == "25 s so far, about 35 s left; step 2 of 2, the layer"
    assert steps.say(170.0).startswith("70 s so far, a few seconds left;")   # slower still: never a negative time
    steps.done = 2
    assert steps.left(171.0) == 0.0


def test_the_machine_s_pace_is_its_time_for_a_piece_of_python_against_the_reference_machine_s(monkeypatch):
    monkeypatch.setattr(compiling, "_probe", lambda: 2 * compiling.REFERENCE_PROBE)
    compiling.machine_pace.cache_clear()
    try:
        assert compiling.machine_pace() == 2.0
    finally:
        compiling.machine_pace.cache_clear()


def test_the_compile_line_names_the_step_while_steps_are_planned():
    seen = []
    with progress.shown_by(seen.append):
        with compiling.steps([("the matrix kernels", 30.0), ("the layer", 30.0)]) as steps:
            compiling._compiles._show()
            steps.next()
        compiling.finish()
    line = "compiling the kernels for this CPU, once: "   # then the times (Steps.say, above)
    assert seen[0].startswith(line) and seen[0].endswith(" s left; step 1 of 2, the matrix kernels")
    assert seen[1].startswith(line) and seen[1].endswith("; step 2 of 2, the layer")
    assert seen[-1].startswith("compiled the kernels for this CPU in ")
