"""Our `countdown` verifier against a grader nobody here wrote: reasoning-gym's countdown dataset and its
`score_answer`.

reasoning-gym's rules (reasoning_gym/games/countdown.py, version 0.1.25), read from its source:

- the answer is the text of the last ``<answer>...</answer>`` block (`reasoning_gym.utils.extract_answer`,
  what its own pipelines feed `score_answer`); no ``\\boxed{}``;
- that text is evaluated by `sympy.parse_expr` (exact rationals: ``7/2`` is 7/2, not 3.5 or 3), so any
  Python/sympy expression is accepted: ``**``, ``//``, ``%``, ``^`` (XOR), ``3!``, ``Abs(...)``, a unary
  plus, ``1.0``; and the value must be within 1e-6 of the target;
- the numbers are the text's runs of digits (``\\b\\d+\\b``): sorted, they must equal the given numbers,
  so every number is used exactly once (signs are not numbers, as in ours);
- scores: 1.0 solved; 0.05 parsed but wrong numbers or value; 0.01 empty or unparsable (shaping credit).

Where the two rule sets coincide we assert that both pass or both fail.  Where they differ by design,
EXPECTED says which side passes and why; every case is checked against it, so a disagreement that
is not written down there fails the test.
"""

import ast
import time
from collections import Counter
from fractions import Fraction
from importlib.metadata import version

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed: pip install 'rlvr[reasoning-gym]'")
from reasoning_gym.utils import extract_answer  # noqa: E402

from rlvr.rewards.countdown import countdown  # noqa: E402

RG_FAIL = {0.01, 0.05}  # reasoning-gym's partial credit for a wrong answer; we give 0.0 (a difference in scale only)
SAME = "both rule sets"

# kind -> (ours passes, reasoning-gym passes, why)
EXPECTED = {
    # --- both accept
    "reference": (True, True, SAME),
    "reference, reasoning before the block": (True, True, SAME),
    "reference, after an earlier wrong block": (True, True, SAME),
    "reference, 25,000 characters of reasoning before": (True, True, "we keep the last 20,000 characters; the block is in them"),
    "negative intermediate": (True, True, SAME),
    "a number given twice, used twice": (True, True, SAME),
    "a unary minus inside": (True, True, SAME),
    # --- both refuse
    "a number used twice": (False, False, SAME),
    "a number left out": (False, False, SAME),
    "a number not given": (False, False, SAME),
    "wrong target": (False, False, SAME),
    "prose inside the block": (False, False, SAME),
    "no answer block": (False, False, SAME),
    "unclosed answer block": (False, False, SAME),
    "division by zero": (False, False, SAME),
    "a leading zero": (False, False, SAME),
    "non-ASCII digits": (False, False, SAME),
    "5,000-term sum": (False, False, SAME),
    # --- differences by design: we refuse, reasoning-gym accepts
    "a number left out, use_all=false": (
        True, False, "use_all=false (the TV show's rule) lets numbers be left out; reasoning-gym always requires all, "
                     "although one of its own prompt templates says 'Each number may be used at most once'"),
    "uneven division": (False, True, "we require every division to be exact; reasoning-gym computes with rationals"),
    "power **": (False, True, "we allow only + - * /; reasoning-gym evaluates any sympy expression"),
    "floor division //": (False, True, "only + - * / (ours)"),
    "modulo %": (False, True, "only + - * / (ours)"),
    "xor ^": (False, True, "only + - * / (ours); in sympy's parse_expr without convert_xor, ^ is Python's XOR"),
    "factorial !": (False, True, "only + - * / (ours); sympy's parser reads 3! as factorial(3)"),
    "a function Abs()": (False, True, "no names or calls (ours)"),
    "unary plus": (False, True, "only a leading minus (ours)"),
    "a trailing period": (False, True, "only integer literals (ours); Python reads `5.` as the float 5.0, so reasoning-gym accepts it"),
    "a decimal point": (False, True, "only integer literals (ours); reasoning-gym reads 1.0 as the numbers 1 and 0 and the value 1"),
    "over 200 characters (redundant parentheses)": (
        False, True, "we cap the expression at MAX_EXPRESSION_CHARS=200 so hostile output stays cheap; reasoning-gym has no cap"),
    # --- differences by design: we accept, reasoning-gym refuses
    "trailing = target": (True, False, "we allow a trailing '= <target>'; reasoning-gym's prompt forbids '=' and sympy cannot parse it"),
    "\\boxed{} without an answer block": (True, False, "we fall back to the last \\boxed{}; reasoning-gym reads only <answer>"),
    "\\boxed{} inside the answer block": (True, False, "we take the box inside the block; reasoning-gym parses the LaTeX as Python"),
    "LaTeX \\times": (True, False, "we read LaTeX and Unicode spellings of * / -; reasoning-gym only Python's"),
    "Unicode × and −": (True, False, "as above"),
    "an expression across lines": (True, False, "we read any whitespace as a space; sympy cannot parse a line break inside"),
    "a nested opening tag": (
        True, False, "we take the last <answer> before the last </answer>; reasoning-gym's non-greedy regex starts at the "
                     "first <answer> and keeps the inner tag in the answer"),
}


