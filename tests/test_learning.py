"""The whole loop learns: a tiny random model is trained until it earns a simple verifiable reward."""

import json

import pytest

from rlvr.config import build_config
from rlvr.run import train

pytestmark = [pytest.mark.trains, pytest.mark.processes]

REWARD = """
def starts_with_seven(completions, **kwargs):
    return [1.0 if c.startswith("7") else 0.0 for c in completions]
"""


def test_tiny_model_learns_a_verifiable_reward(tiny_model_dir, tmp_path):
    plugin = tmp_path / "seven.py"
    plugin.write_text(REWARD)
    cfg = build_config({
        "model": str(tiny_model_dir),
        "task_args": {"digits": 2, "num_train": 200, "num_test": 10},
        "reward_funcs": [f"{plugin}:starts_with_seven"],
        "num_generations": 8,
        "per_device_train_batch_size": 64,
        "max_completion_length": 4,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "loss_type": "grpo",
        "max_steps": 40,
        "logging_steps": 1,
        "save_steps": 1000,
        "eval_on_start": False,
        "eval_on_end": False,
        "output_dir": str(tmp_path / "run"),
    })
    train(cfg)
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [l["reward"] for l in lines]
    assert len(rewards) == 40
    assert sum(rewards[:3]) / 3 < 0.2, rewards[:3]
    assert sum(rewards[-3:]) / 3 > 0.8, rewards[-3:]
