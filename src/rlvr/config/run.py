"""Settings of the run around the steps: output, checkpoints, logging, the Hub, evaluation, alerts."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from rlvr.config.section import Section, choices

REPORT_TO = ("jsonl", "tensorboard", "wandb", "trackio", "none")


@dataclass(frozen=True)
class OutputSettings(Section):
    # --- run ------------------------------------------------------------------------
    output_dir: str | None = None  # default: runs/<run_name or task>-<date>-<time>
    run_name: str | None = None  # the run's name in loggers (wandb, trackio, tensorboard) and in its default output_dir
    max_train_seconds: float = 0.0  # stop (saved, evaluated) after the step during which training time passes this; 0 = no limit
    resume: bool = False  # continue from the newest checkpoint in output_dir that verifies (or start over there if it has none)
    resume_checkpoint: str | None = None  # continue from this checkpoint directory (TRL: resume_from_checkpoint=<path>)
    resume_override: bool = False  # resume even though settings that change the run's course differ from the checkpoint's run
    on_save_error: str = "stop"  # a checkpoint that cannot be written (disk full): stop the run, or continue without it
    trust_unverified_checkpoint: bool = False  # load a checkpoint without manifest.json (nothing to check its files against)
    logging_steps: int = 10  # one metrics.jsonl line per this many steps (their average)
    save_strategy: str = "steps"  # steps: every save_steps | epoch: at each pass over the prompts | no: only at the end and when stopped
    save_steps: int = 500  # a checkpoint every this many steps
    save_total_limit: int | None = None  # keep only the newest checkpoints; null = all
    log_completions: bool = True  # write sample completions to completions.jsonl
    num_completions_to_print: int | None = None  # completions logged per logging step; null = all of the step's
    report_to: tuple = ()  # extra loggers: tensorboard, wandb, trackio (metrics.jsonl is always written)
    push_to_hub: bool = False  # upload the final model to the Hugging Face Hub (needs network and a token)
    hub_model_id: str | None = None  # the repository, e.g. user/my-grpo-model; default: the output_dir's name
    hub_token: str | None = None  # default: HF_TOKEN or the token of `hf auth login`
    hub_private_repo: bool | None = None  # create the repository private
    report_steps: int = 50  # redraw the run's plots and report.html every this many steps; 0 = at the end only

    def _rules(self) -> list[str]:
        problems = choices(self, save_strategy=("steps", "epoch", "no"), on_save_error=("stop", "continue"))
        rules = [
            (self.max_train_seconds >= 0 and math.isfinite(self.max_train_seconds),
             f"max_train_seconds must be >= 0 (0 = no limit); got {self.max_train_seconds}"),
            (self.logging_steps >= 1, "logging_steps must be at least 1"),
            (self.save_steps >= 1, "save_steps must be at least 1"),
            (self.save_strategy != "best", "save_strategy=best (TRL: keep the checkpoint with the best metric_for_best_model) "
             "is not supported yet; use steps, epoch or no, and compare the runs' held-out accuracy (eval_strategy=steps)"),
            (self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit must be at least 1 (or null to keep all)"),
            (self.num_completions_to_print is None or self.num_completions_to_print >= 0,
             "num_completions_to_print must be >= 0 (or null for all)"),
            (self.report_steps >= 0, "report_steps must be >= 0 (0 = the report is written at the end only)"),
        ]
        rules += [(name in REPORT_TO, f"report_to: unknown logger {name!r}; choose from {', '.join(REPORT_TO)}") for name in self.report_to]
        return problems + [message for ok, message in rules if not ok]


@dataclass(frozen=True)
class AlertSettings(Section):
    # --- alerts ---------------------------------------------------------------------
    alert_window: int = 20  # steps in each rule's rolling window
    alert_reward_flat_steps: int = 200  # reward mean not improving for this many steps
    alert_reward_std_low: float = 0.1  # reward std below this (guide: normal 0.3-1.0)
    alert_reward_std_high: float = 2.0  # reward std above this
    alert_kl_high: float = 0.1  # KL above this and rising
    alert_loss_zero: float = 1e-4  # |policy loss| and grad norm below this while reward is not improving
    alert_throughput_fraction: float = 0.5  # tokens/s below this fraction of the run's early throughput
    alert_zero_std_high: float = 0.8  # fraction of zero-signal groups above this
    alert_reward_collapse: float = 0.5  # reward_collapse: the last few steps' mean reward fell this fraction below its recent best
    alert_reward_collapse_steps: int = 50  # ... the best rolling mean of this many recent steps
    alert_audit_agreement: float = 0.9  # reward_audit_disagreement: the reward and its audit (reward_audit) agree on fewer of the window's audited completions
    on_alert: dict = field(default_factory=dict)  # rule -> warn | stop, e.g. {kl_high: stop}; stop exits non-zero

    def _rules(self) -> list[str]:
        problems = []
        if self.alert_window < 1 or self.alert_reward_flat_steps < 1 or self.alert_reward_collapse_steps < 1:
            problems.append("alert_window, alert_reward_flat_steps and alert_reward_collapse_steps must be at least 1")
        if not 0 <= self.alert_reward_std_low < self.alert_reward_std_high:
            problems.append("alert_reward_std_low must be >= 0 and below alert_reward_std_high")
        for name in ("alert_throughput_fraction", "alert_zero_std_high", "alert_reward_collapse", "alert_audit_agreement"):
            if not 0 < getattr(self, name) <= 1:
                problems.append(f"{name} must be in (0, 1]; got {getattr(self, name)}")
        if self.alert_kl_high <= 0 or self.alert_loss_zero < 0:
            problems.append("alert_kl_high must be > 0 and alert_loss_zero >= 0")
        for rule, action in self.on_alert.items():
            if action not in ("warn", "stop"):
                problems.append(f"on_alert.{rule} must be warn or stop; got {action!r}")
        return problems


@dataclass(frozen=True)
class EvalSettings(Section):
    # --- evaluation -----------------------------------------------------------------
    eval_on_start: bool = True  # held-out accuracy before training
    eval_on_end: bool = True  # ... and after it
    eval_strategy: str = "no"  # no | steps: also evaluate every eval_steps during training
    eval_steps: int | None = None  # default: logging_steps (as TRL)
    eval_num_samples: int = 1  # k completions per problem; > 1 reports pass@k, maj@k, mean@k
    eval_num_shots: int = 0  # worked examples from the train split put before each eval prompt
    eval_max_examples: int = 200  # 0 = the whole test split
    eval_temperature: float = 0.0  # 0 = greedy
    eval_batch_size: int = 64  # prompts per generation call
    eval_output: str | None = None  # `rlvr eval` result file; default <run dir>/eval.json or ./eval.json
    metric_for_best_model: str | None = None  # the evaluation metric the best checkpoint has (eval_ optional): reward, accuracy, rewards/<function>/mean, pass@1, ...; with load_best_model_at_end, default loss (transformers'), which rlvr does not compute
    greater_is_better: bool | None = None  # default: true unless metric_for_best_model ends in loss
    load_best_model_at_end: bool = False  # the final model is the checkpoint with the best metric_for_best_model (needs eval_strategy = save_strategy); that checkpoint is never rotated away

    def _rules(self) -> list[str]:
        rules = [
            (self.eval_temperature >= 0, "eval_temperature must be >= 0 (0 = greedy)"),
            (self.eval_num_samples >= 1, "eval_num_samples must be at least 1"),
            (self.eval_num_samples == 1 or self.eval_temperature > 0,
             f"eval_num_samples={self.eval_num_samples} with eval_temperature=0 (greedy) would give identical completions; "
             "set eval_temperature > 0 to sample (e.g. eval_temperature=0.6), or eval_num_samples=1 for greedy pass@1"),
            (self.eval_num_shots >= 0, "eval_num_shots must be >= 0"),
            (self.eval_max_examples >= 0, "eval_max_examples must be >= 0 (0 = all)"),
            (self.eval_batch_size >= 1, "eval_batch_size must be at least 1"),
            (self.eval_steps is None or self.eval_steps >= 1, "eval_steps must be at least 1 (or null for logging_steps)"),
        ]
        problems = [message for ok, message in rules if not ok] + best_metric_problems(self.metric_for_best_model)
        return choices(self, eval_strategy=("no", "steps")) + problems


# What an evaluation reports (evaluate.EvalResult.logged), for metric_for_best_model.
EVAL_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "accuracy", "mean_completion_length", "truncated_fraction",
                "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                "completions/mean_terminated_length", "completions/min_terminated_length", "completions/max_terminated_length")


def best_metric_problems(metric: str | None) -> list[str]:
    """metric_for_best_model must name a metric the evaluation reports (with or without eval_)."""
    if metric is None:
        return []
    name = metric.removeprefix("eval_")
    if name == "loss":
        return [f"metric_for_best_model={metric!r} (transformers' default with load_best_model_at_end): rlvr's evaluation "
                "samples and scores completions and computes no eval_loss; choose what it reports, e.g. "
                "metric_for_best_model=reward (greater is better) or accuracy"]
    known = name in EVAL_METRICS or re.fullmatch(r"(pass|maj|mean)@\d+|rewards/.+/(mean|std)", name)
    return [] if known else [f"metric_for_best_model={metric!r} is not a metric rlvr's evaluation reports; choose one of "
                             f"{', '.join(EVAL_METRICS)}, pass@<k>, maj@<k>, mean@<k>, rewards/<reward function>/mean or /std"]


@dataclass(frozen=True)
class RunSettings(EvalSettings, AlertSettings, OutputSettings):
    """The run around the steps as a whole: what run.py, the logs, the alerts and the Hub read."""
