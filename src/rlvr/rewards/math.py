r"""Answer extraction and grading for math problems.

Extraction (`extract_answer`): the content of the last ``\boxed{...}`` /
``\fbox{...}``; else of the last ``<answer>...</answer>`` block; else what
follows the last "the answer is" / "final answer:" / GSM8K's "####"; else, only when the task
turns it on (``final_number=True``), the last number in the text.  References
(`reference_answer`) may be plain, LaTeX, a MATH-style solution (its last box)
or a GSM8K-style solution ending in ``#### N``.

Equivalence (`grade_pairs`, `is_equivalent`), cheapest step first; the first
step that can decide, decides:

1. string: equal after normalisation (whitespace and LaTeX spacing, ``$``,
   ``\left`` / ``\right``, ``\dfrac`` / ``\tfrac``, ``\text{...}`` wrappers,
   degree signs, a trailing full stop; ``x = 3`` against ``3`` drops ``x =``);
2. number: when both sides are plain numbers (``1,234``, ``-0.5``, ``3/4``,
   ``\frac{3}{4}``, ``1.5e3``, ``1.5 \times 10^{3}``, ``50\%``, with an optional
   ``\text{...}`` unit), they are compared within a relative tolerance of 1e-6,
   and this verdict is final: ``0.333`` is not ``1/3``;
3. symbolic: math_verify parses both sides into sympy and compares them (sets,
   intervals, tuples, equations, matrices, radicals, polynomials).  This step
   runs in worker processes with a hard wall-clock bound (rewards/pool.py): an
   answer that takes too long scores 0 and is counted as a timeout.

Model output is untrusted.  Completions are cut to their last 20,000
characters before any regex sees them, only answers of at most 200 characters
are read as numbers and at most 1,000 go to math_verify, and any error while
grading means "not equal".
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fractions import Fraction

from math_verify import parse, verify

from rlvr.rewards.pool import shared_pool
from rlvr.types import Completion, ScoreList, completion_text

MAX_COMPLETION_CHARS = 20_000  # longer completions keep only their tail
MAX_SYMBOLIC_CHARS = 1_000  # longer answers are not given to math_verify
MAX_NUMBER_CHARS = 200  # longer answers are not read as numbers
MAX_PHRASE_CHARS = 200  # what "the answer is" may be followed by
DEFAULT_TIMEOUT = 5.0  # seconds for one symbolic check
REL_TOL = Fraction(1, 10**6)
ABS_TOL = Fraction(1, 10**9)

# math_verify warns on every call that its own timeout is off; our pool bounds it instead.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BOX_TOKEN = re.compile(r"[^\s${}]+")  # the argument of `\boxed 5`
_TEXT = re.compile(r"\\(?:text|textrm|textbf|mathrm|mbox)\{([^{}]*)\}")
_NOISE = re.compile(r"\\[,;:! ]|\\(?:left|right)(?![A-Za-z])|\$|\{,\}")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![A-Za-z])")
_SMALL_FRAC = re.compile(r"\\[dt]frac(?![A-Za-z])")
_UNIT = re.compile(r"\\(?:text|mathrm|mbox)\{\s*[A-Za-z][A-Za-z ]*\}(?:\^\{?\d\}?)?\s*$")
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?"
_NUMBER = re.compile(
    rf"(?P<sign>[+-]?)(?:(?P<num>{_UNSIGNED})(?:/(?P<den>{_UNSIGNED}))?"
    rf"|\\frac\{{(?P<fnum>[+-]?{_UNSIGNED})\}}\{{(?P<fden>[+-]?{_UNSIGNED})\}})"
    r"(?:(?:\\times|\\cdot|×|\*)10\^(?:\{(?P<exp>[+-]?\d{1,3})\}|(?P<exp1>[+-]?\d)))?"
    r"(?P<percent>\\?%)?"
)
_ASSIGNMENT = re.compile(r"[A-Za-z]\s*=\s*([^=]+)")
_PHRASES = ("the answer is", "final answer is", "final answer:", "answer:", "####")
_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_GSM8K = re.compile(r"####\s*(.+?)\s*$")


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` or ``\fbox{...}`` (also ``\boxed 5``).

    Nested braces are matched (``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``).
    None when there is no box, or when the last box is never closed.
    """
    text = _tail(text)
    last = None
    for last in _BOX.finditer(text):
        pass
    if last is None:
        return None
    rest = text[last.end():].lstrip()
    if rest.startswith("{"):
        return _braced(rest)
    token = _BOX_TOKEN.match(rest)
    return token.group() if token else None


def extract_answer(text: str, final_number: bool = False) -> str | None:
    """The answer a completion commits to, stripped; None if there is none.

    The last non-empty boxed answer anywhere in the text, else the content of
    the last ``<answer>...</answer>`` block (its box content if it holds one),
    else the text after the last "the answer is" / "final answer:" / "####" up to the end
    of its line, else (final_number) the last number in the text.
    """
    text = _tail(text)
    boxed = extract_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    block = _last_answer_block(text)
    if block is not None:
        inner = extract_boxed(block)
        answer = (block if inner is None else inner).strip()
        return answer or None
    stated = _stated_answer(text)
    if stated:
        return stated
    if final_number:
        numbers = _LAST_NUMBER.findall(text)
        return numbers[-1].rstrip(",") if numbers else None
    return None


