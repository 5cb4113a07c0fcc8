r"""Answer extraction and grading for math problems.

The answer of a completion is the content of its last ``\boxed{...}`` (or
``\fbox{...}``), else of its last ``<answer>...</answer>`` block.
`is_equivalent` compares it with the reference in three steps, cheapest first;
the first step that can decide, decides:

1. string: equal after light normalisation (whitespace and LaTeX spacing,
   ``$``, ``\left`` / ``\right``, ``\dfrac`` / ``\tfrac``, ``\text{...}``
   wrappers, a trailing full stop);
2. number: when both sides are plain numbers (``1,234``, ``-0.5``, ``3/4``,
   ``\frac{3}{4}``, optionally followed by a ``\text{...}`` unit), they are
   compared within a relative tolerance of 1e-6, and this verdict is final:
   ``0.333`` is not ``1/3``;
3. symbolic: math_verify parses both sides into sympy and compares them, so
   ``2\sqrt{2}`` equals ``\sqrt{8}`` and ``x^2+2x+1`` equals ``(x+1)^2``.

Model output is untrusted.  Completions are cut to their last 20,000
characters before any regex sees them, answers longer than 1,000 characters
skip the symbolic step, and any error while grading means "not equal".
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

from math_verify import parse, verify
from math_verify.errors import TimeoutException

from rlvr.types import Completion, completion_text

MAX_COMPLETION_CHARS = 20_000  # longer completions keep only their tail
MAX_SYMBOLIC_CHARS = 1_000  # longer answers are not given to math_verify
SYMBOLIC_TIMEOUT_S = 5  # math_verify's own timeout; main thread only (SIGALRM)
REL_TOL = Fraction(1, 10**6)
ABS_TOL = Fraction(1, 10**9)

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BOX_TOKEN = re.compile(r"[^\s${}]+")  # the argument of `\boxed 5`
_TEXT = re.compile(r"\\(?:text|textrm|textbf|mathrm|mbox)\{([^{}]*)\}")
_NOISE = re.compile(r"\\[,;:! ]|\\(?:left|right)(?![A-Za-z])|\$")
_SMALL_FRAC = re.compile(r"\\[dt]frac(?![A-Za-z])")
_UNIT = re.compile(r"\\(?:text|mathrm|mbox)\{\s*[A-Za-z][A-Za-z ]*\}(?:\^\{?\d\}?)?\s*$")
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?"
_NUMBER = re.compile(
    rf"(?P<sign>[+-]?)(?:(?P<num>{_UNSIGNED})(?:/(?P<den>{_UNSIGNED}))?"
    rf"|\\frac\{{(?P<fnum>[+-]?{_UNSIGNED})\}}\{{(?P<fden>[+-]?{_UNSIGNED})\}})"
)


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


def extract_answer(text: str) -> str | None:
    """The answer a completion commits to, stripped; None if there is none.

    The last non-empty boxed answer anywhere in the text, else the content of
    the last ``<answer>...</answer>`` block (its box content if it holds one).
    """
    text = _tail(text)
    boxed = extract_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    block = _last_answer_block(text)
    if block is None:
        return None
    inner = extract_boxed(block)
    answer = (block if inner is None else inner).strip()
    return answer or None


def reference_answer(ref) -> str | None:
    r"""A dataset's reference answer as a string to grade against.

    A MATH-style solution gives the content of its last ``\boxed{}``; anything
    else is the stripped string (numbers through str()).  None for None/empty.
    """
    if ref is None:
        return None
    text = ref if isinstance(ref, str) else str(ref)
    boxed = extract_boxed(text)
    if boxed is not None:
        text = boxed
    return text.strip() or None


def is_equivalent(pred: str, ref: str) -> bool:
    r"""Whether the predicted answer equals the reference (see the module docstring).

    Numbers: an optional sign, digits with optional thousands commas
    (``1,234``), an optional decimal part and exponent, a fraction ``a/b`` or
    ``\frac{a}{b}``, and an optional trailing ``\text{unit}``.  Two numbers are
    equal when |a - b| <= max(1e-6 * max(|a|, |b|), 1e-9), computed exactly
    with fractions.  Anything that goes wrong while grading gives False.
    """
    try:
        if not pred.strip() or not ref.strip():
            return False
        if max(len(pred), len(ref)) > MAX_COMPLETION_CHARS:
            return pred.strip() == ref.strip()
        if _normalise(pred) == _normalise(ref):
            return True
        if _number(pred) is not None and _number(ref) is not None:
            return _numbers_equal(pred, ref)
        if max(len(pred), len(ref)) > MAX_SYMBOLIC_CHARS:
            return False
        return _symbolic_equal(pred, ref)
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return False


def _numbers_equal(pred: str, ref: str) -> bool:
    a, b = _number(pred), _number(ref)
    return a is not None and b is not None and abs(a - b) <= max(REL_TOL * max(abs(a), abs(b)), ABS_TOL)


def _symbolic_equal(pred: str, ref: str) -> bool:
    """math_verify's verdict.  Its timeouts use SIGALRM, so only on the main thread."""
    on_main = threading.current_thread() is threading.main_thread()
    timeout = SYMBOLIC_TIMEOUT_S if on_main else None
    gold = parse(_as_latex(ref), parsing_timeout=timeout)
    target = parse(_as_latex(pred), parsing_timeout=timeout)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=timeout))


