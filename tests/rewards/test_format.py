import time

import pytest

from rlvr.rewards.format import boxed_format, format_curriculum, tag_count, think_answer_format
from rlvr.types import TrainerState


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


# --- think_answer_format: every rule, with the default knobs (partial=0.5, think_only=0.0) ---------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>a</think><answer>4</answer>", 1.0),  # exact
        (" \n<think>a</think>\n<answer>4</answer>\n\n", 1.0),  # whitespace before, between, after
        ("<think> \n\t</think><answer>4</answer>", 0.5),  # whitespace-only think
        ("<think>a</think><answer>\n \t</answer>", 0.0),  # whitespace-only answer: no answer to grade
        ("<think>a<think>b</think></think><answer>4</answer>", 0.5),  # nested think
        ("<think>a<answer>4</answer></think>", 0.5),  # answer nested in think: non-empty answer, wrong layout
        ("<think>a</think><answer><answer>4</answer></answer>", 0.5),  # nested answer
        ("<think>a</think><answer>4</answer></answer>", 0.5),  # stray closing tag after the answer
        ("<think>a</think><answer>4</answer><think>b</think>", 0.5),  # a second think after the answer
        ("<think>a<answer>4</answer>", 0.5),  # think never closed
        ("</think><answer>4</answer>", 0.5),  # think closed, never opened (no pre-fill)
        ("<answer>4</answer></think>", 0.5),
        ("<think>a</think><answer>4</answer><Answer>", 0.5),  # not our tag: just text after the answer
        ("<think>a</think>\n<answer>4</answer>\nThe answer is 4.", 0.5),  # junk after
        ("<think>a</think><answer>", 0.0),  # answer opened, never closed
        ("<think>a</think></answer>", 0.0),  # answer closed, never opened
        ("<answer></answer>", 0.0),
    ],
)
def test_think_answer_format_rules(text, expected):
    assert think_answer_format([text]) == [expected]


def test_think_answer_format_partial_knob_zero_gives_strict_binary_reward():
    texts = ["<think>a</think><answer>4</answer>", "<answer>4</answer>", "<think>a</think><answer>4</answer> bye"]
    assert think_answer_format(texts, partial=0.0) == [1.0, 0.0, 0.0]
    assert think_answer_format(texts, partial=0.25) == [1.0, 0.25, 0.25]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>a</think>", 0.2),  # a think-only completion
        ("\n<think>a</think>\n", 0.2),
        (r"<think>a</think> so \boxed{4}", 0.2),  # text after </think> is allowed (no answer tags)
        ("<think> </think>", 0.0),  # empty think block
        ("Hi <think>a</think>", 0.0),  # text before the think block
        ("<think>a</think><answer>", 0.0),  # an answer tag, but no answer block
        ("<think>a</think><think>b</think>", 0.0),  # two think blocks
        ("<think>a", 0.0),  # never closed
        ("<think>a</think><answer>4</answer>", 1.0),  # full marks are unaffected
    ],
)
def test_think_answer_format_think_only_knob(text, expected):
    assert think_answer_format([text], think_only=0.2) == [expected]
    assert think_answer_format([text])[0] == (1.0 if expected == 1.0 else 0.0)  # default think_only = 0


PREFILLED = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize(
    "prompt_text, text, expected",
    [
        (PREFILLED, "2+2=4\n</think>\n<answer>4</answer>", 1.0),  # starts inside the think block
        (PREFILLED, "<think>2+2=4</think><answer>4</answer>", 0.5),  # repeats <think>: two opening tags
        (PREFILLED, "\n</think><answer>4</answer>", 0.5),  # empty think block
        (PREFILLED, "x</think> y <answer>4</answer>", 0.5),  # junk between
        (PREFILLED, "x</think>", 0.0),  # think-only (default 0)
        ("assistant\n<think>  \n\n", "a</think><answer>4</answer>", 1.0),  # whitespace after the pre-filled tag
        ("assistant\n<think> Let me", "a</think><answer>4</answer>", 0.5),  # prompt does not end with <think>
        ("Use <think> tags.\nassistant\n", "a</think><answer>4</answer>", 0.5),  # <think> only inside the prompt
        (None, "a</think><answer>4</answer>", 0.5),  # prompt text unknown: no pre-fill assumed
        ("Use <think> tags.\nassistant\n", "<think>a</think><answer>4</answer>", 1.0),
    ],
)
def test_think_answer_format_prefilled_think(prompt_text, text, expected):
    assert think_answer_format([text], prompt_texts=[prompt_text]) == [expected]


