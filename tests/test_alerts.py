"""Each alert rule fires on a stream built to trigger it, stays quiet on a healthy one, and clears."""

import json
import math
import random

import pytest

from rlvr.alerts import RULES, AlertMonitor
from rlvr.settings import check_settings
from rlvr.config import ConfigError, build_config, validate

WINDOW = 5


def cfg(**kw):
    base = {"alert_window": WINDOW, "alert_reward_flat_steps": 30}
    return build_config({**base, **kw})


def healthy(step: int, rng: random.Random) -> dict:
    """A run that learns: reward rising, varied groups, small stable KL, steady throughput."""
    return {
        "reward": 0.1 + 0.006 * step + rng.uniform(-0.02, 0.02),
        "reward_std": 0.5 + rng.uniform(-0.1, 0.1),
        "kl": 0.03 + rng.uniform(-0.005, 0.005),
        "loss": 0.01 * rng.choice([-1, 1]),
        "grad_norm": 0.5,
        "tokens_per_second": 100 + rng.uniform(-5, 5),
        "frac_reward_zero_std": 0.2,
    }


def run(monitor: AlertMonitor, stream: list[dict], first_step: int = 1) -> list:
    events = []
    for i, metrics in enumerate(stream):
        events += monitor.update(first_step + i, metrics, [{"completion": "\\boxed{1}"}])
    return events


def starts(events, rule):
    return [e.step for e in events if e.rule == rule and e.event == "start"]


def clears(events, rule):
    return [e.step for e in events if e.rule == rule and e.event == "clear"]


def test_healthy_stream_raises_nothing():
    rng = random.Random(0)
    events = run(AlertMonitor(cfg()), [healthy(s, rng) for s in range(1, 121)])
    assert events == []


def with_(stream, key, values):
    return [{**m, key: v} for m, v in zip(stream, values)]


def test_reward_flat_fires_after_n_steps_and_clears_on_improvement():
    rng = random.Random(1)
    stream = [healthy(s, rng) for s in range(1, 81)]
    # Reward stuck at 0.4 for 60 steps, then up to 0.9.
    stream = with_(stream, "reward", [0.4] * 60 + [0.9] * 20)
    events = run(AlertMonitor(cfg()), stream)
    # The first full window (step 5) sets the best; 30 steps without beating it -> step 35.
    assert starts(events, "reward_flat") == [35]
    # Step 61 brings the rolling mean to (4 * 0.4 + 0.9) / 5 = 0.5 > 0.4 + 0.004: a new best.
    assert clears(events, "reward_flat") == [61]
    assert {e.rule for e in events} == {"reward_flat"}


def test_reward_std_low_and_high():
    rng = random.Random(2)
    base = [healthy(s, rng) for s in range(1, 31)]
    events = run(AlertMonitor(cfg()), with_(base, "reward_std", [0.5] * 10 + [0.05] * 10 + [0.5] * 10))
    # Step 14 (window 10..14): (0.5 + 4 * 0.05) / 5 = 0.14, not low; step 15 (11..15): 0.05 < 0.1.
    # Step 21 (17..21): (4 * 0.05 + 0.5) / 5 = 0.14 >= 0.1: cleared.
    assert starts(events, "reward_std_low") == [15]
    assert clears(events, "reward_std_low") == [21]
    events = run(AlertMonitor(cfg()), with_(base, "reward_std", [0.5] * 10 + [3.0] * 20))
    # Step 13: (2 * 0.5 + 3 * 3.0) / 5 = 2.0, not above 2.0; step 14: (0.5 + 12) / 5 = 2.5.
    assert starts(events, "reward_std_high") == [14]
    assert clears(events, "reward_std_high") == []
    assert "temperature" in next(e for e in events if e.rule == "reward_std_high").suggestion


def test_kl_high_needs_high_and_rising():
    rng = random.Random(3)
    base = [healthy(s, rng) for s in range(1, 41)]
    rising = [0.03] * 10 + [0.05 + 0.02 * i for i in range(15)] + [0.02] * 15
    events = run(AlertMonitor(cfg()), with_(base, "kl", rising))
    [start] = starts(events, "kl_high")
    # Window steps start-4..start: mean just above 0.1 while rising.
    window = rising[start - WINDOW : start]
    assert sum(window) / WINDOW > 0.1 and sum(rising[start - WINDOW - 1 : start - 1]) / WINDOW <= 0.1
    assert len(clears(events, "kl_high")) == 1
    event = next(e for e in events if e.rule == "kl_high")
    assert "beta" in event.suggestion
    # High but falling: no alert.
    falling = [0.5 - 0.01 * i for i in range(40)]
    assert starts(run(AlertMonitor(cfg()), with_(base, "kl", falling)), "kl_high") == []


