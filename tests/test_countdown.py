"""task=countdown and its verifier: the rules on hand cases, hostile output, and the generated splits."""

import time

import pytest

from rlvr.settings import check_settings
from rlvr.config import ConfigError, build_config
from rlvr.rewards import REWARDS, check_reward_args
from rlvr.rewards.countdown import check_expression, countdown, extract_expression
from rlvr.tasks import build_rewards, load_splits, verifier_name
from rlvr.tasks.countdown import CountdownTask
from rlvr.types import Example, Rollout


def score(text, nums=(3, 5, 7), target=16, **kwargs):
    return countdown([text], nums=[list(nums)], target=[target], **kwargs)[0]


@pytest.mark.parametrize("text, expected", [
    ("<answer> (3 + 5) + 7 + 1 </answer>", 0.0),  # 1 is not given
    ("<answer> 3 + 5 + 7 </answer>", 0.0),  # 15, not 16
    ("<answer>7 * 3 - 5</answer>", 1.0),  # 21 - 5 = 16, each number once
    ("I think <answer> 7*3 - 5 = 16 </answer>", 1.0),  # a trailing `= target` is allowed
    ("<answer> 7*3 - 5 = 17 </answer>", 0.0),  # ... but not a wrong one
    ("The answer is \\boxed{7 \\times 3 - 5}.", 1.0),  # a box, LaTeX's times
    ("$\\boxed{(7 × 3) − 5}$", 1.0),  # Unicode times and minus
    ("<answer> 7 * 3 - 5 </answer> no, \\boxed{3 + 5 + 7}", 1.0),  # the answer block comes first
    ("<answer> 7 * 7 - 3 - 5 </answer>", 0.0),  # 7 used twice (49 - 8 = 41 anyway, and not allowed)
    ("<answer> 21 - 5 </answer>", 0.0),  # 3 and 7 left out, 21 not given
    ("<answer> 7 * 3 </answer>", 0.0),  # 5 left out
    ("7 * 3 - 5", 0.0),  # no answer block, no box
    ("<answer> (7 * 3 - 5) / 0 </answer>", 0.0),  # division by zero
])
def test_hand_cases(text, expected):
    assert score(text) == expected


def test_a_number_used_twice_is_refused_even_when_it_reaches_the_target():
    # 4 + 4 + 8 = 16 reaches the target only by using 4 twice; the numbers given are 4, 8, 2
    assert not check_expression("4 + 4 + 8", [4, 8, 2], 16)
    assert check_expression("(4 + 8) * 2 - 8", [4, 8, 2, 8], 16)  # given twice, used twice: fine
    assert not check_expression("4 * 2 + 8", [4, 8, 2, 8], 16)  # the second 8 left out


def test_use_all_false_allows_leaving_numbers_out_but_not_reusing_them():
    assert score("<answer> 7 + 7 + 2 </answer>", nums=(7, 2, 5), use_all=False) == 0.0  # 7 twice
    assert score("<answer> 7 * 2 + 2 </answer>", nums=(7, 2, 5), use_all=False) == 0.0  # 2 twice
    assert score("<answer> 3 * 5 + 1 </answer>", nums=(3, 5, 1, 9), use_all=False) == 1.0
    assert score("<answer> 3 * 5 + 1 </answer>", nums=(3, 5, 1, 9)) == 0.0  # the default: 9 must be used


def test_divisions_must_be_exact_everywhere():
    # 7 / 2 = 3.5, and 3.5 * 4 + 2 = 16: the target, but through a non-integer intermediate
    assert not check_expression("7 / 2 * 4 + 2", [7, 2, 4, 2], 16)
    assert check_expression("8 / 2 * 4", [8, 2, 4], 16)  # 8 / 2 = 4 exactly
    assert check_expression("(10 - 4) / 3 * 8", [10, 4, 3, 8], 16)
    assert not check_expression("(10 - 3) / 3 * 8", [10, 3, 3, 8], 16)  # 7 / 3
    assert check_expression("-(2 - 10) * 2", [2, 10, 2], 16)  # a leading minus and a negative intermediate