def ours(completion, numbers, target, **reward_args):
    return countdown([completion], nums=[list(numbers)], target=[target], **reward_args)[0]


def theirs(dataset, completion, numbers, target):
    return dataset.score_answer(extract_answer(completion), {"metadata": {"numbers": list(numbers), "target": target}})


def exact_value(node):
    """The exact (rational) value of a + - * / expression tree, to check our mutations keep the target."""
    if isinstance(node, ast.Expression):
        return exact_value(node.body)
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        return -exact_value(node.operand)
    left, right = exact_value(node.left), exact_value(node.right)
    if isinstance(node.op, ast.Div):
        return left / right
    return {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}[type(node.op)]


def uneven_division(expression):
    """The expression rewritten to the same value through an uneven division: `x*y/d` -> `x/d*y` where d
    does not divide x (`9*14/6` -> `9/6*14`, 1.5 on the way to 21); None where no division allows it."""
    tree = ast.parse(expression, mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.left, ast.BinOp) \
                and isinstance(node.left.op, ast.Mult):
            divisor = node.right
            for x, y in ((node.left.left, node.left.right), (node.left.right, node.left.left)):
                if (exact_value(x) / exact_value(divisor)).denominator != 1:
                    node.left, node.op, node.right = ast.BinOp(x, ast.Div(), divisor), ast.Mult(), y
                    return ast.unparse(tree)
    return None


def entry_cases(entry):
    """(kind, completion, numbers, target, reward_args) for one reasoning-gym entry: its reference answer and
    mutations that each break one rule.  The reference uses every number once and reaches the target."""
    numbers, target, ref = list(entry["metadata"]["numbers"]), entry["metadata"]["target"], entry["answer"]
    assert Counter(numbers) == Counter(c.value for c in ast.walk(ast.parse(ref)) if isinstance(c, ast.Constant))
    block = f"<answer>{ref}</answer>"
    first = numbers[0]
    yield "reference", block, numbers, target, {}
    yield "reference, reasoning before the block", f"Try 3 + 4 = 7 first, then {first}.\n<answer>\n{ref}\n</answer>", numbers, target, {}
    yield "reference, after an earlier wrong block", f"<answer>{first}</answer> no, wait: <answer>{ref}</answer>", numbers, target, {}
    yield "reference, 25,000 characters of reasoning before", "Let me think. " * 1800 + block, numbers, target, {}
    yield "a number used twice", f"<answer>({ref}) * {first} / {first}</answer>", numbers, target, {}  # still the target
    yield "a number left out", block, numbers + [first], target, {}  # the target reached without the extra number
    yield "a number left out, use_all=false", block, numbers + [first], target, {"use_all": False}
    not_given = "* 1" if 1 not in numbers else "+ 0"  # both keep the value; reasoning-gym never gives 0
    yield "a number not given", f"<answer>({ref}) {not_given}</answer>", numbers, target, {}
    yield "wrong target", block, numbers, target + 1, {}
    yield "prose inside the block", f"<answer>The answer is {ref}.</answer>", numbers, target, {}
    yield "no answer block", ref, numbers, target, {}
    yield "unclosed answer block", f"<answer>{ref}", numbers, target, {}
    uneven = uneven_division(ref)
    if uneven is not None:
        assert exact_value(ast.parse(uneven, mode="eval")) == target, (ref, uneven)
        yield "uneven division", f"<answer>{uneven}</answer>", numbers, target, {}
    # an operator one side forbids, with the number it needs given, keeping the value: exactly one rule broken
    yield "power **", f"<answer>({ref}) ** 1</answer>", numbers + [1], target, {}
    yield "floor division //", f"<answer>({ref}) // 1</answer>", numbers + [1], target, {}
    yield "modulo %", f"<answer>({ref}) % {target + 1}</answer>", numbers + [target + 1], target, {}
    yield "factorial !", f"<answer>({ref}) * 1!</answer>", numbers + [1], target, {}
    yield "a function Abs()", f"<answer>Abs({ref})</answer>", numbers, target, {}
    yield "unary plus", f"<answer>+({ref})</answer>", numbers, target, {}
    yield "a decimal point", f"<answer>({ref}) * 1.0</answer>", numbers + [1, 0], target, {}
    yield "over 200 characters (redundant parentheses)", f"<answer>{'(' * 100}{ref}{')' * 100}</answer>", numbers, target, {}
    yield "trailing = target", f"<answer>{ref} = {target}</answer>", numbers, target, {}
    yield "\\boxed{} without an answer block", f"So the expression is $\\boxed{{{ref}}}$.", numbers, target, {}
    yield "\\boxed{} inside the answer block", f"<answer>\\boxed{{{ref}}}</answer>", numbers, target, {}
    if "*" in ref:
        yield "LaTeX \\times", "<answer>" + ref.replace("*", " \\times ") + "</answer>", numbers, target, {}
    if "*" in ref or "-" in ref:
        yield "Unicode × and −", "<answer>" + ref.replace("*", "×").replace("-", "−") + "</answer>", numbers, target, {}
    yield "a nested opening tag", f"<answer>{first}? <answer>{ref}</answer>", numbers, target, {}


