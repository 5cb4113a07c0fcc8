"""TRL's reward functions under TRL's names (trl.rewards), on rlvr's verifiers, so that TRL's GRPO
script runs with `from rlvr.rewards import ...`:

    reasoning_accuracy_reward    rlvr's `accuracy` (rewards/math.py) on the text after the reasoning (after the
                                 last `</think>`); 0.0 without one (`accuracy_reward` is `accuracy` itself)
    think_format_reward          1.0 when the completion opens with one <think> ... </think> block, else 0.0
    get_soft_overlong_punishment DAPO's soft overlong punishment with fixed lengths (rlvr's `soft_overlong`)
"""

from __future__ import annotations

from rlvr.rewards.length import soft_overlong
from rlvr.rewards.math import accuracy
from rlvr.types import Completion, completion_text

__all__ = ["reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"]

THINK, END_THINK = "<think>", "</think>"


def reasoning_accuracy_reward(completions: list[Completion], solution: list | None = None, answer: list | None = None,
                              reasoning_delimiters: list[str] | None = None, **kwargs) -> list:
    """`accuracy` on what follows the last reasoning delimiter (default `</think>`); 0.0 for a
    completion that never closes its reasoning (its answer would be a guess inside the reasoning)."""
    delimiters = reasoning_delimiters or [END_THINK]
    finals, closed = [], []
    for completion in completions:
        text = completion_text(completion)
        ends = [text.rfind(d) + len(d) for d in delimiters if d in text]
        closed.append(bool(ends))
        finals.append(text[max(ends):] if ends else "")
    scores = accuracy(finals, solution if solution is not None else answer, **kwargs)
    return [score if ok or score is None else 0.0 for score, ok in zip(scores, closed)]


def think_format_reward(completions: list[Completion], **kwargs) -> list[float]:
    """1.0 when the text opens with <think>, has no second <think>, and closes the block with </think>; else 0.0."""
    out = []
    for completion in completions:
        text = completion_text(completion)
        ok = text.startswith(THINK) and text.count(THINK) == 1 and END_THINK in text[len(THINK):]
        out.append(1.0 if ok else 0.0)
    return out


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int):
    """A reward function: 0 up to max_completion_len - soft_punish_cache tokens, then down to -1 at
    max_completion_len, -1 beyond (DAPO, eq. 13; rlvr's soft_overlong with these lengths)."""

    def soft_overlong_punishment(completions: list[Completion], completion_ids: list[list[int]] | None = None, **kwargs):
        return soft_overlong(completions, max_length=max_completion_len, cache=soft_punish_cache, completion_ids=completion_ids)

    return soft_overlong_punishment
