r"""Whether an extracted answer equals the reference: the rules, cheapest first.

Both sides are first written the same way (`canonical`): math delimiters, ``\left``/``\right``,
LaTeX spacing, ``\dfrac``/``\tfrac``, ``\frac12`` -> ``\frac{1}{2}``, currency signs (``\$``, €, £)
and ``\text{...}`` / ``\mathrm{...}`` wrappers go (their content stays: ``\mathrm{e}`` is the
constant e, ``\text{ cm}`` a unit), degree marks become the unit °, thousands separators
(``32,349``, ``32{,}349``, ``32,\!349``) are removed.  A comma followed by a space is a list
separator, never a thousands separator; ``and`` / ``or`` between answers separate them too.

1. string: equal once spaces are removed (words of three letters or more in any case; ``x = 3``
   against ``3`` drops ``x =``; ``(C)`` is ``C``);
2. number: when both sides are a number with an optional unit, or lists of such numbers (compared
   as multisets), this verdict is final (rewards/quantities.py): integers and other terminating
   decimals compare exactly (``1000000001`` is not ``1000000000``), a decimal against a value that
   does not terminate within a relative 1e-6 (``0.333333`` against ``1/3``), units must agree when
   both sides carry one (``cm`` = ``centimeters``; no conversions);
3. symbolic: math-verify compares the rest (sets, intervals, tuples, equations, matrices,
   radicals, constants, complex numbers), after a unit carried by both sides is compared and
   removed.  It runs in worker processes with a hard time bound (rewards/pool.py).
"""

from __future__ import annotations

import logging
import re

from rlvr.rewards.quantities import Quantity, numbers_equal, quantity, unit_name

MAX_SYMBOLIC_CHARS = 1_000  # longer answers are not given to math_verify
MAX_ANSWER_CHARS = 20_000  # longer answers are compared as exact strings

# math_verify warns on every call that its own timeout is off; our pool bounds it instead.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# --- writing both sides the same way ------------------------------------------------------------

_UNICODE = {"−": "-", "–": "-", "×": r"\times ", "·": r"\cdot ", "≤": r"\leq ", "≥": r"\geq ", "≠": r"\neq ",
            "π": r"\pi ", "∞": r"\infty ", "≈": r"\approx ", "\u00a0": " ", "\u2009": " ", "\u202f": " ", "，": ", "}
_WRAPPER = re.compile(r"\\(?:text|textrm|textbf|textit|textnormal|textsf|texttt|mathrm|mathit|mathbf|mathsf|mathnormal|mbox|hbox)\s*\{([^{}]*)\}")
_SIZING = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg|bigl|bigr|Bigl|Bigr|displaystyle|textstyle)(?![A-Za-z])")
_SPACING = re.compile(r"(?<!\\)\\(?:quad|qquad|enspace|thinspace|medspace|thickspace|[,;: ])|\\hspace\*?\{[^{}]*\}|~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\degree(?![A-Za-z])|°")
_FRAC_DIGITS = re.compile(r"\\frac\s*(\d)\s*(\d)")
_FRAC_HALF = [re.compile(r"\\frac\s*(\d)\s*\{"), re.compile(r"\\frac\s*(\{[^{}]*\})\s*(\d)")]
_SQRT_DIGIT = re.compile(r"\\sqrt\s*(\d)")
_THOUSANDS = re.compile(r"(?<![\d.,])([1-9]\d{0,2})((?:,\d{3})+)(?![\d]|,\d)")
# An escaped-twice command (`\\\\frac`, from JSON written twice): a row break never precedes these names.
_DOUBLED = re.compile(r"\\\\(?=(?:left|right|frac|dfrac|tfrac|sqrt|text|mathrm|boxed|le|ge|leq|geq|neq|pi|infty|cdot|times|pm|"
                      r"in|cup|cap|sin|cos|tan|log|ln)(?![A-Za-z]))")
_CONNECTOR = re.compile(r" ?,? ?(?<![A-Za-z\\])(?:and|or)(?![A-Za-z]) ?")


