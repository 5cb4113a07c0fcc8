r"""Which answer a completion commits to, and which answer a reference gives.

Sources, tried in the configured order (`sources`, default boxed, answer_tag, stated):

- ``boxed``: the final answer's boxes.  The last ``\boxed{...}`` / ``\fbox{...}`` together with
  the boxes just before it that only connective text separates from it (``and``, ``or``, commas,
  spacing, ``\text{ for part (a) and }``: at most 6 words and 60 characters, no digit).  Their
  distinct contents, joined with ", ", are the answer: ``\boxed{(2, 2)} and \boxed{(6, 2)}``
  answers ``(2, 2), (6, 2)``, and ``\boxed{7} or \boxed{8}`` answers ``7, 8``, which is not ``7``.
  A box far from the last one (an intermediate result, a corrected attempt) is not part of it.
- ``answer_tag``: the last ``<answer>...</answer>`` block (its boxes when it holds any).
- ``stated``: what follows the last "the answer is", "final answer is", "final answer:",
  "answer:" or GSM8K's "####": a ``$...$`` / ``\(...\)`` span, else the rest of the sentence
  (Minerva's "Final Answer: The final answer is $X$. I hope it is correct." gives X).
- ``last_number``: the last number of the text, only when it stands whole: not part of a word
  (``AZYUK2A``), of a LaTeX group (``\frac{1+\sqrt{5}}{2}``), of an interval or tuple
  (``[0,9)``), after an inequality (``x \geq 5``) or inside an expression (``3 - 5``).

Model output is untrusted: completions are cut to their last 20,000 characters first.
"""

from __future__ import annotations

import re

MAX_COMPLETION_CHARS = 20_000  # longer completions keep only their tail
MAX_PHRASE_CHARS = 300  # what "the answer is" may be followed by
SOURCES = ("boxed", "answer_tag", "stated", "last_number")
DEFAULT_SOURCES = ("boxed", "answer_tag", "stated")
MAX_CONNECTIVE_CHARS = 60
MAX_CONNECTIVE_WORDS = 6
MAX_GROUP_BOXES = 20  # boxes looked at, back from the last one
CONNECTIVE_WORDS = frozenset(
    "and or as well also for part parts case cases respectively then with is are the answer answers solution solutions "
    "value values of either both maybe perhaps possibly".split()
)

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BOX_TOKEN = re.compile(r"[^\s${}]+")  # the argument of `\boxed 5`
_PHRASES = ("the answer is", "final answer is", "final answer:", "answer:", "####")
_GSM8K = re.compile(r"####\s*(.+?)\s*$")
# Connective text between two boxes of one answer, once LaTeX spacing, delimiters and wrappers are gone.
_CONNECTIVE_NOISE = re.compile(r"\\(?:text|textrm|textbf|mathrm|mbox)\s*\{([^{}]*)\}|\\(?:quad|qquad|[,;:! ]|\(|\)|\[|\])|_\{?\w+\}?|[$*_~,;:.&=]|\\\\")
_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
_RELATION_BEFORE = re.compile(r"(?:<|>|≤|≥|≠|\\(?:geq?|leq?|neq?|ne|lt|gt|pm|mp|in|subset|subseteq))\s*$")


def tail(text: str) -> str:
    return text[-MAX_COMPLETION_CHARS:] if len(text) > MAX_COMPLETION_CHARS else text


def check_sources(sources) -> tuple[str, ...]:
    """The sources as a tuple; a ValueError naming the valid ones for anything else."""
    if isinstance(sources, str):
        sources = [sources]
    sources = tuple(sources)
    bad = [s for s in sources if s not in SOURCES]
    if bad or not sources:
        raise ValueError(f"sources must be a non-empty list of {', '.join(SOURCES)}; got {list(sources)}")
    return sources


def extract_answer(text: str, final_number: bool = False, sources=DEFAULT_SOURCES) -> str | None:
    """The answer a completion commits to, stripped; None if there is none (see the module docstring).

    final_number=True adds ``last_number`` after the other sources."""
    text = tail(text)
    sources = check_sources(sources)
    if final_number and "last_number" not in sources:
        sources += ("last_number",)
    for source in sources:
        answer = _FINDERS[source](text)
        if answer and source == "boxed" and "stated" in sources:
            answer = _final_statement_after_boxes(text) or answer
        if answer:
            return _math_of(answer)
    return None


_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_COMMANDS = re.compile(r"\\[A-Za-z]+(?:\{[^{}]*\})?")


def _has_prose(text: str) -> bool:
    return re.search(r"[A-Za-z]{3,}", _COMMANDS.sub("", text)) is not None


