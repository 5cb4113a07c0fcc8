"""Chaos, exceptions: an error raised once at each point of a step, then resume=true; the run must
end with the weights of a run that never failed, bit for bit, and logs that hold each step once
with the same rows.  (Signals, kills, corruption and a full disk are in test_chaos.py.)

Each fault fires once, at step 5 of 6, with checkpoints at steps 3 and 6: a checkpoint written on
the way out of step 5 is the one the resumed run continues from, so a checkpoint whose label and
contents disagree (the step applied but not counted, or counted twice) shows in the final weights.
"""

from __future__ import annotations

import errno
import json
import zlib

import pytest
import torch
from safetensors.torch import load_file

import rlvr.monitor as monitor
import rlvr.rewards as rewards
import rlvr.update as update
from rlvr.alerts import AlertMonitor
from rlvr.run import train
from rlvr.trainer import Trainer

pytestmark = [pytest.mark.chaos, pytest.mark.trains]
LOGS = ("metrics.jsonl", "completions.jsonl", "alerts.jsonl")
FAULT_STEP = 5


def _text_reward(completions, **kwargs):
    """A function of the text alone: a batch sampled again after a rewind scores the same."""
    return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]


@pytest.fixture(autouse=True)
def text_reward(monkeypatch):
    monkeypatch.setitem(rewards.REWARDS, "boxed_format", _text_reward)


def _cfg(tiny_run_config, out, **kw):
    return tiny_run_config(out, **{"max_steps": 6, "save_steps": 3, "per_device_train_batch_size": 4,
                                   "gradient_accumulation_steps": 2, "beta": 0.1, "alert_window": 2, **kw})


def _rows(out, name):
    path = out / name
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    rows = [r for r in rows if r.get("rule") != "throughput_low"]  # timed: depends on the machine's load, not the run
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k not in ("step_time", "tokens_per_second")}
            for r in rows]


