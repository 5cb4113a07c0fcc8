"""A generated arithmetic task: "What is 7 + 5 - 3?", answered in \\boxed{}.

Problems are drawn from a seeded generator; the test split is drawn first and
no test problem ever appears in the train split.  Difficulty knobs (task_args):

    digits     digits per operand (1: 0-9, 2: 10-99, ...)            default 1
    operands   numbers per problem                                    default 2
    operators  string of operators to draw from, among "+-*"          default "+-"
    num_train  train problems                                         default 5000
    num_test   test problems                                          default 100
    template   the prompt: a name from TEMPLATES, or text with {expr}  default "boxed_example"
    final_number  also accept the last number when nothing is boxed   default false
    seed       generator seed (default: the run's seed)

When the problem space is small (1 digit, 2 operands, "+-" has 200 problems)
the splits are a shuffled partition of all problems, so num_train shrinks to
what is left after the test split.
"""

from __future__ import annotations

import itertools
import json
import random

from rlvr.tasks.args import with_defaults
from rlvr.types import Example

DEFAULTS = {"digits": 1, "operands": 2, "operators": "+-", "num_train": 5000, "num_test": 100, "template": "boxed_example", "final_number": False, "seed": None}
TEMPLATES = {
    "boxed": "What is {expr}? Put your final answer in \\boxed{{}}.",
    # One worked example of the expected layout (a 1-shot prompt).
    "boxed_example": (
        "Example: What is 2 + 3? Answer: 2 + 3 = 5, so the answer is \\boxed{{5}}.\n"
        "Now you: What is {expr}? Answer in the same way."
    ),
    # A calculator call to copy (for tools=[calculator]): the model writes the call with its own
    # numbers, reads the result in the next message, then answers.  JSON braces are doubled for format.
    "calculator_example": (
        "To multiply, call the calculator like this:\n<tool_call>\n"
        '{{"name": "calculator", "arguments": {{"expression": "23 * 47"}}}}\n'
        "</tool_call>\n"
        "then read its result and write the answer as \\boxed{{1081}}.\n"
        "What is {expr}?"
    ),
    # The call spelled out with the problem's own expression: what is left to learn is to make the
    # call and to answer with the result it returns (the tools demo, configs/tools_demo.yaml).
    "calculator_call": (
        "To multiply, call the calculator like this:\n<tool_call>\n"
        '{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n'
        "</tool_call>\n"
        "then read its result and write the answer as \\boxed{{}}.\n"
        "What is {expr}?"
    ),
    # The two-call tools demo (configs/tools_chain_demo.yaml; operands: 3, operators: "*"): the first call of
    # MultiplyChain's two-number multiply tool spelled out with the problem's first two numbers; each of the
    # tool's answers spells out the next call.  {n[i]} is the problem's i-th number.
    "multiply_chain": (
        "The multiply tool multiplies two numbers. Call it like this:\n<tool_call>\n"
        '{{"name": "multiply", "arguments": {{"a": {n[0]}, "b": {n[1]}}}}}\n'
        "</tool_call>\n"
        "then do what it says, and write the last result as \\boxed{{}}.\n"
        "What is {expr}?"
    ),
}
_ENUMERATE_BELOW = 200_000