def test_loss_zero_needs_vanished_gradient_and_flat_reward():
    rng = random.Random(4)
    base = [healthy(s, rng) for s in range(1, 41)]
    flat = with_(with_(base, "reward", [1.0] * 40), "loss", [0.0] * 40)
    # Loss 0 with a live gradient (grpo at ratio 1) is normal.
    assert starts(run(AlertMonitor(cfg()), flat), "loss_zero") == []
    # Skipped updates (every group equal, the reward saturated): loss and gradient are zero.
    hacked = [{k: v for k, v in m.items() if k not in ("loss", "grad_norm")} | {"skipped_update": 1.0} for m in flat]
    events = run(AlertMonitor(cfg()), hacked)
    # Best set at step 5; the reward has not improved within a window from step 10 on.
    assert starts(events, "loss_zero") == [10]
    event = next(e for e in events if e.rule == "loss_zero")
    assert "reward hacking" in event.suggestion and "boxed" in event.suggestion
    # While the reward rises, a zero gradient is not flagged.
    rising = [{**m, "reward": 0.02 * i} for i, m in enumerate(hacked)]
    assert starts(run(AlertMonitor(cfg()), rising), "loss_zero") == []


def test_throughput_low_against_the_early_baseline():
    rng = random.Random(5)
    base = [healthy(s, rng) for s in range(1, 41)]
    tps = [500.0] + [100.0] * 14 + [30.0] * 10 + [100.0] * 15  # step 1 (warm-up) is not the baseline
    events = run(AlertMonitor(cfg()), with_(base, "tokens_per_second", tps))
    # Baseline = median of steps 2..6 = 100; threshold 50.  Steps 16..: window mean
    # step 17: (3 * 100 + 2 * 30) / 5 = 72; step 18: (2 * 100 + 3 * 30) / 5 = 58; step 19: 44 < 50.
    assert starts(events, "throughput_low") == [19]
    # Recovery from step 26: step 27: (3 * 30 + 2 * 100) / 5 = 58 >= 50.
    assert clears(events, "throughput_low") == [27]


def test_zero_std_high():
    rng = random.Random(6)
    base = [healthy(s, rng) for s in range(1, 21)]
    events = run(AlertMonitor(cfg()), with_(base, "frac_reward_zero_std", [0.2] * 5 + [0.9] * 15))
    # Step 9: (4 * 0.9 + 0.2) / 5 = 0.76; step 10: 0.9 > 0.8.
    assert starts(events, "zero_std_high") == [10]
    assert "dynamic_sampling" in next(e for e in events if e.rule == "zero_std_high").suggestion


def test_each_alert_is_written_once_when_it_starts_and_once_when_it_clears(tmp_path):
    rng = random.Random(7)
    base = [healthy(s, rng) for s in range(1, 31)]
    path = tmp_path / "alerts.jsonl"
    monitor = AlertMonitor(cfg(on_alert={"reward_std_low": "stop"}), path)
    run(monitor, with_(base, "reward_std", [0.5] * 10 + [0.05] * 10 + [0.5] * 10))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["rule"], x["event"], x["step"], x["severity"]) for x in lines] == [
        ("reward_std_low", "start", 15, "stop"),
        ("reward_std_low", "clear", 21, "stop"),
    ]
    assert set(lines[0]) == {"step", "rule", "event", "severity", "message", "suggestion", "value"}
    assert lines[0]["value"] == pytest.approx(0.05)


def test_resumed_monitor_reports_what_an_uninterrupted_one_does():
    rng = random.Random(8)
    stream = with_([healthy(s, rng) for s in range(1, 81)], "reward", [0.4] * 60 + [0.9] * 20)
    whole = run(AlertMonitor(cfg()), stream)
    first = AlertMonitor(cfg())
    events = run(first, stream[:40])
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints hold plain data
    second = AlertMonitor(cfg())
    second.load_state_dict(state)
    events += run(second, stream[40:], first_step=41)
    assert [(e.rule, e.event, e.step) for e in events] == [(e.rule, e.event, e.step) for e in whole]


