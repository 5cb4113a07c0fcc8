"""The `math_verify` built-in is Math-Verify's own grading as TRL's accuracy_reward does it: the same
verdicts as TRL's function on the same completions, bounded by the grading pool."""

from __future__ import annotations

import pytest

from rlvr.rewards import RewardSet
from rlvr.rewards.math import math_verify

CASES = [  # (reference, completion)
    (r"\frac{1}{3}", r"My answer is \boxed{\frac{1}{3}}"),
    (r"\frac{1}{3}", r"My answer is \boxed{\frac{1}{2}}"),
    ("0.5", r"so \boxed{\frac{1}{2}}"),
    ("8", r"\boxed{3 + 5}"),  # math_verify evaluates it; rlvr's numeric_accuracy would not
    ("12", "the answer is 12"),  # no LaTeX anchor: math_verify's strict mode finds nothing
    ("12", "$12$"),
    (r"x \in [-2, 7]", r"\boxed{[-2, 7]}"),
    ("2", r"First \boxed{2}, then \boxed{3}"),
    (r"\sqrt{8}", r"\boxed{2\sqrt{2}}"),
    ("no latex here at all", r"\boxed{1}"),  # a reference math_verify cannot parse: None
    ("-2", r"7 - 9 = -2, so the answer is \boxed{-2}."),
]


def test_math_verify_gives_trls_accuracy_reward_verdicts():
    trl_rewards = pytest.importorskip("trl.rewards")
    refs, texts = [r for r, _ in CASES], [c for _, c in CASES]
    theirs = trl_rewards.accuracy_reward([[{"role": "assistant", "content": t}] for t in texts], solution=refs)
    ours = math_verify(texts, answer=refs)
    assert list(ours) == theirs
    assert ours.timeouts == ours.errors == 0
    assert 1.0 in ours and 0.0 in ours  # both verdicts occur among the cases


def test_math_verify_is_bounded_and_an_auditor():
    scores = math_verify([r"\boxed{10^{10^{10}}}", r"\boxed{1}"], answer=["1", "1"], timeout=1.0)
    assert list(scores) == [0.0, 1.0] and scores.timeouts == 1  # sympy's power tower runs out of its CPU second, counted
    rewards = RewardSet(["math_verify"])
    assert rewards.names == ["math_verify"]
    with pytest.raises(ValueError, match="timeout must be > 0"):
        math_verify([], answer=[], timeout=0)