def canonical(answer: str) -> str:
    """The answer written the standard way (see the module docstring); cheap, regexes only."""
    s = _DOUBLED.sub(r"\\", answer.strip())
    for char, replacement in _UNICODE.items():
        s = s.replace(char, replacement)
    s = s.replace(r"\$", " ").replace("€", " ").replace("£", " ").replace("¥", " ")
    s = re.sub(r"(?<!\\)\\[()\[\]]|\$", " ", s)
    s = _SIZING.sub("", s)
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r",\\!\s*", ",", s).replace(r"\!", "").replace("{,}", ",")
    s = _SPACING.sub(" ", s)
    for _ in range(3):  # nested wrappers: \text{\textbf{x}}
        s = _WRAPPER.sub(r" \1 ", s)
    s = _DEGREES.sub(" ° ", s)
    s = s.replace(r"\%", "%")
    s = _FRAC_DIGITS.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF[0].sub(r"\\frac{\1}{", s)
    s = _FRAC_HALF[1].sub(r"\\frac\1{\2}", s)
    s = _SQRT_DIGIT.sub(r"\\sqrt{\1}", s)
    s = " ".join(s.split())  # single spaces from here: the patterns below cannot backtrack far
    s = _join_thousands(s)
    s = _CONNECTOR.sub(", ", s)
    s = re.sub(r"(?: ?,)+ ", ", ", s)
    s = re.sub(r" (?=[\^_}])|(?<=[{^_]) ", "", s)
    s = s.replace(r"\varnothing", r"\emptyset")
    s = s.rstrip(" .;:,").lstrip(" ;:,")
    s = s.lstrip("=").strip() if s.startswith("=") else s
    return _unwrap(_exact_part(s))


def _exact_part(s: str) -> str:
    """``x = \\frac{70}{9} \\approx 7.78`` -> ``x = \\frac{70}{9}``: a chain's exact value."""
    equals = s.rfind("=")
    approx = s.find("\\approx", equals) if equals >= 0 else -1
    return s[:approx].rstrip() if approx >= 0 else s


def _unwrap(s: str) -> str:
    """``(\\frac{1}{3})`` -> ``\\frac{1}{3}``: parentheses around the whole answer that hold no comma."""
    partner, stack, commas = {}, [], set()
    for i, char in enumerate(s):
        if char in "([{":
            stack.append(i)
        elif char in ")]}" and stack:
            partner[stack.pop()] = i
        elif char == "," and stack:
            commas.add(stack[-1])  # a comma directly inside the bracket opened at stack[-1]
    k = 0
    while k < len(s) - 1 - k and s[k] == "(" and partner.get(k) == len(s) - 1 - k and k not in commas:
        k += 1
    return s[k:len(s) - k].strip() if k else s


def _join_thousands(s: str) -> str:
    """``32,349`` -> ``32349`` outside brackets (inside, ``(12,102)`` is an interval)."""
    if not _THOUSANDS.search(s):
        return s
    out, depth, start = [], 0, 0
    for i, char in enumerate(s + "("):
        if char in "([{" or i == len(s):
            if depth == 0:
                out.append(_THOUSANDS.sub(lambda m: m.group(1) + m.group(2).replace(",", ""), s[start:i]))
                start = i
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                out.append(s[start:i + 1])
                start = i + 1
    if start < len(s):
        out.append(s[start:])
    return "".join(out)


def _key(answer: str) -> str:
    """What the string step compares: no spaces; words of three letters or more in lower case."""
    key = "".join(answer.split())
    if re.fullmatch(r"[A-Za-z]{3,}", key):
        return key.lower()
    return key


_LHS = r"(?:[A-Za-z](?:_\{?\w+\}?)?(?:\([A-Za-z, ]*\))?|\|[A-Z]{2}\||[A-Z]{2,3})"
_ASSIGNMENT = re.compile(rf"{_LHS}\s*(?:=|\\approx)\s*([^=]+)")


