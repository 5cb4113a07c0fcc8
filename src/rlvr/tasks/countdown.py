r"""Countdown (as in TinyZero): reach a target from given numbers with + - * / and parentheses.

"Using the numbers [19, 36, 55], write an arithmetic expression that equals 72 ..." answered with
``<answer> 55 + 36 - 19 </answer>`` and checked by the `countdown` reward
(rewards/countdown.py): each number used exactly once, every division even, the value the target.

Every problem is solvable: its numbers are drawn, then a random expression over all of them (each
division chosen only where it comes out even) gives the target; problems whose target falls outside
[min_target, max_target] are drawn again.  The test split is drawn first and no train problem has a
test problem's numbers (as a multiset) and target.  task_args:

    count        numbers per problem: an integer, or [low, high] for a mix (TinyZero: [3, 4])  default 3
    min_number   smallest number drawn                                                      default 1
    max_number   largest number drawn                                                       default 99
    min_target   smallest target                                                            default 1
    max_target   largest target                                                             default 100
    num_train    train problems                                                             default 5000
    num_test     test problems                                                              default 100
    template     answer_tag (TinyZero's <answer> layout), boxed, or text with {numbers} and {target}  default answer_tag
    seed         generator seed (default: the run's seed)
"""

from __future__ import annotations

import random

from rlvr.tasks.args import with_defaults
from rlvr.types import Example

DEFAULTS = {"count": 3, "min_number": 1, "max_number": 99, "min_target": 1, "max_target": 100, "num_train": 5000,
            "num_test": 100, "template": "answer_tag", "seed": None}
_RULES = ("Using the numbers {numbers}, write an arithmetic expression that equals {target}. Use each number exactly "
          "once, with + - * / and parentheses; every division must come out even. ")
TEMPLATES = {
    "answer_tag": _RULES + "Work it out, then give only the expression inside <answer> </answer>, "
                           "for example <answer> (6 - 2) * 5 </answer>.",
    "boxed": _RULES + "Work it out, then give only the expression in \\boxed{{}}, for example \\boxed{{(6 - 2) * 5}}.",
}
_OPERATORS = "+-*/"
_MAX_COUNT = 6
_TRIES_PER_PROBLEM = 200


class CountdownTask:
    name = "countdown"
    verifier = "countdown"

    @staticmethod
    def check_args(args: dict) -> dict:
        a = with_defaults(args, DEFAULTS)
        for key in ("min_number", "max_number", "min_target", "max_target", "num_train", "num_test"):
            if not isinstance(a[key], int) or isinstance(a[key], bool):
                raise ValueError(f"{key} must be an integer, got {a[key]!r}")
        for key in ("num_train", "num_test", "min_number"):
            if a[key] < 1:
                raise ValueError(f"{key} must be at least 1, got {a[key]}")
        if a["seed"] is not None and (not isinstance(a["seed"], int) or isinstance(a["seed"], bool)):
            raise ValueError(f"seed must be an integer or null, got {a['seed']!r}")
        low, high = count_range(a["count"])
        if not 2 <= low <= high <= _MAX_COUNT:
            raise ValueError(f"count must be from 2 to {_MAX_COUNT} (an integer, or [low, high]), got {a['count']!r}")
        if a["min_number"] > a["max_number"]:
            raise ValueError(f"min_number={a['min_number']} is above max_number={a['max_number']}")
        if a["min_target"] > a["max_target"]:
            raise ValueError(f"min_target={a['min_target']} is above max_target={a['max_target']}")
        template = TEMPLATES.get(a["template"], a["template"])
        if not isinstance(template, str) or "{numbers}" not in template or "{target}" not in template:
            raise ValueError(f"template must be one of {sorted(TEMPLATES)} or text containing {{numbers}} and {{target}}, "
                             f"got {a['template']!r}")
        return a

    @classmethod
    def reward_args(cls, args: dict) -> dict:
        return {}

    @classmethod
    def splits(cls, args: dict, seed: int) -> tuple[list[Example], list[Example]]:
        a = cls.check_args(args)
        rng = random.Random(seed if a["seed"] is None else a["seed"])
        seen: set = set()
        test = _draw(rng, a, a["num_test"], seen)
        train = _draw(rng, a, a["num_train"], seen)
        template = TEMPLATES.get(a["template"], a["template"])
        return [_example(p, template) for p in train], [_example(p, template) for p in test]

    @staticmethod
    def solution(example: Example) -> str:
        """A worked solution in the prompt's layout (the demonstration for rlvr sft)."""
        expr, target = example.answer, example.columns["target"]
        final = f"<answer> {expr} </answer>" if "<answer>" in str(example.prompt) else f"\\boxed{{{expr}}}"
        return f"{expr} = {target}, so the answer is {final}"


def count_range(count) -> tuple[int, int]:
    if isinstance(count, int) and not isinstance(count, bool):
        return count, count
    if isinstance(count, (list, tuple)) and len(count) == 2 and all(isinstance(c, int) and not isinstance(c, bool) for c in count):
        return count[0], count[1]
    raise ValueError(f"count must be an integer or [low, high], got {count!r}")


def _draw(rng: random.Random, a: dict, n: int, seen: set) -> list[tuple[list[int], int, str]]:
    """n problems (numbers, target, one solution) whose (numbers as a multiset, target) is not in `seen`."""
    low, high = count_range(a["count"])
    out = []
    for _ in range(_TRIES_PER_PROBLEM * n):
        if len(out) == n:
            return out
        nums = [rng.randint(a["min_number"], a["max_number"]) for _ in range(rng.randint(low, high))]
        expr, target = _random_expression(rng, nums)
        key = (tuple(sorted(nums)), target)
        if a["min_target"] <= target <= a["max_target"] and key not in seen:
            seen.add(key)
            out.append((nums, target, expr))
    if len(out) < n:
        raise ValueError(f"could draw only {len(out)} distinct countdown problems of the {n} asked for with targets from "
                         f"{a['min_target']} to {a['max_target']}: widen the number or target range, or lower num_train / num_test")
    return out


def _random_expression(rng: random.Random, nums: list[int]) -> tuple[str, int]:
    """A random expression using every number once, and its value: two parts are joined by a random
    operator until one is left; a division only where it is even, a subtraction never below zero."""
    parts = [(str(n), n) for n in nums]
    while len(parts) > 1:
        (a_text, a), (b_text, b) = [parts.pop(rng.randrange(len(parts))) for _ in range(2)]
        ops = [op for op in _OPERATORS if op != "/" or (b != 0 and a % b == 0)]
        op = rng.choice(ops)
        if op == "-" and a < b:
            (a_text, a), (b_text, b) = (b_text, b), (a_text, a)
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        parts.append((f"({a_text} {op} {b_text})", value))
    text, value = parts[0]
    text = text[1:-1] if text.startswith("(") else text
    return text, value


def _example(problem: tuple[list[int], int, str], template: str) -> Example:
    nums, target, expr = problem
    prompt = template.format(numbers="[" + ", ".join(map(str, nums)) + "]", target=target)
    return Example(prompt=prompt, answer=expr, columns={"nums": list(nums), "target": target, "answer": expr})
