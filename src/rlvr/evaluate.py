"""Held-out evaluation with the same verifiers as training.

Each problem gets k = eval_num_samples completions (greedy when k = 1 and
eval_temperature = 0, the default), optionally after eval_num_shots worked
examples from the train split (tasks/fewshot.py).  Reported:

- accuracy: the mean verifier reward over all completions (rows where it is not
  applicable are left out); with k > 1 this is mean@k;
- pass@k for k = 1, 2, 4, ... and k = n (the unbiased estimator, passk.py), where a
  completion passes when the verifier gives it full reward (>= 1);
- maj@n, with k > 1 and a math verifier: the majority answer of the n completions
  (answers compared by `answer_key`), graded by the verifier;
- the mean of every other configured reward, the mean completion length in tokens
  and the fraction of completions cut off at max_completion_length;
- and TRL's GRPOTrainer evaluation metrics under its names (reward, reward_std,
  rewards/<name>/mean and /std, completions/..., trl_metrics), with transformers' runtime,
  samples_per_second and steps_per_second (EvalResult.logged).

k > 1 with eval_temperature = 0 is an error (k identical greedy completions say
nothing more than one); greedy pass@1 is the default run, eval_num_samples=1.
Sampled evaluation keeps the training rollouts' truncation (top_k, top_p, min_p)
and stop strings, generation_kwargs included; the repetition penalty is left out:
it changes what the model would say, and evaluation measures the model
(rollout.sampling_params).  The completions are sampled and scored along training's
path (rollout/path.py): a run trained with tools, an environment or a rollout_func is
evaluated with them.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlvr.passk import ks_to_report, maj_at_k, pass_at_k
from rlvr.rewards import RewardSet
from rlvr.rewards.answers import DEFAULT_SOURCES
from rlvr.rewards.math import accuracy, answer_key, extract_answer, numeric_accuracy, plain_last_box, signed_accuracy
from rlvr.rollout import sampling_params
from rlvr.config import EvalSettings, RolloutSettings
from rlvr.rollout.path import RolloutPath
from rlvr.tasks.fewshot import pick_shots, with_shots
from rlvr.types import Example

MAX_SAMPLES_KEPT = 20  # completions written to the result, for reading
_VOTING_VERIFIERS = (accuracy, numeric_accuracy, signed_accuracy)  # those whose answers can be extracted


@dataclass
class EvalResult:
    accuracy: float
    n: int  # problems
    mean_completion_length: float
    truncated_fraction: float
    rewards: dict[str, float] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    num_samples: int = 1  # completions per problem (k)
    num_shots: int = 0
    at_k: dict[str, float] = field(default_factory=dict)  # pass@1, pass@2, ..., maj@n, mean@n
    trl: dict[str, float] = field(default_factory=dict)  # TRL's names (trl_metrics)
    seconds: float = 0.0  # the evaluation's wall time
    batches: int = 0  # generation calls (eval_batch_size problems each)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for logging: accuracy, pass@k, maj@k, mean@k, mean_completion_length, truncated_fraction."""
        return {"accuracy": self.accuracy, **self.at_k, "mean_completion_length": self.mean_completion_length,
                "truncated_fraction": self.truncated_fraction}

    def logged(self) -> dict[str, float]:
        """What an evaluation reports, unprefixed (the Python API puts eval_ before each, metrics.jsonl
        eval/): TRL's names, rlvr's (metrics()), and transformers' speed metrics over the completions
        (samples) and generation calls (steps), rounded as transformers' speed_metrics rounds them."""
        speed = {"runtime": round(self.seconds, 4)}
        if self.seconds > 0:
            speed["samples_per_second"] = round(self.n * self.num_samples / self.seconds, 3)
            speed["steps_per_second"] = round(self.batches / self.seconds, 3)
        return {**self.trl, **self.metrics(), **speed}

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate(path: RolloutPath, examples: list[Example], verifier: str, settings: EvalSettings, rollout: RolloutSettings,
             seed: int, generator=None, on_batch=None, shot_pool: list[Example] | None = None) -> EvalResult:
    """Sample settings.eval_num_samples completions per example and score them with the verifier.

    path: the run's sampler along the run's path (rollout/path.py), with its tools, environment or
    rollout_func, and the rewards with the verifier among them (loop.evaluate_run builds it from a
    run's settings); rollout: the training rollouts' sampling settings, which evaluation keeps but for
    the temperature; seed: the draw of the few-shot examples.  shot_pool: the train split, from which
    settings.eval_num_shots worked examples are drawn (required when eval_num_shots > 0)."""
    if not examples:
        raise ValueError("nothing to evaluate: the test split is empty")
    if settings.eval_num_shots and shot_pool is None:
        raise ValueError(f"eval_num_shots={settings.eval_num_shots} needs the train split to draw examples from (shot_pool)")
    shots = pick_shots(shot_pool or [], settings.eval_num_shots, seed)
    k = settings.eval_num_samples
    params = sampling_params(rollout, n=k, eval_temperature=settings.eval_temperature)
    rewards, t0 = path.rewards, time.perf_counter()
    per_func: dict[str, list] = {name: [] for name in rewards.names}
    completions, lengths, truncated, samples = [], [], [], []
    for lo in range(0, len(examples), settings.eval_batch_size):
        chunk = examples[lo : lo + settings.eval_batch_size]
        texts, groups = path.generate(chunk, params, generator, [with_shots(ex.prompt, shots) for ex in chunk])
        scores = path.score(chunk, groups, texts)
        for name in rewards.names:
            per_func[name] += scores.per_func[name]
        rows = [(ex, s, r) for ex, group in zip(chunk, groups) for s, r in enumerate(group)]
        for j, (ex, s, r) in enumerate(rows):
            completions.append(r.text)
            lengths.append(len(r.completion_ids))
            truncated.append(bool(r.truncated))
            if len(samples) < MAX_SAMPLES_KEPT:
                samples.append({"prompt": ex.prompt, "answer": ex.answer, "completion": r.text,
                                **({"sample": s} if k > 1 else {}), **({"turns": r.messages} if r.messages else {}),
                                "rewards": {name: scores.per_func[name][j] for name in rewards.names}})
        if on_batch:
            on_batch(min(lo + settings.eval_batch_size, len(examples)), len(examples))
    vote = _vote_key(rewards, verifier)
    keys = [vote(text) for text in completions] if vote and k > 1 else None
    means = {name: _mean(vals) for name, vals in per_func.items()}
    return EvalResult(
        accuracy=means[verifier],
        n=len(examples),
        mean_completion_length=sum(lengths) / len(lengths),
        truncated_fraction=sum(truncated) / len(lengths),
        rewards=means,
        samples=samples,
        num_samples=k,
        num_shots=len(shots),
        at_k=sample_metrics(per_func[verifier], k, keys),
        trl=trl_metrics(per_func, rewards.weights, lengths, truncated, k),
        seconds=time.perf_counter() - t0,
        batches=math.ceil(len(examples) / settings.eval_batch_size),
    )


