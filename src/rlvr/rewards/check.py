"""Checking a verifier against labelled cases before trusting it with training.

Each case is one JSON object per line:

    {"completion": "... \\boxed{1/2}", "answer": "0.5", "label": true}
    {"completion": "...", "answer": "Step 1 ...\\n#### 12", "expected": 0.0, "level": 3}

`answer` is the reference (plain, LaTeX, a MATH solution or a GSM8K solution
ending in `#### N`); every other column reaches the reward as a keyword
argument, as in training.  `expected` is the reward the case should get;
`label` says whether the completion is correct (true) or not (false).  A
reward counts as "correct" when it is positive.

Agreement is the fraction of cases whose reward is the expected one (or whose
correct/incorrect verdict matches the label); precision and recall are those
of the verdict "correct".
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlvr.rewards import RewardSet, reward_name
from rlvr.rewards.pool import shared_pool
from rlvr.types import TrainerState

TOLERANCE = 1e-6


class CaseError(ValueError):
    pass


@dataclass
class CheckResult:
    reward: str
    n: int
    agreement: float
    precision: float | None  # None when nothing was predicted correct
    recall: float | None  # None when no case is correct
    timeouts: int
    errors: int
    retries: int = 0  # symbolic checks run a second time with a larger bound (rewards/math.py)
    disagreements: list[dict] = field(default_factory=list)
    slowest: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def load_cases(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise CaseError(f"cases file not found: {p}")
    cases = []
    for number, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            case = json.loads(line)
        except json.JSONDecodeError as e:
            raise CaseError(f"{p}:{number}: not valid JSON ({e.msg})") from None
        if not isinstance(case, dict) or "completion" not in case:
            raise CaseError(f"{p}:{number}: each line must be an object with a `completion`")
        if ("expected" in case) == ("label" in case):
            raise CaseError(f"{p}:{number}: give exactly one of `expected` (a reward) or `label` (true/false)")
        if "label" in case and not isinstance(case["label"], bool):
            raise CaseError(f"{p}:{number}: `label` must be true or false, got {case['label']!r}")
        if "expected" in case and not isinstance(case["expected"], (int, float)):
            raise CaseError(f"{p}:{number}: `expected` must be a number, got {case['expected']!r}")
        cases.append({**case, "_line": number})
    if not cases:
        raise CaseError(f"{p} holds no cases")
    return cases


def check_reward(cases: list[dict], reward: str = "accuracy", reward_kwargs: dict | None = None, slowest: int = 5) -> CheckResult:
    """Score every case with `reward` and compare with its expected reward or label."""
    rewards = RewardSet([reward], args={reward: reward_kwargs or {}})
    name = reward_name(reward)
    shared_pool().warm()  # worker start-up is not any case's grading time
    rows, timeouts, errors, retries = [], 0, 0, 0
    for case in cases:
        columns = {k: [v] for k, v in case.items() if k not in ("completion", "expected", "label", "_line", "prompt")}
        columns.setdefault("answer", [None])
        start = time.perf_counter()
        scores = rewards.score([case["completion"]], {"prompts": [case.get("prompt")], "prompt_texts": None, "completion_ids": [[]],
                                                      "trainer_state": TrainerState(), "max_completion_length": None, **columns})
        seconds = time.perf_counter() - start
        timeouts += scores.counters[name]["timeouts"]
        errors += scores.counters[name]["errors"]
        retries += scores.counters[name].get("retries", 0)
        got = scores.per_func[name][0]
        rows.append((case, got, seconds))
    agree, tp, fp, fn = 0, 0, 0, 0
    disagreements = []
    for case, got, seconds in rows:
        predicted = got is not None and got > 0
        truth = case["label"] if "label" in case else case["expected"] > 0
        matches = (predicted == truth) if "label" in case else (got is not None and abs(got - case["expected"]) <= TOLERANCE)
        agree += matches
        tp += predicted and truth
        fp += predicted and not truth
        fn += truth and not predicted
        if not matches:
            want = f"label {str(case['label']).lower()}" if "label" in case else f"expected {case['expected']:g}"
            disagreements.append({"line": case["_line"], "want": want, "got": got,
                                  "completion": _preview(case["completion"]), "answer": _preview(case.get("answer"))})
    ranked = sorted(rows, key=lambda r: -r[2])[:slowest]
    return CheckResult(
        reward=reward,
        n=len(rows),
        agreement=agree / len(rows),
        precision=tp / (tp + fp) if tp + fp else None,
        recall=tp / (tp + fn) if tp + fn else None,
        timeouts=timeouts,
        errors=errors,
        retries=retries,
        disagreements=disagreements,
        slowest=[{"line": c["_line"], "seconds": round(s, 3), "completion": _preview(c["completion"])} for c, _, s in ranked],
    )


def _preview(value, width: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."


def format_result(result: CheckResult, source: str) -> str:
    def ratio(v):
        return "n/a" if v is None else f"{v:.3f}"

    lines = [
        f"rlvr check-reward: {source} with {result.reward} ({result.n} cases)",
        f"agreement {result.agreement:.1%}   precision {ratio(result.precision)}   recall {ratio(result.recall)}"
        f"   timeouts {result.timeouts}   retries {result.retries}   errors {result.errors}",
        "slowest:",
        *[f"  line {s['line']:>5}  {s['seconds']:.3f} s  {s['completion']}" for s in result.slowest],
        f"disagreements ({len(result.disagreements)}):",
        *[f"  line {d['line']:>5}: {d['want']}, got {d['got']}  | completion: {d['completion']} | answer: {d['answer']}"
          for d in result.disagreements],
    ]
    return "\n".join(lines)
