"""The reward audit (audit.py): a second verifier re-grades a sample of each step's completions;
its verdicts against the audited reward's, counted by hand; the alert on pooled agreement; a run
that writes audit.jsonl and shows it in the report; bad settings refused before the model loads."""

from __future__ import annotations

import json
import random

import pytest

from rlvr.alerts import AlertMonitor
from rlvr.audit import RewardAudit
from rlvr.config import ConfigError, build_config
from rlvr.rewards import RewardSet
from rlvr.settings import check_settings
from rlvr.types import Example, Rollout, SampledGroup

# A verifier anyone could game: a digit anywhere passes (the tiny model's random text has some).
GAMEABLE = "def contains_answer(completions, answer, **kwargs):\n" \
           "    return [1.0 if any(ch.isdigit() for ch in c) else 0.0 for c in completions]\n"


def _group(answer: str, texts: list[str], target: list) -> SampledGroup:
    rollouts = [Rollout([1], [5], [-0.1], "stop", t) for t in texts]
    return SampledGroup(Example(f"what is {answer}?", answer), rollouts, list(target), {"contains_answer": list(target)})


def test_verdicts_are_compared_at_half_and_disagreements_kept():
    audit = RewardAudit(RewardSet(["numeric_accuracy"]), "contains_answer", fraction=1.0, seed=0)
    try:
        groups = [_group("7", ["\\boxed{7}", "7 or \\boxed{8}", "\\boxed{6}", "no idea"], [1.0, 1.0, 0.0, None]),
                  _group("12", ["\\boxed{12}", "1 2"], [0.0, 0.0])]
        result = audit.collect(audit.submit(groups, position={"epoch": 0, "index": 0}), step=3)
    finally:
        audit.close()
    # numeric_accuracy: 1, 0, 0, (not audited: the reward gave None), 1, 0.  Pairs (reward, audit):
    # (1, 1) agree; (1, 0) a false pass; (0, 0) agree; (0, 1) a disagreement the other way; (0, 0) agree.
    assert result.metrics == {"audit/audited": 5, "audit/disagreements": 2, "audit/false_passes": 1, "audit/unscored": 1,
                              "audit/agreement": pytest.approx(0.6)}
    assert [(r["completion"], r["reward_score"], r["audit_score"], r["step"]) for r in result.rows] == \
        [("7 or \\boxed{8}", 1.0, 0.0, 3), ("\\boxed{12}", 0.0, 1.0, 3)]
    assert result.rows[0]["reward"] == "contains_answer" and result.rows[0]["audit"] == "numeric_accuracy"


def test_the_sample_is_a_fraction_drawn_from_the_seed_and_the_position():
    audit = RewardAudit(RewardSet(["numeric_accuracy"]), "contains_answer", fraction=0.25, seed=5)
    groups = [_group(str(i), [f"\\boxed{{{i}}}"] * 4, [1.0] * 4) for i in range(4)]  # 16 completions: 4 audited
    try:
        drawn = [audit.collect(audit.submit(groups, position=p), step=1).metrics["audit/audited"] for p in ("a", "a", "b")]
        assert drawn == [4, 4, 4]
        audit.fraction = 0.01  # never none: at least one
        assert audit.collect(audit.submit(groups, position="a"), step=1).metrics["audit/audited"] == 1
    finally:
        audit.close()
    rows = [(g, j) for g in groups for j in range(4)]
    one = random.Random(f"rlvr-audit|5|{'a'!r}").sample(rows, 4)
    assert one == random.Random(f"rlvr-audit|5|{'a'!r}").sample(rows, 4)  # a resumed run audits the same completions


def test_a_failing_auditor_is_counted_not_fatal(tmp_path, caplog):
    plugin = tmp_path / "broken.py"
    plugin.write_text("def broken(completions, **kwargs):\n    raise RuntimeError('no service')\n")
    audit = RewardAudit(RewardSet([f"{plugin}:broken"]), "contains_answer", fraction=1.0, seed=0)
    try:
        result = audit.collect(audit.submit([_group("7", ["7"], [1.0])], position=0), step=1)
    finally:
        audit.close()
    assert result.metrics == {"audit/errors": 1} and "reward_audit 'broken' failed on 1 completions" in caplog.text