class MultiplyChain:
    """The two-call tools demo's environment (TRL's protocol: its public method is the model's tool): a
    problem "a * b * c" takes two calls of multiply, the second on what the first returned.  Each answer
    gives the product and spells out the call that comes next, or says the last product is the answer."""

    def reset(self, expression: str, **row) -> None:
        self.factors = [int(x) for x in expression.split(" * ")]
        self.value, self.used = self.factors[0], 1  # the product so far, and how many factors it has

    def multiply(self, a: int, b: int) -> str:
        """Multiply two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        if self.used < len(self.factors) and {a, b} == {self.value, self.factors[self.used]}:
            self.value, self.used = a * b, self.used + 1
        if self.used == len(self.factors):
            return f"{a * b}. That is the product of all the numbers: write it as \\boxed{{}}."
        call = json.dumps({"name": "multiply", "arguments": {"a": self.value, "b": self.factors[self.used]}})
        return f"{a * b}. Next, call it like this:\n<tool_call>\n{call}\n</tool_call>"


class ArithmeticTask:
    name = "arithmetic"
    verifier = "numeric_accuracy"  # a number equal to the result; boxing the question earns nothing

    @staticmethod
    def check_args(args: dict) -> dict:
        a = with_defaults(args, DEFAULTS)
        for key in ("digits", "operands", "num_train", "num_test"):
            if not isinstance(a[key], int) or isinstance(a[key], bool) or a[key] < 1:
                raise ValueError(f"{key} must be a positive integer, got {a[key]!r}")
        if not isinstance(a["final_number"], bool):
            raise ValueError(f"final_number must be true or false, got {a['final_number']!r}")
        if a["operands"] < 2:
            raise ValueError("operands must be at least 2")
        if a["digits"] > 9:
            raise ValueError("digits must be at most 9")
        ops = a["operators"]
        if not isinstance(ops, str) or not ops or set(ops) - set("+-*"):
            raise ValueError(f"operators must be a non-empty string of + - *, got {ops!r}")
        template = TEMPLATES.get(a["template"], a["template"])
        if not isinstance(template, str) or "{expr}" not in template:
            raise ValueError(f"template must be one of {sorted(TEMPLATES)} or text containing {{expr}}, got {a['template']!r}")
        if a["template"] == "multiply_chain" and (a["operands"] < 3 or a["operators"] != "*"):
            raise ValueError("template multiply_chain is for three or more numbers multiplied: operands >= 3, operators: '*'")
        if a["num_test"] >= space_size(a):
            raise ValueError(f"num_test={a['num_test']} leaves no train problems: only {space_size(a)} distinct problems exist")
        return a

    @classmethod
    def reward_args(cls, args: dict) -> dict:
        """Keyword arguments the task gives its rewards: whether a bare last number counts."""
        final_number = {**DEFAULTS, **args}["final_number"]
        return {name: {"final_number": final_number} for name in ("numeric_accuracy", "accuracy", "signed_accuracy")}

    @classmethod
    def splits(cls, args: dict, seed: int) -> tuple[list[Example], list[Example]]:
        a = cls.check_args(args)
        rng = random.Random(seed if a["seed"] is None else a["seed"])
        if space_size(a) <= _ENUMERATE_BELOW:
            problems = list(_all_problems(a))
            rng.shuffle(problems)
            test = problems[: a["num_test"]]
            train = problems[a["num_test"] : a["num_test"] + a["num_train"]]
        else:
            test = _draw(rng, a, a["num_test"], exclude=set())
            train = _draw(rng, a, a["num_train"], exclude=set(test))
        template = TEMPLATES.get(a["template"], a["template"])
        return [_example(p, template) for p in train], [_example(p, template) for p in test]


    @staticmethod
    def solution(example: Example) -> str:
        """A worked solution in the layout the prompt's example shows (the demonstration for rlvr sft)."""
        return f"{example.columns['expression']} = {example.answer}, so the answer is \\boxed{{{example.answer}}}."


def space_size(a: dict) -> int:
    per_operand = 10 if a["digits"] == 1 else 9 * 10 ** (a["digits"] - 1)
    return per_operand ** a["operands"] * len(set(a["operators"])) ** (a["operands"] - 1)


def _operand_range(digits: int) -> range:
    return range(0, 10) if digits == 1 else range(10 ** (digits - 1), 10**digits)


def _all_problems(a: dict):
    r = _operand_range(a["digits"])
    ops = sorted(set(a["operators"]))
    for nums in itertools.product(r, repeat=a["operands"]):
        for chosen in itertools.product(ops, repeat=a["operands"] - 1):
            yield _expr(nums, chosen)


def _draw(rng: random.Random, a: dict, n: int, exclude: set) -> list[str]:
    r = _operand_range(a["digits"])
    ops = sorted(set(a["operators"]))
    seen, out = set(exclude), []
    while len(out) < n:
        nums = [rng.choice(r) for _ in range(a["operands"])]
        expr = _expr(nums, [rng.choice(ops) for _ in range(a["operands"] - 1)])
        if expr not in seen:
            seen.add(expr)
            out.append(expr)
    return out


def _expr(nums, ops) -> str:
    parts = [str(nums[0])]
    for op, n in zip(ops, nums[1:]):
        parts += [op, str(n)]
    return " ".join(parts)


def evaluate_expression(expr: str) -> int:
    """Value of "a op b op c ..." with * before + and -, without eval()."""
    tokens = expr.split()
    terms, signs = [int(tokens[0])], [1]
    for op, num in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            terms[-1] *= int(num)
        else:
            terms.append(int(num))
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def _example(expr: str, template: str) -> Example:
    answer = str(evaluate_expression(expr))
    prompt = template.format(expr=expr, n=[int(x) for x in expr.split()[::2]])
    return Example(prompt=prompt, answer=answer, columns={"answer": answer, "expression": expr})
