"""task=gsm8k / math500 / aime: their columns, prompts and graders, on local files in each set's own layout."""

import json
from pathlib import Path

import pytest

from rlvr import cli
from rlvr.settings import check_settings
from rlvr.config import ConfigError, build_config
from rlvr.tasks import build_rewards, load_splits, verifier_name
from rlvr.tasks.dataset import DatasetError
from rlvr.types import Rollout

DATA = Path(__file__).parent / "data" / "presets"


def _cfg(**settings):
    return build_config(settings)


def _splits(cfg, evaluation=False):
    return load_splits(cfg.data_settings, cfg.seed, evaluation=evaluation)


def _grade(cfg, example, texts):
    groups = [[Rollout([1], [2], [0.0], "stop", t) for t in texts]]
    return build_rewards(cfg.reward_settings, cfg.data_settings, with_verifier=True).score_groups([example], groups).per_func[verifier_name(cfg)]


def test_gsm8k_reads_question_and_the_number_after_the_hashes():
    cfg = _cfg(task="gsm8k", dataset=str(DATA / "gsm8k.jsonl"), dataset_test_split="train")  # every row, as rlvr eval would
    _, test = _splits(cfg)
    first = json.loads((DATA / "gsm8k.jsonl").read_text().splitlines()[0])
    assert len(test) == 4
    ex = test[0]
    assert ex.prompt == first["question"] + "\n\nSolve the problem step by step, then write the final number in \\boxed{}."
    assert ex.answer == first["answer"] and ex.answer.endswith("#### 480")
    assert verifier_name(cfg) == "numeric_accuracy"
    assert _grade(cfg, ex, ["... so \\boxed{480}", "\\boxed{481}", "480"]) == [1.0, 0.0, 0.0]  # a bare number is no answer
    train, test = _splits(_cfg(task="gsm8k", dataset=str(DATA / "gsm8k.jsonl")))
    assert (len(train), len(test)) == (3, 1)  # a file without a test split: held out as for any dataset


def test_math500_is_an_evaluation_set_graded_symbolically():
    cfg = _cfg(task="math500", dataset=str(DATA / "math500.jsonl"))
    train, test = _splits(cfg, evaluation=True)
    assert train == [] and len(test) == 4  # every row is a test problem
    ex = test[0]
    assert ex.prompt == ("What is the value of $\\frac{1}{2} + \\frac{1}{3}$?\n\n"
                         "Solve the problem step by step, then write the final answer in \\boxed{}.")
    assert ex.answer == "\\frac{5}{6}" and ex.columns["subject"] == "Prealgebra" and "\\boxed" in ex.columns["solution"]
    assert verifier_name(cfg) == "accuracy"
    assert _grade(cfg, ex, ["\\boxed{\\dfrac{5}{6}}", "\\boxed{10/12}", "\\boxed{0.8}", "no box"]) == [1.0, 1.0, 0.0, 0.0]
    assert _grade(cfg, test[2], ["\\boxed{\\sqrt{50}}", "\\boxed{5\\sqrt 2}", "\\boxed{25}"]) == [1.0, 1.0, 0.0]
    with pytest.raises(DatasetError, match="task=math500 is an evaluation set with no train split"):
        _splits(cfg)  # rlvr train: refused before any model loads


def test_aime_reads_integer_answers():
    cfg = _cfg(task="aime", dataset=str(DATA / "aime.jsonl"))
    _, test = _splits(cfg, evaluation=True)
    assert [ex.answer for ex in test] == ["130", "7", "1"]
    assert test[0].prompt.endswith("write the final answer, an integer from 0 to 999, in \\boxed{}.")
    assert test[0].prompt.startswith("Find the number of positive integers less than $1000$")
    assert verifier_name(cfg) == "numeric_accuracy"
    assert _grade(cfg, test[0], ["\\boxed{130}", "\\boxed{131}", "\\boxed{130.0}"]) == [1.0, 0.0, 1.0]