def test_prefilled_think_with_chat_message_completions():
    completions = [
        [{"role": "assistant", "content": "a</think><answer>4</answer>"}],
        [{"role": "assistant", "content": "<think>a</think><answer>4</answer>"}],
        [{"role": "assistant", "content": "<think>a</think><answer>4</answer>"}],
    ]
    prompt_texts = [PREFILLED, PREFILLED, "assistant\n"]
    assert think_answer_format(completions, prompt_texts=prompt_texts) == [1.0, 0.5, 1.0]
    assert tag_count(completions, prompt_texts=prompt_texts) == [1.0, 0.75, 1.0]
    assert format_curriculum(completions, prompt_texts=prompt_texts, trainer_state=TrainerState(global_step=10**6)) == [1.0, 0.0, 1.0]  # a repeated <think> is not even level 1


def test_prompt_texts_must_align_with_completions():
    with pytest.raises(ValueError, match="2 completions but 1 prompt_texts"):
        think_answer_format(["a", "b"], prompt_texts=[PREFILLED])


MB = 1_000_000
HUGE = [
    "<think>" + "a" * MB + "</think><answer>4</answer>",
    "<think>" * (MB // 7),
    "</answer>" * (MB // 9),
    "<answer>" * (MB // 8) + "4" + "</answer>" * (MB // 9),
    "<" * MB,
    " " * MB,
    "<think>a</think>" * (MB // 16),
    "<think" * (MB // 6),
]


@pytest.mark.parametrize("reward", ["think_answer_format", "tag_count", "format_curriculum"])
def test_format_rewards_on_1mb_inputs_are_linear_not_catastrophic(reward):
    """Each 1 MB input is scored in well under a second on a quiet machine (benchmarks/grading.py
    measures it); a regex that backtracks catastrophically would take hours on it.  The bound sits
    between the two, far from both, so no load on a shared machine can flip the verdict."""
    fn = {"think_answer_format": think_answer_format, "tag_count": tag_count, "format_curriculum": format_curriculum}[reward]
    for text in HUGE:
        start = time.perf_counter()
        scores = fn([text], prompt_texts=[PREFILLED])
        assert time.perf_counter() - start < 120.0, text[:20]
        assert len(scores) == 1 and 0.0 <= scores[0] <= 1.0


def test_huge_inputs_score_what_their_layout_deserves():
    assert think_answer_format(HUGE) == [1.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]


# --- tag_count ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>a</think><answer>4</answer>", 1.0),  # 4 x 0.25
        ("<answer>4</answer>", 0.5),  # <answer>, </answer>
        ("<think>a</think>", 0.5),  # <think>, </think>
        ("<think>a</think><answer>4", 0.75),  # </answer> missing
        ("<think></think><answer></answer>", 0.5),  # the closing tags close empty blocks: <think>, <answer> only
        ("Sure <think>a</think><answer>4</answer> bye", 0.5),  # <think> not first, </answer> not last
        ("<think>a</think> so <answer>4</answer>", 1.0),  # text between the blocks is not tag_count's business
        ("<think>a</think><think>b</think><answer>4</answer>", 0.5),  # think tags twice: 0 + 0 + 0.25 + 0.25
        ("<think>a</think><answer>1</answer><answer>2</answer>", 0.5),  # answer tags twice
        ("<answer>4</answer><think>a</think>", 0.0),  # every once-tag is out of order with another
        ("<think>a<answer>4</answer></think>", 0.25),  # only <think>: </think> comes after the answer tags
        ("</think>a<think>", 0.0),  # swapped: </think> has nothing before it, <think> is not first
        ("", 0.0),
    ],
)
def test_tag_count(text, expected):
    assert tag_count([text]) == [expected]


def test_tag_count_with_prefilled_think_and_per_tag_knob():
    assert tag_count(["a</think><answer>4</answer>"], prompt_texts=[PREFILLED]) == [1.0]
    # <think> is pre-filled and repeated: two occurrences, so 0 + 3 x 0.25
    assert tag_count(["<think>a</think><answer>4</answer>"], prompt_texts=[PREFILLED]) == [0.75]
    assert tag_count(["<think>a</think><answer>4</answer>"], per_tag=0.5) == [2.0]


# --- format_curriculum -------------------------------------------------------------------------------

LEVEL_0 = "<answer>4</answer>"  # no think block
LEVEL_0_JUNK = "Hi <think>a</think><answer>4</answer>"  # text before <think>
LEVEL_1 = "<think>a</think> so 4"  # think opens and closes
LEVEL_2 = "<think> </think><answer></answer>"  # both blocks in order, empty
LEVEL_3 = "<think>a</think><answer>4</answer>"  # the full format
LEVELS = [LEVEL_0, LEVEL_0_JUNK, LEVEL_1, LEVEL_2, LEVEL_3]


@pytest.mark.parametrize(
    "step, expected",
    [
        (0, [0.0, 0.0, 1.0, 1.0, 1.0]),  # stage 1: min(level, 1) / 1
        (99, [0.0, 0.0, 1.0, 1.0, 1.0]),  # last step of stage 1
        (100, [0.0, 0.0, 0.5, 1.0, 1.0]),  # stage 2 from step 100: min(level, 2) / 2
        (299, [0.0, 0.0, 0.5, 1.0, 1.0]),
        (300, [0.0, 0.0, 1 / 3, 2 / 3, 1.0]),  # stage 3 from step 300: min(level, 3) / 3
        (10_000, [0.0, 0.0, 1 / 3, 2 / 3, 1.0]),
    ],
)
def test_format_curriculum_graded_stages_and_boundaries(step, expected):
    state = TrainerState(global_step=step, max_steps=1000)
    assert format_curriculum(LEVELS, stages=(100, 300), trainer_state=state) == expected


@pytest.mark.parametrize(
    "step, expected",
    [
        (99, [0.0, 0.0, 1.0, 1.0, 1.0]),  # stage 1: level >= 1
        (100, [0.0, 0.0, 0.0, 1.0, 1.0]),  # stage 2: level >= 2
        (299, [0.0, 0.0, 0.0, 1.0, 1.0]),
        (300, [0.0, 0.0, 0.0, 0.0, 1.0]),  # stage 3: the full format only
    ],
)
def test_format_curriculum_ungraded(step, expected):
    state = TrainerState(global_step=step)
    assert format_curriculum(LEVELS, stages=[100, 300], graded=False, trainer_state=state) == expected


def test_format_curriculum_defaults_and_edge_stages():
    assert format_curriculum(LEVELS) == [0.0, 0.0, 1.0, 1.0, 1.0]  # no trainer_state: step 0, stage 1
    assert format_curriculum(LEVELS, trainer_state=TrainerState(global_step=100)) == [0.0, 0.0, 0.5, 1.0, 1.0]
    # stages (0, 0): the full format from the first step
    assert format_curriculum(LEVELS, stages=(0, 0), trainer_state=TrainerState()) == [0.0, 0.0, 1 / 3, 2 / 3, 1.0]
    # stages (50, 50): stage 2 is skipped
    assert format_curriculum([LEVEL_2], stages=(50, 50), trainer_state=TrainerState(global_step=50)) == [2 / 3]
    # stage 1 with a pre-filled <think>: closing it is enough
    assert format_curriculum(["a</think>"], prompt_texts=[PREFILLED]) == [1.0]


@pytest.mark.parametrize("stages", [(300, 100), (100,), (-1, 5), "abc", None])
def test_format_curriculum_rejects_bad_stages(stages):
    with pytest.raises(ValueError, match="stages"):
        format_curriculum(LEVELS, stages=stages)
