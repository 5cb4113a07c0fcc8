"""The reward registry, user plug-ins, weights and None handling."""

import pytest

from rlvr.rewards import REWARDS, RewardError, RewardSet, resolve_reward
from rlvr.types import Example, Rollout


def rollout(text):
    return Rollout(prompt_ids=[1], completion_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop", text=text)


def test_weighted_total_and_per_function_scores():
    rs = RewardSet(["accuracy", "boxed_format"], [1.0, 0.2])
    ex = Example("What is 2+2?", "4", {"answer": "4"})
    scores = rs.score_groups([ex], [[rollout("\\boxed{4}"), rollout("\\boxed{5}"), rollout("4")]])
    assert scores.per_func == {"accuracy": [1.0, 0.0, 0.0], "boxed_format": [1.0, 1.0, 0.0]}
    assert scores.total == pytest.approx([1.2, 0.2, 0.0])


def test_none_is_left_out_of_the_mean_and_counts_zero_in_the_total(tmp_path):
    plugin = tmp_path / "my_rewards.py"
    plugin.write_text(
        "def only_long(completions, **kwargs):\n"
        "    return [1.0 if len(c) > 3 else None for c in completions]\n"
    )
    rs = RewardSet([f"{plugin}:only_long", "boxed_format"], [2.0, 1.0])
    scores = rs.score_groups([Example("p", None)], [[rollout("\\boxed{1}"), rollout("ab")]])
    assert scores.per_func["only_long"] == [1.0, None]
    assert scores.mean("only_long") == 1.0
    assert scores.total == [3.0, 0.0]


def test_columns_and_chat_completions_reach_user_functions(tmp_path):
    plugin = tmp_path / "cols.py"
    plugin.write_text(
        "SEEN = {}\n"
        "def check(completions, prompts, completion_ids, level, answer, **kwargs):\n"
        "    SEEN.update(completions=completions, level=level, answer=answer, ids=completion_ids)\n"
        "    return [float(l) for l in level]\n"
    )
    fn = resolve_reward(f"{plugin}:check")
    rs = RewardSet([f"{plugin}:check"])
    chat = Example([{"role": "user", "content": "hi"}], "7", {"answer": "7", "level": 3})
    scores = rs.score_groups([chat], [[rollout("seven"), rollout("7")]])
    seen = fn.__globals__["SEEN"]
    assert seen["completions"] == [[{"role": "assistant", "content": "seven"}], [{"role": "assistant", "content": "7"}]]
    assert seen["level"] == [3, 3] and seen["answer"] == ["7", "7"] and seen["ids"] == [[5, 6], [5, 6]]
    assert scores.total == [3.0, 3.0]


def test_dotted_module_path():
    assert resolve_reward("rlvr.rewards.math:accuracy") is REWARDS["accuracy"]


@pytest.mark.parametrize(
    "body,message",
    [
        ("return [1.0]", "must return a list of 2 floats or None, got list of length 1"),
        ("return [1.0, 'x']", "returned 'x'; rewards must be finite numbers or None"),
        ("return [1.0, float('nan')]", "returned nan"),
        ("raise KeyError('answer')", "reward function 'bad' raised KeyError"),
    ],
)
def test_broken_user_functions_fail_with_their_name(tmp_path, body, message):
    plugin = tmp_path / "b.py"
    plugin.write_text(f"def bad(completions, **kwargs):\n    {body}\n")
    rs = RewardSet([f"{plugin}:bad"])
    with pytest.raises(RewardError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        rs.score_groups([Example("p", "1")], [[rollout("a"), rollout("b")]])


def test_unknown_names_list_the_choices():
    with pytest.raises(ValueError, match="built-in: accuracy, numeric_accuracy, signed_accuracy, format, boxed_format"):
        resolve_reward("acc")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve_reward("rlvr.rewards.math:nope")