def _same_weights(out, straight):
    a, b = load_file(str(out / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"


def _same_logs(out, straight):
    for name in LOGS:
        assert _rows(out, name) == _rows(straight, name), f"{name} differs"


class Once:
    """A fault that fires the first time `when(...)` holds, and never again."""

    def __init__(self, error: BaseException):
        self.error, self.fired = error, False

    def __call__(self, hit: bool) -> None:
        if hit and not self.fired:
            self.fired = True
            raise self.error


def _fail_after_optimizer_step(monkeypatch):
    fault, real = Once(RuntimeError("injected: after the optimizer step")), update.optimizer_step

    def wrapped(model, optimizer, scheduler, max_grad_norm, loss, step, *args, **kwargs):
        out = real(model, optimizer, scheduler, max_grad_norm, loss, step, *args, **kwargs)
        fault(step == FAULT_STEP)
        return out

    monkeypatch.setattr(update, "optimizer_step", wrapped)


def _fail_publishing_weights(monkeypatch):
    fault, real = Once(ConnectionError("injected: the sampler did not take the weights")), Trainer.publish_weights

    def wrapped(self):
        fault(self.step == FAULT_STEP)
        return real(self)

    monkeypatch.setattr(Trainer, "publish_weights", wrapped)


def _fail_in_the_record(monkeypatch):
    fault, real = Once(RuntimeError("injected: in the record")), AlertMonitor.update

    def wrapped(self, step, metrics, samples=None):
        fault(step == FAULT_STEP)
        return real(self, step, metrics, samples)

    monkeypatch.setattr(AlertMonitor, "update", wrapped)


def _fail_writing(name):
    def install(monkeypatch):
        fault, real = Once(OSError(errno.EIO, "injected: Input/output error")), monitor.append_rows

        def wrapped(path, rows, dump, on_error=None):
            fault(path.name == name and rows and rows[-1].get("step") == FAULT_STEP)
            return real(path, rows, dump, on_error)

        monkeypatch.setattr(monitor, "append_rows", wrapped)

    return install


def _fail_tensorboard(monkeypatch):
    fault, real = Once(OSError(errno.EIO, "injected: TensorBoard")), monitor.TensorBoardLogger.log

    def wrapped(self, line):
        fault(line["step"] == FAULT_STEP)
        return real(self, line)

    monkeypatch.setattr(monitor.TensorBoardLogger, "log", wrapped)


def _fail_a_reward_sampled_ahead(monkeypatch):
    """max_staleness=1: every batch after the first is sampled (and scored) while the step before
    it trains; the reward fails on the one sampled during step FAULT_STEP's update (its 6th call),
    a step after the last checkpoint, so a checkpoint is written on the way out."""
    fault, calls = Once(ValueError("injected: a reward of the batch sampled ahead")), []

    def reward(completions, **kwargs):
        calls.append(1)
        fault(len(calls) == FAULT_STEP + 1)
        return _text_reward(completions)

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", reward)


FAULTS = {
    "after-optimizer-step": (_fail_after_optimizer_step, {}),
    "publishing-weights": (_fail_publishing_weights, {}),
    "in-the-record": (_fail_in_the_record, {}),
    "metrics-write": (_fail_writing("metrics.jsonl"), {}),
    "completions-write": (_fail_writing("completions.jsonl"), {}),
    "tensorboard-write": (_fail_tensorboard, {"report_to": ["tensorboard"]}),
    "reward-sampled-ahead": (_fail_a_reward_sampled_ahead, {"max_staleness": 1, "gradient_accumulation_steps": 1}),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_exception_once_in_a_step_then_resume(fault, tiny_run_config, tmp_path, monkeypatch):
    install, settings = FAULTS[fault]
    straight = tmp_path / "straight"
    with monkeypatch.context() as m:
        install(m)  # the same code path, with a fault that never fires: a reward counting calls counts here too
        m.setattr(Once, "__call__", lambda self, hit: None)
        train(_cfg(tiny_run_config, straight, **settings))
    out = tmp_path / "faulted"
    install(monkeypatch)
    with pytest.raises(Exception, match="injected"):
        train(_cfg(tiny_run_config, out, **settings))
    train(_cfg(tiny_run_config, out, resume=True, **settings))
    _same_weights(out, straight)
    if fault == "tensorboard-write":  # the row that failed is written on resume, and no step twice
        assert _tensorboard_steps(out) == _tensorboard_steps(straight) == list(range(1, 7))
    if fault != "after-optimizer-step":
        _same_logs(out, straight)
        return
    # Raised inside the update, after the weights changed: the step counts, but the update's own
    # metrics (loss, grad_norm, ...) were never computed; its row holds the generation's, as they were.
    for name in ("completions.jsonl", "alerts.jsonl"):
        assert _rows(out, name) == _rows(straight, name)
    got, want = _rows(out, "metrics.jsonl"), _rows(straight, "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    for a, b in zip(got, want):
        if a["step"] == FAULT_STEP:
            assert "loss" not in a and a["reward"] == b["reward"] and a["num_tokens"] == b["num_tokens"]
        else:
            assert a == b


def _tensorboard_steps(out) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return [e.step for e in EventAccumulator(str(out / "tensorboard")).Reload().Scalars("reward")]


def test_tensorboard_holds_each_step_once_after_resume(tiny_run_config, tmp_path, monkeypatch):
    """A stop after step 5's TensorBoard row, resumed from checkpoint-3: steps 4 and 5 are logged
    again, and TensorBoard (which reads the purge marker the resumed writer leaves) shows each once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    real = Trainer.train_step

    def stop_after_step_5(self, on_step=None):
        if self.step == FAULT_STEP:
            raise KeyboardInterrupt
        return real(self, on_step)

    monkeypatch.setattr(Trainer, "train_step", stop_after_step_5)
    cfg = _cfg(tiny_run_config, out, report_to=["tensorboard"], save_steps=3)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(Trainer, "train_step", real)
    for name in ("checkpoint-5",):  # saved on the way out: remove it, so the resume replays steps 4 and 5
        import shutil

        shutil.rmtree(out / name)
    train(_cfg(tiny_run_config, out, report_to=["tensorboard"], save_steps=3, resume=True))
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    steps = [e.step for e in events.Scalars("reward")]
    assert steps == [1, 2, 3, 4, 5, 6]
    rewards_logged = {e.step: e.value for e in events.Scalars("reward")}
    rows = {r["step"]: r["reward"] for r in _rows(out, "metrics.jsonl")}
    assert rewards_logged == pytest.approx(rows)
