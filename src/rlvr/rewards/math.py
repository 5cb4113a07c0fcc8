r"""Math rewards: the answer a completion commits to, graded against the reference.

Extraction is in rewards/answers.py (the final answer's boxes, an <answer> block, a stated
answer, optionally the last number), equivalence in rewards/equivalence.py (strings, numbers
with units, then math-verify in worker processes with a hard time bound).  Knobs, per reward
(`reward_args`):

- sources: where the answer may come from, in order (default [boxed, answer_tag, stated]);
- final_number: also the last number of the text, when nothing else gave an answer;
- compare: "full" (the three steps) or "plain", the textbook's rule: the last box alone, equal
  once spaces are removed, else equal as floats within 1e-6 (sources must be [boxed]);
- timeout: CPU seconds for one symbolic check (the work it does, not the time it waits on a busy
  machine: rewards/pool.py); a check that runs out is run once more with RETRY_FACTOR times the
  bound (counted in rewards/<name>/retries), and scores 0 only if it runs out again (counted in
  rewards/<name>/timeouts).

Model output is untrusted: any error while grading means "not equal", and is counted.
"""

from __future__ import annotations

from rlvr.rewards.answers import DEFAULT_SOURCES, check_sources, extract_answer, extract_boxed, reference_answer, tail
from rlvr.rewards.equivalence import answer_key, cheap_verdict, math_verify_pair, symbolic_equal, symbolic_input
from rlvr.rewards.pool import shared_pool
from rlvr.types import Completion, ScoreList, completion_text

__all__ = ["accuracy", "numeric_accuracy", "signed_accuracy", "math_verify", "extract_answer", "extract_boxed", "reference_answer",
           "answer_key", "is_equivalent", "grade_pairs"]

DEFAULT_TIMEOUT = 5.0  # CPU seconds for one symbolic check
RETRY_FACTOR = 2  # the bound of a check's second run, once it ran out of the first
COMPARE = ("full", "plain")
CORRECT, WRONG, MISSING, TIMEOUT, ERROR = "correct", "wrong", "missing", "timeout", "error"


def is_equivalent(pred: str, ref: str, timeout: float = DEFAULT_TIMEOUT) -> bool:
    """Whether the predicted answer equals the reference (rewards/equivalence.py); the symbolic
    step runs in a worker process and is abandoned after `timeout` CPU seconds, and once more after
    RETRY_FACTOR times that (then: not equal)."""
    return grade_pairs([pred], [ref], timeout=timeout)[0] == CORRECT


def grade_pairs(preds: list[str | None], refs: list[str | None], numeric_only: bool = False,
                timeout: float = DEFAULT_TIMEOUT, retried: list | None = None) -> list[str | None]:
    """Grade extracted answers against references, the slow symbolic checks in parallel.

    Per pair: None (no reference), MISSING (no answer), CORRECT, WRONG, or
    TIMEOUT / ERROR (the symbolic check overran twice, or crashed; both count as wrong).
    `retried`, when given, gets the index of every pair whose check ran out once and was run again.
    """
    grades: list[str | None] = [None] * len(preds)
    symbolic: list[tuple[int, str, str]] = []
    for i, (pred, ref) in enumerate(zip(preds, refs)):
        if ref is None or not ref.strip():
            continue
        if pred is None or not pred.strip():
            grades[i] = MISSING
            continue
        verdict = cheap_verdict(pred, ref, numeric_only)
        pair = symbolic_input(pred, ref) if verdict is None else None
        if verdict is None and pair is not None:
            symbolic.append((i, *pair))
        else:
            grades[i] = CORRECT if verdict else WRONG
    if symbolic:
        results, again = bounded_map(symbolic_equal, [(p, r) for _, p, r in symbolic], timeout)
        if retried is not None:
            retried.extend(symbolic[k][0] for k in again)
        for (i, _, _), result in zip(symbolic, results):
            grades[i] = result if result in (TIMEOUT, ERROR) else (CORRECT if result is True else WRONG)
    return grades


def bounded_map(fn, jobs: list, timeout: float) -> tuple[list, list[int]]:
    """(fn's result for each job in the grading pool, bounded by `timeout` CPU seconds, and the indices of
    the jobs that ran out and were run once more, with RETRY_FACTOR times the bound): a check that was
    merely slow gets its verdict; one that runs out again is TIMEOUT."""
    results = shared_pool().map(fn, jobs, timeout=timeout)
    again = [k for k, result in enumerate(results) if result == TIMEOUT]
    if again:
        for k, result in zip(again, shared_pool().map(fn, [jobs[k] for k in again], timeout=timeout * RETRY_FACTOR)):
            results[k] = result
    return results, again


def plain_last_box(text: str) -> str | None:
    """The textbook's extraction: from the last ``\\boxed{`` to its matching brace, stripped."""
    at = text.rfind("\\boxed{")
    if at < 0:
        return None
    depth, start = 0, at + len("\\boxed{")
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[start:i].strip()
            depth -= 1
    return None