def drop_variable(answer: str, other: str) -> str:
    """``x = 3`` -> ``3`` (also ``f(x) = ...``, ``a_{1} = ...``, ``AB = ...``) when the other side has
    no ``=``; a chain ``x = 5 + 1 = 6 \\approx 6.0`` gives its last exact value, ``6``."""
    if "=" in other or len(split_list(answer)) > 1:
        return answer
    if answer.count("=") > 1:
        head, _, last = answer.rpartition("=")
        first = head.split("=", 1)[0]
        if re.fullmatch(rf"\s*{_LHS}\s*", first):
            return last.strip()
    match = _ASSIGNMENT.fullmatch(answer)
    return match.group(1).strip() if match else answer


def split_list(answer: str) -> list[str]:
    """The top-level parts of a list answer (commas outside brackets, ``and``, ``or``); one part if none."""
    parts, depth, current = [], 0, []
    for char in answer:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    parts.append("".join(current).strip())
    return [p for p in parts if p]


def quantities(answer: str, other: str) -> list[Quantity] | None:
    """The answer as one quantity, else each part of a list answer; None if any part is something else."""
    whole = quantity(answer, other)
    if whole is not None:
        return [whole]
    parts = split_list(answer)
    out = [quantity(p, other) for p in parts]
    return None if any(q is None for q in out) else out


def _multiset_equal(a: list[Quantity], b: list[Quantity]) -> bool:
    if len(a) != len(b):
        return False
    left = list(b)
    for qa in a:
        match = next((i for i, qb in enumerate(left) if numbers_equal(qa, qb)), None)
        if match is None:
            return False
        left.pop(match)
    return True


# --- the verdict ----------------------------------------------------------------------------------

def cheap_verdict(pred: str, ref: str, numeric_only: bool = False) -> bool | None:
    """The string and number steps on canonical answers; None when only the symbolic step can decide."""
    if max(len(pred), len(ref)) > MAX_ANSWER_CHARS:
        return pred.strip() == ref.strip()
    pred, ref = canonical(pred), canonical(ref)
    pred, ref = drop_variable(pred, ref), drop_variable(ref, pred)
    if not numeric_only and _key(pred) == _key(ref):
        return True
    a, b = quantities(pred, ref), quantities(ref, pred)
    if numeric_only:
        return a is not None and b is not None and len(a) == len(b) == 1 and numbers_equal(a[0], b[0])
    if a is not None and b is not None:
        return _multiset_equal(a, b)
    if max(len(pred), len(ref)) > MAX_SYMBOLIC_CHARS:
        return False
    return None


def symbolic_input(pred: str, ref: str) -> tuple[str, str] | None:
    """The two answers as math_verify gets them: canonical, with a shared trailing unit removed.
    None (not equal) when they carry different units, or when either holds what math_verify would
    read as something else: a LaTeX command outside `SYMBOLIC_COMMANDS` (it drops ``\\foo``,
    ``\\overline{3}``, ``\\div``), a dangling operator (``\\le 5`` reads as 5, ``3 +`` as 3), or a
    number in another base (``204_5`` reads as 204)."""
    pred, ref = canonical(pred), canonical(ref)
    pred, ref = drop_variable(pred, ref), drop_variable(ref, pred)
    pred, pred_unit = _split_unit(pred)
    ref, ref_unit = _split_unit(ref)
    if pred_unit and ref_unit and pred_unit != ref_unit:
        return None
    if not (_readable(pred) and _readable(ref)):
        return None
    return pred, ref


SYMBOLIC_COMMANDS = frozenset(
    "frac sqrt pi infty cdot times pm mp sin cos tan sec csc cot arcsin arccos arctan sinh cosh tanh log ln exp "
    "le ge leq geq lt gt neq ne in cup cap setminus emptyset begin end binom lfloor rfloor lceil rceil mathbb sum prod "
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho sigma tau "
    "upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Pi Sigma Phi Psi Omega".split()
)
_ENVIRONMENTS = {"pmatrix", "bmatrix", "matrix", "array", "vmatrix", "Bmatrix", "cases"}
_COMMAND = re.compile(r"\\([A-Za-z]+)")
_DANGLING_START = re.compile(r"(?:\\(?:le|ge|leq|geq|lt|gt|neq|ne|div|times|cdot|in|cup|cap|setminus)(?![A-Za-z])|[<>=*/^:,;!])")
_DANGLING_END = re.compile(r"(?:[+\-*/^=<>,:;(\[{_]|\\(?:le|ge|leq|geq|lt|gt|neq|ne|div|times|cdot|pm|mp|in|cup|cap|frac|sqrt))$")
_BASE = re.compile(r"\d_\{?\d")


