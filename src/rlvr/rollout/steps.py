"""Process rewards: step scores placed on the tokens where their steps end.

A reward function scores a step of a completion's text with a (char_offset, score) pair, the offset
where the step ends (rewards/__init__.py checks them).  The step ends at the token that holds the
character before that offset: the first token whose decoded prefix of the completion reaches the
offset (a binary search over prefix decodes, the way the text itself was decoded, so a token that
spans the offset takes the step).  A step that ends where the text ends ends at the last token, the
end-of-sequence token or a stop string's included, as scores given as one number do (with any KL
charged to the reward, kl_penalty=reward): the decision to stop is part of the last step.
advantages.step_advantages turns the result into per-token advantages.

With turn_advantage=return, the reward each turn of a multi-turn rollout gave (an environment's Step.reward,
a tool's ToolResult.reward) is a step too, ending at the last token the policy wrote in that turn
(rollout/multiturn.py records it): `turn_steps`.
"""

from __future__ import annotations

from rlvr.errors import RewardError
from rlvr.types import Rollout


def token_steps(steps: list[tuple[int | None, float]], rollout: Rollout, tokenizer, charged: float = 0.0) -> dict[int, float]:
    """One completion's steps (Scores.steps: char offsets, None for the end) -> {token index: score},
    steps that end at the same token added up; `charged`: what a KL in the reward took off its total,
    taken off at the end.  A completion without steps gets one at its end (its score 0, as a total of
    scores that are all None is 0)."""
    if rollout.mask is not None and any(offset is not None for offset, _ in steps):
        raise RewardError("a reward function returned step scores for a multi-turn rollout; step scores "
                          "(char_offset, score) are for single-turn completions")
    last = max(len(rollout.completion_ids) - 1, 0)
    out: dict[int, float] = {}
    for offset, score in steps:
        t = last if offset is None or offset >= len(rollout.text) else token_of(tokenizer, rollout.completion_ids, offset)
        out[t] = out.get(t, 0.0) + score
    if charged or not out:
        out[last] = out.get(last, 0.0) + charged
    return out


def token_of(tokenizer, ids: list[int], offset: int) -> int:
    """The index of the token that holds character offset - 1 of the completion's decoded text: the
    first k whose decoded prefix ids[:k + 1] is at least `offset` characters long (the last token
    where none is, e.g. a text cut at a stop string is shorter than its tokens)."""
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[: mid + 1], skip_special_tokens=True)) >= offset:
            hi = mid
        else:
            lo = mid + 1
    return lo


def turn_steps(rollout: Rollout, steps: dict[int, float]) -> dict[int, float]:
    """`steps` (a rollout's reward as steps by the token each ends at: its total at the last token) with the
    reward of each of its turns (Rollout.info["turn_rewards"]: (token, reward)) added at that turn's last token."""
    out = dict(steps)
    for t, reward in (rollout.info or {}).get("turn_rewards", ()):
        out[t] = out.get(t, 0.0) + reward
    return out