def test_preset_columns_follow_other_spellings_and_overrides(tmp_path):
    path = tmp_path / "aime25.jsonl"  # e.g. Maxwell-Jia/AIME_2024 capitalises its columns; answers are numbers
    path.write_text("".join(json.dumps({"ID": i, "Problem": f"Find {i} + 1.", "Answer": i + 1}) + "\n" for i in range(3)))
    _, test = _splits(_cfg(task="aime", dataset=str(path)), evaluation=True)
    assert [ex.answer for ex in test] == ["1", "2", "3"] and test[1].prompt.startswith("Find 1 + 1.\n\n")
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"q": f"Find {i}.", "final": str(i), "answer": "x"}) + "\n" for i in range(3)))
    _, test = _splits(_cfg(task="math500", dataset=str(path), prompt_column="q", answer_column="final"), evaluation=True)
    assert [ex.answer for ex in test] == ["0", "1", "2"]
    with pytest.raises(DatasetError, match="has no prompt column \\(looked for problem, Problem, question, prompt\\)"):
        _splits(_cfg(task="aime", dataset=str(path)), evaluation=True)


def test_a_plain_dataset_keeps_the_accuracy_grader_and_its_own_prompts():
    cfg = _cfg(dataset=str(DATA / "gsm8k.jsonl"), dataset_test_split="train")
    _, test = _splits(cfg)
    first = json.loads((DATA / "gsm8k.jsonl").read_text().splitlines()[0])
    assert test[0].prompt == first["question"] and verifier_name(cfg) == "accuracy"


def test_without_a_network_the_hub_default_says_to_pass_a_local_file(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read when the libraries are imported; they may be already
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetError) as e:
        _splits(_cfg(task="math500"), evaluation=True)
    message = str(e.value)
    assert message.startswith("task=math500 reads HuggingFaceH4/MATH-500 from the Hugging Face Hub, which failed (")
    assert message.endswith("pass the dataset as a local file: task=math500 dataset=<file.jsonl, .parquet or .csv>")
    assert "\n" not in message


@pytest.mark.parametrize("settings, message", [
    ({"task": "gsm8k", "task_args": {"num_test": 5}}, "task=gsm8k takes no task_args"),
    ({"task": "math5000"}, "unknown task 'math5000'; built-in tasks: arithmetic, humaneval, countdown, reasoning_gym, gsm8k, math500, aime"),
    ({"task": "humaneval", "dataset": str(DATA / "aime.jsonl")}, "task=humaneval makes its own problems and reads no dataset"),
])
def test_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_settings(build_config(settings))  # tasks are checked at launch


class AlwaysTwo:
    """A sampler that answers every prompt with \\boxed{2}."""

    def generate(self, prompt_ids, params, generator=None):
        return [[Rollout(list(ids), [5], [0.0], "stop", "so \\boxed{2}") for _ in range(params.n)] for ids in prompt_ids]


def test_rlvr_eval_task_math500_with_a_local_file_just_works(tmp_path, tiny_model_dir, monkeypatch):
    import rlvr.rollout.engine

    monkeypatch.setattr(rlvr.rollout.engine, "make_sampler", lambda model, tokenizer, *a, **k: AlwaysTwo())
    out = tmp_path / "eval.json"
    args = ["eval", "task=math500", f"dataset={DATA / 'math500.jsonl'}", f"model={tiny_model_dir}", f"eval_output={out}"]
    assert cli.main(args) == 0
    result = json.loads(out.read_text())
    assert result["n"] == 4 and result["verifier"] == "accuracy"
    assert result["accuracy"] == 0.25  # only "the remainder of 2^10 divided by 7" is 2


def test_rlvr_train_refuses_an_evaluation_set_before_loading_a_model(tmp_path, tiny_model_dir, monkeypatch, capsys):
    import rlvr.run

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(rlvr.run, "load_model", boom)
    args = ["train", "task=aime", f"dataset={DATA / 'aime.jsonl'}", f"model={tiny_model_dir}", f"output_dir={tmp_path / 'run'}"]
    assert cli.main(args) == 2
    assert "task=aime is an evaluation set with no train split" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