def _readable(answer: str) -> bool:
    """Whether math_verify can read all of `answer` (see `symbolic_input`)."""
    if not answer or _DANGLING_START.match(answer) or _DANGLING_END.search(answer) or _BASE.search(answer):
        return False
    for name in _COMMAND.findall(answer):
        if name not in SYMBOLIC_COMMANDS:
            return False
    envs = re.findall(r"\\(?:begin|end)\{([A-Za-z*]+)\}", answer)
    return all(env in _ENVIRONMENTS for env in envs)


_TRAILING_UNIT = re.compile(r"(?P<body>.*?[\d}a-zA-Z)])\s+(?P<unit>°|[A-Za-z]+(?:\^\{?[23]\}?)?(?:\s+[A-Za-z]+(?:\^\{?[23]\}?)?){0,2})")


def _split_unit(answer: str) -> tuple[str, str | None]:
    match = _TRAILING_UNIT.fullmatch(answer)
    if match is None or "\\" in match["unit"]:
        return answer.replace("°", "").strip(), None
    unit = unit_name(match["unit"])
    if unit is None:
        return answer.replace("°", "").strip(), None
    return match["body"].replace("°", "").strip(), unit


def symbolic_equal(pred: str, ref: str) -> bool:
    """math_verify's verdict, with its own SIGALRM timeouts off: callers bound it with the worker pool.
    Imported here: math_verify brings sympy and an ANTLR parser (0.4 s), which a run whose rewards never
    compare symbolically (and every process of a launch) need not load; the grading pool preloads it."""
    from math_verify import parse, verify

    gold = parse(_as_latex(ref), parsing_timeout=None)
    target = parse(_as_latex(pred), parsing_timeout=None)
    if not _whole(gold, ref) or not _whole(target, pred):
        return False
    return bool(verify(gold, target, timeout_seconds=None, allow_set_relation_comp=True))


def math_verify_pair(reference: str | None, completion: str) -> bool | None:
    """Math-Verify's verdict on a completion as its own rules read it (rewards.math.math_verify): the
    reference parsed as it is, the completion's LaTeX with its boxes tried first, then verify; None
    when the reference does not parse.  Its SIGALRM timeouts are off: the grading pool bounds the call."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    gold = parse(reference, parsing_timeout=None) if reference is not None else []
    if not gold:
        return None
    config = LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                   try_extract_without_anchor=False)
    target = parse(completion, extraction_config=[config], extraction_mode="first_match", parsing_timeout=None)
    return bool(target) and bool(verify(gold, target, timeout_seconds=None))


def _whole(parsed: list, answer: str) -> bool:
    """Whether math_verify read all of the answer: it returns [value, the text it read], and
    reads the longest part it can (``1-\\frac{1}{`` of a broken fraction), which must not pass."""
    if len(parsed) != 2 or not isinstance(parsed[1], str):
        return False
    squash = re.compile(r"[\s{}$]")
    return squash.sub("", parsed[1]) == squash.sub("", answer)


def _as_latex(answer: str) -> str:
    """math_verify reads LaTeX between `$` delimiters; bare strings often fail to parse."""
    return f"${answer}$"


def answer_key(answer: str) -> str:
    r"""A key under which equal-looking answers vote together (majority voting, maj@k).

    A plain number becomes its exact value (``0.5``, ``\frac{1}{2}`` and ``1/2`` share a key; a
    percentage keeps its own); anything else its canonical string (``x = 3`` counts as ``3``).
    Cheap, and no symbolic step: ``\sqrt{4}`` and ``2`` vote apart.
    """
    answer = drop_variable(canonical(answer), "")
    number = quantity(answer, ".")
    if number is not None:
        return f"{number.value}{'%' if number.percent else ''}"
    return _key(answer)
