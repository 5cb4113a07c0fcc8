r"""Format rewards: does a completion lay out its answer the way the prompt asked?

They score layout only, never correctness; pair them with `rewards.math.accuracy`.
Every false positive of a format reward is a behaviour we train in, so full marks
need the exact layout, and each partial credit is a knob you can set to zero.

The think/answer rewards read a completion the same way: one scan finds the tags
``<think>``, ``</think>``, ``<answer>``, ``</answer>`` (spelled exactly so; a regex
without repetition, so the work is linear in the text) and the text between them.
When the chat template pre-fills ``<think>`` (the rendered prompt, `prompt_texts[i]`,
ends with ``<think>`` and maybe whitespace), the completion starts inside the think
block: the pre-filled tag counts as the completion's opening tag, at offset 0, and a
completion that writes ``<think>`` again has two.

The layout is graded in levels, each containing the one before:

* level 1: exactly one ``<think>`` with nothing but whitespace before it and exactly
  one ``</think>`` after it;
* level 2: the tags are exactly ``<think> </think> <answer> </answer>`` in this order,
  with nothing but whitespace before, between the blocks and after (the blocks may be empty);
* level 3 (the full format): level 2, and both blocks hold non-whitespace text.
"""

from __future__ import annotations

import re
from collections import Counter

from rlvr.rewards.math import extract_boxed
from rlvr.types import Completion, completion_text

THINK, END_THINK, ANSWER, END_ANSWER = "<think>", "</think>", "<answer>", "</answer>"
_ORDER = (THINK, END_THINK, ANSWER, END_ANSWER)
_TAG = re.compile(r"</?(?:think|answer)>")


def think_answer_format(completions: list[Completion], *, partial: float = 0.5, think_only: float = 0.0,
                        prompt_texts: list[str | None] | None = None, **kwargs) -> list[float]:
    r"""1.0 for the full format (level 3 in the module docstring): one non-empty think block,
    then one non-empty answer block, nothing but whitespace before, between and after.

    Otherwise `partial` when the last ``<answer>...</answer>`` block (where `accuracy` looks
    when there is no ``\boxed{}``) holds non-whitespace text: an answer in the wrong layout
    (no or empty think, text around the blocks, repeated or nested tags, wrong order).  Otherwise `think_only`
    for a think-only completion: level 1 with a non-empty think block and no answer tag at
    all (text after ``</think>``, e.g. a boxed answer, is allowed).  Otherwise 0.0.
    R1-style format reward: https://arxiv.org/abs/2501.12948
    """
    prefilled = _prefilled(prompt_texts, len(completions))
    scores = []
    for completion, pre in zip(completions, prefilled):
        layout = _Layout(completion_text(completion), pre)
        if layout.level() == 3:
            scores.append(1.0)
        elif layout.answer_block_filled():
            scores.append(float(partial))
        elif layout.think_only():
            scores.append(float(think_only))
        else:
            scores.append(0.0)
    return scores


def tag_count(completions: list[Completion], *, per_tag: float = 0.25,
              prompt_texts: list[str | None] | None = None, **kwargs) -> list[float]:
    """`per_tag` for each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` used
    correctly, so 0 to 4 * per_tag (1.0 by default).  A tag is used correctly when

    1. it occurs exactly once (a pre-filled ``<think>`` is one occurrence);
    2. it is in order with every other tag that occurs exactly once
       (``<think>`` < ``</think>`` < ``<answer>`` < ``</answer>``); when two are swapped
       neither earns credit;
    3. ``<think>`` has nothing but whitespace before it, ``</answer>`` nothing but
       whitespace after it;
    4. a closing tag has non-whitespace text right before it (back to the previous tag or
       the start): the block it closes is not empty.

    Text between ``</think>`` and ``<answer>`` is not checked; `format` checks it.
    Shaping in the spirit of open-r1's XML tag count: https://github.com/huggingface/open-r1
    """
    prefilled = _prefilled(prompt_texts, len(completions))
    return [
        per_tag * _Layout(completion_text(c), pre).tags_used_correctly()
        for c, pre in zip(completions, prefilled)
    ]


def format_curriculum(completions: list[Completion], *, stages=(100, 300), graded: bool = True, trainer_state=None,
                      prompt_texts: list[str | None] | None = None, **kwargs) -> list[float]:
    """The format taught in three stages by training step (`trainer_state.global_step`):

        stage 1 (step < stages[0]):             the think block opens and closes (level 1)
        stage 2 (stages[0] <= step < stages[1]): both blocks, in order, nothing around (level 2)
        stage 3 (step >= stages[1]):             both blocks non-empty: the full format (level 3)

    Levels are those of the module docstring.  With `graded`, reward = min(level, stage) / stage,
    so earlier lessons keep partial credit (stage 3: level 1 gets 1/3, level 2 gets 2/3);
    without, 1.0 when level >= stage, else 0.0.  The full format scores 1.0 in every stage.
    Without a trainer_state (e.g. in evaluation) the step is 0: stage 1.
    Curriculum over R1-style format rewards: https://arxiv.org/abs/2501.12948
    """
    first, second = _check_stages(stages)
    step = getattr(trainer_state, "global_step", 0) or 0
    stage = 1 + (step >= first) + (step >= second)
    prefilled = _prefilled(prompt_texts, len(completions))
    scores = []
    for completion, pre in zip(completions, prefilled):
        level = _Layout(completion_text(completion), pre).level()
        if graded:
            scores.append(min(level, stage) / stage)
        else:
            scores.append(1.0 if level >= stage else 0.0)
    return scores


