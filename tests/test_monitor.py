"""monitor.generation_metrics: the numbers of one generation, checked against values computed by hand."""

import math
from types import SimpleNamespace

import pytest

from rlvr.monitor import generation_metrics


PROMPT_TOKENS = 5


def group(rewards, lengths, truncated, per_func, kl=None, scored=None):
    """A sampled group as generation_metrics reads it (trainer.SampledGroup's fields); `scored`: the rewards
    with NaN where no function scored the completion (default: all scored)."""
    rollouts = [SimpleNamespace(completion_ids=[7] * n, truncated=t, prompt_ids=[1] * PROMPT_TOKENS) for n, t in zip(lengths, truncated)]
    return SimpleNamespace(rewards=rewards, rollouts=rollouts, per_func=per_func, kl=kl,
                           has_signal=max(rewards) > min(rewards), scored_rewards=scored or rewards)


def round_(groups, counters, rollout_seconds, reward_seconds, logged=None):
    return SimpleNamespace(groups=groups, counters=counters, rollout_seconds=rollout_seconds, reward_seconds=reward_seconds,
                           logged=logged or {})


def test_generation_metrics_by_hand():
    mixed = group([1.0, 0.0, 0.5], lengths=[4, 2, 6], truncated=[False, False, True],
                  per_func={"accuracy": [1.0, 0.0, None], "format": [0.0, 0.0, 1.0]}, kl=[0.5, 0.25, 1.25])
    flat = group([1.0, 1.0, 1.0], lengths=[3, 3, 6], truncated=[False, True, False],
                 per_func={"accuracy": [1.0, 1.0, 1.0], "format": [1.0, 0.0, 0.0]}, kl=[0.0, 0.5, 0.5])
    rounds = [round_([mixed], {"accuracy": {"timeouts": 1}}, 1.5, 0.25),
              round_([flat], {"accuracy": {"timeouts": 2, "errors": 0}, "format": {"errors": 1}}, 2.25, 0.5)]
    metrics = generation_metrics([mixed, flat], rounds, group_size=3)
    assert metrics == pytest.approx({
        "reward": 0.75,  # (1 + 0 + 0.5 + 1 + 1 + 1) / 6 = 4.5 / 6
        # TRL's: the sample std (n - 1) of the whole batch: mean 0.75, squares 0.0625 + 0.5625 + 0.0625
        # + 3 * 0.0625 = 0.875, / 5 = 0.175 -> std sqrt(0.175) = 0.418330
        "reward_std": math.sqrt(0.175),
        # per-group sample std: mixed: mean 0.5, squares 0.25 + 0.25 + 0 = 0.5, / 2 -> std 0.5; flat: 0. Their mean: 0.25
        "reward_std/within_group": 0.25,
        "frac_reward_zero_std": 0.5,  # 1 of the 2 groups has all rewards equal
        "completions/mean_length": 4.0,  # lengths 4, 2, 6, 3, 3, 6: 24 / 6
        "completions/min_length": 2.0,
        "completions/max_length": 6.0,
        "completions/clipped_ratio": 2 / 6,  # 2 of the 6 completions hit max_completion_length
        "completions/mean_terminated_length": 3.75,  # not cut: mixed's 4 and 2, flat's 3 and 6 -> 15 / 4
        "completions/min_terminated_length": 2.0,
        "completions/max_terminated_length": 6.0,
        "completions/num_tokens": 24.0,
        "tokens/generation": 24.0 + 6 * PROMPT_TOKENS,
        "timing/rollout": 3.75,  # 1.5 + 2.25, summed over the rounds
        "timing/reward": 0.75,  # 0.25 + 0.5
        "kl": 0.125,  # per-completion sums 0.5 + 0.25 + 1.25 + 0 + 0.5 + 0.5 = 3.0, per token: 3 / 24
        # accuracy, the unscored None left out: 1, 0, 1, 1, 1 -> mean 0.8;
        # squares 0.04 + 0.64 + 3 * 0.04 = 0.8, / (5 - 1) = 0.2 -> std sqrt(0.2) = 0.447214
        "rewards/accuracy/mean": 0.8,
        "rewards/accuracy/std": math.sqrt(0.2),
        "rewards/accuracy/timeouts": 3,  # 1 + 2 over the rounds; 0 errors: no key
        # format: 0, 0, 1, 1, 0, 0 -> mean 1/3; squares 4 * 1/9 + 2 * 4/9 = 4/3, / 5 = 4/15 -> std 0.516398
        "rewards/format/mean": 1 / 3,
        "rewards/format/std": math.sqrt(4 / 15),
        "rewards/format/errors": 1,
    }, abs=1e-6)


