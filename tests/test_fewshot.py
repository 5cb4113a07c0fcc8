"""n-shot prompts: which worked examples, in what layout."""

import pytest

from rlvr.chat import render_prompt
from rlvr.rewards.math import extract_answer
from rlvr.tasks.fewshot import pick_shots, with_shots, worked_solution
from rlvr.types import Example


def ex(prompt, answer=None, **columns):
    return Example(prompt=prompt, answer=answer, columns={"answer": answer, **columns})


def test_worked_solution_layouts():
    gsm = ex("q", "She has 3 + 4 = 7 apples.\n#### 7")
    assert worked_solution(gsm) == "She has 3 + 4 = 7 apples.\nThe answer is \\boxed{7}."
    math_style = ex("q", "Half of one is $\\boxed{\\frac{1}{2}}$.")
    assert worked_solution(math_style) == "Half of one is $\\boxed{\\frac{1}{2}}$."
    assert worked_solution(ex("q", "5")) == "The answer is \\boxed{5}."
    # MATH rows often have a short answer and a full solution: the solution is shown
    both = ex("q", "2", solution="1 + 1 = \\boxed{2}")
    assert worked_solution(both) == "1 + 1 = \\boxed{2}"
    assert worked_solution(ex("q", None)) is None
    # every layout ends in an answer the accuracy reward reads
    assert extract_answer(worked_solution(gsm)) == "7"


def test_with_shots_builds_user_assistant_turns_before_the_prompt():
    shots = [ex("what is 1 + 1?", "2"), ex("what is 2 + 5?", "#### 7")]
    prompt = with_shots("what is 3 + 3?", shots)
    assert prompt == [
        {"role": "user", "content": "what is 1 + 1?"},
        {"role": "assistant", "content": "The answer is \\boxed{2}."},
        {"role": "user", "content": "what is 2 + 5?"},
        {"role": "assistant", "content": "The answer is \\boxed{7}."},
        {"role": "user", "content": "what is 3 + 3?"},
    ]
    assert with_shots("what is 3 + 3?", []) == "what is 3 + 3?"


def test_with_shots_keeps_the_prompts_system_message_first_and_drops_the_shots():
    system = {"role": "system", "content": "be brief"}
    shot = ex([system, {"role": "user", "content": "1 + 1?"}], "2")
    prompt = with_shots([system, {"role": "user", "content": "3 + 3?"}], [shot])
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user"]
    assert prompt[1]["content"] == "1 + 1?" and prompt[3]["content"] == "3 + 3?"


def test_rendered_n_shot_prompt_with_a_chat_template(tiny):
    _, tokenizer = tiny
    text = render_prompt(tokenizer, with_shots("what is 3 + 3?", [ex("what is 1 + 1?", "2")]), "be brief")
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nwhat is 1 + 1?<|im_end|>\n"
        "<|im_start|>assistant\nThe answer is \\boxed{2}.<|im_end|>\n"
        "<|im_start|>user\nwhat is 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_pick_shots_is_seeded_and_skips_rows_without_an_answer():
    train = [ex(f"q{i}", str(i)) for i in range(10)] + [ex("no answer", None)]
    shots = pick_shots(train, 3, seed=1)
    assert len(shots) == 3 and len({s.prompt for s in shots}) == 3
    assert shots == pick_shots(train, 3, seed=1)
    assert pick_shots(train, 3, seed=1) != pick_shots(train, 3, seed=2)
    assert pick_shots(train, 0, seed=1) == []
    with pytest.raises(ValueError, match="eval_num_shots=11 but the train split has only 10 examples with an answer"):
        pick_shots(train, 11, seed=1)
