"""`from rlvr import AsyncGRPOConfig, AsyncGRPOTrainer`: TRL's asynchronous GRPO API (TRL 1.16's
trl.experimental.async_grpo, top-level from TRL 1.18) on rlvr's sampling ahead: its fields and
defaults, what it refuses, and a run on the tiny model."""

import dataclasses
import importlib.util
import json
import os

import pytest

from rlvr import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig
from rlvr.config import ConfigError
from rlvr.trl_settings import TRL_DEFAULTS_DIFFER


def _trl_async_config():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl

    if hasattr(trl, "AsyncGRPOConfig"):  # TRL 1.18 and later
        return trl.AsyncGRPOConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig as theirs

    return theirs


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="compares with the installed TRL")
def test_the_config_has_trls_fields_and_defaults():
    theirs = {f.name: f for f in dataclasses.fields(_trl_async_config()) if f.init}
    ours = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    assert set(ours) == set(theirs)
    for name, field in ours.items():
        if name in TRL_DEFAULTS_DIFFER:  # rlvr's default on purpose, as for GRPOConfig (docs/trl.md)
            continue
        expected = _default(theirs[name])
        assert _default(field) == getattr(expected, "value", expected), name  # an Enum as its value


def _default(field):
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def test_trls_async_defaults_are_what_the_run_does():
    cfg = AsyncGRPOConfig(output_dir="x")._config
    assert (cfg.max_staleness, cfg.weight_sync_steps, cfg.lr_scheduler_type, cfg.logging_steps, cfg.max_completion_length) == \
        (4, 1, "constant", 1, 2048)
    assert (cfg.use_vllm, cfg.vllm_mode, cfg.vllm_server_base_url) == (True, "server", "http://localhost:8000")
    # GRPOConfig keeps its own: on-policy, a linear schedule
    assert (GRPOConfig(output_dir="x")._config.max_staleness, GRPOConfig(output_dir="x")._config.lr_scheduler_type) == (0, "linear")
    # set fields and rlvr settings win over those defaults; request_timeout bounds each request to a server
    cfg = AsyncGRPOConfig(output_dir="x", max_staleness=2, weight_sync_steps=2, use_vllm=False, request_timeout=30)._config
    assert (cfg.max_staleness, cfg.weight_sync_steps, cfg.use_vllm, cfg.vllm_server_timeout) == (2, 2, False, 30)


def test_what_it_cannot_do_is_refused_before_anything_loads():
    with pytest.raises(ConfigError, match="weight_sync_steps=8 lets a sample lag up to 8 weight versions.*max_staleness=4"):
        AsyncGRPOConfig(output_dir="x", weight_sync_steps=8)
    with pytest.raises(ConfigError, match="token_budget=4096 is not supported"):
        AsyncGRPOConfig(output_dir="x", token_budget=4096)
    args = AsyncGRPOConfig(output_dir="x", use_vllm=False)
    with pytest.raises(ConfigError, match=r"AsyncGRPOTrainer\(rollout_worker=...\) is not supported"):
        AsyncGRPOTrainer(model="m", reward_funcs="boxed_format", args=args, train_dataset=[{"prompt": "a"}], rollout_worker=object())
    # TRL's own queue and task bounds have nothing to bound here: accepted, and named as without effect
    assert AsyncGRPOConfig(output_dir="x", max_inflight_tasks=64, queue_maxsize=8)._ignored == ["max_inflight_tasks", "queue_maxsize"]


def _length(completions, **kwargs):
    return [len(c) / 10 for c in completions]


@pytest.mark.trains
def test_a_script_trains_one_generation_ahead_syncing_every_two_steps(tiny_model_dir, tmp_path):
    """TRL's AsyncGRPOTrainer usage, sampling in the training process (use_vllm=false: no server here).
    weight_sync_steps=2: the sampler gets the weights after step 2 only, so the generations of steps 1-3
    were sampled with those of steps 0, 0 and 0 and lag the policy by 0, 1 and 2 versions."""
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(12)]
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), use_vllm=False, max_steps=3, per_device_train_batch_size=8,
                           num_generations=4, max_completion_length=6, max_staleness=2, weight_sync_steps=2,
                           learning_rate=1e-2, report_to="none")
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=_length, args=args, train_dataset=rows)
    trainer.train()
    assert trainer.state.global_step == 3
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]  # logging_steps=1, TRL's async default
    assert [m["sampling/weight_version"] for m in lines] == [0, 0, 0]
    assert [m["sampling/staleness"] for m in lines] == [0, 1, 2]
    assert all(m["learning_rate"] == 1e-2 for m in lines)  # a constant schedule, TRL's async default
