import time

import pytest

from rlvr.rewards.format import boxed_format, think_answer_format


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
        ("\n<think>\nadd\n</think>\n\n<answer> 4 </answer>\n", 1.0),  # whitespace allowed
        ("<answer>4</answer>", 0.5),  # no think block
        ("<think></think><answer>4</answer>", 0.5),  # empty think
        ("Sure! <think>a</think><answer>4</answer>", 0.5),  # junk before
        ("<think>a</think><answer>4</answer> Hope this helps", 0.5),  # junk after
        ("<think>a</think> so <answer>4</answer>", 0.5),  # junk between
        ("<think>a</think><answer>1</answer><answer>2</answer>", 0.5),  # two answers
        ("<think>a</think><think>b</think><answer>4</answer>", 0.5),  # two thinks
        ("<answer>4</answer><think>a</think>", 0.5),  # wrong order
        ("<think>a</think><answer>  </answer>", 0.0),  # empty answer
        ("<think>a</think><answer>4", 0.0),  # answer never closed
        ("<think>a</think>", 0.0),
        ("The answer is 4.", 0.0),
        ("", 0.0),
    ],
)
def test_think_answer_format(text, expected):
    assert think_answer_format([text]) == [expected]


def test_think_answer_format_batch_and_conversational_shape():
    completions = [
        [{"role": "assistant", "content": "<think>a</think><answer>4</answer>"}],
        "<answer>4</answer>",
        "4",
    ]
    assert think_answer_format(completions, answer=["4"] * 3) == [1.0, 0.5, 0.0]


def test_think_answer_format_huge_completion_is_fast():
    huge = "<think>" + "a" * 1_000_000 + "</think><answer>4</answer>"
    start = time.perf_counter()
    assert think_answer_format([huge, "<think>" * 200_000]) == [1.0, 0.0]
    assert time.perf_counter() - start < 2.0


def test_boxed_format():
    completions = [
        r"so $\boxed{\frac{1}{2}}$",
        r"\boxed 5",
        r"\boxed{}",
        r"\boxed{  }",
        r"\boxed{\frac{1}{2}",  # never closed
        "<answer>4</answer>",  # tags are not a box
        [{"role": "assistant", "content": r"\fbox{3}"}],
    ]
    assert boxed_format(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
