"""The thread count of each pass: pinned by -t, or chosen from how fast passes ran (runner/threads.py)."""
import numba
import numpy as np
import pytest

from nibble.quant.convert import quantize_model
from nibble.runner.model import Model
from nibble.runner.threads import FIRST_PROBE, MAX_INTERVAL, MIN_INTERVAL, RECENT, ThreadChooser, procs_running_elsewhere
from tests.tiny import tiny_model_dir


def drive(chooser: ThreadChooser, seconds_with, passes: int, rows: int = 1) -> list[int]:
    """Run `passes` passes whose time depends on the thread count as `seconds_with` says; -> the
    count of each."""
    counts = []
    for _ in range(passes):
        n = chooser.next_count(rows)
        chooser.record(rows, n, seconds_with(n))
        counts.append(n)
    return counts


def quiet():
    return 0   # no other program's thread waiting to run


def test_a_quiet_machine_keeps_every_core_and_probes_ever_less_often():
    chooser = ThreadChooser(most=4, others_running=quiet)
    counts = drive(chooser, lambda n: 1.0 / n, 4000)
    probes = [i for i, n in enumerate(counts) if n != 4]
    assert {counts[i] for i in probes} == {3, 2}   # one fewer and half as many
    gaps = np.diff(probes)
    assert list(gaps[:3]) == [2 * MIN_INTERVAL, 4 * MIN_INTERVAL, 8 * MIN_INTERVAL]
    assert gaps.max() == MAX_INTERVAL
    assert len(probes) < 20   # 4000 passes: the probes cost next to nothing


def test_a_busy_core_makes_it_step_down_and_come_back_when_freed():
    chooser = ThreadChooser(most=2, others_running=lambda: None)   # a system that does not say
    busy = lambda n: {1: 1.0, 2: 4.0}[n]   # the second thread waits behind another program
    counts = drive(chooser, busy, 200)
    assert counts[:FIRST_PROBE] == [2] * FIRST_PROBE
    switched = counts.index(1)
    assert switched == FIRST_PROBE   # the first probe wins at once
    assert counts[switched:].count(2) < 6   # later probes of 2 lose, ever less often
    assert drive(chooser, lambda n: 1.0 / n, 2 * MAX_INTERVAL)[-1] == 2   # the core freed: back to 2


def test_no_probe_with_more_threads_while_other_programs_wait_to_run():
    others = [1]
    chooser = ThreadChooser(most=2, others_running=lambda: others[0])
    busy = lambda n: {1: 1.0, 2: 4.0}[n]
    counts = drive(chooser, busy, 3000)
    assert counts[FIRST_PROBE:].count(2) == 0   # down at the first probe, never up again
    others[0] = 0   # the other program ended
    assert drive(chooser, lambda n: 1.0 / n, 2 * MAX_INTERVAL)[-1] == 2


def test_a_program_starting_on_a_long_quiet_run_is_noticed_at_once():
    chooser = ThreadChooser(most=2, others_running=quiet)
    drive(chooser, lambda n: 1.0 / n, 5000)   # probes are MAX_INTERVAL apart by now
    counts = drive(chooser, lambda n: {1: 1.0, 2: 4.0}[n], 20)
    assert counts[:RECENT // 2] == [2] * (RECENT // 2) and counts[RECENT // 2:] == [1] * (20 - RECENT // 2)


def test_the_first_pass_takes_the_cores_free_then():
    chooser = ThreadChooser(most=8, others_running=lambda: 3)
    assert chooser.next_count(1) == 5


def test_procs_running_elsewhere_reads_the_system(tmp_path):
    assert isinstance(procs_running_elsewhere(), int)   # Linux's /proc/stat says
    stat = tmp_path / "stat"
    for text, others in (("cpu  1 2 3\nprocs_running 5\nprocs_blocked 0\n", 4),   # the asker is one of them
                         ("procs_running 1\n", 0), ("procs_running 0\n", 0),
                         ("cpu  1 2 3\n", None), ("procs_running many\n", None)):
        stat.write_text(text)
        assert procs_running_elsewhere(str(stat)) == others, text
    assert procs_running_elsewhere(str(tmp_path / "missing")) is None


def test_several_cores_taken_are_found_a_step_at_a_time():
    chooser = ThreadChooser(most=8, others_running=lambda: None)
    free = 5   # three cores busy: more threads than 5 wait, fewer do less
    counts = drive(chooser, lambda n: 1.0 / n if n <= free else 3.0, 400)
    assert counts[-50:].count(5) > 45


def test_a_probe_is_compared_with_passes_of_as_many_rows():
    chooser = ThreadChooser(most=2, others_running=quiet)
    drive(chooser, lambda n: 1.0, 2, rows=256)   # a long prefill chunk
    counts = drive(chooser, lambda n: 0.01 / n, 2 * MIN_INTERVAL, rows=1)
    assert set(counts) <= {1, 2} and counts[-1] == 2   # a decode pass never beat a prefill's time


def test_passes_from_two_threads_at_once_share_the_chooser():
    # the server's engine and a caller of the same model: a decode pass (1 row) probing one
    # thread is still running while prefill passes (8 rows) switch to one thread and back to two,
    # dropping every baseline each time
    chooser = ThreadChooser(most=2, others_running=quiet)
    for rows in (1, 8):
        drive(chooser, lambda n: 1.0 / n, RECENT, rows=rows)
    chooser._countdown = 0   # both next passes probe
    decode_probe = chooser.next_count(1)
    chooser.record(8, chooser.next_count(8), 0.1)   # much faster: the count switches to 1
    drive(chooser, lambda n: 1.0 / n, 2 * MIN_INTERVAL, rows=8)   # ... and back to 2
    assert decode_probe == 1 and chooser.current == 2
    chooser.record(1, decode_probe, 0.1)   # its baseline is gone: it teaches nothing
    assert chooser.current == 2
    counts = drive(chooser, lambda n: 1.0 / n, 2 * MIN_INTERVAL)   # and all goes on
    assert counts.count(2) >= 2 * MIN_INTERVAL - 2


def test_pinned_is_always_that_many_and_learns_nothing():
    chooser = ThreadChooser(most=4, others_running=quiet)
    chooser.pin(3)
    assert drive(chooser, lambda n: 1.0 / n, 100) == [3] * 100
    chooser.pin(9)
    assert chooser.next_count(1) == 4   # at most the threads numba may start
    chooser.pin(None)
    assert drive(chooser, lambda n: 1.0 / n, FIRST_PROBE)[0] == 4


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU: no other thread count to compare")
# The group sizes of other tests' models held in memory (test_cuda_kernels' int4 layer, bench
# --shapes' int8): the layer compiled for them serves these too.
@pytest.mark.parametrize("bits,group", [(None, None), (4, 32), (8, 64)])
def test_logits_are_the_same_whatever_the_thread_count(bits, group):
    """Switching counts mid-reply changes the speed only: each output is summed by one thread."""
    md = tiny_model_dir() if bits is None else quantize_model(tiny_model_dir(), bits, group).model
    model = Model(md.config, md.tensors)
    prompt = list(range(1, 40))
    logits = {}
    for threads in (1, 2):
        model.threads.pin(threads)
        cache = model.new_cache(64)
        prefill = model.forward(prompt, cache, all_logits=True)   # past SMALL rows: the tiles
        decode = [model.forward([t], cache) for t in (5, 6, 7)]
        assert numba.get_num_threads() == threads   # the calling thread's count, set for the pass
        logits[threads] = prefill, np.concatenate(decode)
    for a, b in zip(logits[1], logits[2]):
        np.testing.assert_array_equal(a, b)