def test_reward_collapse_fires_on_a_sudden_drop_and_clears_on_recovery():
    rng = random.Random(2)
    stream = with_([healthy(s, rng) for s in range(1, 51)], "reward", [0.6] * 30 + [0.1] * 9 + [0.6] * 11)
    events = run(AlertMonitor(cfg()), stream)
    # Window 5: the last k = max(2, 5 // 4) = 2 steps against the best rolling mean, 0.6 (steps 5..30).
    # Step 31: (0.6 + 0.1) / 2 = 0.35, a fall of 0.25 <= 0.5 * 0.6 = 0.3: not yet.  Step 32: 0.1, a fall
    # of 0.5 > 0.3, and the step-to-step spread is 0 (the median of the windows' std: most are all 0.6).  Step 40: (0.1 + 0.6) / 2
    # = 0.35 again, one quiet step = window // 4: cleared.
    assert starts(events, "reward_collapse") == [32] and clears(events, "reward_collapse") == [40]
    start = next(e for e in events if e.rule == "reward_collapse")
    assert start.value == pytest.approx(0.1)
    assert "from a rolling mean of 0.600 at step" in start.message and "checkpoint before the drop" in start.suggestion


def test_reward_collapse_ignores_noise_and_slow_decline_below_its_threshold():
    rng = random.Random(3)
    base = [healthy(s, rng) for s in range(1, 201)]
    # Step means anywhere in 0.2 .. 0.8: two low steps in a row fall far from the best rolling mean,
    # but by less than four standard errors (std about 0.17: 4 * 0.17 * (1 / sqrt 2 + 1 / sqrt 5) = 0.78).
    noisy = run(AlertMonitor(cfg()), with_(base, "reward", [rng.uniform(0.2, 0.8) for _ in base]))
    assert starts(noisy, "reward_collapse") == []
    # A fall of 40% of the best (0.5 -> 0.3) is below the default 50%; at 30% it fires.
    drop = with_(base, "reward", [0.5] * 40 + [0.3] * 160)
    assert starts(run(AlertMonitor(cfg()), drop), "reward_collapse") == []
    assert starts(run(AlertMonitor(cfg(alert_reward_collapse=0.3)), drop), "reward_collapse") == [42]


def test_nan_and_missing_metrics_keep_rules_off():
    rng = random.Random(9)
    stream = [{**healthy(s, rng), "kl": math.nan, "reward_std": None} for s in range(1, 30)]
    events = run(AlertMonitor(cfg()), stream)
    assert starts(events, "kl_high") == [] and starts(events, "reward_std_low") == []


def test_on_alert_names_are_checked():
    with pytest.raises(ConfigError, match="on_alert: unknown rule 'kl'"):
        check_settings(cfg(on_alert={"kl": "stop"}))  # rule names: the launch check
    with pytest.raises(ConfigError, match="on_alert.kl_high must be warn or stop"):
        validate(cfg(on_alert={"kl_high": "halt"}))
    assert set(RULES) == {"reward_flat", "reward_std_low", "reward_std_high", "kl_high", "loss_zero",
                          "throughput_low", "zero_std_high", "reward_collapse", "reward_audit_disagreement"}


def test_a_value_hovering_at_the_threshold_does_not_flap():
    rng = random.Random(10)
    base = [healthy(s, rng) for s in range(1, 41)]
    # Window 8, so an alert clears only after 8 // 4 = 2 steps without its condition.
    stds = [0.09] * 11 + [0.25, 0.0] + [0.09] * 27
    # Step 8: mean 0.09 < 0.1 -> start.  Step 12: 0.09 + (0.25 - 0.09) / 8 = 0.11, one quiet step;
    # step 13: 0.11 + (0.0 - 0.09) / 8 = 0.09875, low again: no clear, no second start.
    events = run(AlertMonitor(cfg(alert_window=8)), with_(base, "reward_std", stds))
    assert starts(events, "reward_std_low") == [8] and clears(events, "reward_std_low") == []
    # The same stream with no patience (window 5 -> 5 // 4 = 1) would have flapped; a real recovery clears:
    stds = [0.09] * 11 + [0.5] * 29
    events = run(AlertMonitor(cfg(alert_window=8)), with_(base, "reward_std", stds))
    # Step 12: 0.09 + 0.41 / 8 = 0.141 (quiet 1), step 13: quiet 2 -> clear.
    assert starts(events, "reward_std_low") == [8] and clears(events, "reward_std_low") == [13]
