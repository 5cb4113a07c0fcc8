"""Hostile and tricky inputs for math grading: each case has an asserted reward and a time bound.

Timeout cases use a 1 s symbolic budget; bounds leave room for a replacement
worker to start on a busy 2-core machine, and still prove no call hangs.
"""

import subprocess
import sys
import threading
import time

import pytest

from rlvr.rewards.math import accuracy, extract_answer, numeric_accuracy, reference_answer, signed_accuracy

FAST = 2.0  # seconds: cases decided without a timeout
SLOW = 90.0  # seconds: far above the 1 s symbolic timeout plus a replacement worker started on a loaded machine

MATCH = [
    (r"\boxed{\dfrac{3}{4}}", "0.75"),
    (r"\boxed{1{,}000}", "1000"),
    (r"\boxed{1\,000}", "1000"),
    (r"\boxed{1 000}", "1000"),
    (r"\boxed{1.5e3}", "1500"),
    (r"\boxed{1.5 \times 10^{3}}", "1500"),
    (r"\boxed{2.5\cdot10^{-2}}", "0.025"),
    (r"\boxed{50\%}", "50"),
    (r"\boxed{50\%}", "0.5"),
    (r"\boxed{90^\circ}", "90"),
    (r"\boxed{90^{\circ}}", "90"),
    (r"\boxed{90°}", "90"),
    (r"\boxed{x = 3}", "3"),
    (r"\boxed{3}", "x=3"),
    (r"\boxed{\left(1, 2\right)}", "(1,2)"),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}"),
    (r"\boxed{(0,1]}", r"(0, 1]"),
    (r"\boxed{\begin{pmatrix}1&2\\3&4\end{pmatrix}}", r"\begin{pmatrix}1 & 2\\ 3 & 4\end{pmatrix}"),
    (r"\boxed{5\text{ apples}}", "5"),
    (r"\boxed{-0.50}", r"-\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}\sqrt{3}"),
    (r"The answer is $12$.", "12"),
    (r"**Final answer:** \frac{1}{2}", "0.5"),
    ("<think>4 + 4</think><answer>8</answer>", "8"),
    (r"\boxed{1234}", "Natalia sold 48 + 24 = 72 clips... so 1,234 in all.\n#### 1,234"),  # GSM8K reference
    (r"\boxed{\frac{3}{4}}", r"so the probability is $\boxed{\frac34}$."),  # MATH-style reference
    ("\x00\\boxed{5}\x00", "5"),  # control characters around the box
]

NO_MATCH = [
    (r"\boxed{0.333}", "1/3"),
    (r"\boxed{12}", "1.2"),
    (r"\boxed{-5}", "5"),
    (r"\boxed{1,234}", "1.234"),
    (r"\boxed{(0,1)}", "[0,1]"),
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}"),
    (r"\boxed{x=4}", "3"),
    (r"\boxed{50\%}", "5"),
    (r"\boxed{1000}", "1001"),
    (r"\boxed{-\infty}", r"\infty"),
    (r"\boxed{1e-7}", "0"),
    (r"\boxed{\begin{pmatrix}1&2\\3&4\end{pmatrix}}", r"\begin{pmatrix}1&2\\3&5\end{pmatrix}"),
    (r"I think 7 is close, but the answer is 8", "7"),  # the stated answer, not the first number
]


@pytest.mark.parametrize("completion,ref", MATCH)
def test_equivalences_that_must_match(completion, ref):
    start = time.perf_counter()
    assert accuracy([completion], answer=[ref], timeout=1.0) == [1.0]
    assert time.perf_counter() - start < SLOW


@pytest.mark.parametrize("completion,ref", NO_MATCH)
def test_near_misses_that_must_not(completion, ref):
    start = time.perf_counter()
    assert accuracy([completion], answer=[ref], timeout=1.0) == [0.0]
    assert time.perf_counter() - start < SLOW


