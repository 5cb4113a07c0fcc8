"""Metrics: the per-step numbers, metrics.jsonl, sample completions, the progress bar, and
the optional loggers of report_to (tensorboard, wandb, trackio; each imported only when named).

Metric names follow TRL's (reward, reward_std, rewards/<fn>/mean,
frac_reward_zero_std, kl, entropy, clip_ratio/..., completions/...), so
dashboards built for TRL keep working.  Each line of metrics.jsonl averages the
steps since the previous line (every `logging_steps` optimizer steps).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from rlvr.errors import ConfigError
from rlvr.jsonl import append_rows
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rlvr.errors import LoggerError  # noqa: F401 - raised here, defined in the leaf errors.py

if TYPE_CHECKING:
    from rlvr.config import OutputSettings


class MetricsLog:
    """Averages step metrics over the logging window and appends them to metrics.jsonl; appends
    the logged completions to completions.jsonl.

    Each step is taken once (a record finished after a failure, loop.py, does not add it twice),
    and a row is dropped from memory only once it is written: a row whose write failed is kept
    (`unwritten`, saved in checkpoints) and written first the next time, so no row is lost."""

    def __init__(self, output_dir: Path, logging_steps: int):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.completions_path = Path(output_dir) / "completions.jsonl"
        self.audit_path = Path(output_dir) / "audit.jsonl"
        self.logging_steps = logging_steps
        self.window: list[dict] = []
        self.last_step = 0  # the last step added
        self.last_line: dict | None = None  # the last line logged
        self.last_completions_step = 0
        self.unwritten: list[dict] = []  # metrics rows not yet on disk
        self.unwritten_completions: list[dict] = []
        self.last_audit_step = 0
        self.unwritten_audit: list[dict] = []  # the reward audit's disagreements (audit.py) not yet on disk
        self.on_error = None  # jsonl.append_rows: what a failed write does (loop.py sets it)

    def add(self, step: int, metrics: dict, force: bool = False) -> dict | None:
        """Record one step; returns the logged line when this step closes a window."""
        if step > self.last_step:
            self.window.append(metrics)
            self.last_step = step
            if step % self.logging_steps == 0 or force:
                self.unwritten.append({"step": step, **_average(self.window)})
                self.window = []
        elif not self.unwritten:  # on disk already: the line again for the loggers (purged there on resume)
            return self.last_line if self.last_line and self.last_line["step"] == step else None
        if not self.unwritten:
            return None
        self.last_line = append_rows(self.path, self.unwritten, lambda row: json.dumps(_finite(row)), self.on_error)
        return self.last_line

    def add_completions(self, step: int, rows: list[dict]) -> None:
        if step > self.last_completions_step:
            self.unwritten_completions.extend({"step": step, **row} for row in rows)
            self.last_completions_step = step
        append_rows(self.completions_path, self.unwritten_completions, lambda row: json.dumps(row, ensure_ascii=False),
                    self.on_error)

    def add_audit(self, step: int, rows: list[dict]) -> None:
        """The reward audit's disagreements of a step, each stamped with it already (audit.py)."""
        if step > self.last_audit_step:
            self.unwritten_audit.extend(rows)
            self.last_audit_step = step
        append_rows(self.audit_path, self.unwritten_audit, lambda row: json.dumps(row, ensure_ascii=False), self.on_error)

    def state_dict(self) -> dict:
        return {"window": self.window, "last_step": self.last_step, "last_line": self.last_line, "last_completions_step": self.last_completions_step,
                "unwritten": self.unwritten, "unwritten_completions": self.unwritten_completions,
                "last_audit_step": self.last_audit_step, "unwritten_audit": self.unwritten_audit}

    def load_state_dict(self, state: dict) -> None:
        self.window = list(state.get("window", []))
        self.last_step = state.get("last_step", 0)
        self.last_line = state.get("last_line")
        self.last_completions_step = state.get("last_completions_step", 0)
        self.unwritten = list(state.get("unwritten", []))
        self.unwritten_completions = list(state.get("unwritten_completions", []))
        self.last_audit_step = state.get("last_audit_step", 0)
        self.unwritten_audit = list(state.get("unwritten_audit", []))


def _average(window: list[dict]) -> dict:
    keys = dict.fromkeys(k for m in window for k in m)
    out = {}
    for k in keys:
        vals = [m[k] for m in window if k in m and m[k] is not None and not _isnan(m[k])]
        if k.endswith("/min"):
            out[k] = min(vals) if vals else None
        elif k.endswith("/max"):
            out[k] = max(vals) if vals else None
        else:
            out[k] = sum(vals) / len(vals) if vals else None
    return out


