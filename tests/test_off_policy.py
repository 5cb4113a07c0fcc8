"""One step off-policy (max_staleness=1) on the tiny model: the next batch is sampled while a step
trains, from the weights before that step's update, and the update corrects for it with the
truncated importance weight."""

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


def test_the_next_batch_comes_from_the_weights_before_the_update(tiny, tmp_path, noisy_rewards):
    model, tokenizer = tiny
    cfg = build_config({"model": "default", "reward_funcs": ["boxed_format"], "num_generations": 4,
                        "per_device_train_batch_size": 8, "max_completion_length": 6, "learning_rate": 1e-2,
                        "temperature": 1.0, "max_staleness": 1})
    examples = [Example(f"what is {i}+{i}?", str(2 * i)) for i in range(20)]
    trainer = Trainer(cfg, model, tokenizer, examples, output_dir=tmp_path, total_steps=3)
    start = copy.deepcopy(model)
    first = trainer.train_step()
    ahead = trainer.pending.batch  # sampled during step 1, for step 2
    assert trainer.pending.staleness == 1 and trainer.pending.iterations_done == 0
    with torch.no_grad():
        before, _ = trainer.completion_logprobs(start, ahead)
        after, _ = trainer.completion_logprobs(model, ahead)
    mask = ahead.completion_mask
    assert (before[mask] - ahead.sampler_logprobs[mask]).abs().max() < 1e-4  # sampled with the old weights
    assert (after[mask] - ahead.sampler_logprobs[mask]).abs().max() > 1e-3  # which the update has since changed
    second = trainer.train_step()
    assert first["sampling/staleness"] == 0 and second["sampling/staleness"] == 1
    assert first["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    # the ratio of step 2 is exp(new - old log-prob) per token, capped at 2, averaged over tokens
    expected = torch.exp(after[mask] - ahead.sampler_logprobs[mask]).clamp(max=2.0).mean().item()
    assert second["sampling/importance_sampling_ratio/mean"] == pytest.approx(expected, rel=1e-4)
    # the sampler has the new weights once the step returns
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), trainer.rollout.sampler.model.parameters()))
    trainer.close()


def test_an_off_policy_run_learns(tiny_model_dir, tmp_path):
    plugin = tmp_path / "seven.py"
    plugin.write_text("def starts_with_seven(completions, **kw):\n    return [float(c.startswith('7')) for c in completions]\n")
    out = tmp_path / "run"
    train(build_config({
        "model": str(tiny_model_dir), "task_args": {"digits": 2, "num_train": 200, "num_test": 10},
        "reward_funcs": [f"{plugin}:starts_with_seven"], "num_generations": 8, "per_device_train_batch_size": 64,
        "max_completion_length": 4, "learning_rate": 1e-2, "max_steps": 40, "logging_steps": 1, "save_steps": 1000,
        "eval_on_start": False, "eval_on_end": False, "max_staleness": 1, "output_dir": str(out),
    }))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows]
    assert sum(rewards[:3]) / 3 < 0.2 and sum(rewards[-3:]) / 3 > 0.8, rewards
    assert all(r["sampling/staleness"] == 1 for r in rows[1:])


def test_settings_it_cannot_run_with_are_refused():
    with pytest.raises(ConfigError, match="max_staleness must be 0 .* or 1"):
        build_config({"max_staleness": 2})
    with pytest.raises(ConfigError, match="max_staleness=1 with use_peft and kl_penalty=reward"):
        build_config({"max_staleness": 1, "use_peft": True, "beta": 0.1, "kl_penalty": "reward"})
    from rlvr import distributed

    with pytest.raises(ConfigError, match="max_staleness=1 is not supported with several training processes"):
        distributed.check_supported(build_config({"max_staleness": 1, "num_generations": 4, "per_device_train_batch_size": 8}),
                                    distributed.World(0, 2))