@pytest.mark.parametrize("text", [
    "<answer> __import__('os').system('echo hi') </answer>",
    "<answer> 2 ** 4 </answer>",  # a power
    "<answer> 9**9**9**9 + 3 + 5 + 7 </answer>",
    "<answer> 10**10**10 </answer>",
    "<answer> 33 // 2 </answer>",
    "<answer> 7.0 * 3 - 5 </answer>",  # only integers
    "<answer> ٧ * ٣ - ٥ </answer>",  # Arabic-Indic digits
    "<answer> ７ * ３ - ５ </answer>",  # full-width digits
    "<answer> 07 * 3 - 5 </answer>",  # a leading zero
    "<answer> (7)(3) - 5 </answer>",  # a call
    "<answer> x = 7 * 3 - 5 </answer>",
    "<answer> 7 * 3 - 5 if 1 else 0 </answer>",
    "<answer> " + "(" * 500 + "7 * 3 - 5" + ")" * 500 + " </answer>",  # deep nesting
    "<answer> " + " + ".join(["3"] * 5000) + " </answer>",  # very long
    "<answer>" * 5000 + "7 * 3 - 5",  # never closed
    "\\boxed{" * 3000,
    "<answer> 7 * 3 - 5 \x00 </answer>",
    "<answer></answer>",
    "",
])
def test_hostile_output_scores_zero_quickly(text):
    start = time.perf_counter()
    assert score(text) == 0.0
    assert time.perf_counter() - start < 0.5


def test_redundant_parentheses_within_the_length_limit_are_fine():
    assert score("<answer> " + "(" * 90 + "7 * 3 - 5" + ")" * 90 + " </answer>") == 1.0


def test_extraction():
    assert extract_expression("work... <answer> 1 + 2 </answer>") == "1 + 2"
    assert extract_expression("<answer>\\boxed{1 + 2}</answer>") == "1 + 2"
    assert extract_expression("\\boxed{\\left(1 + 2\\right) \\cdot 3}") == "(1 + 2) * 3"
    assert extract_expression("<answer> 1 + 2 = 3 </answer>", 3) == "1 + 2"
    assert extract_expression("<answer> 1 + 2 = 3 = 3 </answer>", 3) is None
    assert extract_expression("nothing here") is None


def test_reward_rows_and_references():
    completions = ["<answer> 7 * 3 - 5 </answer>"] * 3
    scores = countdown(completions, nums=[[3, 5, 7], "[3, 5, 7]", None], target=[16, "16", None])
    assert scores == [1.0, 1.0, None]  # nums as JSON text and the target as a string are read; no numbers: not applicable
    assert countdown(completions, answer=["x"] * 3) == [None] * 3  # not a countdown dataset
    with pytest.raises(ValueError, match="`nums` column must hold a list of integers"):
        countdown(completions[:1], nums=[["a"]], target=[1])
    chat = [[{"role": "assistant", "content": "<answer> 7 * 3 - 5 </answer>"}]]
    assert countdown(chat, nums=[[3, 5, 7]], target=[16]) == [1.0]
    assert check_reward_args("countdown", {"use_all": False}) == []
    assert check_reward_args("countdown", {"use_all": "no"})[0].startswith("reward_args.countdown: use_all must be true or false")
    assert "countdown" in REWARDS


# --- the task ----------------------------------------------------------------------------------


