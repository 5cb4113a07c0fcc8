import threading
import time

import pytest

import rlvr.rewards.math as math_rewards
from rlvr.rewards.math import (
    accuracy,
    extract_answer,
    extract_boxed,
    is_equivalent,
    reference_answer,
    signed_accuracy,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),  # nested braces
        (r"try \boxed{1}, no: \boxed{2}", "2"),  # the last box wins
        (r"\fbox{7}", "7"),
        (r"hence $\boxed 5$", "5"),  # space form, one token
        (r"\boxed {12}", "12"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are not groups
        (r"\boxed{}", ""),
        ("the answer is 5", None),
        (r"\boxed{\frac{1}{2}", None),  # unbalanced
        (r"\boxed{1} then \boxed{2", None),  # the last box is broken: no fallback
        (r"\boxedx{3}", None),  # another command, not a box
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>2+2</think>\n<answer> 4 </answer>", "4"),
        (r"<answer>It is \boxed{7}.</answer>", "7"),  # box inside the answer tags
        (r"\boxed{3} ... <answer>4</answer>", "3"),  # a box anywhere beats the tags
        ("<answer>1</answer> <answer>2</answer>", "2"),  # the last block wins
        (r"\boxed{} <answer>9</answer>", "9"),  # an empty box is no answer
        ("<answer>   </answer>", None),
        ("<answer>5", None),  # never closed
        ("I believe it is 42", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "ref, expected",
    [
        (r"We get $x = \boxed{\frac{3}{4}}$.", r"\frac{3}{4}"),  # MATH-style solution
        (" 72 ", "72"),
        (72, "72"),
        (0.5, "0.5"),
        (None, None),
        ("", None),
        ("   ", None),
    ],
)
def test_reference_answer(ref, expected):
    assert reference_answer(ref) == expected


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("1,234", "1234"),  # thousands separator
        ("1,234,567.5", "1234567.5"),
        ("+7", "7"),
        ("0.5", r"\frac{1}{2}"),
        ("1/2", "0.5"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac{3}{4}", "0.75"),
        (r"-\frac{3}{4}", "-0.75"),
        ("3.", "3"),  # trailing full stop
        ("$10$", "10"),
        (r"5\text{ cm}", "5"),  # a trailing unit is dropped
        (r"12 \mathrm{cm}^2", "12"),
        (r"\text{(B)}", "(B)"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        ("0.3333333", "1/3"),  # within the 1e-6 relative tolerance
        (r"2\sqrt{2}", r"\sqrt{8}"),  # symbolic
        ("x^2+2x+1", "(x+1)^2"),
        (r"\frac12", "0.5"),
    ],
)
def test_equivalent(pred, ref):
    assert is_equivalent(pred, ref)
    assert is_equivalent(ref, pred)


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("-5", "5"),
        ("0.333", "1/3"),  # numbers are final: no looser symbolic retry
        ("12", "1.2"),
        ("8", "18"),
        ("1001", "1000"),
        ("1,234", "1.234"),
        (r"2\sqrt{3}", r"\sqrt{8}"),
        ("x^2+1", "(x+1)^2"),
        ("", "5"),
        ("5", " "),
        (r"\frac{{{", "1"),  # garbage grades as wrong, never raises
    ],
)
def test_not_equivalent(pred, ref):
    assert not is_equivalent(pred, ref)


def test_huge_completions_are_graded_quickly():
    completions = [
        "a" * 1_000_000 + r" \boxed{42}",  # answer at the end survives the cut
        r"\boxed{42} " + "a" * 1_000_000,  # answer in the first megabyte is cut off
        r"\boxed{" * 200_000,  # never closed
        "<answer>" * 200_000,
        "{" * 1_000_000,
        r"\boxed{" + "9" * 5_000 + "}",  # too many digits to be a number
        r"\boxed{" + "x+" * 700 + "x}",  # 701x, but too long for the symbolic step
    ]
    refs = ["42", "42", "42", "42", "42", "9", "701x"]
    start = time.perf_counter()
    scores = signed_accuracy(completions, answer=refs)
    assert time.perf_counter() - start < 2.0
    assert scores == [1.0, -1.0, -1.0, -1.0, -1.0, -0.5, -0.5]


def test_conversational_completion():
    completion = [{"role": "assistant", "content": r"So the answer is $\boxed{2\sqrt{2}}$."}]
    assert accuracy([completion], answer=[r"\sqrt{8}"]) == [1.0]


def test_rows_without_reference_are_not_scored():
    completions = [r"\boxed{4}", r"\boxed{4}", r"\boxed{4}"]
    assert accuracy(completions, answer=[None, "", "4"]) == [None, None, 1.0]
    assert signed_accuracy(completions, answer=None) == [None, None, None]
    assert accuracy(completions) == [None, None, None]


def test_answers_must_align_with_completions():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        accuracy(["a", "b"], answer=["1"])


def test_grading_in_a_thread_matches_the_main_thread():
    pairs = [(r"2\sqrt{2}", r"\sqrt{8}"), ("x^2+2x+1", "(x+1)^2"), ("x^2+1", "(x+1)^2"), ("1/2", "0.5")]
    expected = [is_equivalent(p, r) for p, r in pairs]
    results = []
    thread = threading.Thread(target=lambda: results.extend(is_equivalent(p, r) for p, r in pairs))
    thread.start()
    thread.join(timeout=30)
    assert results == expected == [True, True, False, True]


BATCH = [
    r"\boxed{4}",  # correct
    "<answer>5</answer>",  # wrong
    "I think it is four",  # no answer
    [{"role": "assistant", "content": r"\boxed{2\sqrt{2}}"}],  # correct, symbolically
    r"\boxed{4}",  # no reference
    r"\boxed{1,000}",  # correct, reference is a number
]
BATCH_REFS = ["4", r"The sum is $\boxed{4}$.", "4", r"\sqrt{8}", None, 1000]


def test_accuracy_batch():
    assert accuracy(BATCH, answer=BATCH_REFS) == [1.0, 0.0, 0.0, 1.0, None, 1.0]


def test_signed_accuracy_batch():
    assert signed_accuracy(BATCH, answer=BATCH_REFS, prompts=["p"] * 6) == [1.0, -0.5, -1.0, 1.0, None, 1.0]


def test_numeric_accuracy_wants_a_number_not_the_question():
    from rlvr.rewards.math import numeric_accuracy

    completions = [r"\boxed{8}", r"\boxed{3 + 5}", r"3 + 5 = \boxed{8.0}", r"\boxed{-8}", "8", r"\boxed{1,000}"]
    answers = ["8", "8", "8", "8", "8", "1000"]
    # symbolic equality would accept "3 + 5"; numeric_accuracy does not
    assert accuracy([completions[1]], answer=["8"]) == [1.0]
    assert numeric_accuracy(completions, answer=answers) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert numeric_accuracy(["\\boxed{8}"], answer=[None]) == [None]
