"""The labs' overlap rule (zerolab.labs.overlap), in one process: a collective overlapped if compute
STARTED between its launch and the graded code's wait for it, counted in events, not seconds.

A reducer is played by gradient hooks on the labs' model, with zerolab's own Ledger (one process:
its collectives are done at once, which is the fastest a collective can be). The same reducer is
run with random delays in its hooks: the rule must give the same verdict, entry for entry, whatever
the timing, so that a loaded machine cannot fail a reducer that waits a hook later nor pass one that
waits in place.
"""

import random
import time

import torch

from zerolab.runtime.comm import Ledger
from zerolab.labs.model import build, loss_of, micro_batch
from zerolab.labs.overlap import ComputeClock, GradedLedger, blocked, overlapped


def reduce_during_backward(blocking: bool, delay=lambda: None) -> list:
    """One backward of the labs' model whose gradient hook launches one all-reduce per parameter.
    blocking: wait for it in the hook that launched it; else in the next hook (or after backward).
    Returns the entries' rows."""
    model = build()
    clock = ComputeClock()
    clock.watch_forward(model)
    pending = []

    def hook(p):
        delay()
        while pending:
            pending.pop().wait()
        handle = graded.all_reduce(torch.zeros(3), async_op=True, tag="bucket")
        if blocking:
            handle.wait()
        else:
            pending.append(handle)

    graded = GradedLedger(Ledger(timeout=None), clock, {hook.__code__})
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    with clock.during("forward"):
        loss = loss_of(model, micro_batch(0, 0, 0, 1), 1)
    with clock.during("backward"):
        clock.watch_backward(loss)
        loss.backward()
    while pending:
        pending.pop().wait()
    for e in graded.entries:
        e.needed = clock.count      # a gradient's reduction is needed by the end of backward
    return [e.row() for e in graded.entries]


def test_a_wait_in_the_launching_hook_is_blocked_and_a_wait_a_hook_later_overlapped():
    n_params = len(list(build().parameters()))
    later = reduce_during_backward(blocking=False)
    assert len(later) == n_params
    assert blocked(later, ("all_reduce",)) == []
    # every reduction but the last (launched by backward's final node) had compute to hide behind
    # and some of it started before its wait
    hidden = overlapped(later, ("all_reduce",))
    assert len(hidden) == n_params - 1 and min(events for _, events in hidden) >= 1

    in_place = reduce_during_backward(blocking=True)
    stuck = blocked(in_place, ("all_reduce",))
    assert len(stuck) == n_params - 1
    assert all(e[7].startswith("in hook (test_labs_overlap.py, line ") for e in stuck), stuck[0]


def test_the_verdict_does_not_depend_on_timing():
    rng = random.Random(0)

    def jitter():
        time.sleep(rng.random() * 0.002)

    for blocking in (False, True):
        steady = reduce_during_backward(blocking)
        for _ in range(3):
            noisy = reduce_during_backward(blocking, jitter)
            assert [e[4:7] for e in noisy] == [e[4:7] for e in steady]
            assert blocked(noisy, ("all_reduce",)) == blocked(steady, ("all_reduce",))


def test_a_collective_issued_without_async_op_counts_as_waited_where_it_was_issued():
    clock = ComputeClock()

    def issue():
        return graded.all_reduce(torch.zeros(2), tag="bucket")     # returns finished: no handle

    graded = GradedLedger(Ledger(timeout=None), clock, {issue.__code__})
    with clock.during("backward"):
        assert issue() is None
        clock.tick()
    graded.entries[0].needed = clock.count
    (row,) = blocked([e.row() for e in graded.entries], ("all_reduce",))
    assert row[8] is True and row[7].startswith("in issue (test_labs_overlap.py, line ")