HAND_CASES = [  # (kind, completion, numbers, target)
    ("uneven division", "<answer>7/2*4 + 2</answer>", [7, 2, 4, 2], 16),  # 3.5 * 4 + 2
    ("xor ^", "<answer>(7*3 - 5) ^ 0</answer>", [7, 3, 5, 0], 16),  # 16 XOR 0
    ("negative intermediate", "<answer>-(2 - 10) * 2</answer>", [2, 10, 2], 16),
    ("a number given twice, used twice", "<answer>(4 + 8) * 2 - 8</answer>", [4, 8, 2, 8], 16),
    ("a unary minus inside", "<answer>7*3 + -5</answer>", [7, 3, 5], 16),
    ("a trailing period", "<answer>7*3 - 5.</answer>", [7, 3, 5], 16),
    ("an expression across lines", "<answer>7*3\n- 5</answer>", [7, 3, 5], 16),
    ("division by zero", "<answer>16 / (5 - 5)</answer>", [16, 5, 5], 16),
    ("a leading zero", "<answer>07*3 - 5</answer>", [7, 3, 5], 16),
    ("non-ASCII digits", "<answer>٧*٣ - ٥</answer>", [7, 3, 5], 16),  # reasoning-gym's \d reads them; sympy cannot
    ("5,000-term sum", "<answer>" + " + ".join(["3"] * 5000) + "</answer>", [3, 5, 7], 16),
]


@pytest.fixture(scope="module")
def datasets():
    """reasoning-gym's defaults (4-6 numbers up to 100, targets 100-999) and TinyZero's sizes (3-4 numbers, targets up to 100)."""
    return [reasoning_gym.create_dataset("countdown", size=60, seed=11),
            reasoning_gym.create_dataset("countdown", size=60, seed=12, min_numbers=3, max_numbers=4,
                                         max_value=99, min_target=1, max_target=100)]


def test_our_verifier_agrees_with_reasoning_gym_except_where_the_rules_differ_by_design(datasets):
    start = time.perf_counter()
    cases = [(kind, completion, numbers, target, args, dataset)
             for dataset in datasets for entry in dataset for kind, completion, numbers, target, args in entry_cases(entry)]
    cases += [(kind, completion, numbers, target, {}, datasets[0]) for kind, completion, numbers, target in HAND_CASES]
    tally, unexpected = {}, []
    for kind, completion, numbers, target, args, dataset in cases:
        our_score, their_score = ours(completion, numbers, target, **args), theirs(dataset, completion, numbers, target)
        assert our_score in (0.0, 1.0) and (their_score == 1.0 or their_score in RG_FAIL), (kind, our_score, their_score)
        got = (our_score == 1.0, their_score == 1.0)
        if got != EXPECTED[kind][:2]:
            unexpected.append((kind, completion[-200:], numbers, target, our_score, their_score))
        n, agree = tally.get(kind, (0, 0))
        tally[kind] = (n + 1, agree + (got[0] == got[1]))
    total, agreed = sum(n for n, _ in tally.values()), sum(a for _, a in tally.values())
    coinciding = [(n, a) for kind, (n, a) in tally.items() if EXPECTED[kind][0] == EXPECTED[kind][1]]
    print(f"\ncountdown vs reasoning-gym {version('reasoning-gym')}: {len(cases)} cases from "
          f"{sum(len(d) for d in datasets)} entries + {len(HAND_CASES)} hand cases; pass/fail agreement {agreed}/{total} "
          f"= {agreed / total:.1%} (the mix of mutations sets this), on the kinds where the rules coincide "
          f"{sum(a for _, a in coinciding)}/{sum(n for n, _ in coinciding)}")
    for kind, (n, agree) in tally.items():
        ours_pass, rg_pass, why = EXPECTED[kind]
        print(f"  {kind:48} {agree:4}/{n:<4} ours {'pass' if ours_pass else 'fail'}, reasoning-gym {'pass' if rg_pass else 'fail'}"
              + ("" if why == SAME else f"  ({why})"))
    print(f"  took {time.perf_counter() - start:.1f}s")
    assert not unexpected, f"{len(unexpected)} cases break EXPECTED, e.g. {unexpected[:5]}"
    assert set(tally) == set(EXPECTED), f"kinds never exercised: {set(EXPECTED) - set(tally)}"
    assert tally["uneven division"][0] >= 5  # the rewrite applies to enough generated references to mean something