def accuracy(completions: list[Completion], answer: list | None = None, **kwargs) -> list[float | None]:
    """1.0 if the completion's answer equals the reference, else 0.0; None where a row has no reference."""
    scores = {"correct": 1.0, "wrong": 0.0, "missing": 0.0}
    return [None if g is None else scores[g] for g in _grades(completions, answer)]


def numeric_accuracy(completions: list[Completion], answer: list | None = None, **kwargs) -> list[float | None]:
    r"""1.0 if the completion's answer is a plain number equal to the reference, else 0.0.

    No symbolic step: for arithmetic, boxing the question itself (``\boxed{3 + 5}``)
    must not count as answering 8.  None where a row has no reference.
    """
    scores = {"correct": 1.0, "wrong": 0.0, "missing": 0.0}
    return [None if g is None else scores[g] for g in _grades(completions, answer, numeric_only=True)]


def signed_accuracy(completions: list[Completion], answer: list | None = None, **kwargs) -> list[float | None]:
    """1.0 correct, -0.5 wrong, -1.0 no answer found; None where a row has no reference."""
    scores = {"correct": 1.0, "wrong": -0.5, "missing": -1.0}
    return [None if g is None else scores[g] for g in _grades(completions, answer)]


def _grades(completions: list[Completion], answer: list | None, numeric_only: bool = False) -> list[str | None]:
    """Per row: "correct", "wrong", "missing" (no answer extracted) or None (no reference)."""
    if answer is None:
        return [None] * len(completions)
    if len(answer) != len(completions):
        raise ValueError(
            f"got {len(completions)} completions but {len(answer)} answers; "
            "the `answer` column must hold one reference per completion"
        )
    grades = []
    for completion, raw_ref in zip(completions, answer):
        ref = reference_answer(raw_ref)
        if ref is None:
            grades.append(None)
            continue
        pred = extract_answer(completion_text(completion))
        if pred is None:
            grades.append("missing")
        else:
            equal = _numbers_equal(pred, ref) if numeric_only else is_equivalent(pred, ref)
            grades.append("correct" if equal else "wrong")
    return grades


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
    answer = _SMALL_FRAC.sub(r"\\frac", answer)
    answer = "".join(answer.split())
    return answer.rstrip(".")


def _number(answer: str) -> Fraction | None:
    """The exact value of a plain number (units dropped), or None if it is not one."""
    match = _NUMBER.fullmatch(_normalise(_UNIT.sub("", answer)))
    if match is None:
        return None
    num, den = match["num"] or match["fnum"], match["den"] or match["fden"] or "1"
    try:
        value = Fraction(num.replace(",", "")) / Fraction(den.replace(",", ""))
    except (ValueError, ZeroDivisionError):  # a zero denominator, or > 4300 digits
        return None
    return -value if match["sign"] == "-" else value


def _as_latex(answer: str) -> str:
    """math_verify reads LaTeX between `$` delimiters; bare strings often fail to parse."""
    return answer if "$" in answer else f"${answer}$"
