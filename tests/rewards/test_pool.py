"""The grading pool: a hard bound on each call's work (its worker's CPU seconds), and on its time on
the clock at WALL_FACTOR times that, that holds from any thread and any process."""

import multiprocessing as mp
import os
import threading
import time

import pytest

from rlvr.rewards.pool import ERROR, TIMEOUT, WALL_FACTOR, WorkerPool, cpu_seconds

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


def burn(seconds):
    """Work for `seconds` of this process's CPU time, however long that takes on the clock."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass
    return seconds


def busy(ready):
    ready.set()
    while True:
        pass


# The jobs below would run for 60 s or forever; each bound allows for starting
# replacement workers on a busy 2-core machine, and still proves the kill.  A sleeping job uses no
# CPU time, so it is stopped by the wall-clock bound, WALL_FACTOR x 0.2 s.
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
    results = pool.map(nap, [(60,), (0.0,), (60,), (0.05,)], timeout=0.2)
    elapsed = time.monotonic() - start
    assert results == [TIMEOUT, 0.0, TIMEOUT, 0.05]
    assert elapsed < BOUND
    assert pool.map(nap, [(0.0,)], timeout=5) == [0.0]  # the pool still works


def test_busy_loops_cannot_ignore_the_deadline(pool):
    # no signal handler or cooperative check involved: the process is killed
    start = time.monotonic()
    assert pool.map(spin, [()], timeout=0.3) == [TIMEOUT]
    assert time.monotonic() - start < BOUND


def test_a_call_that_waits_is_bounded_by_the_clock_at_wall_factor_times_its_bound(pool):
    # 1 s asleep uses no CPU time: past its 0.3 s of work, inside its 3 s on the clock
    assert WALL_FACTOR * 0.3 > 1.0
    assert pool.map(nap, [(1.0,)], timeout=0.3) == [1.0]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or cpu_seconds(os.getpid()) is None,
                    reason="needs Linux's /proc and CPU affinity")
def test_the_bound_counts_the_work_of_a_call_not_its_wait_for_a_busy_cpu(pool):
    """0.3 CPU seconds of work under a 0.6 s bound, its worker on one core with three busy loops: it
    gets about a quarter of the core, so it takes about 1.2 s on the clock, where a wall-clock bound
    of 0.6 s (the pool's before 2026-12-06) scored it a timeout; it is not stopped (work past the
    bound still is: test_busy_loops_cannot_ignore_the_deadline)."""
    pool.warm()
    core, every = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    ctx = mp.get_context("spawn")
    events = [ctx.Event() for _ in range(3)]
    hogs = [ctx.Process(target=busy, args=(e,), daemon=True) for e in events]
    workers = [w.proc.pid for w in pool._workers]
    try:
        for hog in hogs:
            hog.start()
        for hog, event in zip(hogs, events):
            assert event.wait(60)
            os.sched_setaffinity(hog.pid, {core})
        for pid in workers:
            os.sched_setaffinity(pid, {core})
        start = time.monotonic()
        assert pool.map(burn, [(0.3,)], timeout=0.6) == [0.3]
        assert time.monotonic() - start > 0.6  # it did wait for the core (a wall-clock bound would have stopped it)
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()
        for pid in workers:
            os.sched_setaffinity(pid, every)


def test_exceptions_and_crashes_are_errors_not_crashes(pool):
    assert pool.map(boom, [()], timeout=5) == [ERROR]
    assert pool.map(die, [(), ()], timeout=5) == [ERROR, ERROR]
    assert pool.map(nap, [(0.0,)], timeout=5) == [0.0]


def test_the_bound_holds_from_a_thread(pool):
    out = []
    t = threading.Thread(target=lambda: out.extend(pool.map(nap, [(60,), (0.0,)], timeout=0.2)))
    start = time.monotonic()
    t.start()
    t.join(timeout=45)
    assert out == [TIMEOUT, 0.0] and time.monotonic() - start < BOUND


def test_jobs_are_spread_over_the_workers(pool):
    pids = pool.warm().map(pid_after, [(0.5,), (0.5,)], timeout=30)
    assert len(set(pids)) == 2 and os.getpid() not in pids