def _stated_answer(text: str) -> str | None:
    lower = text.lower()
    at = max((lower.rfind(p) + len(p) for p in _PHRASES if p in lower), default=-1)
    if at < 0:
        return None
    line = text[at:at + MAX_PHRASE_CHARS].split("\n", 1)[0]
    answer = line.strip().lstrip(":").strip("*$ ").rstrip(".").strip("*$ ")
    return answer or None


def reference_answer(ref) -> str | None:
    r"""A dataset's reference answer as a string to grade against.

    A MATH-style solution gives the content of its last ``\boxed{}``; a
    GSM8K-style solution the number after its final ``#### `` (commas
    dropped); anything else is the stripped string (numbers through str()).
    None for None/empty.
    """
    if ref is None:
        return None
    text = ref if isinstance(ref, str) else str(ref)
    boxed = extract_boxed(text)
    if boxed is not None:
        text = boxed
    elif "####" in text:
        match = _GSM8K.search(text[text.rfind("####"):])
        text = match.group(1).replace(",", "") if match else ""
    return text.strip() or None


def answer_key(answer: str) -> str:
    r"""A key under which equal-looking answers vote together (majority voting, maj@k).

    A plain number becomes its exact value (``0.5``, ``\frac{1}{2}`` and ``1/2`` share
    a key; a percentage keeps its own); anything else its normalised string
    (``x = 3`` counts as ``3``).  Cheap, and no symbolic step: ``\sqrt{4}`` and ``2``
    vote apart.
    """
    answer = _drop_variable(answer, "")
    number = _number(answer)
    if number is not None:
        return f"{number.value}{'%' if number.percent else ''}"
    return _normalise(answer)


def is_equivalent(pred: str, ref: str, timeout: float = DEFAULT_TIMEOUT) -> bool:
    r"""Whether the predicted answer equals the reference (see the module docstring).

    Numbers: an optional sign, digits with optional thousands commas
    (``1,234``), an optional decimal part and exponent (``1.5e3``,
    ``1.5 \times 10^{3}``), a fraction ``a/b`` or ``\frac{a}{b}``, an optional
    trailing ``\text{unit}``, degree sign or percent sign.  Two numbers are
    equal when |a - b| <= max(1e-6 * max(|a|, |b|), 1e-9), computed exactly with
    fractions; a percentage p also matches p / 100.  The symbolic step runs in a
    worker process and is abandoned after `timeout` seconds (then: not equal).
    """
    return grade_pairs([pred], [ref], timeout=timeout)[0] == CORRECT


CORRECT, WRONG, MISSING, TIMEOUT, ERROR = "correct", "wrong", "missing", "timeout", "error"


def grade_pairs(preds: list[str | None], refs: list[str | None], numeric_only: bool = False,
                timeout: float = DEFAULT_TIMEOUT) -> list[str | None]:
    """Grade extracted answers against references, the slow symbolic checks in parallel.

    Per pair: None (no reference), MISSING (no answer), CORRECT, WRONG, or
    TIMEOUT / ERROR (the symbolic check overran or crashed; both count as wrong).
    """
    grades: list[str | None] = [None] * len(preds)
    symbolic: list[tuple[int, str, str]] = []
    for i, (pred, ref) in enumerate(zip(preds, refs)):
        if ref is None or not ref.strip():
            continue
        if pred is None or not pred.strip():
            grades[i] = MISSING
            continue
        verdict = _cheap_verdict(pred, ref, numeric_only)
        if verdict is None:
            symbolic.append((i, pred, ref))
        else:
            grades[i] = CORRECT if verdict else WRONG
    if symbolic:
        results = shared_pool().map(_symbolic_equal, [(p, r) for _, p, r in symbolic], timeout=timeout)
        for (i, _, _), result in zip(symbolic, results):
            grades[i] = result if result in (TIMEOUT, ERROR) else (CORRECT if result is True else WRONG)
    return grades


def _cheap_verdict(pred: str, ref: str, numeric_only: bool) -> bool | None:
    """The string and number steps; None when only the symbolic step can decide."""
    if max(len(pred), len(ref)) > MAX_COMPLETION_CHARS:
        return pred.strip() == ref.strip()
    pred, ref = _drop_variable(pred, ref), _drop_variable(ref, pred)
    if not numeric_only and _normalise(pred) == _normalise(ref):
        return True
    a, b = _number(pred), _number(ref)
    if a is not None and b is not None:
        return _close(a, b) or (a.percent and _close(a.value / 100, b.value)) or (b.percent and _close(a.value, b.value / 100))
    if numeric_only or max(len(pred), len(ref)) > MAX_SYMBOLIC_CHARS:
        return False
    return None


