"""How fast are completions graded? Prints completions graded per second.

    python benchmarks/grading.py [--n 2000] [--workers 1 2 4] [--timeout 5]

The batch mixes what training produces: plain numbers (decided in the parent,
no worker), LaTeX fractions and units, symbolic answers that need math_verify
(sent to the worker pool), answers with no box, and a few pathological ones
that hit the timeout.  Worker start-up is excluded (the pool is warmed first).
"""

from __future__ import annotations

import argparse
import random
import time

from rlvr.rewards import math as grading
from rlvr.rewards.equivalence import cheap_verdict
from rlvr.rewards.pool import WorkerPool


def make_batch(n: int, seed: int = 0, pathological: int = 2):
    rng = random.Random(seed)
    completions, refs = [], []
    for i in range(n - pathological):
        kind = rng.random()
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        if kind < 0.55:  # a plain number, right or wrong
            completions.append(f"{a} + {b} = {a + b}, so the answer is \\boxed{{{a + b + rng.choice([0, 0, 1])}}}.")
            refs.append(str(a + b))
        elif kind < 0.75:  # LaTeX number forms
            completions.append(f"Hence $\\boxed{{\\dfrac{{{a}}}{{{b}}}}}$")
            refs.append(f"{a / b:.10f}")
        elif kind < 0.95:  # symbolic: needs math_verify
            completions.append(f"Expanding, \\boxed{{x^2 + {2 * a}x + {a * a}}}")
            refs.append(f"(x+{a + rng.choice([0, 1])})^2")
        else:  # no answer at all
            completions.append("I am not sure how to solve this. " * 5)
            refs.append(str(a))
    for _ in range(pathological):
        completions.append(r"\boxed{10^{10^{10}}}")
        refs.append("1")
    order = list(range(n))
    rng.shuffle(order)
    return [completions[i] for i in order], [refs[i] for i in order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    completions, refs = make_batch(args.n)
    print(f"{args.n} completions, symbolic timeout {args.timeout} s")
    print(f"{'workers':>8} {'seconds':>9} {'graded/s':>10} {'symbolic':>9} {'timeouts':>9} {'mean reward':>12}")
    for workers in args.workers:
        pool = WorkerPool(workers=workers, preload=("rlvr.rewards.equivalence",)).warm()
        grading.shared_pool = lambda pool=pool: pool  # grade with this pool
        start = time.perf_counter()
        scores = grading.accuracy(completions, answer=refs, timeout=args.timeout)
        seconds = time.perf_counter() - start
        symbolic = sum(1 for p, r in zip(completions, refs) if cheap_verdict(grading.extract_answer(p) or "x", r) is None)
        print(f"{workers:>8} {seconds:>9.2f} {args.n / seconds:>10.0f} {symbolic:>9} {scores.timeouts:>9} {sum(scores) / len(scores):>12.3f}")
        pool.close()


if __name__ == "__main__":
    main()
