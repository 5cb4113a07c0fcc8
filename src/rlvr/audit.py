"""The reward audit: a second verifier re-grades a sample of each step's completions while the step trains.

In RLVR the verifier is the reward model, and a policy that finds a hole in it (a format it misreads,
an answer taken from the wrong place) climbs the reward while held-out accuracy stalls.  With
`reward_audit=<reward>` (a built-in with `reward_audit_args`, your own function, a reward model) a
random `reward_audit_fraction` of the completions each generation trains on is graded again by that
verifier, in a thread of its own while the update runs, and its verdicts are compared with those of
the reward it audits (`reward_audit_target`, default the first of reward_funcs):

    a verdict is "pass" when the score is at least 0.5, else "fail"; a completion that either
    side could not score (None) is left out and counted (audit/unscored)

    audit/audited        completions both sides scored
    audit/disagreements  ... on which their verdicts differ
    audit/false_passes   ... that the reward passes and the audit fails: the way hacking shows
    audit/agreement      1 - disagreements / audited

Each disagreement is kept in audit.jsonl (step, prompt, answer, completion, both names and scores),
shown in the report, and the alert `reward_audit_disagreement` (alerts.py) fires when the agreement
over the alert window falls below `alert_audit_agreement`.  The sample is drawn from a seed and the
prompt stream's position, so a resumed run audits the same completions.  An auditor that fails
is a warning and `audit/errors`, not the end of the run.  Only the main process audits (every
process holds every group).
"""

from __future__ import annotations

import logging
import random
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from rlvr.types import SampledGroup

PASS = 0.5  # a score at least this is a pass
log = logging.getLogger(__name__)


@dataclass
class AuditResult:
    metrics: dict
    rows: list  # the disagreements, for audit.jsonl


class RewardAudit:
    def __init__(self, auditor, target: str, fraction: float, seed: int):
        """auditor: a RewardSet of the one auditing function; target: the metric name of the reward
        function it audits (rewards.reward_name); fraction: reward_audit_fraction."""
        self.auditor, self.target, self.fraction, self.seed = auditor, target, fraction, seed
        self.name = auditor.names[0]
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rlvr-audit")

    def submit(self, groups: list[SampledGroup], position) -> Future:
        """Start auditing a sample of `groups`' completions; `position`: where the prompt stream was
        before this generation (the sample's seed, with the run's)."""
        rows = [(g, j) for g in groups for j in range(len(g.rollouts))]
        k = min(len(rows), max(1, round(self.fraction * len(rows))))
        chosen = random.Random(f"rlvr-audit|{self.seed}|{position!r}").sample(rows, k) if rows else []
        return self._thread.submit(self._grade, chosen)

    def collect(self, pending: Future | None, step: int) -> AuditResult:
        """The audit of a generation (waited for), its metrics and its disagreements stamped with `step`."""
        if pending is None:
            return AuditResult({}, [])
        result = pending.result()
        for row in result.rows:
            row["step"] = step
        return result

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.auditor.close()

    def _grade(self, chosen: list) -> AuditResult:
        try:
            scores = self.auditor.score_groups([g.example for g, _ in chosen], [[g.rollouts[j]] for g, j in chosen])
        except Exception as e:  # noqa: BLE001 - a failing auditor is reported, and training goes on
            log.warning("reward_audit %r failed on %d completions, counted in audit/errors: %s", self.name, len(chosen), e)
            return AuditResult({"audit/errors": len(chosen)}, [])
        theirs = scores.per_func[self.name]
        audited = disagreements = false_passes = unscored = 0
        rows = []
        for (g, j), audit in zip(chosen, theirs):
            ours = g.per_func.get(self.target, [None] * (j + 1))[j]
            if ours is None or audit is None:
                unscored += 1
                continue
            audited += 1
            if (ours >= PASS) != (audit >= PASS):
                disagreements += 1
                false_passes += ours >= PASS
                rows.append({"prompt": g.example.prompt, "answer": g.example.answer, "completion": g.rollouts[j].text,
                             "reward": self.target, "reward_score": ours, "audit": self.name, "audit_score": audit})
        metrics = {"audit/audited": audited, "audit/disagreements": disagreements, "audit/false_passes": false_passes,
                   "audit/unscored": unscored}
        if audited:
            metrics["audit/agreement"] = 1 - disagreements / audited
        return AuditResult(metrics, rows)


def reward_audit(rewards, data, seed: int) -> RewardAudit | None:
    """The run's audit from its reward settings (and data settings: the task's verifier is the
    default target without reward_funcs), or None without `reward_audit`."""
    if rewards.reward_audit is None:
        return None
    from rlvr.rewards import RewardSet, reward_name
    from rlvr.tasks import reward_funcs

    auditor = RewardSet.of(rewards, [rewards.reward_audit], args={rewards.reward_audit: dict(rewards.reward_audit_args)})
    target = rewards.reward_audit_target or reward_funcs(rewards, data)[0]
    return RewardAudit(auditor, reward_name(target), rewards.reward_audit_fraction, seed)