def test_generation_metrics_without_kl_and_with_nothing_scored():
    # kl None (no kl_penalty=reward): no kl key. A function that scored nothing (all None) has mean
    # nan (metrics.jsonl writes null) and std 0; one scored value has std 0, not the nan of n - 1 = 0.
    only = group([0.0, 1.0], lengths=[5, 1], truncated=[True, True],
                 per_func={"code": [None, None], "format": [None, 1.0]})
    metrics = generation_metrics([only], [round_([only], {}, 0.5, 0.0)], group_size=2)
    assert "kl" not in metrics
    assert math.isnan(metrics["rewards/code/mean"]) and metrics["rewards/code/std"] == 0.0
    assert metrics["rewards/format/mean"] == 1.0 and metrics["rewards/format/std"] == 0.0
    # rewards 0, 1: std (n - 1) = sqrt(0.5); both completions truncated; lengths 5 and 1
    assert metrics["reward_std"] == pytest.approx(math.sqrt(0.5))
    assert metrics["frac_reward_zero_std"] == 0.0 and metrics["completions/clipped_ratio"] == 1.0
    assert (metrics["completions/mean_length"], metrics["completions/num_tokens"], metrics["timing/rollout"]) == (3.0, 6.0, 0.5)


# --- run_name -----------------------------------------------------------------------------------


def test_run_name_names_the_default_output_dir():
    import re

    from rlvr.config import build_config
    from rlvr.rundir import default_output_dir

    named, plain = build_config({"run_name": "grpo-arith"}), build_config({})
    assert re.fullmatch(r"runs/grpo-arith-\d{8}-\d{6}", default_output_dir(named.run_settings, named.data_settings, named.command).as_posix())
    assert re.fullmatch(r"runs/arithmetic-\d{8}-\d{6}", default_output_dir(plain.run_settings, plain.data_settings, plain.command).as_posix())  # else the task's name


@pytest.mark.parametrize("run_name", [None, "grpo-arith"])
def test_loggers_name_the_run_and_never_get_the_hub_token(run_name, tmp_path, monkeypatch):
    import sys
    import types

    from rlvr.config import build_config
    from rlvr.monitor import build_loggers

    pytest.importorskip("tensorboard")
    inits = []
    for module in ("wandb", "trackio"):
        fake = types.ModuleType(module)
        fake.init = lambda **kw: inits.append(kw)
        monkeypatch.setitem(sys.modules, module, fake)
    cfg = build_config({"run_name": run_name, "hub_token": "hf_secret", "report_to": ["wandb", "trackio", "tensorboard"]})
    loggers = build_loggers(cfg.run_settings, tmp_path / "run-20250101-000000", cfg.without_secrets().to_dict())
    loggers[2].start(1)  # the event file is opened once the run knows its first step
    loggers[2].close()
    name = run_name or "run-20250101-000000"  # else the output dir's name
    assert [kw["name"] for kw in inits] == [name, name]
    assert all(kw["config"]["hub_token"] is None for kw in inits)
    events = list((tmp_path / "run-20250101-000000" / "tensorboard").rglob("events.out.tfevents.*"))
    assert [e.parent.name for e in events] == [run_name or "tensorboard"]  # with a run_name: tensorboard/<run_name>


def test_multi_turn_metrics_by_hand():
    g = group([1.0, 0.0], lengths=[5, 5], truncated=[False, False], per_func={"accuracy": [1.0, 0.0]})
    g.rollouts[0].info = {"turns": 3, "tool_calls": 2, "tool_errors": 1, "env_error": False, "env_reward": None}
    g.rollouts[1].info = {"turns": 1, "tool_calls": 0, "tool_errors": 0, "env_error": True, "env_reward": None}
    metrics = generation_metrics([g], [round_([g], {}, 1.0, 0.0)], group_size=2)
    assert metrics["turns/mean"] == 2.0 and metrics["turns/max"] == 3  # (3 + 1) / 2
    assert metrics["tools/calls_per_completion"] == 1.0 and metrics["tools/errors_per_completion"] == 0.5
    assert metrics["tools/error_rate"] == 0.5 and metrics["env/errors"] == 1  # 1 of the 2 calls failed


def test_a_completion_no_function_scored_is_left_out_of_the_reward_as_in_trl():
    # the third completion: every function returned None (total 0, but unscorable): TRL's nanmean leaves it out
    g = group([1.0, 0.0, 0.0], lengths=[2, 2, 2], truncated=[False] * 3, per_func={"accuracy": [1.0, 0.0, None]},
              scored=[1.0, 0.0, math.nan])
    metrics = generation_metrics([g], [round_([g], {}, 0.0, 0.0)], group_size=3)
    assert metrics["reward"] == 0.5 and metrics["reward_std"] == pytest.approx(math.sqrt(0.5))
    assert metrics["reward_std/within_group"] == pytest.approx(math.sqrt(0.5))
