"""Does a verdict depend on how busy the machine is?  Grades the graded suite twice, on an idle
core and on a core shared with busy loops, under rlvr's bound and under a wall-clock bound.

    python benchmarks/grading_load.py [--timeout 0.5] [--hogs 3]

The cases are tests/rewards/grading_cases.py (every class, the hostile ones included) and the
pathological answers of tests/rewards/test_math_hostile.py; `accuracy` grades them with a symbolic
bound of --timeout seconds, tighter than the default 5 s so that a slow machine shows at once.  The
benchmark pins itself to one core, so the pool's two workers (and those that replace a timed-out one)
run there; "busy" adds --hogs busy loops on that core, so a worker gets about 1 / (hogs + 2) of it.
Two bounds:

- cpu: rlvr's (rewards/pool.py): the CPU seconds the worker spent on the check, then a retry with
  twice the bound (rewards/math.py);
- wall: the pool before 2026-12-06: seconds on the clock, no retry (emulated here: no /proc reading,
  a retry bound of 0).

For each it prints the verdicts that differ between idle and busy, the timeouts, and the seconds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[1] / "tests" / "rewards"), str(Path(__file__).parents[1] / "tests")]

from grading_cases import FINAL_NUMBER, all_cases  # noqa: E402

from rlvr.rewards import math as grading  # noqa: E402
from rlvr.rewards import pool as pools  # noqa: E402

PATHOLOGICAL = [(r"1", r"\boxed{10^{10^{10}}}", False), ("3", r"\boxed{9^{9^{9^{9}}}}", False),
                ("1", r"\boxed{\sum_{k=1}^{10^{12}} k^{k}}", False)]


def busy(ready) -> None:
    ready.set()
    while True:
        pass


def grade(cases, timeout: float) -> tuple[list, str, float]:
    start = time.perf_counter()
    scores = grading.accuracy([c[1] for c in cases], answer=[c[0] for c in cases], timeout=timeout)
    return list(scores), f"{scores.timeouts} / {scores.retries}", time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=0.5)
    parser.add_argument("--hogs", type=int, default=3)
    args = parser.parse_args()
    cases = all_cases() + FINAL_NUMBER + PATHOLOGICAL
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})  # the workers, their replacements and the busy loops inherit it
    read_cpu, retry = pools.cpu_seconds, grading.RETRY_FACTOR
    print(f"{len(cases)} cases, bound {args.timeout} s, two workers on core {core}, busy: {args.hogs} busy loops beside them")
    print(f"{'bound':>6} {'idle s':>7} {'busy s':>7} {'timeouts / retries idle':>24} {'... busy':>9} {'verdicts that differ':>21}")
    for bound in ("cpu", "wall"):
        pools.cpu_seconds = read_cpu if bound == "cpu" else (lambda pid: None)
        grading.RETRY_FACTOR = retry if bound == "cpu" else 0
        pool = pools.WorkerPool(workers=2, preload=("rlvr.rewards.equivalence", "math_verify")).warm()
        grading.shared_pool = lambda pool=pool: pool
        idle, idle_timeouts, idle_seconds = grade(cases, args.timeout)
        ctx = mp.get_context("spawn")
        events = [ctx.Event() for _ in range(args.hogs)]
        hogs = [ctx.Process(target=busy, args=(e,), daemon=True) for e in events]
        try:
            for hog, event in zip(hogs, events):
                hog.start()
                event.wait(60)
            loaded, busy_timeouts, busy_seconds = grade(cases, args.timeout)
        finally:
            for hog in hogs:
                hog.kill()
                hog.join()
            pool.close()
        differ = sum(a != b for a, b in zip(idle, loaded))
        print(f"{bound:>6} {idle_seconds:>7.1f} {busy_seconds:>7.1f} {idle_timeouts:>24} {busy_timeouts:>9} {differ:>21}")
        for case, a, b in zip(cases, idle, loaded):
            if a != b:
                print(f"       idle {a:g}, busy {b:g}: {case[1][:70]!r} against {case[0]!r}")


if __name__ == "__main__":
    main()
