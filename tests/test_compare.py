"""`rlvr compare`: eval results side by side, and clear errors on bad input."""

import json

import pytest

from rlvr import cli
from rlvr.compare import column_labels, compare_rows, load_results

BASE = {"model": "base", "task": "gsm8k.jsonl", "n": 100, "accuracy": 0.25, "at_k": {"pass@1": 0.25}}
TUNED = {"results": [
    {"model": "runs/x", "task": "gsm8k.jsonl", "n": 100, "accuracy": 0.5,
     "at_k": {"pass@1": 0.5, "pass@2": 0.625, "pass@4": 0.75, "maj@4": 0.55, "mean@4": 0.5}},
    {"model": "runs/x", "task": "arithmetic", "n": 100, "accuracy": 0.9, "at_k": {"pass@1": 0.9}},
]}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "base.json").write_text(json.dumps(BASE))
    run = tmp_path / "runs" / "tuned"
    run.mkdir(parents=True)
    (run / "eval.json").write_text(json.dumps(TUNED))
    return tmp_path


def test_rows_are_tasks_and_metrics_columns_are_runs(files):
    rows = compare_rows([load_results(str(files / "base.json")), load_results(str(files / "runs" / "tuned"))])
    assert rows == [
        ("gsm8k.jsonl", "accuracy", [0.25, 0.5]),
        ("gsm8k.jsonl", "pass@1", [0.25, 0.5]),
        ("gsm8k.jsonl", "pass@2", [None, 0.625]),  # the base model was run with one sample
        ("gsm8k.jsonl", "pass@4", [None, 0.75]),
        ("gsm8k.jsonl", "maj@4", [None, 0.55]),  # mean@4 is the accuracy row
        ("arithmetic", "accuracy", [None, 0.9]),
        ("arithmetic", "pass@1", [None, 0.9]),
    ]


def test_column_labels():
    assert column_labels(["runs/a", "runs/b/eval.json", "base.json"]) == ["a", "b", "base"]
    assert column_labels(["x/eval.json", "y/x"]) == ["x/eval.json", "y/x"]  # the short names clash


def test_cli_prints_the_table(files, capsys):
    assert cli.main(["compare", str(files / "base.json"), str(files / "runs" / "tuned")]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "gsm8k.jsonl" in line or "arithmetic" in line]
    assert "base" in out and "tuned" in out
    assert any("accuracy" in l and "25.0%" in l and "50.0%" in l for l in lines)
    assert any("pass@4" in l and "-" in l and "75.0%" in l for l in lines)
    assert any("arithmetic" in l and "90.0%" in l for l in lines)


def test_trainer_eval_files_without_a_task_compare_as_held_out(tmp_path, capsys):
    (tmp_path / "eval_before.json").write_text(json.dumps({"model": "m", "step": 0, "n": 8, "accuracy": 0.125}))
    (tmp_path / "eval_after.json").write_text(json.dumps({"model": "m", "step": 40, "n": 8, "accuracy": 0.5}))
    assert cli.main(["compare", str(tmp_path / "eval_before.json"), str(tmp_path / "eval_after.json")]) == 0
    out = capsys.readouterr().out
    assert "held-out" in out and "12.5%" in out and "50.0%" in out


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "eval result not found"),
        ("not json", "is not valid JSON"),
        (json.dumps({"task": "x", "n": 3}), "is not an `rlvr eval` result: missing key(s) 'accuracy'"),
        (json.dumps({"results": []}), '"results" must be a non-empty list'),
        (json.dumps({"results": [{"task": "x"}]}), "missing key(s) 'accuracy'"),
        (json.dumps([1, 2]), "expected an eval result object, got list"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, content, message, capsys):
    path = tmp_path / "eval.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["compare", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlvr compare: error:") and message in err


def test_a_run_directory_without_eval_json(tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path)]) == 2
    assert f"{tmp_path} holds no eval.json; run `rlvr eval model={tmp_path}` first" in capsys.readouterr().err