def _isnan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _finite(line: dict) -> dict:
    """JSON has no NaN or infinity: such values are written as null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in line.items()}


def make_console() -> Console:
    return Console(file=sys.stdout, highlight=False, soft_wrap=True)


def make_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[shown]}"),  # reward (rlvr train), loss (sft, dpo)
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def format_log_line(line: dict, total_steps: int) -> str:
    def f(key, fmt="{:.3f}"):
        v = line.get(key)
        return "-" if v is None else fmt.format(v)

    if "reward" not in line:  # rlvr sft / dpo (finetune/)
        parts = [f"step {line['step']}/{total_steps}", f"loss {f('loss', '{:.4f}')}"]
        for key, name in (("rewards/accuracies", "pair acc"), ("rewards/margins", "margin"), ("self/keep_rate", "keep"),
                          ("num_tokens", "tokens")):
            if line.get(key) is not None:
                parts.append(f"{name} {f(key, '{:.3g}')}")
        return "  ".join([*parts, f"{f('step_time', '{:.2f}')}s/step"])
    parts = [
        f"step {line['step']}/{total_steps}",
        f"reward {f('reward')}",
        f"reward_std {f('reward_std')}",
        f"zero_std {f('frac_reward_zero_std', '{:.2f}')}",
        f"loss {f('loss', '{:.4f}')}",
        f"len {f('completions/mean_length', '{:.1f}')}",
        f"{f('step_time', '{:.1f}')}s/step",
    ]
    if line.get("kl") is not None:
        parts.insert(4, f"kl {f('kl', '{:.4f}')}")
    if line.get("divergence") is not None:  # rlvr distill: the teacher's divergence per token, in zero_std's place (groups of one)
        parts[3] = f"divergence {f('divergence', '{:.4f}')}"
    return "  ".join(parts)


def generation_metrics(groups: list, rounds: list, group_size: int) -> dict:
    """The metrics of one generation, TRL's names, over every group sampled in the step
    (types.SampledGroup and Round: rollouts, rewards after any KL penalty, per-function scores)."""
    import torch

    from rlvr.advantages import group_reward_std

    rewards = torch.tensor([x for g in groups for x in g.scored_rewards])  # NaN: no function scored it (TRL leaves it out)
    scored = rewards[~rewards.isnan()]
    rollouts = [r for g in groups for r in g.rollouts]
    lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float)
    ended = lengths[torch.tensor([not r.truncated for r in rollouts])]  # ended by the model itself
    ended = ended if len(ended) else torch.zeros(1)  # TRL's convention when every completion was cut
    metrics = {
        "reward": scored.mean().item() if len(scored) else math.nan,
        "reward_std": scored.std().item() if len(scored) > 1 else math.nan,  # TRL's: over the whole batch (n - 1)
        "reward_std/within_group": group_reward_std(rewards, group_size).nanmean().item(),  # what the advantages see
        "frac_reward_zero_std": sum(not g.has_signal for g in groups) / len(groups),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/mean_terminated_length": ended.mean().item(),
        "completions/min_terminated_length": ended.min().item(),
        "completions/max_terminated_length": ended.max().item(),
        "completions/clipped_ratio": sum(r.truncated for r in rollouts) / len(rollouts),
        "completions/num_tokens": lengths.sum().item(),  # this generation's completion tokens
        # prompt + completion tokens of every completion, which TRL's `num_tokens` adds up over the run (trainer.py)
        "tokens/generation": lengths.sum().item() + sum(len(r.prompt_ids) for r in rollouts),
        "timing/rollout": sum(r.rollout_seconds for r in rounds),
        "timing/reward": sum(r.reward_seconds for r in rounds),
    }
    if groups[0].kl is not None:
        metrics["kl"] = sum(k for g in groups for k in g.kl) / max(lengths.sum().item(), 1.0)
    infos = [r.info for r in rollouts if getattr(r, "info", None) and "turns" in r.info]
    if infos:  # multi-turn rollouts (rollout/multiturn.py), per completion
        n = len(infos)
        metrics["turns/mean"] = sum(i["turns"] for i in infos) / n
        metrics["turns/max"] = max(i["turns"] for i in infos)
        metrics["tools/calls_per_completion"] = sum(i["tool_calls"] for i in infos) / n
        metrics["tools/errors_per_completion"] = sum(i["tool_errors"] for i in infos) / n
        metrics["tools/error_rate"] = sum(i["tool_errors"] for i in infos) / max(sum(i["tool_calls"] for i in infos), 1)
        metrics["env/errors"] = sum(bool(i["env_error"]) for i in infos)
        turn_rewards = [reward for i in infos for _, reward in i.get("turn_rewards", ())]
        if turn_rewards:  # the rewards steps (or tools) gave per turn: the mean over the turns that gave one
            metrics["turns/reward_mean"] = sum(turn_rewards) / len(turn_rewards)
    logged: dict = {}  # what reward functions logged with log_metric: the mean of the step's values, as TRL
    for rnd in rounds:
        for key, values in rnd.logged.items():
            logged.setdefault(key, []).extend(values)
    metrics.update({key: sum(values) / len(values) for key, values in logged.items() if values and key not in metrics})
    for name in groups[0].per_func:
        vals = torch.tensor([v for g in groups for v in g.per_func[name] if v is not None] or [math.nan])
        metrics[f"rewards/{name}/mean"] = vals.mean().item()
        metrics[f"rewards/{name}/std"] = vals.std().item() if len(vals) > 1 else 0.0
        for counter in ("timeouts", "errors", "retries"):
            count = sum(r.counters.get(name, {}).get(counter, 0) for r in rounds)
            if count:
                metrics[f"rewards/{name}/{counter}"] = count
    return metrics


# --- report_to: loggers beside metrics.jsonl -------------------------------------------------


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise LoggerError(
            f"report_to={extra} needs the {extra} package, which is not installed: pip install 'rlvr[{extra}]' "
            f"(or pip install {extra}), or drop it from report_to"
        ) from e


class TensorBoardLogger:
    """Its event file is opened by `start(first_step)`, once the run knows where it resumes: events
    of that step and later ones, written before a stop, are purged (SummaryWriter's purge_step),
    so the steps a resumed run logs again appear once in TensorBoard."""

    def __init__(self, settings: OutputSettings, output_dir: Path, logged_settings: dict):
        _require("tensorboard", "tensorboard")
        # With a run_name, its own directory: `tensorboard --logdir runs` lists the run under that name.
        self.log_dir = str(Path(output_dir) / "tensorboard" / (settings.run_name or ""))
        self.writer = None

    def start(self, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=first_step if first_step > 1 else None)

    def log(self, line: dict) -> None:
        if self.writer is None:
            self.start(line["step"])
        for key, value in _scalars(line).items():
            self.writer.add_scalar(key, value, line["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbLogger:
    """Project from $WANDB_PROJECT (default rlvr); offline runs work as wandb's own do (WANDB_MODE=offline)."""

    def __init__(self, settings: OutputSettings, output_dir: Path, logged_settings: dict):
        self.wandb = _require("wandb", "wandb")
        self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT", "rlvr"), name=run_name(settings, output_dir),
                                   dir=str(output_dir), config=logged_settings)

    def start(self, first_step: int) -> None:
        pass

    def log(self, line: dict) -> None:
        self.run.log(_scalars(line), step=line["step"])

    def close(self) -> None:
        self.run.finish()