def boxed_format(completions: list[Completion], **kwargs) -> list[float]:
    r"""1.0 if the completion has a non-empty ``\boxed{}`` answer, else 0.0."""
    scores = []
    for completion in completions:
        boxed = extract_boxed(completion_text(completion))
        scores.append(1.0 if boxed is not None and boxed.strip() else 0.0)
    return scores


class _Layout:
    """The think/answer tags of one completion, in order, with their offsets in its text."""

    def __init__(self, text: str, prefilled: bool):
        self.text = text
        self.tags = [(THINK, 0, 0)] if prefilled else []
        self.tags += [(m.group(), m.start(), m.end()) for m in _TAG.finditer(text)]
        self.names = [name for name, _, _ in self.tags]

    def blank(self, start: int, end: int) -> bool:
        return not self.text[start:end].strip()

    def level(self) -> int:
        """3, 2, 1 or 0, as in the module docstring."""
        if self.names == list(_ORDER):
            # The four tags split the text into: before <think>, thought, between, answer, after </answer>.
            gap_starts = [0] + [end for _, _, end in self.tags]
            gap_ends = [start for _, start, _ in self.tags] + [len(self.text)]
            before, thought, between, answer, after = zip(gap_starts, gap_ends)
            if self.blank(*before) and self.blank(*between) and self.blank(*after):
                return 2 if self.blank(*thought) or self.blank(*answer) else 3
        return 1 if self._think_span() is not None else 0

    def answer_block_filled(self) -> bool:
        """Whether the last ``</answer>`` and the last ``<answer>`` before it enclose non-whitespace text."""
        end = None
        for name, start, stop in reversed(self.tags):
            if end is None and name == END_ANSWER:
                end = start
            elif end is not None and name == ANSWER:
                return not self.blank(stop, end)
        return False

    def think_only(self) -> bool:
        """Level 1, a non-empty think block, and no answer tag anywhere."""
        span = self._think_span()
        no_answer = ANSWER not in self.names and END_ANSWER not in self.names
        return span is not None and no_answer and not self.blank(*span)

    def tags_used_correctly(self) -> int:
        """How many of the four tags satisfy tag_count's rules."""
        counts = Counter(self.names)
        where = {name: i for i, name in enumerate(self.names) if counts[name] == 1}
        used = 0
        for rank, name in enumerate(_ORDER):
            if name not in where:
                continue
            i = where[name]
            in_order = all((other_rank < rank) == (where[other] < i)
                           for other_rank, other in enumerate(_ORDER) if other != name and other in where)
            _, start, end = self.tags[i]
            if name == THINK:
                placed = self.blank(0, start)
            elif name == ANSWER:
                placed = True
            else:  # a closing tag: the block it closes holds text (and nothing follows </answer>)
                previous_end = self.tags[i - 1][2] if i > 0 else 0
                placed = not self.blank(previous_end, start)
                if name == END_ANSWER:
                    placed = placed and self.blank(end, len(self.text))
            used += in_order and placed
        return used

    def _think_span(self) -> tuple[int, int] | None:
        """The think block's (start, end) offsets at level 1 or more, else None."""
        counts = Counter(self.names)
        if counts[THINK] != 1 or counts[END_THINK] != 1:
            return None
        open_i, close_i = self.names.index(THINK), self.names.index(END_THINK)
        if open_i > close_i or not self.blank(0, self.tags[open_i][1]):
            return None
        return self.tags[open_i][2], self.tags[close_i][1]


def _prefilled(prompt_texts: list[str | None] | None, n: int) -> list[bool]:
    """Per completion: did the chat template end the prompt with ``<think>`` (maybe and whitespace)?"""
    if prompt_texts is None:
        return [False] * n
    if len(prompt_texts) != n:
        raise ValueError(f"got {n} completions but {len(prompt_texts)} prompt_texts; they must be aligned")
    return [isinstance(p, str) and p.rstrip().endswith(THINK) for p in prompt_texts]


def _check_stages(stages) -> tuple[int, int]:
    try:
        first, second = (int(s) for s in stages)
    except (TypeError, ValueError):
        raise ValueError(f"format_curriculum: stages must be two step numbers, e.g. [100, 300], got {stages!r}") from None
    if not 0 <= first <= second:
        raise ValueError(f"format_curriculum: stages must satisfy 0 <= stages[0] <= stages[1], got {stages!r}")
    return first, second
