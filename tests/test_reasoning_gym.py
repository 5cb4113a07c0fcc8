"""task=reasoning_gym: reasoning-gym's datasets as a task, scored by their own verifiers; end to end on the tiny model."""

import json
import sys
import time

import pytest

pytest.importorskip("reasoning_gym")

from rlvr import cli  # noqa: E402
from rlvr.config import ConfigError, build_config  # noqa: E402
from rlvr.rewards import check_reward_args  # noqa: E402
from rlvr.settings import check_settings  # noqa: E402
from rlvr.rewards.reasoning_gym import answer_of, reasoning_gym_score  # noqa: E402
from rlvr.tasks import build_rewards, load_splits, verifier_name  # noqa: E402
from rlvr.tasks.reasoning_gym import INSTRUCTION, ReasoningGymTask  # noqa: E402
from rlvr.types import Rollout  # noqa: E402

ARITHMETIC = {"name": "basic_arithmetic", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
              "num_train": 40, "num_test": 8}


def _columns(examples):
    keys = ("question", "answer", "metadata", "rg_dataset", "rg_config")
    return {k: [ex.columns[k] for ex in examples] for k in keys}


def test_splits_come_from_the_dataset_with_its_settings_and_are_disjoint():
    train, test = ReasoningGymTask.splits(ARITHMETIC, seed=1)
    again = ReasoningGymTask.splits(ARITHMETIC, seed=1)
    assert [e.prompt for e in train + test] == [e.prompt for e in again[0] + again[1]]
    assert len(test) == 8 and 0 < len(train) <= 40
    assert not {e.columns["question"] for e in train} & {e.columns["question"] for e in test}
    ex = test[0]
    assert ex.prompt == f"{ex.columns['question']}\n\n{INSTRUCTION}"
    assert ex.columns["metadata"]["num_terms"] == 2  # the dataset's own setting reached it
    assert ex.columns["rg_dataset"] == "basic_arithmetic" and ex.columns["rg_config"]["max_terms"] == 2
    assert ex.answer == ex.columns["answer"] and ex.answer is not None
    other = ReasoningGymTask.splits(ARITHMETIC, seed=2)[1]
    assert [e.prompt for e in other] != [e.prompt for e in test]


def test_the_dataset_scores_the_answer_block():
    _, test = ReasoningGymTask.splits({"name": "leg_counting", "num_train": 2, "num_test": 3}, seed=0)
    right = [f"thinking... <answer> {ex.answer} </answer>" for ex in test]
    wrong = [f"<answer>{int(ex.answer) + 1}</answer>" for ex in test]
    untagged = [ex.answer for ex in test]
    scores = reasoning_gym_score(right + wrong + untagged, **{k: v * 3 for k, v in _columns(test).items()})
    assert scores == [1.0] * 3 + [0.0] * 3 + [0.0] * 3
    assert scores.errors == 0 and scores.timeouts == 0
    assert reasoning_gym_score(right, answer=[ex.answer for ex in test]) == [None] * 3  # not reasoning-gym rows
    assert answer_of("<answer>1</answer> then <answer> 2 </answer>") == "2" and answer_of("<answer> 3") is None


def test_a_scorer_that_raises_or_hangs_scores_zero_and_is_counted(monkeypatch):
    from rlvr.rewards import reasoning_gym as module

    _, test = ReasoningGymTask.splits({"name": "leg_counting", "num_train": 2, "num_test": 1}, seed=0)
    dataset = module._dataset("leg_counting", "{}")

    def broken(answer, entry):
        raise KeyError("metadata")

    monkeypatch.setattr(dataset, "score_answer", broken)
    scores = reasoning_gym_score(["<answer>4</answer>"], **_columns(test))
    assert scores == [0.0] and scores.errors == 1

    def slow(answer, entry):
        time.sleep(10)

    monkeypatch.setattr(dataset, "score_answer", slow)
    start = time.perf_counter()
    scores = reasoning_gym_score(["<answer>4</answer>"], timeout=0.2, **_columns(test))
    assert scores == [0.0] and scores.timeouts == 1 and time.perf_counter() - start < 8  # not the 10 s sleep
    assert check_reward_args("reasoning_gym", {"timeout": 0})[0] == "reward_args.reasoning_gym: timeout must be a positive number of seconds, got 0"


