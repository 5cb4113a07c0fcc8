"""`evaluate` and `rlvr eval`: k samples, pass@k / maj@k / mean@k, n-shot prompts, GSM8K and MATH files.

A scripted sampler stands in for the model where exact numbers matter: it finds
which question a prompt ends with and returns that question's scripted completions.
"""

import json

import pandas as pd
import pytest

from rlvr import cli
from rlvr.config import ConfigError, build_config
from rlvr.loop import evaluate_run as evaluate
from rlvr.rewards import RewardSet
from rlvr.rewards.math import reference_answer
from rlvr.tasks import load_splits
from rlvr.types import Example, Rollout

GSM8K = [
    {"question": "what is 70 + 2?", "answer": "she adds 70 and 2.\n70 + 2 = 72\n#### 72"},
    {"question": "what is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
]
MATH = [{"problem": "what is 1/2 as a fraction?", "solution": "one half is $\\boxed{\\frac{1}{2}}$."}]
SCRIPT = {
    # c = 1: pass@1 1/4, pass@2 1 - C(3,2)/C(4,2) = 1/2, pass@4 1; 71 wins the vote 2-1: maj wrong
    "what is 70 + 2?": ["so \\boxed{72}", "\\boxed{71}", "\\boxed{71}", "no idea"],
    # c = 4 (GSM8K's own `#### 7` layout is read too): pass@k 1, maj right
    "what is 3 + 4?": ["\\boxed{7}", "#### 7", "the answer is 7.", "\\boxed{7}"],
    # c = 3, every form of one half is one vote: pass@1 3/4, pass@2 1 (n - c = 1 < 2), maj right
    "what is 1/2 as a fraction?": ["\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{\\frac{1}{2}}", "\\boxed{2}"],
}


class ScriptedSampler:
    def __init__(self, tokenizer, script=SCRIPT):
        self.tokenizer, self.script, self.prompts = tokenizer, script, []

    def generate(self, prompt_ids, params, generator=None):
        out = []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids)
            self.prompts.append(text)
            question = max(self.script, key=text.rfind)  # the last question in the prompt is the one asked
            assert question in text
            texts = self.script[question][: params.n]
            out.append([Rollout(list(ids), [5] * (i + 1), [0.0] * (i + 1), "stop", t) for i, t in enumerate(texts)])
        return out


@pytest.fixture
def tokenizer():
    from conftest import make_tokenizer

    return make_tokenizer()


@pytest.fixture
def data(tmp_path):
    gsm, math = tmp_path / "gsm8k.jsonl", tmp_path / "math.parquet"
    gsm.write_text("".join(json.dumps(row) + "\n" for row in GSM8K))
    pd.DataFrame(MATH).to_parquet(math)
    # a local file has one split; using it as the test split keeps every row in order
    (tmp_path / "gsm.yaml").write_text(f"dataset: {gsm}\ndataset_test_split: train\n")
    (tmp_path / "math.yaml").write_text(f"dataset: {math}\ndataset_test_split: train\n")
    return tmp_path


def cfg_for(dataset, **values):
    return build_config({"dataset": str(dataset), "dataset_test_split": "train", **values})


def test_gsm8k_and_math_files_grade_against_the_final_answer(data):
    gsm_cfg = cfg_for(data / "gsm8k.jsonl")
    _, gsm = load_splits(gsm_cfg.data_settings, gsm_cfg.seed)
    assert [reference_answer(ex.answer) for ex in gsm] == ["72", "7"]
    math_cfg = cfg_for(data / "math.parquet")
    _, math = load_splits(math_cfg.data_settings, math_cfg.seed)
    assert math[0].prompt == MATH[0]["problem"] and reference_answer(math[0].answer) == "\\frac{1}{2}"


def test_k_samples_give_pass_maj_and_mean_at_k(data, tokenizer):
    cfg = cfg_for(data / "gsm8k.jsonl", eval_num_samples=4, eval_temperature=1.0)
    _, test = load_splits(cfg.data_settings, cfg.seed)
    result = evaluate(ScriptedSampler(tokenizer), tokenizer, test, RewardSet(["accuracy"]), "accuracy", cfg)
    assert result.metrics() == pytest.approx({
        "accuracy": 5 / 8,  # = mean@4: five correct completions of eight
        "pass@1": (1 / 4 + 1) / 2,
        "pass@2": (1 / 2 + 1) / 2,
        "pass@4": 1.0,
        "maj@4": 1 / 2,  # wrong on the first problem, right on the second
        "mean@4": 5 / 8,
        "mean_completion_length": 2.5,  # the scripted completions have 1, 2, 3, 4 tokens
        "truncated_fraction": 0.0,
    })
    assert result.n == 2 and result.num_samples == 4
    assert [s["sample"] for s in result.samples] == [0, 1, 2, 3] * 2


def test_one_greedy_sample_reports_accuracy_and_pass_at_1(data, tokenizer):
    cfg = cfg_for(data / "math.parquet")
    _, test = load_splits(cfg.data_settings, cfg.seed)
    result = evaluate(ScriptedSampler(tokenizer), tokenizer, test, RewardSet(["accuracy"]), "accuracy", cfg)
    assert result.metrics() == {"accuracy": 1.0, "pass@1": 1.0, "mean_completion_length": 1.0, "truncated_fraction": 0.0}
    assert "sample" not in result.samples[0]  # the k = 1 layout is unchanged


