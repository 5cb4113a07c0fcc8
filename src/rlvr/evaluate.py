"""Held-out evaluation with the same verifiers as training.

accuracy = mean of the task's verifier reward over the examples (rows where it
is not applicable are left out); also the mean of every other configured
reward and the mean completion length in tokens.  Greedy by default.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlvr.chat import render_prompts, tokenize_prompts
from rlvr.rewards import RewardSet
from rlvr.rollout import SamplingParams
from rlvr.types import Example


@dataclass
class EvalResult:
    accuracy: float
    n: int
    mean_completion_length: float
    truncated_fraction: float
    rewards: dict[str, float] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate(sampler, tokenizer, examples: list[Example], rewards: RewardSet, verifier: str, cfg, generator=None, on_batch=None) -> EvalResult:
    """Sample one completion per example (temperature cfg.eval_temperature) and score it."""
    if not examples:
        raise ValueError("nothing to evaluate: the test split is empty")
    params = SamplingParams(
        n=1,
        max_tokens=cfg.max_completion_length,
        temperature=cfg.eval_temperature,
        top_p=cfg.top_p if cfg.eval_temperature > 0 else 1.0,
        top_k=cfg.top_k if cfg.eval_temperature > 0 else 0,
        stop_strings=cfg.stop_strings,
    )
    per_func: dict[str, list] = {name: [] for name in rewards.names}
    lengths, truncated, samples = [], 0, []
    for lo in range(0, len(examples), cfg.eval_batch_size):
        chunk = examples[lo : lo + cfg.eval_batch_size]
        texts = render_prompts(tokenizer, [ex.prompt for ex in chunk], cfg.system_prompt)
        groups = sampler.generate(tokenize_prompts(tokenizer, texts, cfg.max_prompt_length), params, generator)
        scores = rewards.score_groups(chunk, groups, texts, max_completion_length=cfg.max_completion_length)
        for name in rewards.names:
            per_func[name] += scores.per_func[name]
        for i, (ex, group) in enumerate(zip(chunk, groups)):
            r = group[0]
            lengths.append(len(r.completion_ids))
            truncated += r.truncated
            if len(samples) < 20:
                samples.append({"prompt": ex.prompt, "answer": ex.answer, "completion": r.text,
                                "rewards": {name: scores.per_func[name][i] for name in rewards.names}})
        if on_batch:
            on_batch(min(lo + cfg.eval_batch_size, len(examples)), len(examples))
    means = {name: _mean(vals) for name, vals in per_func.items()}
    return EvalResult(
        accuracy=means[verifier],
        n=len(examples),
        mean_completion_length=sum(lengths) / len(lengths),
        truncated_fraction=truncated / len(lengths),
        rewards=means,
        samples=samples,
    )


def _mean(vals) -> float:
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else math.nan


def write_result(result: EvalResult, path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, **result.to_dict()}, indent=2, ensure_ascii=False, default=str) + "\n")
