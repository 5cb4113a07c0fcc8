"""pass@k and maj@k: pure functions over counts and answers.

pass@k, the unbiased estimator of Chen et al. 2021 (Codex, https://arxiv.org/abs/2107.03374,
eq. 1): from n samples of which c are correct, the probability that at least one
of k samples drawn without replacement is correct,

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

The product form avoids the huge binomials; it is the paper's numpy code, in plain Python.

maj@k (majority voting, "self-consistency", Wang et al. 2022, https://arxiv.org/abs/2203.11171):
the answer most of the k samples give is the one submitted.  Decisions:
- samples without an answer (None) do not vote; when no sample answers, maj@k is 0;
- a tie is won by the answer that appears first among the samples (in sample order), so
  the result is deterministic and does not depend on how answers sort;
- it is computed on the first k samples, not averaged over subsets (so maj@k with k < n is
  not reported by `rlvr eval`, which gives maj@n only).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples include a correct one."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every draw of k samples contains a correct one
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def majority_index(answers: Sequence[Hashable | None]) -> int | None:
    """Index of the first sample giving the most common answer (ties: the earliest answer); None if none answer."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    return next(i for i, a in enumerate(answers) if a is not None and counts[a] == top)


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """1.0 if the majority answer of the first k samples is correct, else 0.0 (see the module docstring)."""
    if len(answers) != len(correct):
        raise ValueError(f"got {len(answers)} answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(answers):
        raise ValueError(f"need 1 <= k <= {len(answers)} samples, got k={k}")
    winner = majority_index(answers[:k])
    return 0.0 if winner is None else float(correct[winner])


def ks_to_report(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself: [1, 2, 4, 5] for n = 5."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]
