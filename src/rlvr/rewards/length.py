"""Length and repetition shaping: rewards that add to a verifier, never replace it.

Lengths are in tokens, from the `completion_ids` keyword argument (the completion's
tokens, EOS included when it was sampled).  The maximum length defaults to the run's
`max_completion_length`, which reaches reward functions as a keyword argument too.
"""

from __future__ import annotations

import math

from rlvr.rewards.math import accuracy
from rlvr.types import Completion, completion_text


def soft_overlong(completions: list[Completion], *, max_length: int | None = None, cache: int | None = None,
                  completion_ids: list[list[int]] | None = None, max_completion_length: int | None = None,
                  **kwargs) -> list[float]:
    """DAPO's soft overlong punishment (eq. 13, https://arxiv.org/abs/2503.14476).

    With L the completion's length in tokens, Lmax = `max_length` and Lc = `cache`:

        0                        if L <= Lmax - Lc
        (Lmax - Lc - L) / Lc     if Lmax - Lc < L <= Lmax   (from 0 down to -1)
        -1                       if L > Lmax

    `max_length` defaults to `max_completion_length`; `cache` to Lmax // 5 (DAPO used
    Lmax = 20480 and Lc = 4096, i.e. 20%).  cache = 0 gives a hard cut: 0 up to Lmax, -1 beyond.
    """
    limit = _max_length("soft_overlong", max_length, max_completion_length)
    cache = limit // 5 if cache is None else cache
    if not 0 <= cache <= limit:
        raise ValueError(f"soft_overlong: cache must be between 0 and max_length ({limit}), got {cache}")
    scores = []
    for length in _lengths("soft_overlong", completion_ids, len(completions)):
        if length <= limit - cache:
            scores.append(0.0)
        elif length <= limit:
            scores.append((limit - cache - length) / cache)
        else:
            scores.append(-1.0)
    return scores


def cosine_length(completions: list[Completion], *, max_length: int | None = None,
                  correct_at_0: float = 2.0, correct_at_max: float = 1.0,
                  wrong_at_0: float = -10.0, wrong_at_max: float = 0.0, exceed: float = -10.0,
                  answer: list | None = None, completion_ids: list[list[int]] | None = None,
                  max_completion_length: int | None = None, **kwargs) -> list[float | None]:
    """Cosine length scaling of correctness ("Demystifying Long Chain-of-Thought Reasoning
    in LLMs", section 4, https://arxiv.org/abs/2502.03373).

    With L the length in tokens, Lmax = `max_length`, and (at_0, at_max) the reward at
    L = 0 and at L = Lmax, chosen by whether `accuracy` grades the completion correct:

        r = at_max + 0.5 (at_0 - at_max) (1 + cos(pi L / Lmax))

    (the paper's min + 0.5 (max - min)(1 + cos(...)) with min = at_max, max = at_0).
    Defaults are the paper's: correct 2.0 -> 1.0 (shorter is better), wrong -10.0 -> 0.0
    (when wrong, thinking longer is better), and `exceed` = -10.0, a fixed reward for a
    completion that is too long: L > Lmax, or L >= max_completion_length (the sampler cut
    it off, so its answer is lost; with the default Lmax = max_completion_length this is
    L >= Lmax).  A completion with no answer counts as wrong; None where a row has no reference.
    """
    limit = _max_length("cosine_length", max_length, max_completion_length)
    lengths = _lengths("cosine_length", completion_ids, len(completions))
    graded = accuracy(completions, answer=answer)
    scores = []
    for length, correct in zip(lengths, graded):
        cut_off = max_completion_length is not None and length >= max_completion_length
        if correct is None:
            scores.append(None)
        elif length > limit or cut_off:
            scores.append(float(exceed))
        else:
            at_0, at_max = (correct_at_0, correct_at_max) if correct else (wrong_at_0, wrong_at_max)
            scores.append(at_max + 0.5 * (at_0 - at_max) * (1.0 + math.cos(math.pi * length / limit)))
    return scores


def repetition_penalty(completions: list[Completion], *, n: int = 3, max_penalty: float = 1.0,
                       **kwargs) -> list[float]:
    """N-gram repetition penalty ("Demystifying Long Chain-of-Thought Reasoning in LLMs",
    https://arxiv.org/abs/2502.03373), per completion rather than per token:

        penalty = -max_penalty * (total - distinct) / total

    over the completion's n-grams of whitespace-separated words (case-sensitive), where
    total = words - n + 1 and distinct counts each different n-gram once.  0.0 when there
    are fewer than n words (no n-gram) or no n-gram repeats; -max_penalty approached when
    one n-gram fills the completion.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"repetition_penalty: n must be a positive whole number, got {n!r}")
    if max_penalty < 0:
        raise ValueError(f"repetition_penalty: max_penalty is a size and must be >= 0, got {max_penalty}")
    scores = []
    for completion in completions:
        words = completion_text(completion).split()
        total = len(words) - n + 1
        if total <= 0:
            scores.append(0.0)
            continue
        repeated = total - len(set(zip(*(words[i:] for i in range(n)))))
        scores.append(-max_penalty * repeated / total if repeated else 0.0)
    return scores


def _max_length(name: str, max_length: int | None, max_completion_length: int | None) -> int:
    limit = max_length if max_length is not None else max_completion_length
    if limit is None:
        raise ValueError(
            f"{name} needs a maximum length: set reward_args.{name}.max_length, "
            "or call it with max_completion_length (the trainer passes it)"
        )
    if limit < 1:
        raise ValueError(f"{name}: max_length must be at least 1 token, got {limit}")
    return int(limit)


def _lengths(name: str, completion_ids: list[list[int]] | None, n: int) -> list[int]:
    if completion_ids is None:
        raise ValueError(f"{name} measures length in tokens and needs the completion_ids keyword argument")
    if len(completion_ids) != n:
        raise ValueError(f"{name}: got {n} completions but {len(completion_ids)} completion_ids; they must be aligned")
    return [len(ids) for ids in completion_ids]
