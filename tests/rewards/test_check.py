"""`rlvr check-reward`: agreement, precision, recall, timeouts, disagreements, exit codes."""

import json

import pytest

from rlvr import cli

CASES = [
    {"completion": r"so \boxed{\frac{1}{2}}", "answer": "0.5", "label": True},  # TP
    {"completion": "the answer is 12", "answer": "Natalia sold...\n#### 12", "label": True},  # TP (GSM8K reference)
    {"completion": r"\boxed{13}", "answer": "12", "label": False},  # TN
    {"completion": "12 apples", "answer": "12", "label": True},  # FN: no stated answer
    {"completion": r"\boxed{3 + 5}", "answer": "8", "label": False},  # FP under symbolic accuracy
    {"completion": r"\boxed{10^{10^{10}}}", "answer": "1", "expected": 0.0},  # times out, scores 0: agrees
    {"completion": "<answer>7</answer>", "answer": "7", "expected": 1.0},
]


@pytest.fixture
def cases_file(tmp_path):
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in CASES) + "\n")
    return path


@pytest.mark.processes
def test_json_report(cases_file, capsys):
    # a bound of 1 CPU second (the work a check does, not its wait on a busy machine): the 10^{10^{10}}
    # case runs out twice (1 s, then the retry's 2 s); every other case needs a fraction of a second
    assert cli.main(["check-reward", str(cases_file), "timeout=1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # 7 cases, 5 agree (all but the FN on line 4 and the FP on line 5)
    assert out["n"] == 7 and out["agreement"] == pytest.approx(5 / 7)
    # "correct" predicted on lines 1, 2, 5, 7 (3 truly correct): precision 3/4; truly correct 1, 2, 4, 7: recall 3/4
    assert out["precision"] == pytest.approx(3 / 4) and out["recall"] == pytest.approx(3 / 4)
    assert out["timeouts"] == 1 and out["retries"] == 1
    assert [d["line"] for d in out["disagreements"]] == [4, 5]
    assert out["slowest"][0]["line"] == 6


@pytest.mark.processes
def test_other_reward_and_its_arguments(cases_file, capsys):
    assert cli.main(["check-reward", str(cases_file), "reward=numeric_accuracy", "final_number=true", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reward"] == "numeric_accuracy"
    assert out["disagreements"] == []  # the last number counts, and boxing "3 + 5" does not


@pytest.mark.processes
def test_min_agreement_sets_the_exit_code(tmp_path, capsys):
    decidable = tmp_path / "decidable.jsonl"  # the cases without the one that runs into the time bound
    decidable.write_text("".join(json.dumps(c) + "\n" for c in CASES if "10^{10" not in c["completion"]))
    assert cli.main(["check-reward", str(decidable), "timeout=10", "--min-agreement", "0.9"]) == 1
    captured = capsys.readouterr()
    assert "agreement 66.7%" in captured.out and "disagreements (2):" in captured.out  # 4 of 6 agree
    assert "below --min-agreement 90.0%" in captured.err


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"completion": "a", "answer": "1"}', ":1: give exactly one of `expected`"),
        ('{"completion": "a", "label": "yes"}', "`label` must be true or false"),
        ("not json", ":1: not valid JSON"),
        ('{"answer": "1", "label": true}', "must be an object with a `completion`"),
        ("", "holds no cases"),
    ],
)
def test_malformed_cases_are_reported_with_their_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content + "\n")
    assert cli.main(["check-reward", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_missing_file(capsys):
    assert cli.main(["check-reward", "/no/such/cases.jsonl"]) == 2
    assert "cases file not found" in capsys.readouterr().err


def test_unknown_reward_is_a_usage_error(cases_file, capsys):
    assert cli.main(["check-reward", str(cases_file), "reward=acuracy"]) == 2
    assert "unknown reward function 'acuracy'" in capsys.readouterr().err


def test_an_unknown_knob_of_a_built_in_reward_is_a_usage_error(cases_file, capsys):
    """A mistyped knob (or another command's setting) used to reach the reward's **kwargs and be ignored."""
    assert cli.main(["check-reward", str(cases_file), "reward_funcs=math_verify"]) == 2
    err = capsys.readouterr().err
    assert "check-reward accuracy: unknown setting 'reward_funcs'" in err and "accuracy takes" in err
    assert cli.main(["check-reward", str(cases_file), "timout=1"]) == 2
    assert "did you mean 'timeout'?" in capsys.readouterr().err
