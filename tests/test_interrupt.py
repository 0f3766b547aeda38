"""mdi.system.interrupt: a deadline stops Python code that never looks at a clock, and one
that does not run out leaves nothing behind to strike later."""
import time

import pytest

from mdi.system.interrupt import DeadlinePassed, thread_deadline


def test_a_deadline_stops_a_loop_that_never_checks():
    t0 = time.monotonic()
    with pytest.raises(DeadlinePassed):
        with thread_deadline(0.2):
            while True:
                pass
    assert time.monotonic() - t0 < 5


def test_deadlines_that_do_not_run_out_leave_no_exception_behind():
    for _ in range(200):
        t0 = time.monotonic()
        try:
            with thread_deadline(0.05):
                sum(range(100))
        except DeadlinePassed:  # only where the block really overran it (a busy machine's stall)
            assert time.monotonic() - t0 >= 0.05
    # any exception still pending would surface in this loop
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.3:
        sum(range(1000))


def test_a_deadline_that_runs_out_as_the_block_ends_is_caught_around_it():
    # the timer and the block's end race: whichever wins, the exception surfaces inside the
    # `with` (caught around it) or not at all, never after it: a stray one fails this test
    # in the loops below
    for _ in range(50):
        try:
            with thread_deadline(0.001):
                t0 = time.monotonic()
                while time.monotonic() - t0 < 0.001:
                    pass
        except DeadlinePassed:
            pass
        sum(range(1000))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.2:
        sum(range(1000))