def _math_of(answer: str) -> str:
    """An answer written as prose around math (``Therefore $x \\geq 5$ is the solution.``): its last
    math span, or the math after an opening delimiter that never closes; any other answer as it is."""
    if len(answer) > MAX_PHRASE_CHARS:
        return answer  # not a sentence; and the patterns below would take quadratic time
    prose = _MATH_SPAN.sub(" ", answer)
    if not _has_prose(prose):
        return answer
    at = max(prose.rfind("$"), prose.rfind("\\("), prose.rfind("\\["))
    if at >= 0:  # `Here is the matrix: $ \\begin{pmatrix}...`
        display = prose.startswith("\\[", at) or prose.startswith("$$", max(at - 1, 0))
        rest = prose[at + (1 if prose[at] == "$" else 2):]
        inline_across_lines = not display and "\n" in rest.rstrip()  # inline math stays on its line
        if rest.strip() and not inline_across_lines and not _has_prose(rest):
            return rest.strip()
    spans = list(_MATH_SPAN.finditer(answer))
    if not spans:
        return answer
    return next(g for g in spans[-1].groups() if g is not None).strip() or answer


def _final_statement_after_boxes(text: str) -> str | None:
    """A "final answer is" / "Final Answer:" / "####" statement made after the last box (the
    boxes were intermediate results): its answer."""
    lower = text.lower()
    at = max(lower.rfind(p) for p in ("final answer is", "final answer:", "####"))
    if at < 0 or at < max(m.start() for m in _BOX.finditer(text)) or _BOX.search(text, at):
        return None
    return stated_answer(text[at:])