def _drop_variable(answer: str, other: str) -> str:
    """"x = 3" -> "3" when the other side is not an equation too."""
    match = _ASSIGNMENT.fullmatch(answer.strip())
    return match.group(1) if match and "=" not in other else answer


def _close(a, b) -> bool:
    a, b = getattr(a, "value", a), getattr(b, "value", b)
    return abs(a - b) <= max(REL_TOL * max(abs(a), abs(b)), ABS_TOL)


def _symbolic_equal(pred: str, ref: str) -> bool:
    """math_verify's verdict, with its own SIGALRM timeouts off: callers bound it with the worker pool."""
    gold = parse(_as_latex(ref), parsing_timeout=None)
    target = parse(_as_latex(pred), parsing_timeout=None)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=None))


def accuracy(completions: list[Completion], answer: list | None = None, *, final_number: bool = False,
             timeout: float = DEFAULT_TIMEOUT, **kwargs) -> ScoreList:
    """1.0 if the completion's answer equals the reference, else 0.0; None where a row has no reference.

    final_number: when the completion has no boxed / tagged / stated answer, take its last number.
    timeout: seconds for the symbolic check of one answer; an overrun scores 0 and is counted."""
    return _score(completions, answer, {CORRECT: 1.0, WRONG: 0.0, MISSING: 0.0}, final_number, timeout)


def numeric_accuracy(completions: list[Completion], answer: list | None = None, *, final_number: bool = False,
                     **kwargs) -> ScoreList:
    r"""1.0 if the completion's answer is a plain number equal to the reference, else 0.0.

    No symbolic step: for arithmetic, boxing the question itself (``\boxed{3 + 5}``)
    must not count as answering 8.  None where a row has no reference.
    """
    return _score(completions, answer, {CORRECT: 1.0, WRONG: 0.0, MISSING: 0.0}, final_number, 0.0, numeric_only=True)


def signed_accuracy(completions: list[Completion], answer: list | None = None, *, final_number: bool = False,
                    timeout: float = DEFAULT_TIMEOUT, **kwargs) -> ScoreList:
    """1.0 correct, -0.5 wrong, -1.0 no answer found; None where a row has no reference."""
    return _score(completions, answer, {CORRECT: 1.0, WRONG: -0.5, MISSING: -1.0}, final_number, timeout)


def _score(completions, answer, values: dict, final_number: bool, timeout: float, numeric_only: bool = False) -> ScoreList:
    if answer is None:
        return ScoreList([None] * len(completions))
    if len(answer) != len(completions):
        raise ValueError(
            f"got {len(completions)} completions but {len(answer)} answers; "
            "the `answer` column must hold one reference per completion"
        )
    refs = [reference_answer(a) for a in answer]
    preds = [None if ref is None else extract_answer(completion_text(c), final_number=final_number)
             for c, ref in zip(completions, refs)]
    grades = grade_pairs(preds, refs, numeric_only=numeric_only, timeout=timeout)
    wrong = values[WRONG]
    scores = ScoreList([None if g is None else values.get(g, wrong) for g in grades])
    scores.timeouts = grades.count(TIMEOUT)
    scores.errors = grades.count(ERROR)
    return scores


def _tail(text: str) -> str:
    return text[-MAX_COMPLETION_CHARS:] if len(text) > MAX_COMPLETION_CHARS else text


def _braced(text: str) -> str | None:
    """The content of the brace group `text` opens with; None if it never closes."""
    depth = 0
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\":  # `\{`, `\}` and `\\` are not group braces
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[1:i]
        i += 1
    return None


def _last_answer_block(text: str) -> str | None:
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    if end < 0 or start < 0:
        return None
    return text[start + len("<answer>"):end]


def _normalise(answer: str) -> str:
    answer = _TEXT.sub(r"\1", answer)
    answer = _NOISE.sub("", answer)
    answer = _DEGREES.sub("", answer)
    answer = _SMALL_FRAC.sub(r"\\frac", answer)
    answer = "".join(answer.split())
    return answer.rstrip(".")


@dataclass(frozen=True)
class _Number:
    value: Fraction
    percent: bool


def _number(answer: str) -> _Number | None:
    """The exact value of a plain number (units dropped), or None if it is not one."""
    if len(answer) > MAX_NUMBER_CHARS:
        return None
    match = _NUMBER.fullmatch(_normalise(_UNIT.sub("", answer)))
    if match is None:
        return None
    num, den = match["num"] or match["fnum"], match["den"] or match["fden"] or "1"
    exp = match["exp"] or match["exp1"]
    try:
        value = Fraction(num.replace(",", "")) / Fraction(den.replace(",", ""))
    except (ValueError, ZeroDivisionError):  # a zero denominator, or > 4300 digits
        return None
    if exp is not None:
        value *= Fraction(10) ** int(exp)
    return _Number(-value if match["sign"] == "-" else value, bool(match["percent"]))


def _as_latex(answer: str) -> str:
    """math_verify reads LaTeX between `$` delimiters; bare strings often fail to parse."""
    return answer if "$" in answer else f"${answer}$"