def trl_metrics(per_func: dict[str, list[float | None]], weights: list[float], lengths: list[int], truncated: list[bool],
                k: int) -> dict[str, float]:
    """TRL's GRPOTrainer evaluation metrics (its _metrics["eval"]), unprefixed, over the completions
    of an evaluation, problem after problem, k each:

    - reward, reward_std: the weighted sum of the functions' rewards (None left out of the sum), over
      the completions some function scored (TRL's unscorable ones, every function None, are left out);
    - rewards/<name>/mean and /std: each function over the completions it scored;
    - frac_reward_zero_std: the problems whose k rewards are all equal (only with k > 1: a problem
      with one completion has no spread to speak of);
    - completions/mean_length, min_length, max_length, clipped_ratio (cut off at max_completion_length)
      and mean/min/max_terminated_length (of the others; 0 when every one was cut off, as TRL).

    The standard deviations are TRL's nanstd (n - 1 in the denominator; nan below two values).  TRL
    averages these over its evaluation batches; here they are over all completions at once."""
    names = list(per_func)
    rows = list(zip(*(per_func[n] for n in names)))
    sums = [None if all(v is None for v in row) else sum(w * v for w, v in zip(weights, row) if v is not None) for row in rows]
    out = {"reward": _mean(sums), "reward_std": _std(sums)}
    for name in names:
        out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = _mean(per_func[name]), _std(per_func[name])
    if k > 1:
        groups = [[v for v in sums[i:i + k] if v is not None] for i in range(0, len(sums), k)]
        out["frac_reward_zero_std"] = sum(len(g) > 1 and max(g) - min(g) < 1e-8 for g in groups) / len(groups)
    terminated = [n for n, cut in zip(lengths, truncated) if not cut] or [0]
    out.update({"completions/mean_length": sum(lengths) / len(lengths), "completions/min_length": float(min(lengths)),
                "completions/max_length": float(max(lengths)), "completions/clipped_ratio": sum(truncated) / len(lengths),
                "completions/mean_terminated_length": sum(terminated) / len(terminated),
                "completions/min_terminated_length": float(min(terminated)),
                "completions/max_terminated_length": float(max(terminated))})
    return out