@pytest.mark.processes
@pytest.mark.parametrize(
    "completion",
    [
        r"\boxed{10^{10^{10}}}",
        r"\boxed{9^{9^{9^{9}}}}",
        r"\boxed{(x+1)^{100000} - (x-1)^{100000}}",
        r"\boxed{\sum_{k=1}^{10^{12}} k^{k}}",
    ],
)
def test_pathological_answers_time_out_score_zero_and_are_counted(completion):
    start = time.perf_counter()
    scores = accuracy([completion], answer=["1"], timeout=0.25)
    assert time.perf_counter() - start < SLOW
    assert scores == [0.0]
    assert scores.timeouts + scores.errors <= 1  # an overrun is counted, never raised
    assert scores.retries == scores.timeouts  # a check that ran out was run once more before it scored


@pytest.mark.processes
def test_timeouts_are_counted_per_batch():
    scores = accuracy([r"\boxed{10^{10^{10}}}", r"\boxed{2}", r"\boxed{9^{9^{9^{9}}}}"], answer=["1", "2", "3"], timeout=0.25)
    assert list(scores) == [0.0, 1.0, 0.0]
    assert scores.timeouts == 2 and scores.retries == 2


@pytest.mark.parametrize(
    "completion,ref,expected",
    [
        ("a" * 1_000_000 + r" \boxed{42}", "42", 1.0),  # the answer at the end survives the 20k cut
        ("{" * 100_000, "42", -1.0),  # deep nesting, no answer
        (r"\boxed{" * 1_000 + "1" + "}" * 1_000, "1", 1.0),  # 1,000 nested boxes: the innermost is the last
        (r"\boxed{" + r"\frac{1}{" * 300 + "2" + "}" * 300 + "}", "1", -0.5),  # deep LaTeX nesting
        (r"\boxed{" + "9" * 5_000 + "}", "9", -0.5),  # too many digits to be a number
        ("<answer>" * 200_000, "1", -1.0),
        ("the answer is " * 50_000, "1", -1.0),  # the phrase with nothing after it
        ("\\" * 200_000 + r"\boxed{3}", "3", 1.0),  # a wall of backslashes
        (r"\boxed{" + "(" * 5_000 + "1" + ")" * 5_000 + "}", "1", 1.0),  # parentheses around the whole answer go
        ("1" * 100_000, "1", -1.0),  # digits but no stated answer
    ],
)
def test_huge_and_deep_inputs(completion, ref, expected):
    start = time.perf_counter()
    assert signed_accuracy([completion], answer=[ref], timeout=1.0) == [expected]
    assert time.perf_counter() - start < SLOW


@pytest.mark.processes
@pytest.mark.parametrize(
    "answer",
    [
        r"\(" * 9_000 + " x",  # opening delimiters that never close
        r"\approx " * 2_000 + "= 1",
        "a and " * 3_000,
        " " * 19_000 + "x",
        "1, " * 6_000,
        "$a " * 6_000,
        r"word \[" * 2_000,
    ],
)
def test_inputs_that_make_patterns_backtrack_are_graded_quickly(answer):
    """Each of these once took tens of seconds in one regular expression (a run of spaces before
    `and`/`or`, a `[^=]*$` after every `\\approx`); canonical form and extraction are now linear."""
    from rlvr.rewards.pool import shared_pool

    shared_pool().warm()
    start = time.perf_counter()
    assert signed_accuracy([rf"\boxed{{{answer}}}"], answer=["1"], timeout=1.0, final_number=True) == [-0.5]
    assert time.perf_counter() - start < FAST


def test_final_number_fallback_is_the_tasks_choice():
    completion = "She has 3 bags of 4 apples, so 12 apples."
    assert accuracy([completion], answer=["12"]) == [0.0]  # off: no stated answer
    assert accuracy([completion], answer=["12"], final_number=True) == [1.0]
    assert extract_answer(r"\boxed{7} but 12", final_number=True) == "7"  # a box still wins


def test_boxing_the_question_is_not_an_answer_for_numeric_tasks():
    assert numeric_accuracy([r"\boxed{3 + 5}", r"\boxed{8}"], answer=["8", "8"]) == [0.0, 1.0]