def test_the_task_grades_with_the_reasoning_gym_verifier():
    cfg = build_config({"task": "reasoning_gym", "task_args": ARITHMETIC})
    assert verifier_name(cfg) == "reasoning_gym"
    _, test = load_splits(cfg.data_settings, cfg.seed)
    groups = [[Rollout([1], [2], [0.0], "stop", f"<answer>{test[0].answer}</answer>"), Rollout([1], [2], [0.0], "stop", "no")]]
    assert build_rewards(cfg.reward_settings, cfg.data_settings).score_groups(test[:1], groups).total == [1.0, 0.0]


@pytest.mark.parametrize("task_args, message", [
    ({}, "name is required: one of reasoning-gym's \\d+ datasets, e.g. basic_arithmetic"),
    ({"name": "leg_countin"}, "unknown reasoning-gym dataset 'leg_countin'; did you mean leg_counting"),
    ({"name": "nothing_like_it"}, "unknown reasoning-gym dataset 'nothing_like_it'; valid names include basic_arithmetic, leg_counting"),
    ({"name": "leg_counting", "legs": 3}, "unknown key\\(s\\) \\['legs'\\] for reasoning-gym's leg_counting; its settings: min_animals"),
    ({"name": "leg_counting", "size": 10}, "set num_train and num_test, not size"),
    ({"name": "leg_counting", "min_animals": 5, "max_animals": 2}, "reasoning-gym's leg_counting refuses"),
    ({"name": "leg_counting", "num_test": 0}, "num_test must be a positive integer"),
])
def test_bad_task_args_fail_at_config_check(task_args, message):
    with pytest.raises(ConfigError, match=f"task_args for 'reasoning_gym': {message}"):
        check_settings(build_config({"task": "reasoning_gym", "task_args": task_args}))


def test_without_the_package_the_error_says_what_to_install(monkeypatch, capsys):
    import rlvr.run

    for name in [m for m in sys.modules if m == "reasoning_gym" or m.startswith("reasoning_gym.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(ConfigError, match=r"task=reasoning_gym needs the reasoning-gym package: pip install 'rlvr\[reasoning-gym\]'"):
        check_settings(build_config({"task": "reasoning_gym", "task_args": {"name": "leg_counting"}}))

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(rlvr.run, "load_model", boom)
    assert cli.main(["eval", "task=reasoning_gym", "task_args.name=leg_counting"]) == 2
    assert "pip install 'rlvr[reasoning-gym]'" in capsys.readouterr().err


@pytest.mark.trains
def test_train_and_eval_end_to_end_on_the_tiny_model(tiny_run_config, tiny_model_dir, tmp_path):
    from rlvr.run import train

    cfg = tiny_run_config(tmp_path / "run", task="reasoning_gym", task_args=ARITHMETIC, reward_funcs=None, max_steps=2,
                          save_steps=2, eval_on_end=True, eval_max_examples=4)
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["eval_after"]["n"] == 4
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and "rewards/reasoning_gym/mean" in metrics[0]
    out = tmp_path / "eval.json"
    args = ["eval", "task=reasoning_gym", "task_args.name=leg_counting", "task_args.num_train=4", "task_args.num_test=3",
            "task_args.max_animals=3", f"model={tiny_model_dir}", "max_completion_length=4", f"eval_output={out}"]
    assert cli.main(args) == 0
    result = json.loads(out.read_text())
    assert result["n"] == 3 and result["verifier"] == "reasoning_gym" and 0.0 <= result["accuracy"] <= 1.0
