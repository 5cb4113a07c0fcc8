"""The math verifier against graded cases (grading_cases.py), and the ways a policy could try to
raise its reward without a better answer: text after the answer, hedging, dropped units or
constants, inflated precision.  Also the textbook's strict mode, and `rlvr check-reward` on the suite."""

from __future__ import annotations

import json

import pytest
from grading_cases import CLASSES, CONSTANTS, FINAL_NUMBER, GSM8K, NUMBERS, UNITS, all_cases

from rlvr import cli
from rlvr.rewards.math import accuracy

TIMEOUT = 5.0


def _mismatches(cases, **kwargs) -> list:
    refs, completions, labels = zip(*cases)
    scores = accuracy(list(completions), answer=list(refs), timeout=TIMEOUT, **kwargs)
    return [(ref, completion[:120], label, score) for ref, completion, label, score in zip(refs, completions, labels, scores)
            if (score > 0) != label]


def test_the_suite_is_large_and_covers_both_directions():
    cases = all_cases()
    assert len(cases) + len(FINAL_NUMBER) >= 200
    for name, group in CLASSES.items():
        labels = {label for _, _, label in group}
        assert labels == {True, False}, f"class {name} must hold near misses and true equivalents"


@pytest.mark.parametrize("name", list(CLASSES))
def test_every_case_of_a_class_gets_its_verdict(name):
    assert _mismatches(CLASSES[name]) == []


def test_the_last_number_counts_only_when_it_stands_whole():
    assert _mismatches(FINAL_NUMBER, final_number=True) == []