class TrackioLogger:
    """Project from $TRACKIO_PROJECT (default rlvr)."""

    def __init__(self, settings: OutputSettings, output_dir: Path, logged_settings: dict):
        self.trackio = _require("trackio", "trackio")
        self.trackio.init(project=os.environ.get("TRACKIO_PROJECT", "rlvr"), name=run_name(settings, output_dir), config=logged_settings)

    def start(self, first_step: int) -> None:
        pass

    def log(self, line: dict) -> None:
        self.trackio.log(_scalars(line), step=line["step"])

    def close(self) -> None:
        self.trackio.finish()


def run_name(settings: OutputSettings, output_dir: Path) -> str:
    """The run's name in the loggers: run_name, else its directory's name."""
    return settings.run_name or Path(output_dir).name


def _scalars(line: dict) -> dict:
    return {k: v for k, v in line.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def build_loggers(settings: OutputSettings, output_dir: Path, logged_settings: dict) -> list:
    """One logger per report_to entry (metrics.jsonl is always written, by MetricsLog).
    logged_settings: every setting of the run as the loggers record it, without the Hub token
    (Config.without_secrets().to_dict(), what config.yaml holds)."""
    return [LOGGERS[name](settings, output_dir, logged_settings) for name in dict.fromkeys(settings.report_to) if name in LOGGERS]


LOGGERS = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "trackio": TrackioLogger}