def plain_equal(pred: str, ref: str) -> bool:
    """The textbook's comparison: equal once spaces are removed, else equal as floats within 1e-6."""
    pred, ref = pred.strip().replace(" ", ""), ref.strip().replace(" ", "")
    if pred == ref:
        return True
    try:
        return abs(float(pred) - float(ref)) < 1e-6
    except (ValueError, OverflowError):
        return False


def accuracy(completions: list[Completion], answer: list | None = None, *, final_number: bool = False,
             timeout: float = DEFAULT_TIMEOUT, sources=DEFAULT_SOURCES, compare: str = "full", **kwargs) -> ScoreList:
    """1.0 if the completion's answer equals the reference, else 0.0; None where a row has no reference."""
    return _score(completions, answer, {CORRECT: 1.0, WRONG: 0.0, MISSING: 0.0}, final_number, timeout, sources, compare)


def numeric_accuracy(completions: list[Completion], answer: list | None = None, *, final_number: bool = False,
                     sources=DEFAULT_SOURCES, **kwargs) -> ScoreList:
    r"""1.0 if the completion's answer is a plain number equal to the reference, else 0.0.

    No symbolic step: for arithmetic, boxing the question itself (``\boxed{3 + 5}``)
    must not count as answering 8.  None where a row has no reference.
    """
    return _score(completions, answer, {CORRECT: 1.0, WRONG: 0.0, MISSING: 0.0}, final_number, 0.0, sources, "full",
                  numeric_only=True)


def signed_accuracy(completions: list[Completion], answer: list | None = None, *, final_number: bool = False,
                    timeout: float = DEFAULT_TIMEOUT, sources=DEFAULT_SOURCES, compare: str = "full", **kwargs) -> ScoreList:
    """1.0 correct, -0.5 wrong, -1.0 no answer found; None where a row has no reference."""
    return _score(completions, answer, {CORRECT: 1.0, WRONG: -0.5, MISSING: -1.0}, final_number, timeout, sources, compare)


def math_verify(completions: list[Completion], answer: list | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                **kwargs) -> ScoreList:
    """Math-Verify's own grading, as TRL's accuracy_reward does it: the reference and the completion
    each parsed by math_verify (the completion's LaTeX, its boxes first), 1.0 when math_verify.verify
    finds them equal, else 0.0; None where the reference does not parse.  None of rlvr's extraction
    rules: a grader nobody here wrote, for the reward audit (reward_audit=math_verify).  Run in the
    grading pool with a bound of `timeout` CPU seconds, and once more with a larger one as accuracy's
    checks (bounded_map; past both: 0.0, counted in timeouts)."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 CPU seconds; got {timeout}")
    if answer is None:
        return ScoreList([None] * len(completions))
    pairs = [(None if a is None else str(a), completion_text(c)) for c, a in zip(completions, answer)]
    verdicts, retried = bounded_map(math_verify_pair, pairs, timeout)
    scores = ScoreList([None if v is None else 1.0 if v is True else 0.0 for v in verdicts])
    scores.timeouts, scores.errors, scores.retries = verdicts.count(TIMEOUT), verdicts.count(ERROR), len(retried)
    return scores


def check_knobs(sources, compare: str) -> tuple[str, ...]:
    """The sources, checked with `compare`; a ValueError that says what to change otherwise."""
    sources = check_sources(sources)
    if compare not in COMPARE:
        raise ValueError(f"compare must be one of {', '.join(COMPARE)}; got {compare!r}")
    if compare == "plain" and sources != ("boxed",):
        raise ValueError(f"compare: plain is the textbook's rule, which reads the last box alone: set sources: [boxed] (got {list(sources)})")
    return sources


def _score(completions, answer, values: dict, final_number: bool, timeout: float, sources, compare: str,
           numeric_only: bool = False) -> ScoreList:
    sources = check_knobs(sources, compare)
    if answer is None:
        return ScoreList([None] * len(completions))
    if len(answer) != len(completions):
        raise ValueError(
            f"got {len(completions)} completions but {len(answer)} answers; "
            "the `answer` column must hold one reference per completion"
        )
    refs = [reference_answer(a) for a in answer]
    texts = [None if ref is None else completion_text(c) for c, ref in zip(completions, refs)]
    retried: list[int] = []
    if compare == "plain":
        preds = [None if t is None else plain_last_box(tail(t)) for t in texts]
        grades = [None if r is None else MISSING if p is None else CORRECT if plain_equal(p, r) else WRONG
                  for p, r in zip(preds, refs)]
    else:
        preds = [None if t is None else extract_answer(t, final_number=final_number, sources=sources) for t in texts]
        grades = grade_pairs(preds, refs, numeric_only=numeric_only, timeout=timeout, retried=retried)
    wrong = values[WRONG]
    scores = ScoreList([None if g is None else values.get(g, wrong) for g in grades])
    scores.retries = len(retried)
    scores.timeouts = grades.count(TIMEOUT)
    scores.errors = grades.count(ERROR)
    return scores
