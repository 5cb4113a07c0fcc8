"""Alerts: the guide's monitoring rules, evaluated on rolling windows of the step metrics.

Each rule looks at the last `alert_window` steps (some at a longer history) and
is either active or not.  An alert is reported once when its rule becomes
active ("start") and once when it has stayed inactive for a quarter of the
window ("clear", so a value hovering at a threshold does not flap), with a
suggestion, and appended to alerts.jsonl.  A rule that `on_alert` marks `stop`
ends the run when it starts (the trainer saves a checkpoint and exits non-zero).

    reward_flat       the rolling mean reward has not beaten its best by more than
                      1% (at least 0.001) for `alert_reward_flat_steps` steps
    reward_std_low    rolling mean of reward_std below `alert_reward_std_low`
    reward_std_high   ... above `alert_reward_std_high`
    kl_high           rolling mean KL above `alert_kl_high` and rising (the second
                      half of the window higher than the first)
    loss_zero         |policy loss| and grad norm both below `alert_loss_zero` on
                      average while the reward is not improving over the window
                      (nothing is being learned; a saturated reward suggests hacking)
    throughput_low    rolling tokens/s below `alert_throughput_fraction` of the run's
                      early throughput (the median of steps 2 .. window + 1)
    zero_std_high     rolling mean fraction of groups whose rewards are all equal
                      above `alert_zero_std_high`
    reward_collapse   the mean reward of the last few steps (a quarter of the window,
                      at least 2) fell below the best rolling mean of the last
                      `alert_reward_collapse_steps` steps by more than
                      `alert_reward_collapse` of that best, and by more than four
                      standard errors of the two means (the step-to-step spread: the
                      median of the recent windows' std), so noise does not fire it
                      (the textbook's "reward collapse", Table 18-3: a sudden drop)
    reward_audit_disagreement
                      the reward and its audit (reward_audit, audit.py) agree on fewer
                      than `alert_audit_agreement` of the completions audited over
                      the window (pooled; at least AUDIT_MIN_SAMPLES of them)

Note on loss_zero: with one update per batch the clipped loss is exactly the
mean advantage, and for loss_type grpo that is 0 by construction; so a zero loss
alone means nothing, and the rule also requires the gradient to have vanished.

Rules need a full window before they can fire, and read only the metrics they
name; a metric absent from the stream (e.g. kl when beta = 0) keeps its rule off.
This module imports nothing but the standard library (and rlvr.jsonl, which is the same).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlvr.jsonl import append_rows

if TYPE_CHECKING:
    from rlvr.config import AlertSettings


@dataclass
class AlertEvent:
    step: int
    rule: str
    event: str  # "start" | "clear"
    severity: str  # "warn" | "stop"
    message: str
    suggestion: str
    value: float | None

    def format(self) -> str:
        if self.event == "clear":
            return f"alert cleared at step {self.step}: {self.rule} ({self.message})"
        tag = "STOP" if self.severity == "stop" else "alert"
        return f"{tag} at step {self.step}: {self.rule}: {self.message}\n  suggestion: {self.suggestion}"


@dataclass
class Finding:
    """What a rule reports while it is active."""

    value: float
    message: str
    suggestion: str


@dataclass
class History:
    """The step metrics a rule may read: values per metric name, oldest first."""

    window: int
    steps: list[int] = field(default_factory=list)
    values: dict[str, list] = field(default_factory=dict)
    best_reward: float | None = None
    best_reward_step: int = 0
    early_tokens_per_second: list = field(default_factory=list)  # steps 1 .. window + 1: the baseline
    samples: list[dict] = field(default_factory=list)  # the latest logged completions
    rolling: list = field(default_factory=list)  # [step, mean, std] of the recent rolling windows of reward (reward_collapse)

    def recent(self, name: str) -> list[float]:
        """The values of a metric recorded over the window's steps (none where it was not logged)."""
        return [v for v in self.values.get(name, [])[-self.window:] if v is not None]

    def last(self, name: str, n: int | None = None) -> list[float] | None:
        """The last n (default: window) values of a metric, or None if fewer were recorded."""
        n = n or self.window
        vals = [v for v in self.values.get(name, [])[-n:] if v is not None]
        return vals if len(vals) >= n else None


