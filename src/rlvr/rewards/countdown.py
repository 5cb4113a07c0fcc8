r"""The Countdown verifier (TinyZero's task): reach the target from the given numbers.

The completion's expression is its last ``<answer>...</answer>`` block (TinyZero's layout), else
its last ``\boxed{...}``.  A trailing ``= <target>`` is allowed, and so are ``$...$``, ``\times``,
``\cdot``, ``×``, ``\div``, ``÷`` and a Unicode minus.  The expression is parsed with `ast`, never
evaluated as Python: only ASCII integer literals, binary ``+ - * /``, unary minus (``7*3 + -5``,
as TinyZero and reasoning-gym accept it) and parentheses are accepted; anything else (a name, a call, ``**``, ``//``, a decimal point, a
non-ASCII digit, more than MAX_EXPRESSION_CHARS characters) scores 0.

The rules, those of TinyZero's ``validate_equation`` made exact:

- the numbers written are exactly the given multiset: each given number used once, none left out
  (``use_all=false``: at most once, so some may be left out, as on the TV show), no other number;
- arithmetic is exact on integers: a division must come out even wherever it appears (``7 / 2``
  scores 0 even where the rest would reach the target), and dividing by zero scores 0;
- negative intermediate results are allowed (TinyZero allows them; the TV show does not);
- the value equals the target: 1.0, else 0.0.

A row without `nums` or `target` is not applicable (None).  Column names are those of
Jiayi-Pan/Countdown-Tasks-3to4 (`nums`, `target`), so the reward also scores that dataset.
"""

from __future__ import annotations

import ast
import re
from collections import Counter

from rlvr.rewards.answers import answer_block, extract_boxed, tail
from rlvr.types import Completion, ScoreList, completion_text

MAX_EXPRESSION_CHARS = 200  # four numbers below 1,000 in any useful layout fit in far less
_ALLOWED = re.compile(r"[0-9+\-*/() ]+")
_SPELLINGS = (("\\times", "*"), ("\\cdot", "*"), ("×", "*"), ("·", "*"), ("⋅", "*"), ("\\div", "/"), ("÷", "/"),
              ("−", "-"), ("–", "-"), ("\\left", ""), ("\\right", ""), ("\\,", " "), ("\\!", ""), ("$", ""))


class Invalid(ValueError):
    """The expression breaks a rule: it scores 0."""


def countdown(completions: list[Completion], nums: list | None = None, target: list | None = None, *,
              use_all: bool = True, **kwargs) -> ScoreList:
    """1.0 if the completion's expression uses the given numbers (each exactly once; `use_all=false`:
    at most once) and reaches the target with exact arithmetic, else 0.0; None for a row without numbers."""
    if not isinstance(use_all, bool):
        raise ValueError(f"use_all must be true or false, got {use_all!r}")
    if nums is None or target is None:
        return ScoreList([None] * len(completions))
    if not len(nums) == len(target) == len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(nums)} `nums` and {len(target)} `target` values")
    scores = ScoreList()
    for completion, given, goal in zip(completions, nums, target):
        if given is None or goal is None:
            scores.append(None)
            continue
        given, goal = reference_numbers(given), reference_target(goal)
        expression = extract_expression(completion_text(completion), goal)
        try:
            scores.append(1.0 if expression is not None and check_expression(expression, given, goal, use_all) else 0.0)
        except Exception:  # a case the parser's rules missed: unscorable, counted, never a crash
            scores.append(0.0)
            scores.errors += 1
    return scores


def check_expression(expression: str, nums: list[int], target: int, use_all: bool = True) -> bool:
    """Whether `expression` reaches `target` from `nums` under the rules above (never raises Invalid)."""
    try:
        tree = parse_expression(expression)
        used = Counter(node.value for node in ast.walk(tree) if isinstance(node, ast.Constant))
        given = Counter(nums)
        if used - given or (use_all and used != given):  # a number not given, given fewer times, or left out
            return False
        return evaluate(tree) == target
    except Invalid:
        return False


def extract_expression(text: str, target: int | None = None) -> str | None:
    """The expression a completion commits to: its last <answer> block, else its last box, with the
    spellings above made plain and a trailing `= target` dropped; None when there is none."""
    text = tail(text)
    found = answer_block(text)
    if found is None:
        found = extract_boxed(text)
    if found is None:
        return None
    for spelling, plain in _SPELLINGS:
        found = found.replace(spelling, plain)
    found = " ".join(found.split())
    if "=" in found:  # `(6 - 2) * 5 = 20`: the right side must be the target itself
        left, _, right = found.partition("=")
        if "=" in right or target is None or right.strip() != str(target):
            return None
        found = left.strip()
    return found or None


def parse_expression(expression: str) -> ast.expr:
    """The syntax tree of a plain arithmetic expression; Invalid for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS or not _ALLOWED.fullmatch(expression) or "**" in expression or "//" in expression:
        raise Invalid("not a plain arithmetic expression")
    try:
        tree = ast.parse(expression, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise Invalid("does not parse") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise Invalid("only integer numbers")
        elif isinstance(node, ast.BinOp):
            if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
                raise Invalid("only + - * /")
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, ast.USub):
                raise Invalid("only a unary minus")
        elif not isinstance(node, (ast.operator, ast.unaryop)):
            raise Invalid(f"{type(node).__name__} is not allowed")
    return tree


def evaluate(node: ast.expr) -> int:
    """The exact integer value of a tree from parse_expression; Invalid for an uneven division or one by zero."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp):
        return -evaluate(node.operand)
    left, right = evaluate(node.left), evaluate(node.right)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    if right == 0:
        raise Invalid("division by zero")
    quotient, remainder = divmod(left, right)
    if remainder:
        raise Invalid(f"{left} / {right} is not a whole number")
    return quotient


def reference_numbers(value) -> list[int]:
    """A row's `nums`: a list of integers (or of integer strings, or its JSON text)."""
    if isinstance(value, str):
        value = [v for v in re.split(r"[\s,\[\]]+", value) if v]
    try:
        numbers = [_integer(v) for v in value]
    except (TypeError, ValueError):
        numbers = []
    if not numbers:
        raise ValueError(f"countdown: the `nums` column must hold a list of integers, got {value!r:.80}")
    return numbers


def reference_target(value) -> int:
    try:
        return _integer(value)
    except (TypeError, ValueError):
        raise ValueError(f"countdown: the `target` column must hold an integer, got {value!r:.80}") from None


def _integer(value) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a number")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) or (isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value)):
        return int(value)
    raise ValueError(f"not an integer: {value!r}")