def test_n_shot_prompts_put_train_examples_before_each_question(tokenizer):
    train = [Example("what is 3 + 4?", "3 + 4 = 7\n#### 7", {"answer": "3 + 4 = 7\n#### 7"})]
    test = [Example("what is 70 + 2?", "72", {"answer": "72"})]
    cfg = build_config({"eval_num_shots": 1})
    sampler = ScriptedSampler(tokenizer)
    result = evaluate(sampler, tokenizer, test, RewardSet(["accuracy"]), "accuracy", cfg, shot_pool=train)
    text = sampler.prompts[0]  # (the tiny tokenizer has no capitals: "T" comes back as <unk>)
    assert text.index("what is 3 + 4?") < text.index("3 + 4 = 7\n<unk>he answer is \\boxed{7}.") < text.index("what is 70 + 2?")
    assert result.num_shots == 1 and result.accuracy == 1.0  # graded on the test question alone
    with pytest.raises(ValueError, match="eval_num_shots=1 needs the train split"):
        evaluate(sampler, tokenizer, test, RewardSet(["accuracy"]), "accuracy", cfg)


def test_many_samples_at_temperature_zero_is_an_error():
    # In the configuration, so training learns it before any model loads, as rlvr eval does.
    with pytest.raises(ConfigError, match="eval_num_samples=4 with eval_temperature=0"):
        build_config({"eval_num_samples": 4})


# --- the command ------------------------------------------------------------------------------


@pytest.fixture
def scripted(monkeypatch):
    """`rlvr eval` with the real (tiny) model loader and the scripted sampler."""
    import rlvr.rollout.engine

    monkeypatch.setattr(rlvr.rollout.engine, "make_sampler", lambda model, tokenizer, *a, **k: ScriptedSampler(tokenizer))


def test_cli_evaluates_several_tasks_into_one_json_and_one_table(data, tiny_model_dir, scripted, capsys):
    out = data / "eval.json"
    args = ["eval", str(data / "gsm.yaml"), str(data / "math.yaml"), f"model={tiny_model_dir}",
            "eval_num_samples=4", "eval_temperature=1.0", f"eval_output={out}"]
    assert cli.main(args) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["task"] for r in results] == [str(data / "gsm8k.jsonl"), str(data / "math.parquet")]
    assert results[0]["at_k"] == pytest.approx({"pass@1": 0.625, "pass@2": 0.75, "pass@4": 1.0, "maj@4": 0.5, "mean@4": 0.625})
    assert results[1]["at_k"] == pytest.approx({"pass@1": 0.75, "pass@2": 1.0, "pass@4": 1.0, "maj@4": 1.0, "mean@4": 0.75})
    assert results[1]["accuracy"] == 0.75 and results[1]["config"]["eval_num_samples"] == 4
    table = capsys.readouterr().out
    for text in ("pass@1", "pass@2", "pass@4", "maj@4", "62.5%", "75.0%"):  # mean@4 is the accuracy column
        assert text in table


def test_cli_one_task_writes_one_result_object(data, tiny_model_dir, scripted):
    out = data / "one.json"
    assert cli.main(["eval", str(data / "math.yaml"), f"model={tiny_model_dir}", f"eval_output={out}"]) == 0
    result = json.loads(out.read_text())
    assert result["accuracy"] == 1.0 and result["at_k"] == {"pass@1": 1.0} and result["n"] == 1


def test_cli_real_tiny_model_samples_with_shots(data, tiny_model_dir, capsys):
    out = data / "tiny.json"
    args = ["eval", f"dataset={data / 'gsm8k.jsonl'}", "dataset_test_split=train", f"model={tiny_model_dir}",
            "eval_num_samples=2", "eval_temperature=1.0", "eval_num_shots=1", "max_completion_length=4", f"eval_output={out}"]
    assert cli.main(args) == 0
    result = json.loads(out.read_text())
    assert result["n"] == 2 and result["num_samples"] == 2 and result["num_shots"] == 1
    # every completion is written (2 problems x 2 samples), with the verifier's reward
    assert [(reference_answer(s["answer"]), s["sample"]) for s in result["samples"]] == [("72", 0), ("72", 1), ("7", 0), ("7", 1)]
    rewards = [s["rewards"]["accuracy"] for s in result["samples"]]
    # A completion of at most 4 characters (one token per character) cannot state an answer: the shortest
    # forms, "\\boxed{7}" and "the answer is 7", are longer. So every completion fails and each number is 0,
    # which the rewards the file records agree with.
    assert all(len(s["completion"]) <= 4 for s in result["samples"]) and rewards == [0.0] * 4
    assert result["at_k"] == {"pass@1": 0.0, "pass@2": 0.0, "maj@2": 0.0, "mean@2": 0.0} and result["accuracy"] == 0.0
    assert 0 < result["mean_completion_length"] <= 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval_num_samples=4"], "eval_num_samples=4 with eval_temperature=0"),
        (["dataset=missing.jsonl"], "dataset file not found: missing.jsonl"),
        (["nope.yaml"], "nope.yaml"),
    ],
)
def test_cli_errors_before_loading_a_model(args, message, monkeypatch, capsys):
    import rlvr.models

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(rlvr.models, "load_model", boom)
    assert cli.main(["eval", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlvr eval: error:") and message in err


def test_train_still_takes_one_config_file(capsys):
    assert cli.main(["train", "a.yaml", "b.yaml"]) == 2
    assert "expected at most one config file" in capsys.readouterr().err


def test_task_labels_tell_two_configs_of_one_task_apart():
    cfgs = [build_config({}), build_config({"task_args": {"digits": 2}}), build_config({"dataset": "README.md"})]
    assert cli._task_labels(cfgs, ["one.yaml", "two.yaml", "data.yaml"]) == ["arithmetic (one)", "arithmetic (two)", "README.md"]
    assert cli._task_labels(cfgs[:2], [None, "x/one.yaml"]) == ["arithmetic", "arithmetic (one)"]
    assert cli._task_labels(cfgs[:2], ["a/one.yaml", "b/one.yaml"]) == ["arithmetic (one) #1", "arithmetic (one) #2"]
