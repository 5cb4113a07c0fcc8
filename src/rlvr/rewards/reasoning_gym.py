"""The verifier of task=reasoning_gym: each reasoning-gym dataset's own `score_answer`.

The answer is the completion's last <answer>...</answer> block, stripped, or None when it has none
(reasoning-gym's `extract_answer`, read from the end); the dataset, made with the row's settings
(columns `rg_dataset`, `rg_config`), scores it against the entry (columns `question`, `answer`,
`metadata`), usually 1.0 or 0.0, some datasets give partial credit.  A row without `rg_dataset`
is not applicable (None).  A scorer that raises scores 0 and is counted (rewards/<fn>/errors);
one that runs past `timeout` seconds scores 0 and is counted (rewards/<fn>/timeouts).
"""

from __future__ import annotations

import functools
import json
from math import isfinite

from rlvr.rewards.answers import tail
from rlvr.rewards.deadline import RewardTimeout, time_limit
from rlvr.types import Completion, ScoreList, completion_text

DEFAULT_TIMEOUT = 5.0


def reasoning_gym_score(completions: list[Completion], question: list | None = None, answer: list | None = None,
                        metadata: list | None = None, rg_dataset: list | None = None, rg_config: list | None = None, *,
                        timeout: float = DEFAULT_TIMEOUT, **kwargs) -> ScoreList:
    """The reasoning-gym dataset's score of each completion's <answer>; None for rows of no reasoning-gym dataset."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    n = len(completions)
    if rg_dataset is None:
        return ScoreList([None] * n)
    question, answer, metadata, rg_config = (v if v is not None else [None] * n for v in (question, answer, metadata, rg_config))
    scores = ScoreList()
    for completion, name, config, q, a, meta in zip(completions, rg_dataset, rg_config, question, answer, metadata):
        if name is None:
            scores.append(None)
            continue
        dataset = _dataset(name, json.dumps(config or {}, sort_keys=True))
        entry = {"question": q, "answer": a, "metadata": meta or {}}
        try:
            with time_limit(timeout, f"reasoning-gym's {name} scorer"):
                score = float(dataset.score_answer(answer_of(completion_text(completion)), entry))
        except RewardTimeout:
            scores.append(0.0)
            scores.timeouts += 1
            continue
        except Exception:  # the scorer choked on model output: unscorable, counted
            scores.append(0.0)
            scores.errors += 1
            continue
        if not isfinite(score):
            score, scores.errors = 0.0, scores.errors + 1
        scores.append(score)
    return scores


def answer_of(text: str) -> str | None:
    """The last <answer>...</answer> block's text, stripped; None without one."""
    text = tail(text)
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    if end < 0 or start < 0:
        return None
    return text[start + len("<answer>"):end].strip()


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str):
    """The dataset that scores rows of `name` made with these settings (made once per process)."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("the reasoning_gym reward needs the reasoning-gym package: pip install 'rlvr[reasoning-gym]'") from None
    return reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(config_json))
