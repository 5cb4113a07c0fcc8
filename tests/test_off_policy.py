"""One step off-policy (max_staleness=1) on the tiny model: the next batch is sampled while a step
trains, from the weights before that step's update, and the update corrects for it with the
importance weight of vllm_importance_sampling_mode."""

import copy
import json

import pytest
import torch

from rlvr.config import ConfigError, build_config
from rlvr.run import train
from rlvr.trainer import Trainer
from rlvr.types import Example


@pytest.fixture
def noisy_rewards(monkeypatch):
    import rlvr.rewards as rewards

    gen = torch.Generator().manual_seed(0)
    monkeypatch.setitem(rewards.REWARDS, "boxed_format", lambda completions, **kw: torch.rand(len(completions), generator=gen).tolist())


def _trainer(tiny, tmp_path, total_steps: int, **settings) -> Trainer:
    """A GRPO trainer of the tiny model on 20 additions, 2 prompts x 4 completions a step, sampling ahead."""
    model, tokenizer = tiny
    cfg = build_config({"model": "default", "reward_funcs": ["boxed_format"], "num_generations": 4,
                        "per_device_train_batch_size": 8, "max_completion_length": 6, "learning_rate": 1e-2, **settings})
    examples = [Example(f"what is {i}+{i}?", str(2 * i)) for i in range(20)]
    return Trainer(cfg, model, tokenizer, examples, output_dir=tmp_path, total_steps=total_steps)


@pytest.mark.trains
def test_the_next_batch_comes_from_the_weights_before_the_update(tiny, tmp_path, noisy_rewards):
    model, _ = tiny
    trainer = _trainer(tiny, tmp_path, 3, temperature=1.0, max_staleness=1)
    start = copy.deepcopy(model)
    first = trainer.train_step()
    ahead = trainer.pending.batch  # sampled during step 1, for step 2
    assert trainer.pending.weight_version == 0 and trainer.pending.iterations_done == 0
    with torch.no_grad():
        before, _ = trainer.logprobs(start, ahead)
        after, _ = trainer.logprobs(model, ahead)
    mask = ahead.completion_mask
    assert (before[mask] - ahead.sampler_logprobs[mask]).abs().max() < 1e-4  # sampled with the old weights
    assert (after[mask] - ahead.sampler_logprobs[mask]).abs().max() > 1e-3  # which the update has since changed
    second = trainer.train_step()
    assert first["sampling/staleness"] == 0 and second["sampling/staleness"] == 1
    assert first["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    # the ratio of step 2 (TRL's default sequence_mask): exp(sum of new - old log-probs) per completion,
    # zero where it exceeds 3, averaged over completions
    ratio = torch.exp(torch.where(mask, after - ahead.sampler_logprobs, 0.0).sum(-1))
    expected = torch.where(ratio > 3.0, 0.0, ratio).mean().item()
    assert second["sampling/importance_sampling_ratio/mean"] == pytest.approx(expected, rel=1e-4)
    # the sampler has the new weights once the step returns
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), trainer.rollout.sampler.model.parameters()))
    trainer.close()


def test_settings_it_cannot_run_with_are_refused():
    with pytest.raises(ConfigError, match="max_staleness must be >= 0"):
        build_config({"max_staleness": -1})
    with pytest.raises(ConfigError, match="weight_sync_steps must be >= 1"):
        build_config({"weight_sync_steps": 0})
    # on-policy: a sampler of its own synced every 2 steps would lag a version; sampled ahead, 3 lag 3
    with pytest.raises(ConfigError, match="weight_sync_steps=2 lets a sample lag up to 1 weight versions .*max_staleness=0: "
                                          "set max_staleness >= 2 or weight_sync_steps <= 1"):
        build_config({"weight_sync_steps": 2, "use_vllm": True})
    with pytest.raises(ConfigError, match="weight_sync_steps=3 lets a sample lag up to 3 .*sampled one generation ahead"):
        build_config({"weight_sync_steps": 3, "max_staleness": 2})
    assert build_config({"weight_sync_steps": 4, "max_staleness": 4}).weight_sync_steps == 4
    assert build_config({"max_staleness": 4}).max_staleness == 4  # TRL's AsyncGRPOConfig default
    with pytest.raises(ConfigError, match="max_staleness >= 1 with use_peft and kl_penalty=reward"):
        build_config({"max_staleness": 1, "use_peft": True, "beta": 0.1, "kl_penalty": "reward"})
    from rlvr.distributed import World
    from rlvr.settings import check_runnable

    # Several processes are no reason to refuse it (tests/test_distributed.py trains so, fsdp too).
    check_runnable(build_config({"max_staleness": 1, "num_generations": 4, "per_device_train_batch_size": 8}), World(0, 2))
    check_runnable(build_config({"max_staleness": 1, "fsdp": True, "num_generations": 4, "per_device_train_batch_size": 8}), World(0, 2))