class AlertMonitor:
    def __init__(self, settings: AlertSettings, path: Path | None = None):
        self.settings, self.path = settings, path
        self.history = History(settings.alert_window)
        self.active: dict[str, Finding] = {}
        self.quiet: dict[str, int] = {}  # active rules: consecutive steps their condition has been false
        self.last_events: list[AlertEvent] = []  # those of the last step taken
        self.unwritten: list[AlertEvent] = []  # events not yet in alerts.jsonl
        self.on_error = None  # jsonl.append_rows: what a failed write does (run.py sets it)

    def update(self, step: int, metrics: dict, samples: list[dict] | None = None) -> list[AlertEvent]:
        """Record one step's metrics; return the alerts that start or clear at this step.  A step
        already taken is not taken again (a record finished after a failure): its events are
        returned as they were, and written if their write had failed."""
        h = self.history
        if h.steps and step <= h.steps[-1]:
            self._write()
            return list(self.last_events) if step == h.steps[-1] else []
        if metrics.get("skipped_update"):  # no group had signal: nothing was learned this step
            metrics = {**metrics, "loss": 0.0, "grad_norm": 0.0}
        h.steps.append(step)
        del h.steps[:-2 * h.window]
        for name in _WATCHED:
            h.values.setdefault(name, []).append(_number(metrics.get(name)))
            del h.values[name][: -2 * h.window]
        tps = _number(metrics.get("tokens_per_second"))
        if tps is not None and len(h.early_tokens_per_second) <= h.window:
            h.early_tokens_per_second.append(tps)
        if samples:
            h.samples = list(samples)
        rolling = h.last("reward")
        if rolling is not None:
            mean = sum(rolling) / len(rolling)
            if h.best_reward is None or mean > h.best_reward + max(0.01 * abs(h.best_reward), 1e-3):
                h.best_reward, h.best_reward_step = mean, step
            h.rolling.append([step, mean, statistics.stdev(rolling) if len(rolling) > 1 else 0.0])
        h.rolling = [r for r in h.rolling if r[0] > step - self.settings.alert_reward_collapse_steps]
        events, patience = [], max(1, self.settings.alert_window // 4)
        for rule, check in RULES.items():
            finding = check(h, self.settings)
            if finding:
                if rule not in self.active:
                    events.append(self._event(step, rule, "start", finding))
                self.active[rule], self.quiet[rule] = finding, 0
            elif rule in self.active:
                self.quiet[rule] += 1
                if self.quiet[rule] >= patience:
                    events.append(self._event(step, rule, "clear", self.active.pop(rule)))
                    del self.quiet[rule]
        self.last_events = events
        self.unwritten.extend(events)
        self._write()
        return events

    def _write(self) -> None:
        if self.path is None:
            self.unwritten = []
        elif self.unwritten:
            rows = [asdict(e) for e in self.unwritten]
            append_rows(self.path, rows, lambda row: json.dumps(row, ensure_ascii=False), self.on_error)
            if not rows:  # written (append_rows empties the list); else kept for the next write
                self.unwritten = []

    def _event(self, step: int, rule: str, kind: str, finding: Finding) -> AlertEvent:
        severity = self.settings.on_alert.get(rule, "warn")
        return AlertEvent(step, rule, kind, severity, finding.message, finding.suggestion, finding.value)

    def state_dict(self) -> dict:
        return {"history": asdict(self.history), "active": {k: asdict(v) for k, v in self.active.items()},
                "quiet": dict(self.quiet), "last_events": [asdict(e) for e in self.last_events],
                "unwritten": [asdict(e) for e in self.unwritten]}

    def load_state_dict(self, state: dict) -> None:
        self.history = History(**state["history"])
        self.active = {k: Finding(**v) for k, v in state["active"].items()}
        self.quiet = dict(state.get("quiet", {}))
        self.last_events = [AlertEvent(**e) for e in state.get("last_events", [])]
        self.unwritten = [AlertEvent(**e) for e in state.get("unwritten", [])]


def _number(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals)


# --- the rules: History + alert settings -> Finding while active, else None ---------------


def reward_flat(h: History, settings: AlertSettings) -> Finding | None:
    if h.best_reward is None or h.steps[-1] - h.best_reward_step < settings.alert_reward_flat_steps:
        return None
    return Finding(
        h.best_reward,
        f"reward has not improved for {h.steps[-1] - h.best_reward_step} steps (best rolling mean {h.best_reward:.3f})",
        "check the verifier on labelled cases (rlvr check-reward); try a higher learning_rate, easier data, "
        "or a prompt that shows the answer format",
    )


def reward_std_low(h: History, settings: AlertSettings) -> Finding | None:
    vals = h.last("reward_std")
    if vals is None or _mean(vals) >= settings.alert_reward_std_low:
        return None
    return Finding(
        _mean(vals),
        f"reward std {_mean(vals):.3f} < {settings.alert_reward_std_low} over the last {len(vals)} steps: the rewards of the batch barely differ",
        "raise temperature or num_generations so completions of a prompt differ more",
    )


def reward_std_high(h: History, settings: AlertSettings) -> Finding | None:
    vals = h.last("reward_std")
    if vals is None or _mean(vals) <= settings.alert_reward_std_high:
        return None
    return Finding(
        _mean(vals),
        f"reward std {_mean(vals):.3f} > {settings.alert_reward_std_high} over the last {len(vals)} steps",
        "check the reward scale and reward_weights; lower temperature; consider scale_rewards=group",
    )


def kl_high(h: History, settings: AlertSettings) -> Finding | None:
    vals = h.last("kl")
    if vals is None:
        return None
    half = len(vals) // 2
    rising = half > 0 and _mean(vals[half:]) > _mean(vals[:half])
    if _mean(vals) <= settings.alert_kl_high or not rising:
        return None
    return Finding(
        _mean(vals),
        f"KL {_mean(vals):.4f} > {settings.alert_kl_high} and rising",
        "raise beta (or set kl_target for adaptive KL), or lower the learning_rate",
    )


def loss_zero(h: History, settings: AlertSettings) -> Finding | None:
    loss, grad, reward = h.last("loss"), h.last("grad_norm"), h.last("reward")
    if loss is None or reward is None:
        return None
    if _mean([abs(v) for v in loss]) >= settings.alert_loss_zero or (grad is not None and _mean(grad) >= settings.alert_loss_zero):
        return None
    if h.steps[-1] - h.best_reward_step < len(reward):  # the reward improved within the window
        return None
    shown = "; ".join(repr(str(s.get("completion", ""))[:120]) for s in h.samples[:2])
    return Finding(
        _mean([abs(v) for v in loss]),
        f"policy loss and gradient near zero while reward is flat at {_mean(reward):.3f}",
        "suspect reward hacking: read the completions (completions.jsonl), e.g. " + (shown or "(none logged)"),
    )


def throughput_low(h: History, settings: AlertSettings) -> Finding | None:
    early, vals = h.early_tokens_per_second, h.last("tokens_per_second")
    if vals is None or len(early) <= h.window or len(h.steps) < 2 * h.window:
        return None
    baseline = statistics.median(early[1:])  # the first step pays for warm-up
    now = _mean(vals)
    if baseline <= 0 or now >= settings.alert_throughput_fraction * baseline:
        return None
    return Finding(
        now,
        f"{now:.0f} tokens/s, below {settings.alert_throughput_fraction:.0%} of the run's early {baseline:.0f} tokens/s",
        "check for other processes on the machine, swapping, or completions growing to max_completion_length",
    )


def zero_std_high(h: History, settings: AlertSettings) -> Finding | None:
    vals = h.last("frac_reward_zero_std")
    if vals is None or _mean(vals) <= settings.alert_zero_std_high:
        return None
    return Finding(
        _mean(vals),
        f"{_mean(vals):.0%} of groups have all-equal rewards (no signal)",
        "use data of a difficulty the model sometimes solves (harder if all right, easier if all wrong), "
        "or dynamic_sampling=true",
    )


def reward_collapse(h: History, settings: AlertSettings) -> Finding | None:
    k = max(2, h.window // 4)
    latest = h.last("reward", k)
    if latest is None or not h.rolling:
        return None
    best_step, best, _ = max(h.rolling, key=lambda r: r[1])
    now = _mean(latest)
    # The step-to-step spread of the reward (the median of the recent windows', which the few windows
    # that straddle a drop do not move): four standard errors of the latest mean plus the best's.
    spread = statistics.median(r[2] for r in h.rolling)
    noise = 4 * spread * (1 / math.sqrt(k) + 1 / math.sqrt(h.window))
    if best - now <= max(settings.alert_reward_collapse * abs(best), noise):
        return None
    return Finding(
        now,
        f"reward fell to {now:.3f} over the last {k} steps from a rolling mean of {best:.3f} at step {best_step} "
        f"(more than {settings.alert_reward_collapse:.0%} of it)",
        f"compare completions.jsonl at step {best_step} and now (a new format, length at max_completion_length, "
        "entropy collapsing); lower learning_rate, raise beta or clip less, and resume from a checkpoint before the drop",
    )


AUDIT_MIN_SAMPLES = 10  # audited completions the window needs before reward_audit_disagreement can fire


def reward_audit_disagreement(h: History, settings: AlertSettings) -> Finding | None:
    audited, disagreed, false_passes = (h.recent(name) for name in ("audit/audited", "audit/disagreements", "audit/false_passes"))
    n = sum(audited)
    if n < AUDIT_MIN_SAMPLES:
        return None
    agreement = 1 - sum(disagreed) / n
    if agreement >= settings.alert_audit_agreement:
        return None
    return Finding(
        agreement,
        f"the reward and its audit agree on {agreement:.0%} of {n:.0f} completions over the last {len(audited)} steps "
        f"({sum(false_passes):.0f} passed by the reward and failed by the audit)",
        "read audit.jsonl (each completion they disagree on, with both scores) or the report's audit table: a reward "
        "that passes what the audit fails has a hole the policy may be learning to use; fix the verifier, or resume "
        "from a checkpoint before the agreement fell",
    )


RULES = {
    "reward_flat": reward_flat,
    "reward_std_low": reward_std_low,
    "reward_std_high": reward_std_high,
    "kl_high": kl_high,
    "loss_zero": loss_zero,
    "throughput_low": throughput_low,
    "zero_std_high": zero_std_high,
    "reward_collapse": reward_collapse,
    "reward_audit_disagreement": reward_audit_disagreement,
}
_WATCHED = ("reward", "reward_std", "kl", "loss", "grad_norm", "tokens_per_second", "frac_reward_zero_std",
            "audit/audited", "audit/disagreements", "audit/false_passes")