def test_splits_are_deterministic_disjoint_and_solvable():
    args = {"count": [3, 4], "num_train": 300, "num_test": 50}
    train, test = CountdownTask.splits(args, seed=3)
    again_train, again_test = CountdownTask.splits(args, seed=3)
    assert [e.prompt for e in train] == [e.prompt for e in again_train] and [e.prompt for e in test] == [e.prompt for e in again_test]
    assert [e.prompt for e in CountdownTask.splits(args, seed=4)[1]] != [e.prompt for e in test]
    assert len(train) == 300 and len(test) == 50

    def key(e):
        return tuple(sorted(e.columns["nums"])), e.columns["target"]

    assert not {key(e) for e in train} & {key(e) for e in test}
    assert len({key(e) for e in train}) == 300
    assert {len(e.columns["nums"]) for e in train} == {3, 4}
    for e in train + test:  # the generating expression is a solution the verifier accepts
        assert 1 <= e.columns["target"] <= 100 and all(1 <= n <= 99 for n in e.columns["nums"])
        assert check_expression(e.answer, e.columns["nums"], e.columns["target"]), e.answer


def test_prompt_templates_and_worked_solution():
    (ex, *_), _ = CountdownTask.splits({"num_train": 5, "num_test": 5}, 0)
    nums, target = ex.columns["nums"], ex.columns["target"]
    assert ex.prompt.startswith(f"Using the numbers [{', '.join(map(str, nums))}], write an arithmetic expression that equals {target}.")
    assert "<answer>" in ex.prompt
    assert score(CountdownTask.solution(ex), nums, target) == 1.0
    (ex, *_), _ = CountdownTask.splits({"num_train": 5, "num_test": 5, "template": "boxed"}, 0)
    assert "\\boxed{" in ex.prompt and "\\boxed{" in CountdownTask.solution(ex)
    assert score(CountdownTask.solution(ex), ex.columns["nums"], ex.columns["target"]) == 1.0
    (ex, *_), _ = CountdownTask.splits({"num_train": 5, "num_test": 5, "template": "{numbers} -> {target}"}, 0)
    assert ex.prompt == f"{ex.columns['nums']} -> {ex.columns['target']}"


@pytest.mark.parametrize("args, message", [
    ({"count": 1}, "count must be from 2 to 6"),
    ({"count": [4, 3]}, "count must be from 2 to 6"),
    ({"count": "3"}, "count must be an integer or"),
    ({"min_number": 10, "max_number": 5}, "min_number=10 is above max_number=5"),
    ({"min_target": 0, "max_target": -1}, "min_target=0 is above max_target=-1"),
    ({"num_test": 0}, "num_test must be at least 1"),
    ({"template": "no placeholders"}, "text containing {numbers} and {target}"),
    ({"digits": 2}, "unknown key"),
])
def test_bad_task_args_fail_at_config_check(args, message):
    with pytest.raises(ConfigError, match=f"task_args for 'countdown': .*{message}".replace("[", r"\[").replace("{", r"\{")):
        check_settings(build_config({"task": "countdown", "task_args": args}))


def test_a_problem_space_too_small_says_how_to_widen_it():
    cfg = build_config({"task": "countdown", "task_args": {"count": 2, "max_number": 2, "num_train": 50, "num_test": 5}})
    with pytest.raises(ValueError, match="could draw only .* widen the number or target range"):
        load_splits(cfg.data_settings, cfg.seed)


def test_the_task_grades_with_its_verifier():
    cfg = build_config({"task": "countdown", "task_args": {"num_train": 10, "num_test": 5}})
    assert verifier_name(cfg) == "countdown"
    ex = Example("p", "7 * 3 - 5", {"nums": [3, 5, 7], "target": 16, "answer": "7 * 3 - 5"})
    groups = [[Rollout([1], [2], [0.0], "stop", "<answer>7*3-5</answer>"), Rollout([1], [2], [0.0], "stop", "<answer>16</answer>")]]
    assert build_rewards(cfg.reward_settings, cfg.data_settings).score_groups([ex], groups).total == [1.0, 0.0]


def test_a_generated_task_refuses_a_dataset():
    with pytest.raises(ConfigError, match="task=countdown makes its own problems and reads no dataset"):
        check_settings(build_config({"task": "countdown", "dataset": "x.jsonl"}))
