"""The committed GSM8K-format files (tests/data/gsm8k_style, made by benchmarks/gsm8k_style.py):
their sizes, every row's arithmetic, no question in both, and the accuracy reward grading the
reference solutions correct."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rlvr.rewards import resolve_reward

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "gsm8k_style"


def _script():
    spec = importlib.util.spec_from_file_location("gsm8k_style", ROOT / "benchmarks" / "gsm8k_style.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(name: str) -> list[dict]:
    with open(DATA / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_sizes_rows_and_split():
    train, test = _rows("train"), _rows("test")
    assert (len(train), len(test)) == (400, 100)
    check_row = _script().check_row
    for row in train + test:
        check_row(row)
    train_q, test_q = {r["question"] for r in train}, {r["question"] for r in test}
    assert len(train_q) == 400 and len(test_q) == 100
    assert not train_q & test_q


def test_check_row_refuses_bad_arithmetic():
    check_row = _script().check_row
    good = "He has 3 + 4 = <<3+4=7>>7 pens.\nHe buys 7 * 2 = <<7*2=14>>14 more.\n#### 14"
    check_row({"question": "q?", "answer": good})
    for bad in (good.replace("<<3+4=7>>7", "<<3+4=8>>8"), good.replace("#### 14", "#### 15"),
                good.replace("7 * 2 = <<7*2=14>>14", "7 / 2 = <<7/2=3>>3").replace("#### 14", "#### 3"),
                good.replace("<<3+4=7>>", "<<__import__('os')=7>>")):
        with pytest.raises(ValueError):
            check_row({"question": "q?", "answer": bad})


def test_accuracy_grades_the_reference_solutions():
    accuracy = resolve_reward("accuracy")
    answers = [r["answer"] for r in _rows("test")[:20]]
    assert list(accuracy(completions=answers, answer=answers)) == [1.0] * 20
    off_by_one = [a.rsplit("\n", 1)[0] + f"\n#### {int(a.rsplit('#### ', 1)[1]) + 1}" for a in answers]
    assert list(accuracy(completions=off_by_one, answer=answers)) == [0.0] * 20
