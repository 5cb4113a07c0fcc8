r"""Format rewards: does a completion lay out its answer the way the prompt asked?

They score layout only, never correctness; pair them with `rewards.math.accuracy`.
Only linear string methods touch the text, so any length is safe.
"""

from __future__ import annotations

from rlvr.rewards.math import extract_boxed
from rlvr.types import Completion, completion_text

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def think_answer_format(completions: list[Completion], **kwargs) -> list[float]:
    """1.0 for exactly ``<think>...</think>`` then ``<answer>...</answer>``, both non-empty
    and nothing but whitespace around them; 0.5 when the last ``<answer>`` block is
    non-empty but the layout is not that (no think, junk around, repeated tags);
    0.0 otherwise."""
    return [_think_answer_score(completion_text(c)) for c in completions]


def boxed_format(completions: list[Completion], **kwargs) -> list[float]:
    r"""1.0 if the completion has a non-empty ``\boxed{}`` answer, else 0.0."""
    scores = []
    for completion in completions:
        boxed = extract_boxed(completion_text(completion))
        scores.append(1.0 if boxed is not None and boxed.strip() else 0.0)
    return scores


def _think_answer_score(text: str) -> float:
    answer_end = text.rfind("</answer>")
    answer_start = text.rfind("<answer>", 0, max(answer_end, 0))
    if answer_end < 0 or answer_start < 0:
        return 0.0
    if not text[answer_start + len("<answer>"):answer_end].strip():
        return 0.0
    return 1.0 if _is_strict(text) else 0.5


def _is_strict(text: str) -> bool:
    """One think block, then one answer block, only whitespace around; think non-empty."""
    if any(text.count(tag) != 1 for tag in _TAGS):
        return False
    body = text.strip()
    if not (body.startswith("<think>") and body.endswith("</answer>")):
        return False
    think_end = body.index("</think>")
    answer_start = body.index("<answer>")
    between = body[think_end + len("</think>"):answer_start]
    thought = body[len("<think>"):think_end]
    return think_end < answer_start and not between.strip() and bool(thought.strip())