def test_non_text_completions_score_zero():
    start = time.perf_counter()
    assert accuracy([None, 5, {"x": 1}, [], [{"role": "assistant"}]], answer=["1"] * 5) == [0.0] * 5
    assert time.perf_counter() - start < FAST


def test_gsm8k_reference_parsing():
    assert reference_answer("Step 1...\nStep 2...\n#### 1,234") == "1234"
    assert reference_answer("#### -7") == "-7"
    assert reference_answer("####") is None


SYMBOLIC = [(r"\boxed{2\sqrt{2}}", r"\sqrt{8}"), (r"\boxed{x^2+2x+1}", "(x+1)^2"), (r"\boxed{x^2+1}", "(x+1)^2"),
            (r"\boxed{\{1,2\}}", r"\{2,1\}"), (r"\boxed{10^{10^{10}}}", "1")]
SYMBOLIC_EXPECTED = [1.0, 1.0, 0.0, 1.0, 0.0]


def _grade_symbolic():
    # The bound counts CPU time (rewards/pool.py), so a loaded machine cannot turn a correct answer
    # into a timed-out zero; the four decidable cases still get a bound far above their grading time
    # (milliseconds); 10^(10^10), graded on its own, runs into its bound twice (0.25 s, then the retry's
    # 0.5 s) in every context, which is what the test compares (it scores 0 either way).
    decidable = list(accuracy([c for c, _ in SYMBOLIC[:-1]], answer=[r for _, r in SYMBOLIC[:-1]], timeout=5.0))
    return decidable + list(accuracy([SYMBOLIC[-1][0]], answer=[SYMBOLIC[-1][1]], timeout=0.25))


@pytest.mark.processes
def test_same_results_from_main_thread_worker_thread_and_subprocess():
    assert _grade_symbolic() == SYMBOLIC_EXPECTED
    out = []
    t = threading.Thread(target=lambda: out.append(_grade_symbolic()))
    t.start()
    t.join(timeout=120)
    assert out == [SYMBOLIC_EXPECTED]
    code = (
        "import json, sys; sys.path[:0] = %r\n"
        "from test_math_hostile import _grade_symbolic\n"
        "print(json.dumps(_grade_symbolic()))\n"
    ) % ([str(__import__("pathlib").Path(__file__).parent)] + sys.path,)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert eval(result.stdout.strip().splitlines()[-1]) == SYMBOLIC_EXPECTED


class _OnceSlow:
    """A grading pool whose first call runs out of its bound; the retry, with the larger bound, answers."""

    def __init__(self):
        self.bounds = []

    def map(self, fn, jobs, timeout):
        self.bounds.append(timeout)
        return ["timeout"] * len(jobs) if len(self.bounds) == 1 else [True] * len(jobs)


def test_a_check_that_runs_out_once_is_run_again_with_a_larger_bound_and_counted(monkeypatch):
    import rlvr.rewards.math as math_rewards

    slow = _OnceSlow()
    monkeypatch.setattr(math_rewards, "shared_pool", lambda: slow)
    scores = accuracy([r"\boxed{2\sqrt{2}}", r"\boxed{5}"], answer=[r"\sqrt{8}", "5"], timeout=0.5)
    assert list(scores) == [1.0, 1.0]  # the first needs the symbolic check; the second is equal as a number
    assert slow.bounds == [0.5, 0.5 * math_rewards.RETRY_FACTOR]
    assert scores.retries == 1 and scores.timeouts == 0


def test_math_verify_runs_a_check_that_ran_out_once_more_as_accuracy_does(monkeypatch):
    import rlvr.rewards.math as math_rewards

    slow = _OnceSlow()
    monkeypatch.setattr(math_rewards, "shared_pool", lambda: slow)
    scores = math_rewards.math_verify([r"\boxed{2\sqrt{2}}", r"\boxed{5}"], answer=[r"\sqrt{8}", "5"], timeout=0.5)
    assert list(scores) == [1.0, 1.0]  # math_verify sends every pair to the pool: both ran out, both again
    assert slow.bounds == [0.5, 0.5 * math_rewards.RETRY_FACTOR]
    assert scores.retries == 2 and scores.timeouts == 0