def sample_metrics(rewards: list[float | None], k: int, keys: list | None = None) -> dict[str, float]:
    """pass@j for j in 1, 2, 4, ..., k; with k > 1 also mean@k, and maj@k when answer keys are given.

    rewards: the verifier's reward per completion, problem after problem, k each;
    keys: the answer key per completion (None: no answer), same order.  A problem
    whose rewards are all None (no reference) is left out; a None among rewards
    counts as not passing.
    """
    problems = [rewards[i : i + k] for i in range(0, len(rewards), k)]
    kept = [i for i, p in enumerate(problems) if any(v is not None for v in p)]
    passed = [[v is not None and v >= 1.0 for v in problems[i]] for i in kept]
    out = {f"pass@{j}": _mean([pass_at_k(k, sum(p), j) for p in passed]) for j in ks_to_report(k)}
    if k > 1:
        if keys is not None:
            out[f"maj@{k}"] = _mean([maj_at_k(keys[i * k : (i + 1) * k], p, k) for i, p in zip(kept, passed)])
        out[f"mean@{k}"] = _mean(rewards)
    return out


def _vote_key(rewards: RewardSet, verifier: str):
    """completion text -> the key its answer votes under; None when the verifier's answers cannot be extracted."""
    fn = rewards.fns[rewards.names.index(verifier)]
    if getattr(fn, "func", fn) not in _VOTING_VERIFIERS:
        return None
    knobs = getattr(fn, "keywords", {})
    final_number = bool(knobs.get("final_number", False))
    sources = knobs.get("sources", DEFAULT_SOURCES)

    def key(text: str):
        if knobs.get("compare") == "plain":  # the textbook's rule: the last box, spaces removed
            answer = plain_last_box(text)
            return None if answer is None else answer.replace(" ", "")
        answer = extract_answer(text, final_number=final_number, sources=sources)
        return None if answer is None else answer_key(answer)

    return key


def _mean(vals) -> float:
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else math.nan


def _std(vals) -> float:
    """TRL's nanstd: the standard deviation with n - 1 (Bessel), None left out; nan below two values."""
    vals = [v for v in vals if v is not None and not math.isnan(v)]
    if len(vals) < 2:
        return math.nan
    mean = sum(vals) / len(vals)
    return math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def write_result(result: EvalResult, path: Path, meta: dict) -> None:
    """One task's result (with `meta` such as model, task, config) as JSON."""
    write_results([{**meta, **result.to_dict()}], path)


def write_results(results: list[dict], path: Path) -> None:
    """One result object, or {"results": [...]} for several tasks (what `rlvr compare` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = results[0] if len(results) == 1 else {"results": results}
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")