def _stream(disagreements_per_step: list[int], audited: int = 4) -> list[dict]:
    return [{"reward": 0.5, "audit/audited": audited, "audit/disagreements": d, "audit/false_passes": d}
            for d in disagreements_per_step]


def test_the_alert_pools_the_windows_audits_and_needs_ten_of_them():
    def starts(stream, **settings):
        monitor = AlertMonitor(build_config({"alert_window": 5, **settings}))
        return [e.step for i, m in enumerate(stream) for e in monitor.update(i + 1, m) if e.rule == "reward_audit_disagreement"
                and e.event == "start"]

    # 4 audited a step, 1 disagreement each: 75% < 90%, but only at step 3 are there 12 >= 10 audited.
    assert starts(_stream([1] * 6)) == [3]
    assert starts(_stream([0] * 20)) == []  # full agreement
    # One disagreement in 5 steps of 4 = 95% agreement: quiet; a lower threshold keeps 75% quiet too.
    assert starts(_stream([0, 0, 1, 0, 0] * 4)) == []
    assert starts(_stream([1] * 6), alert_audit_agreement=0.7) == []
    monitor = AlertMonitor(build_config({"alert_window": 5}))
    events = [e for i, m in enumerate(_stream([1] * 5 + [0] * 10)) for e in monitor.update(i + 1, m)]
    start = next(e for e in events if e.rule == "reward_audit_disagreement")
    assert "agree on 75% of 12 completions over the last 3 steps (3 passed by the reward and failed by the audit)" in start.message
    # cleared once the window's pooled agreement is back: steps 4-8 have 2 disagreements in 20 (90%, not below)
    assert [e.step for e in events if e.rule == "reward_audit_disagreement" and e.event == "clear"] == [8]


@pytest.mark.trains
def test_an_audited_run_writes_its_disagreements_and_reports_them(tiny_run_config, tmp_path):
    from rlvr.report import write_report
    from rlvr.run import train

    plugin = tmp_path / "game.py"
    plugin.write_text(GAMEABLE)
    cfg = tiny_run_config(tmp_path / "run", reward_funcs=[f"{plugin}:contains_answer", "numeric_accuracy"],
                          reward_weights=[1.0, 0.0], reward_audit="numeric_accuracy", reward_audit_fraction=1.0, max_steps=2,
                          max_completion_length=12, task_args={"digits": 1, "num_train": 50, "num_test": 8})
    train(cfg)
    run = tmp_path / "run"
    samples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    # audited in full: every completion the two rewards disagree on, and nothing else
    expected = [(s["step"], s["completion"]) for s in samples
                if (s["rewards"]["contains_answer"] >= 0.5) != (s["rewards"]["numeric_accuracy"] >= 0.5)]
    audit = [json.loads(line) for line in (run / "audit.jsonl").read_text().splitlines()] if (run / "audit.jsonl").exists() else []
    assert sorted((r["step"], r["completion"]) for r in audit) == sorted(expected) and expected
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["audit/audited"] for m in metrics] == [8, 8]
    assert sum(m["audit/disagreements"] for m in metrics) == len(expected)
    page = write_report(run).read_text()
    assert 'id="audit"' in page and "Reward audit: " in page


def test_audit_settings_are_checked_before_the_model_loads(tiny_model_dir):
    def problems(**settings):
        with pytest.raises(ConfigError) as raised:
            check_settings(build_config({"model": str(tiny_model_dir), "reward_funcs": ["accuracy"], **settings}))
        return str(raised.value)

    assert "reward_audit: unknown reward function 'acuracy'" in problems(reward_audit="acuracy")
    assert "reward_audit_args: unknown setting 'comparison'" in problems(reward_audit="accuracy",
                                                                         reward_audit_args={"comparison": "plain"})
    assert "reward_audit_fraction must be in (0, 1]" in problems(reward_audit="accuracy", reward_audit_fraction=0)
    assert "reward_audit_target 'format' is not in reward_funcs" in problems(reward_audit="accuracy", reward_audit_target="format")
    assert "need reward_audit" in problems(reward_audit_fraction=0.5, reward_audit_target="accuracy")
