"""Ctrl-C and SIGTERM at every phase of a step: the run saves a checkpoint it can resume from
exactly (same weights, same metrics rows as a run that never stopped), or leaves the last one."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from rlvr import interrupts
from rlvr.run import train


def _cfg(tiny_run_config, out, **kw):
    """The shared tiny run, in micro-batches of 4 with 2 accumulation steps, for 5 steps."""
    return tiny_run_config(out, **{"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 5, **kw})


def _rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k not in ("step_time", "tokens_per_second")}
            for r in rows]


@pytest.fixture
def text_rewards(monkeypatch):
    """A reward of the text alone with signal in every group (every step updates), and a hook to
    send a signal from inside the reward function."""
    import zlib

    import rlvr.rewards as rewards

    calls = {"n": 0, "at": None, "signals": []}

    def reward(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["at"]:
            for s in calls["signals"]:
                os.kill(os.getpid(), s)
        return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", reward)
    return calls


@pytest.fixture(scope="module")
def straight(tiny_run_config, tmp_path_factory):
    """The run that never stopped: its final weights and rows."""
    import zlib

    import rlvr.rewards as rewards

    out = tmp_path_factory.mktemp("straight")
    saved = rewards.REWARDS["boxed_format"]
    rewards.REWARDS["boxed_format"] = lambda completions, **kw: [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]
    try:
        train(_cfg(tiny_run_config, out))
    finally:
        rewards.REWARDS["boxed_format"] = saved
    return load_file(str(out / "model.safetensors")), _rows(out)


def _signal_on_call(monkeypatch, target, name, at, signals):
    """Send `signals` to this process on the `at`-th call of target.name (1-based), then call it."""
    original, count = getattr(target, name), {"n": 0}

    def wrapper(*args, **kwargs):
        count["n"] += 1
        if count["n"] == at:
            for s in signals:
                os.kill(os.getpid(), s)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)
    return original


PHASES = ["rollout", "reward", "backward", "optimizer", "logging", "save"]


def _arm(phase, monkeypatch, text_rewards, signals, optimizers):
    """Make `signals` arrive during step 3's `phase` (the save: checkpoint-4's)."""
    from rlvr import trainer as trainer_module
    from rlvr.monitor import MetricsLog
    from rlvr.rollout.stage import RolloutStage
    from rlvr.update import PolicyUpdate

    if phase == "rollout":
        _signal_on_call(monkeypatch, RolloutStage, "sample", 3, signals)
    elif phase == "reward":
        text_rewards.update(at=3, signals=signals)
    elif phase == "backward":
        _signal_on_call(monkeypatch, PolicyUpdate, "accumulate_gradients", 3, signals)
    elif phase == "optimizer":
        original = trainer_module.build_optimizer

        def build(*args, **kwargs):
            optimizer, scheduler = original(*args, **kwargs)
            optimizers.append(optimizer)
            steps = {"n": 0}

            def pre_hook(opt, a, k):
                steps["n"] += 1
                if steps["n"] == 3:
                    for s in signals:
                        os.kill(os.getpid(), s)

            optimizer.register_step_pre_hook(pre_hook)
            return optimizer, scheduler

        monkeypatch.setattr(trainer_module, "build_optimizer", build)
    elif phase == "logging":
        _signal_on_call(monkeypatch, MetricsLog, "add", 3, signals)
    elif phase == "save":
        _signal_on_call(monkeypatch, trainer_module, "save_checkpoint", 2, signals)  # checkpoint-4


# (phase, the step of the checkpoint left behind): signals in sampling and scoring stop before
# step 3; anywhere in its update or record, step 3 completes first; during a save, it completes.
EXPECTED_CHECKPOINT = {"rollout": 2, "reward": 2, "backward": 3, "optimizer": 3, "logging": 3, "save": 4}


@pytest.mark.trains
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_at_any_phase_resumes_exactly(phase, sig, tiny_run_config, tmp_path, monkeypatch, text_rewards, straight):
    out = tmp_path / "run"
    _arm(phase, monkeypatch, text_rewards, [sig], [])
    with pytest.raises(interrupts.Terminated if sig == signal.SIGTERM else KeyboardInterrupt):
        train(_cfg(tiny_run_config, out))
    checkpoints = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert checkpoints[-1] == EXPECTED_CHECKPOINT[phase], checkpoints
    assert [r["step"] for r in _rows(out)] == list(range(1, checkpoints[-1] + 1))  # each step recorded once
    monkeypatch.undo()
    import zlib

    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format",
                        lambda completions, **kw: [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions])
    train(_cfg(tiny_run_config, out, resume=True))
    weights, rows = straight
    resumed = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)
    assert _rows(out) == rows


@pytest.mark.trains
def test_a_second_signal_during_the_save_is_refused(tiny_run_config, tmp_path, monkeypatch, text_rewards, capsys):
    out = tmp_path / "run"
    _arm("save", monkeypatch, text_rewards, [signal.SIGINT, signal.SIGINT, signal.SIGTERM], [])
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_run_config, out))
    printed = capsys.readouterr().out
    assert "Ctrl-C: finishing first: checkpoint-4 is being written" in printed
    assert "Ctrl-C again: refused while checkpoint-4 is being written" in printed
    assert "SIGTERM again: refused" in printed
    assert (out / "checkpoint-4" / "trainer_state.pt").is_file() and not list(out.glob(".checkpoint-*"))


def test_without_the_handlers_nothing_is_deferred():
    with interrupts.deferred("anything"):  # a library user's own loop: Python's KeyboardInterrupt as usual
        pass
    previous = signal.getsignal(signal.SIGINT)
    with interrupts.handling():
        assert signal.getsignal(signal.SIGINT) is not previous
    assert signal.getsignal(signal.SIGINT) is previous