SIGNAL_REWARDS = '''
import signal

from math_verify import parse, verify


def guide_accuracy(completions, answer, **kwargs):
    """The guide's pattern: math-verify with its default (SIGALRM) timeouts inside try/except."""
    rewards = []
    for completion, ref in zip(completions, answer):
        try:
            rewards.append(1.0 if verify(parse(f"${ref}$"), parse(f"${ref}$")) else -0.5)
        except Exception:
            rewards.append(-1.0)
    return rewards


def alarm_length(completions, **kwargs):
    """A per-completion time limit through signal.alarm, as many reward functions have."""
    rewards = []
    for completion in completions:
        try:
            previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
            signal.alarm(5)
            rewards.append(len(completion) / 10)
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        except ValueError:  # "signal only works in main thread of the main interpreter"
            rewards.append(-1.0)
    return rewards
'''


@pytest.mark.trains
@pytest.mark.processes
def test_reward_functions_that_use_signals_score_the_same_sampled_ahead(tiny_model_dir, tmp_path):
    """With max_staleness=1 the next batch is sampled in a thread; its rewards are still computed on
    the main thread, so signal-based timeouts work as on-policy.  With async_mode=free they are scored on
    a thread of their own, your functions in their worker process (whose main thread has the signals),
    or with reward_isolation=inline on the main thread again.  The learning rate is so small that
    the weights do not move, so every run samples the same completions and must score them the same."""
    plugin = tmp_path / "signal_rewards.py"
    plugin.write_text(SIGNAL_REWARDS)
    runs = {}
    modes = {0: {}, 1: {}, "free": {"async_mode": "free"}, "free-inline": {"async_mode": "free", "reward_isolation": "inline"}}
    for staleness, mode in modes.items():
        out = tmp_path / f"run{staleness}"
        train(build_config({
            "model": str(tiny_model_dir), "task_args": {"num_train": 50, "num_test": 10},
            "reward_funcs": [f"{plugin}:guide_accuracy", f"{plugin}:alarm_length"], "num_generations": 4,
            "per_device_train_batch_size": 8, "max_completion_length": 6, "learning_rate": 1e-20, "max_steps": 4,
            "logging_steps": 1, "save_steps": 1000, "eval_on_start": False, "eval_on_end": False,
            "max_staleness": staleness if isinstance(staleness, int) else 2, "output_dir": str(out), **mode,
        }))
        runs[staleness] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for name in ("rewards/guide_accuracy/mean", "rewards/alarm_length/mean"):
        for other in (1, "free", "free-inline"):
            assert [r[name] for r in runs[0]] == [r[name] for r in runs[other]], (name, other)
    assert all(r["rewards/guide_accuracy/mean"] == 1.0 for r in runs[1])  # never the -1 of a failed signal
    assert all(r["rewards/alarm_length/mean"] > 0 for r in runs[1])
    assert [r["sampling/staleness"] for r in runs[1]] == [0, 1, 1, 1]


@pytest.mark.trains
def test_weights_synced_every_few_steps_sample_from_the_version_they_say(tiny, tmp_path, noisy_rewards):
    """weight_sync_steps=2, max_staleness=2: the copy sampling ahead gets the weights after steps 2 and 4
    only, so the generations of steps 1-5 were sampled with the weights of steps 0, 0, 0, 2, 2 (the
    first on-policy, the rest one generation ahead) and lag the policy they train by 0, 1, 2, 1, 2."""
    model, _ = tiny
    trainer = _trainer(tiny, tmp_path, 5, max_staleness=2, weight_sync_steps=2)
    sampler = trainer.rollout.sampler.model
    weights = [copy.deepcopy(model.state_dict())]  # after step 0, 1, ...
    rows = []
    for _ in range(5):
        rows.append(trainer.train_step())
        weights.append(copy.deepcopy(model.state_dict()))
        held = sampler.state_dict()
        synced = trainer.step - trainer.step % 2
        assert all(torch.equal(held[k], weights[synced][k]) for k in held), trainer.step  # the weights of the last sync
        if trainer.step % 2:
            assert not all(torch.equal(held[k], weights[trainer.step][k]) for k in held)  # not the policy's own
    assert [r["sampling/weight_version"] for r in rows] == [0, 0, 0, 2, 2]
    assert [r["sampling/staleness"] for r in rows] == [0, 1, 2, 1, 2]
    # where each overlapped step's time went (the last step samples nothing ahead)
    assert [("timing/trainer_idle" in r, "timing/sampler_idle" in r) for r in rows] == [(True, True)] * 4 + [(False, False)]
    for r in rows[:4]:
        assert 0 <= r["timing/trainer_idle"] <= r["step_time"] and 0 <= r["timing/sampler_idle"] <= r["step_time"]
    for r in rows:
        assert r["timing/rollout_tokens_per_second"] == pytest.approx(r["completions/num_tokens"] / r["timing/rollout"])
        assert r["timing/update_tokens_per_second"] == pytest.approx(r["update_tokens"] / r["timing/update"])
    trainer.close()