def _box_at(text: str, at: int) -> tuple[int, int, str] | None:
    """The box whose command starts at `at` as (start, end, content); None if it never closes."""
    command = _BOX.match(text, at)
    rest_at = command.end() + len(text[command.end():]) - len(text[command.end():].lstrip())
    if text.startswith("{", rest_at):
        content = braced(text[rest_at:])
        return None if content is None else (at, rest_at + len(content) + 2, content)
    token = _BOX_TOKEN.match(text, rest_at)
    return (at, token.end(), token.group()) if token else None


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` or ``\fbox{...}`` (also ``\boxed 5``); nested braces
    are matched.  None when there is no box, or when the last box is never closed."""
    text = tail(text)
    last = None
    for last in _BOX.finditer(text):
        pass
    box = None if last is None else _box_at(text, last.start())
    return None if box is None else box[2]


def final_boxes(text: str) -> str | None:
    """The final answer's boxes, distinct contents joined with ", " (see the module docstring)."""
    starts = [m.start() for m in _BOX.finditer(text)]
    last = _box_at(text, starts[-1]) if starts else None
    if last is None:
        return None  # no box, or the last one is broken: no fallback to an earlier one
    if not last[2].strip():
        return None
    group = [last]
    for at in reversed(starts[-MAX_GROUP_BOXES:-1]):
        box = _box_at(text, at)
        if box is None or box[1] > group[0][0] or not box[2].strip():
            continue  # broken, empty, or it holds the boxes after it
        if not _connective(text[box[1]:group[0][0]]):
            break
        group.insert(0, box)
    parts = list(dict.fromkeys(b[2].strip() for b in group))
    return ", ".join(parts)


def _connective(between: str) -> bool:
    """Whether the text between two boxes only links them: at most 6 words, each a linking word
    (`CONNECTIVE_WORDS`) or a name such as ``y`` or ``(b)``, and no digit outside subscripts."""
    if len(between) > MAX_CONNECTIVE_CHARS:
        return False
    words = _CONNECTIVE_NOISE.sub(lambda m: f" {m.group(1) or ''} ", between).lower().split()
    words = [w.strip("()") for w in words]
    return len(words) <= MAX_CONNECTIVE_WORDS and all(w in CONNECTIVE_WORDS or re.fullmatch(r"[a-z]|[ivx]+|", w) for w in words)


def answer_block(text: str) -> str | None:
    """The last <answer>...</answer> block's answer: its boxes if it holds any, else its text."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    if end < 0 or start < 0:
        return None
    block = text[start + len("<answer>"):end]
    inner = final_boxes(block)
    answer = (block if inner is None else inner).strip()
    return answer or None


def stated_answer(text: str) -> str | None:
    """What follows the last answer phrase: a math span, else the rest of its sentence."""
    lower = text.lower()
    at = max((lower.rfind(p) + len(p) for p in _PHRASES if p in lower), default=-1)
    if at < 0:
        return None
    rest = text[at:at + MAX_PHRASE_CHARS].lstrip(" \t:*")
    rest = rest.lstrip('"“')
    answer = _after_verb(_sentence(rest).strip())
    return answer.strip('*"” ').rstrip(".").strip() or None


def _after_verb(sentence: str) -> str:
    """``The volume of $ABCD$ is 120`` -> ``120``: what follows the last "is" / "are" / "equals"
    outside math, up to a clause that follows (``7 but I did not box it`` -> ``7``)."""
    outside = re.sub(r"\$[^$]*\$", lambda m: "#" * len(m.group()), sentence)
    said = None
    if re.match(r"[A-Za-z]{2,}", outside):  # prose first: the answer is what it says something is
        for said in re.finditer(r"\s(?:is|are|equals)\s+", outside):
            pass
    start = said.end() if said else 0
    clause = re.search(r",?\s+(?:but|because|since|which|so|although|though|where|when|if|as|I|we|it|this|that)\s",
                       outside[start:])
    end = start + clause.start() if clause else len(sentence)
    return sentence[start:end].strip()


def _sentence(text: str) -> str:
    """Text up to the end of its sentence: a newline or a full stop followed by a space, outside
    ``$...$``, ``\\(...\\)`` and ``\\[...\\]``."""
    depth_dollar, i, out = False, 0, []
    closers = []
    while i < len(text):
        two = text[i:i + 2]
        if two in ("\\(", "\\["):
            closers.append("\\)" if two == "\\(" else "\\]")
            out.append(two)
            i += 2
            continue
        if closers and two == closers[-1]:
            closers.pop()
            out.append(two)
            i += 2
            continue
        char = text[i]
        if char == "\\" and i + 1 < len(text):  # `\$`, `\{`: one escaped character
            out.append(two)
            i += 2
            continue
        if char == "$" and (depth_dollar or "$" in text[i + 1:].split("\n", 1)[0]):  # else a currency sign
            depth_dollar = not depth_dollar
        elif not depth_dollar and not closers:
            if char == "\n" or (char == "." and (i + 1 == len(text) or text[i + 1].isspace())):
                break
        out.append(char)
        i += 1
    return "".join(out)


def last_number(text: str) -> str | None:
    """The last number of the text when it stands whole (see the module docstring); else None."""
    found = None
    for found in _NUMBER.finditer(text):
        pass
    if found is None:
        return None
    start, end = found.start(), found.end()
    before = text[:start]
    if before.endswith("-"):  # a sign, unless an operand comes before it (`3 - 5`, `x-5`)
        operand = before[:-1].rstrip(" $")
        if operand and (operand[-1].isalnum() or operand[-1] in ")]}"):
            return None
        start, before = start - 1, before[:-1]
    if before[-1:] and (before[-1].isalnum() or before[-1] in "_^{\\./,"):
        return None  # attached to what precedes it: AZYUK2A, x_2, 10^2, 0,5
    prev = before.rstrip(" $")
    if prev.endswith("**"):  # markdown bold
        prev = prev[:-2].rstrip(" $")
    if prev[-1:] in ("(", "[", "{", ",", ";", "+", "-", "*", "/", "^", "×", "·") or _RELATION_BEFORE.search(prev):
        return None
    after = text[end:].replace("**", "").replace("$", "")
    if after[:1] and (after[0].isalnum() or after[0] in "_^}/)],"):
        return None
    if re.match(r"\s*(?:[)\]}+\-*/^=<>]|\\(?:times|cdot|frac|sqrt))", after):
        return None
    return text[start:end]


def reference_answer(ref) -> str | None:
    r"""A dataset's reference answer as a string to grade against.

    A MATH-style solution gives its final boxes (as a completion's, see `final_boxes`); a
    GSM8K-style solution the number after its final ``#### `` (commas dropped); a worked
    solution without either, what its last "the (final) answer is" states; anything else is the
    stripped string (numbers through str()).  None for None/empty.
    """
    if ref is None:
        return None
    text = ref if isinstance(ref, str) else str(ref)
    boxed = final_boxes(text) if _BOX.search(text) else None
    if boxed is not None:
        text = boxed
    elif "####" in text:
        match = _GSM8K.search(text[text.rfind("####"):])
        text = match.group(1).replace(",", "") if match else ""
    elif re.search(r"(?:the|final) answer is", text, re.IGNORECASE):
        text = stated_answer(text) or text
    return text.strip() or None


def braced(text: str) -> str | None:
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


_FINDERS = {"boxed": final_boxes, "answer_tag": answer_block, "stated": stated_answer, "last_number": last_number}