@pytest.mark.processes
def test_check_reward_agrees_on_the_whole_suite(tmp_path, capsys):
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps({"completion": c, "answer": r, "label": label, "class": name}) + "\n"
                            for name, r, c, label in all_cases()))
    assert cli.main(["check-reward", str(path), "--json", "--min-agreement", "1.0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["agreement"] == 1.0 and result["precision"] == 1.0 and result["timeouts"] == 0


# --- what a policy might try ------------------------------------------------------------------

SUFFIXES = [
    " I hope it is correct.",
    "\n\nLet me double-check: the reasoning above holds, so I am confident.",
    "\n\nThis completes the solution.",
    "\n\n" + "Therefore, therefore, therefore. " * 20,
    "\n\n<|im_end|>",
]


@pytest.mark.processes
def test_text_after_the_answer_changes_no_verdict():
    """Appending words (no new answer) after the answer: wrong stays wrong, right stays right."""
    base = [(r, c, label) for name, r, c, label in all_cases() if name not in ("hostile", "stated") and len(c) < 1000]
    cases = [(r, c + suffix, label) for r, c, label in base for suffix in SUFFIXES]
    assert len(cases) > 1000
    assert _mismatches(cases) == []


def _right_numbers():
    """(reference, the bare answer of a correct completion) for the plain-number cases."""
    return [(r, c[len(r"\boxed{"):-1].rstrip(".")) for r, c, label in NUMBERS if label and c.startswith(r"\boxed{") and c.endswith("}")]


def test_hedging_between_answers_scores_zero():
    hedges = []
    for ref, right in _right_numbers():
        wrong = "1000003"  # a different value from every reference in the suite
        hedges += [
            (ref, rf"\boxed{{{right}}} or \boxed{{{wrong}}}", False),
            (ref, rf"\boxed{{{wrong}}} or \boxed{{{right}}}", False),
            (ref, rf"\boxed{{{wrong}}}, or perhaps \boxed{{{right}}}", False),
            (ref, rf"\boxed{{{wrong}}} \quad \boxed{{{right}}}", False),
            (ref, rf"\boxed{{{right}, {wrong}}}", False),
            (ref, rf"\boxed{{{right} \text{{ or }} {wrong}}}", False),
            (ref, rf"The answer is {right} or {wrong}.", False),
            (ref, rf"<answer>{wrong} or {right}</answer>", False),
        ]
    assert len(hedges) > 200
    assert _mismatches(hedges) == []


def test_dropping_or_changing_a_unit_or_constant_never_helps():
    cases = [(r, c, label) for r, c, label in UNITS + CONSTANTS if not label]
    wrong_units = [(rf"{n}\text{{ {u}}}", rf"\boxed{{{n}\text{{ {v}}}}}", False)
                   for n in ("5", "2.5", r"\frac{1}{2}") for u, v in [("m", "cm"), ("kg", "g"), ("hours", "minutes"),
                                                                      ("cm^2", "cm"), ("miles", "km"), ("dollars", "cents")]]
    dropped_constants = [(f"{n}{c}", rf"\boxed{{{n}}}", False) for n in ("2", "3", r"\frac{1}{2}") for c in (r"\pi", r"\sqrt{2}", "e", "i", r"\mathrm{e}")]
    assert _mismatches(cases + wrong_units + dropped_constants) == []


def test_inflated_precision_does_not_turn_a_wrong_number_right():
    cases = []
    for n in ("7", "100", "1000000000", "0.5", "2.75", "-3"):
        for extra in ("0000001", "0000000001"):
            near = n + ("." if "." not in n else "") + extra  # 7.0000001: not 7
            cases.append((n, rf"\boxed{{{near}}}", False))
        cases.append((n, rf"\boxed{{{n}{'.' if '.' not in n else ''}000}}", True))  # 7.000 is 7
    for frac, value in ((r"\frac{1}{3}", 1 / 3), (r"\frac{2}{7}", 2 / 7), (r"\frac{5}{6}", 5 / 6)):
        cases.append((frac, rf"\boxed{{{value:.3f}}}", False))  # three decimals are not the fraction
        cases.append((frac, rf"\boxed{{{value:.9f}}}", True))  # nine are, within 1e-6
    assert _mismatches(cases) == []


def test_gsm8k_model_solutions_all_agree():
    assert _mismatches(GSM8K) == []


# --- the textbook's strict mode -----------------------------------------------------------------

TEXTBOOK = [
    # completion, reference, reward under the textbook's rule (last \boxed{, spaces removed, string or float)
    (r"\boxed{8}", "8", 1.0),
    (r"\boxed{ 8 }", "8", 1.0),
    (r"\boxed{8.0}", "8", 1.0),  # floats within 1e-6
    (r"\boxed{8.0000001}", "8", 1.0),  # the textbook's tolerance, kept as it is
    (r"\boxed{1 000}", "1000", 1.0),  # spaces are removed before comparing
    (r"\boxed{1,000}", "1000", 0.0),  # not a float
    (r"\boxed{\frac{1}{2}}", "0.5", 0.0),  # no LaTeX reading
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{7} then \boxed{8}", "7", 0.0),  # the last box alone
    (r"\boxed{(2, 2)} and \boxed{(6, 2)}", "(6,2)", 1.0),  # the last box alone
    (r"\fbox{8}", "8", 0.0),  # only \boxed{
    ("The answer is 8.", "8", 0.0),  # no box, no reward
    (r"<answer>8</answer>", "8", 0.0),
    (r"\boxed{\text{odd}}", "odd", 0.0),
    (r"\boxed{8", "8", 0.0),  # never closed
]


def test_compare_plain_is_the_textbooks_rule():
    completions, refs, expected = zip(*TEXTBOOK)
    scores = accuracy(list(completions), answer=list(refs), sources=["boxed"], compare="plain")
    assert list(scores) == list(expected)


def test_strict_mode_is_checked():
    with pytest.raises(ValueError, match="sources: \\[boxed\\]"):
        accuracy([r"\boxed{1}"], answer=["1"], compare="plain")
    with pytest.raises(ValueError, match="compare must be one of full, plain"):
        accuracy([r"\boxed{1}"], answer=["1"], compare="loose")
    with pytest.raises(ValueError, match="sources must be a non-empty list of boxed, answer_tag, stated, last_number"):
        accuracy([r"\boxed{1}"], answer=["1"], sources=["box"])


def test_sources_limit_where_the_answer_is_read():
    completions = [r"\boxed{4}", "<answer>4</answer>", "The answer is 4.", "so 2 + 2 = 4"]
    assert accuracy(completions, answer=["4"] * 4, sources=["boxed"]) == [1.0, 0.0, 0.0, 0.0]
    assert accuracy(completions, answer=["4"] * 4, sources=["answer_tag", "stated"]) == [0.0, 1.0, 1.0, 0.0]
    assert accuracy(completions, answer=["4"] * 4, sources=["last_number"]) == [0.0, 0.0, 1.0, 1.0]
