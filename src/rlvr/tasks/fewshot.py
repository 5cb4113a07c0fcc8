r"""n-shot prompts: worked examples from the train split put before each eval prompt.

Each shot is a user turn (the train example's prompt) followed by an assistant turn
(its worked solution), so the chat template shows the model a finished exchange.
The solution is the example's `solution` column, else its reference answer:

- a MATH-style solution (with a ``\boxed{}``) is shown as it is;
- a GSM8K-style solution (``... #### 72``) loses its ``#### 72`` line and ends with
  "The answer is \boxed{72}." instead, a layout the accuracy reward reads;
- a bare answer (``5``) becomes "The answer is \boxed{5}."

The same shots, drawn once with the run's seed, precede every eval prompt.
"""

from __future__ import annotations

import random

from rlvr.rewards.math import extract_boxed, reference_answer
from rlvr.types import Example, Message, Prompt


def pick_shots(train: list[Example], num_shots: int, seed: int) -> list[Example]:
    """num_shots train examples that have a reference answer, drawn with `seed`."""
    if num_shots == 0:
        return []
    pool = [ex for ex in train if worked_solution(ex) is not None]
    if len(pool) < num_shots:
        raise ValueError(
            f"eval_num_shots={num_shots} but the train split has only {len(pool)} examples with an answer; "
            f"lower eval_num_shots"
        )
    return random.Random(seed).sample(pool, num_shots)


def worked_solution(example: Example) -> str | None:
    r"""The assistant turn of a shot (see the module docstring); None without a reference answer."""
    text = example.columns.get("solution") or example.answer
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    if extract_boxed(text) is not None:
        return text
    answer = reference_answer(text)
    if answer is None:
        return None
    reasoning = text[: text.rfind("####")].strip() if "####" in text else ""
    final = f"The answer is \\boxed{{{answer}}}."
    return f"{reasoning}\n{final}" if reasoning else final


def with_shots(prompt: Prompt, shots: list[Example]) -> Prompt:
    """The prompt preceded by the shots as user / assistant turns (after its own system message, if any)."""
    if not shots:
        return prompt
    turns: list[Message] = []
    for shot in shots:
        turns += [m for m in _as_messages(shot.prompt) if m["role"] != "system"]
        turns.append({"role": "assistant", "content": worked_solution(shot)})
    messages = _as_messages(prompt)
    if messages and messages[0]["role"] == "system":
        return [messages[0], *turns, *messages[1:]]
    return turns + messages


def _as_messages(prompt: Prompt) -> list[Message]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
