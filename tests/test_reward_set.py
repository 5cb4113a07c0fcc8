"""The reward registry, user plug-ins, weights and None handling."""

import json

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


@pytest.mark.processes
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


@pytest.mark.processes
def test_columns_and_chat_completions_reach_user_functions(tmp_path):
    """The function runs in a worker process (reward_isolation=process): it writes what it saw to a file."""
    plugin = tmp_path / "cols.py"
    plugin.write_text(
        "import json\n"
        f"SEEN = {str(tmp_path / 'seen.json')!r}\n"
        "def check(completions, prompts, completion_ids, level, answer, **kwargs):\n"
        "    with open(SEEN, 'w') as f:\n"
        "        json.dump(dict(completions=completions, level=level, answer=answer, ids=completion_ids), f)\n"
        "    return [float(l) for l in level]\n"
    )
    rs = RewardSet([f"{plugin}:check"])
    chat = Example([{"role": "user", "content": "hi"}], "7", {"answer": "7", "level": 3})
    scores = rs.score_groups([chat], [[rollout("seven"), rollout("7")]])
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["completions"] == [[{"role": "assistant", "content": "seven"}], [{"role": "assistant", "content": "7"}]]
    assert seen["level"] == [3, 3] and seen["answer"] == ["7", "7"] and seen["ids"] == [[5, 6], [5, 6]]
    assert scores.total == [3.0, 3.0]


def test_dotted_module_path():
    assert resolve_reward("rlvr.rewards.math:accuracy") is REWARDS["accuracy"]


@pytest.mark.processes
@pytest.mark.parametrize(
    "body,message",
    [
        ("return [1.0]", "must return a list of 2 floats or None, got list of length 1"),
        ("return [1.0, 'x']", "returned 'x'; rewards must be finite numbers or None"),
        ("return [1.0, float('inf')]", "returned inf"),
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


def _batch_of(values_source: str, tmp_path, name="f", **kwargs):
    plugin = tmp_path / f"{name}.py"
    plugin.write_text(f"import numpy as np\nimport torch\nimport time\n\ndef {name}(completions, **kwargs):\n    {values_source}\n")
    rs = RewardSet([f"{plugin}:{name}", "boxed_format"], weights=[1.0, 0.5], **kwargs)
    return rs.score_groups([Example("p", "1")], [[rollout("a"), rollout("\\boxed{1}"), rollout("c")]])


@pytest.mark.processes
@pytest.mark.parametrize(
    "source, expected",
    [
        ("return np.array([0.5, 1, 0], dtype=np.float32)", [0.5, 1.0, 0.0]),  # numpy arrays, as TRL takes them
        ("return [np.float32(0.5), np.int64(1), np.bool_(False)]", [0.5, 1.0, 0.0]),
        ("return torch.tensor([0.5, 1.0, 0.0])", [0.5, 1.0, 0.0]),
        ("return [torch.tensor(0.5), 1, None]", [0.5, 1.0, None]),
        ("return [None, float('nan'), np.nan]", [None, None, None]),  # NaN is "not applicable", as in TRL
    ],
)
def test_numpy_and_torch_scores_are_taken(source, expected, tmp_path):
    scores = _batch_of(source, tmp_path)
    assert scores.per_func["f"] == expected
    boxed = [0.0, 1.0, 0.0]
    assert scores.total == [(e or 0.0) + 0.5 * b for e, b in zip(expected, boxed)]


@pytest.mark.processes
def test_a_function_with_no_score_for_anything_is_not_applicable(tmp_path):
    plugin = tmp_path / "none.py"
    plugin.write_text("def none(completions, **kwargs):\n    return [None] * len(completions)\n")
    scores = RewardSet([f"{plugin}:none"]).score_groups([Example("p", "1")], [[rollout("a"), rollout("b")]])
    assert scores.total == [0.0, 0.0] and all(isinstance(t, float) for t in scores.total)
    assert scores.mean("none") != scores.mean("none")  # NaN: no score to average


@pytest.mark.processes
def test_a_slow_reward_function_is_stopped_at_reward_timeout(tmp_path, caplog):
    import time

    start = time.perf_counter()
    scores = _batch_of("time.sleep(30)\n    return [1.0] * len(completions)", tmp_path, name="slow", timeout=1.0)
    assert time.perf_counter() - start < 10
    assert scores.per_func["slow"] == [None, None, None] and scores.counters["slow"]["timeouts"] == 3
    assert scores.per_func["boxed_format"] == [0.0, 1.0, 0.0]  # the other functions still score
    assert "reward function 'slow' ran past reward_timeout=1 s" in caplog.text
    # `except Exception` in the function does not swallow the limit, nor does a busy loop escape it
    scores = _batch_of("try:\n        while True: pass\n    except Exception:\n        return [1.0] * 3", tmp_path, name="busy", timeout=1.0)
    assert scores.per_func["busy"] == [None, None, None]
    # and a function within its limit is untouched
    assert _batch_of("time.sleep(0.1)\n    return [1.0] * 3", tmp_path, name="quick", timeout=1.0).per_func["quick"] == [1.0] * 3
