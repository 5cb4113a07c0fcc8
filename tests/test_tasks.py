import json

import pytest

from rlvr.config import build_config
from rlvr.tasks import PromptStream, load_splits
from rlvr.tasks.arithmetic import ArithmeticTask, evaluate_expression
from rlvr.tasks.dataset import DatasetError


def test_arithmetic_is_reproducible_and_splits_are_disjoint():
    args = {"digits": 2, "operands": 3, "operators": "+-*", "num_train": 300, "num_test": 100}
    train_a, test_a = ArithmeticTask.splits(args, seed=1)
    train_b, test_b = ArithmeticTask.splits(args, seed=1)
    assert [e.prompt for e in train_a] == [e.prompt for e in train_b]
    assert len(train_a) == 300 and len(test_a) == 100
    assert not {e.prompt for e in train_a} & {e.prompt for e in test_a}
    assert [e.prompt for e in ArithmeticTask.splits(args, seed=2)[1]] != [e.prompt for e in test_a]


def test_small_problem_spaces_are_partitioned():
    train, test = ArithmeticTask.splits({"digits": 1, "operands": 2, "operators": "+", "num_test": 30}, seed=0)
    assert len(test) == 30 and len(train) == 70  # all 100 problems, none in both
    assert not {e.prompt for e in train} & {e.prompt for e in test}


def test_arithmetic_answers_respect_precedence():
    assert evaluate_expression("2 + 3 * 4") == 14
    assert evaluate_expression("9 - 2 * 3 - 1") == 2
    assert evaluate_expression("7 * 8 * 0 + 5") == 5
    args = {"digits": 1, "operands": 3, "operators": "*-", "num_test": 10, "num_train": 50, "template": "boxed"}
    train, _ = ArithmeticTask.splits(args, 0)
    for ex in train:
        assert ex.answer == str(evaluate_expression(ex.columns["expression"]))
        assert ex.prompt == f"What is {ex.columns['expression']}? Put your final answer in \\boxed{{}}."


def test_templates():
    (ex, *_), _ = ArithmeticTask.splits({"num_test": 10, "num_train": 5}, 0)
    expr = ex.columns["expression"]
    assert ex.prompt.endswith(f"Now you: What is {expr}? Answer in the same way.")  # the default, one-shot
    (ex, *_), _ = ArithmeticTask.splits({"num_test": 10, "num_train": 5, "template": "Compute {expr}."}, 0)
    assert ex.prompt == f"Compute {ex.columns['expression']}."
    with pytest.raises(ValueError, match="text containing \\{expr\\}"):
        ArithmeticTask.check_args({"template": "no placeholder"})


def test_operand_digits():
    train, _ = ArithmeticTask.splits({"digits": 3, "operands": 2, "num_test": 5, "num_train": 20}, 0)
    for ex in train:
        a, _, b = ex.columns["expression"].split()
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999


def test_prompt_stream_covers_each_epoch_once_and_resumes():
    train, _ = ArithmeticTask.splits({"digits": 1, "operands": 2, "num_test": 10, "num_train": 90}, 0)
    stream = PromptStream(train, seed=5)
    first_epoch = stream.take(90)
    assert sorted(e.prompt for e in first_epoch) == sorted(e.prompt for e in train)
    stream.take(7)
    state = stream.state_dict()
    expected = stream.take(20)
    other = PromptStream(train, seed=5)
    other.load_state_dict(state)
    assert [e.prompt for e in other.take(20)] == [e.prompt for e in expected]
    assert stream.epochs_done == pytest.approx(1 + 27 / 90)


# --- datasets ----------------------------------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(**kw):
    return build_config({"task_args": {"num_test": 10}, **kw})


def _splits(cfg):
    return load_splits(cfg.data_settings, cfg.seed)


def test_jsonl_with_text_prompts_and_a_held_out_split(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "ground_truth": i + 1, "difficulty": i % 3} for i in range(50)]
    train, test = _splits(_cfg(dataset=_write_jsonl(tmp_path / "d.jsonl", rows)))
    assert len(train) == 45 and len(test) == 5  # 10% held out
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    ex = train[0]
    i = int(ex.prompt.split()[2])
    assert ex.answer == str(i + 1) and ex.columns["ground_truth"] == i + 1  # the columns as they are
    assert "answer" not in ex.columns  # not a column: reward functions that name `answer` get it (rewards/calls.py)
    assert ex.columns["difficulty"] == i % 3  # extra columns reach the reward functions
    assert "question" not in ex.columns


