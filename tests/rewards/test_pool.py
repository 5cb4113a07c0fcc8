"""The grading pool: a hard wall-clock bound that holds from any thread and any process."""

import os
import threading
import time

import pytest

from rlvr.rewards.pool import ERROR, TIMEOUT, WorkerPool

pytestmark = pytest.mark.processes


def nap(seconds):
    time.sleep(seconds)
    return seconds


def boom():
    raise ValueError("inside the worker")


def die():
    os._exit(3)


def spin():
    while True:
        pass


def pid_after(seconds):
    time.sleep(seconds)
    return os.getpid()


# The jobs below would run for 60 s or forever; each bound allows for starting
# replacement workers on a busy 2-core machine, and still proves the kill.  The deadlines (3 s)
# leave a quick job time to run in a replacement worker started under load.
BOUND = 30


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(workers=2)
    yield p
    p.close()


def test_results_come_back_in_order(pool):
    assert pool.map(nap, [(0.2,), (0.0,), (0.1,)], timeout=5) == [0.2, 0.0, 0.1]


def test_overrunning_calls_are_killed_and_replaced(pool):
    start = time.monotonic()
    results = pool.map(nap, [(60,), (0.0,), (60,), (0.05,)], timeout=3)
    elapsed = time.monotonic() - start
    assert results == [TIMEOUT, 0.0, TIMEOUT, 0.05]
    assert elapsed < BOUND
    assert pool.map(nap, [(0.0,)], timeout=5) == [0.0]  # the pool still works


def test_busy_loops_cannot_ignore_the_deadline(pool):
    # no signal handler or cooperative check involved: the process is killed
    start = time.monotonic()
    assert pool.map(spin, [()], timeout=0.3) == [TIMEOUT]
    assert time.monotonic() - start < BOUND


def test_exceptions_and_crashes_are_errors_not_crashes(pool):
    assert pool.map(boom, [()], timeout=5) == [ERROR]
    assert pool.map(die, [(), ()], timeout=5) == [ERROR, ERROR]
    assert pool.map(nap, [(0.0,)], timeout=5) == [0.0]


def test_the_bound_holds_from_a_thread(pool):
    out = []
    t = threading.Thread(target=lambda: out.extend(pool.map(nap, [(60,), (0.0,)], timeout=3)))
    start = time.monotonic()
    t.start()
    t.join(timeout=45)
    assert out == [TIMEOUT, 0.0] and time.monotonic() - start < BOUND


def test_jobs_are_spread_over_the_workers(pool):
    pids = pool.warm().map(pid_after, [(0.5,), (0.5,)], timeout=30)
    assert len(set(pids)) == 2 and os.getpid() not in pids