def test_chat_message_prompts_like_deepmath(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Solve {i}"}], "solution": f"\\boxed{{{i}}}"} for i in range(20)]
    train, _ = _splits(_cfg(dataset=_write_jsonl(tmp_path / "d.jsonl", rows)))
    assert train[0].is_conversational and train[0].answer.startswith("\\boxed{")


def test_parquet_with_configured_columns_and_its_own_test_split(tmp_path):
    import datasets

    rows = {"q": [f"q{i}" for i in range(8)], "final": [str(i) for i in range(8)]}
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(path))
    train, test = _splits(_cfg(dataset=str(path), prompt_column="q", answer_column="final"))
    assert len(train) + len(test) == 8
    assert {e.answer for e in train + test} == {str(i) for i in range(8)}


def test_dataset_errors_name_the_problem(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "hi", "answer": "1"}] * 4)
    with pytest.raises(DatasetError, match="no prompt column .*columns: text, answer. Set prompt_column"):
        _splits(_cfg(dataset=path))
    with pytest.raises(DatasetError, match="prompt_column='nope' is not a column"):
        _splits(_cfg(dataset=path, prompt_column="nope"))
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}] * 5 + [{"prompt": [{"role": "user"}], "answer": "1"}] * 5)
    with pytest.raises(DatasetError, match=r"bad\.jsonl:\d+, column 'prompt': each chat message must be \{role: str, content: str\}"):
        _splits(_cfg(dataset=bad))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "answer": 1}\n{not json\n')
    with pytest.raises(DatasetError, match=r"broken\.jsonl:2: not valid JSON"):
        _splits(_cfg(dataset=str(broken)))


def test_unreachable_hub_dataset_is_a_clear_error(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # the libraries read these variables once, at import: an earlier test may have imported them already,
    # and then the lookup would go to the network and wait for its timeouts
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetError, match="could not load dataset 'someone/not-here'"):
        _splits(_cfg(dataset="someone/not-here"))


def test_the_task_turns_the_final_number_fallback_on_or_off():
    from rlvr.tasks import build_rewards
    from rlvr.types import Example, Rollout

    def score(**task_args):
        cfg = build_config({"task_args": {"num_test": 10, **task_args}})
        groups = [[Rollout([1], [2], [0.0], "stop", "3 + 5 = 8")]]
        return build_rewards(cfg.reward_settings, cfg.data_settings).score_groups([Example("What is 3 + 5?", "8")], groups).total

    assert score() == [0.0]  # the default: only a boxed answer counts
    assert score(final_number=True) == [1.0]


def test_prompt_stream_without_shuffle_serves_the_dataset_order_every_epoch_and_resumes():
    train, _ = ArithmeticTask.splits({"digits": 1, "operands": 2, "num_test": 10, "num_train": 12}, 0)
    prompts = [e.prompt for e in train]
    stream = PromptStream(train, seed=5, shuffle=False)
    assert [e.prompt for e in stream.take(30)] == prompts + prompts + prompts[:6]  # shuffle_dataset=false, as TRL
    other = PromptStream(train, seed=5, shuffle=False)
    other.load_state_dict(stream.state_dict())
    assert [e.prompt for e in other.take(10)] == [e.prompt for e in stream.take(10)] == prompts[6:] + prompts[:4]
    assert [e.prompt for e in PromptStream(train, seed=5).take(12)] != prompts  # the default shuffles


def test_epochs_completed_counts_a_pass_when_its_last_prompt_is_taken():
    train, _ = ArithmeticTask.splits({"digits": 1, "operands": 2, "num_test": 10, "num_train": 5}, 0)
    stream = PromptStream(train, seed=0)
    seen = []
    for _ in range(5):
        stream.take(2)
        seen.append(stream.epochs_completed)
    assert seen == [0, 0, 1, 1, 2]  # 2, 4, 6 (one pass + 1), 8, 10 prompts taken of 5


def test_prompt_stream_within_an_epoch_gives_a_short_last_batch_then_the_next_epoch():
    from rlvr.types import Example

    """SFT's and DPO's steps, as transformers' dataloader: 5 rows in batches of 2 are 2, 2, 1, then a new epoch."""
    examples = [Example(prompt=str(i), answer=str(i)) for i in range(5)]
    stream = PromptStream(examples, seed=0, shuffle=False)
    sizes = [len(stream.take(2, within_epoch=True)) for _ in range(4)]
    assert sizes == [2, 2, 1, 2] and stream.epoch == 1 and stream.index == 2
    wrapped = PromptStream(examples, seed=0, shuffle=False)  # GRPO's: a step's prompts run on into the next epoch
    assert [e.prompt for e in wrapped.take(3) + wrapped.take(3)] == ["0", "1", "2", "3", "4", "0"]

