"""Steering a run: KL estimators, adaptive KL, KL in the reward, dynamic sampling, loggers,
and alerts that stop a run."""

import json
import math
import sys
import types

import pytest
import torch

from rlvr.config import ConfigError, build_config, validate
from rlvr.kl import AdaptiveKL, kl_estimate, sequence_kl
from rlvr.trainer import Trainer
from rlvr.types import Example, TrainerState

LN = math.log


@pytest.mark.parametrize("estimator,expected", [
    # logp = ln 0.5, ref = ln 0.25: r = ref - logp = -ln 2 = -0.693147
    ("k1", 0.693147),  # -r
    ("k2", 0.240227),  # r^2 / 2 = 0.480453 / 2
    ("k3", 0.193147),  # exp(r) - r - 1 = 0.5 + 0.693147 - 1
])
def test_kl_estimators_by_hand(estimator, expected):
    value = kl_estimate(torch.tensor(LN(0.5)), torch.tensor(LN(0.25)), estimator)
    assert value.item() == pytest.approx(expected, abs=1e-6)
    assert kl_estimate(torch.tensor(-1.3), torch.tensor(-1.3), estimator).item() == 0.0


def test_sequence_kl_sums_unmasked_tokens():
    logp = torch.tensor([[LN(0.5), LN(0.5), 0.0], [LN(0.25), 0.0, 0.0]])
    ref = torch.tensor([[LN(0.25), LN(0.5), 5.0], [LN(0.5), 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # row 0: 0.693147 + 0 (the masked 5.0 is ignored); row 1: r = ln 2 -> k1 = -0.693147
    assert sequence_kl(logp, ref, mask, "k1").tolist() == pytest.approx([0.693147, -0.693147], abs=1e-6)
    with pytest.raises(ValueError, match="kl_estimator must be one of k1, k2, k3"):
        kl_estimate(logp, ref, "k4")


def test_adaptive_kl_moves_beta_toward_the_target():
    control = AdaptiveKL(beta=0.1, target=0.05, horizon=10)
    # KL twice the target: e = clip(0.1 / 0.05 - 1) = 1 -> beta * exp(0.1) = 0.110517
    assert control.update(0.1) == pytest.approx(0.110517, abs=1e-6)
    # KL half the target: e = -0.5 -> 0.110517 * exp(-0.05) = 0.105127
    assert control.update(0.025) == pytest.approx(0.105127, abs=1e-6)
    # On target: unchanged; a huge KL is clipped to e = 1; a missing KL changes nothing.
    assert control.update(0.05) == pytest.approx(0.105127, abs=1e-6)
    assert control.update(50.0) == pytest.approx(0.105127 * math.exp(0.1), abs=1e-6)
    before = control.beta
    assert control.update(float("nan")) == before
    # Sustained high KL keeps raising beta, sustained low KL lowers it.
    rising = [control.update(0.3) for _ in range(5)]
    assert rising == sorted(rising) and rising[-1] > before
    falling = [control.update(0.0) for _ in range(5)]
    assert falling == sorted(falling, reverse=True)


def test_adaptive_kl_needs_a_starting_beta():
    with pytest.raises(ConfigError, match="kl_target .* set beta > 0"):
        validate(build_config({"kl_target": 0.05}))
    with pytest.raises(ConfigError, match="report_to: unknown logger 'tensorbored'"):
        validate(build_config({"report_to": ["tensorbored"]}))


# --- on the tiny model ---------------------------------------------------------------------


def trainer_with(tiny, tmp_path, monkeypatch, reward, examples, **kw):
    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", reward)
    model, tokenizer = tiny
    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "reward_funcs": ["boxed_format"],
                        "num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 4,
                        "learning_rate": 1e-2, **kw})
    ref = None
    if cfg.beta > 0:
        from rlvr.models import make_reference

        ref = make_reference(model, cfg.beta)
    return Trainer(cfg, model, tokenizer, examples, tmp_path, 10, ref)


def easy_or_mixed(completions, prompts, **kwargs):
    """All 1.0 for prompts starting with 'easy' (no signal), alternating 1, 0 otherwise."""
    return [1.0 if p.startswith("easy") else float(i % 2) for i, p in enumerate(prompts)]


def test_dynamic_sampling_fills_the_batch_with_informative_groups(tiny, tmp_path, monkeypatch):
    examples = [Example(f"easy {i}", "1") for i in range(6)] + [Example(f"hard {i}", "1") for i in range(2)]
    trainer = trainer_with(tiny, tmp_path, monkeypatch, easy_or_mixed, examples, dynamic_sampling=True, max_sampling_rounds=10)
    gen = trainer.generate()
    # 2 prompts per step; rounds continue until both hard prompts (the only informative ones) were drawn.
    assert len(gen.batch) == 4 and gen.batch.advantages.abs().min() > 0
    rounds = gen.metrics["sampling/rounds"]
    assert 1 <= rounds <= 3  # the 8 prompts are seen once every 4 rounds
    assert gen.metrics["sampling/dropped_groups"] == 2 * (rounds + 1) - 2
    assert gen.metrics["frac_reward_zero_std"] == pytest.approx(gen.metrics["sampling/dropped_groups"] / (2 * (rounds + 1)))
    # Without it, the easy groups are simply left out of the update.
    plain = trainer_with(tiny, tmp_path, monkeypatch, easy_or_mixed, examples)
    assert "sampling/rounds" not in plain.generate().metrics


def test_dynamic_sampling_stops_at_its_cap(tiny, tmp_path, monkeypatch):
    examples = [Example(f"easy {i}", "1") for i in range(4)]
    trainer = trainer_with(tiny, tmp_path, monkeypatch, easy_or_mixed, examples, dynamic_sampling=True, max_sampling_rounds=2)
    gen = trainer.generate()
    assert gen.metrics["sampling/rounds"] == 2 and gen.metrics["sampling/dropped_groups"] == 6
    assert len(gen.batch) == 0
    metrics = trainer.update(gen.batch)  # nothing to learn from: AdamW steps on zero gradients, as TRL's would
    assert (metrics["loss"], metrics["grad_norm"]) == (0.0, 0.0)


def test_kl_in_the_reward_lowers_each_reward_by_beta_times_its_kl(tiny, tmp_path, monkeypatch):
    examples = [Example("hard a", "1"), Example("hard b", "1")]
    trainer = trainer_with(tiny, tmp_path, monkeypatch, easy_or_mixed, examples, beta=0.5, kl_penalty="reward", kl_estimator="k1")
    with torch.no_grad():  # make the reference differ from the policy
        for p in trainer.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rnd = trainer.batches.sample_round(TrainerState())
    for group in rnd.groups:
        raw = easy_or_mixed(None, [group.example.prompt] * 2)
        kls = trainer.kl.sequence_kl(group.rollouts, trainer.rollout.pad_id, len(group.rollouts))
        assert any(abs(k) > 1e-3 for k in kls)
        assert group.rewards == pytest.approx([r - 0.5 * k for r, k in zip(raw, kls)], abs=1e-6)
        assert group.per_func["boxed_format"] == raw  # the verifier's own scores are logged unchanged
    # k1 summed over a completion = sum of (logp - ref) of its tokens, by hand for the first completion
    r = rnd.groups[0].rollouts[0]
    batch = trainer.logprobs.in_chunks(trainer.ref_model, __import__("rlvr.types", fromlist=["Batch"]).Batch.from_rollouts(
        [r], torch.zeros(1), torch.ones(1, dtype=torch.bool), trainer.rollout.pad_id, False))
    by_hand = sum(lp - ref for lp, ref in zip(r.logprobs, batch[0, : len(r.logprobs)].tolist()))
    assert rnd.groups[0].kl[0] == pytest.approx(by_hand, abs=1e-5)
    gen = trainer.generate()
    assert gen.batch.ref_logprobs is None  # no KL term in the loss
    assert gen.metrics["kl"] != 0


@pytest.mark.trains
def test_adaptive_beta_is_logged_and_rises_while_kl_exceeds_the_target(tiny, tmp_path, monkeypatch):
    examples = [Example("hard a", "1"), Example("hard b", "1")]
    trainer = trainer_with(tiny, tmp_path, monkeypatch, easy_or_mixed, examples, beta=0.1, kl_target=1e-9, kl_horizon=2,
                           learning_rate=5e-2)
    betas = [trainer.train_step()["beta"] for _ in range(4)]
    # Step 1: policy == reference, KL = 0 < target: e = -1, beta = 0.1 * exp(-1 / 2) = 0.060653.
    # Steps 2, 3: the policy has moved, KL >> 1e-9: e = 1, beta grows by exp(1 / 2) each step.
    assert betas[0] == 0.1
    assert betas[1] == pytest.approx(0.060653, abs=1e-6)
    assert betas[2] == pytest.approx(0.1, abs=1e-6)
    assert betas[3] == pytest.approx(0.1 * math.exp(0.5), abs=1e-6)
    assert trainer.state_dict()["kl"]["beta"] == trainer.kl.beta


# --- report_to -----------------------------------------------------------------------------


def run_tiny(tiny_model_dir, tmp_path, **kw):
    from rlvr.run import train

    cfg = build_config({
        "model": str(tiny_model_dir), "task_args": {"num_train": 20, "num_test": 4}, "num_generations": 2,
        "per_device_train_batch_size": 4, "max_completion_length": 4, "max_steps": 4, "logging_steps": 2,
        "eval_on_start": False, "eval_on_end": False, "report_steps": 0, "output_dir": str(tmp_path / "run"), **kw,
    })
    return train(cfg)


def test_a_missing_logger_package_is_a_clear_error_before_loading(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"report_to=wandb needs the wandb package.*pip install 'rlvr\[wandb\]'"):
        run_tiny(tiny_model_dir, tmp_path, report_to=["wandb"])


@pytest.mark.trains
def test_tensorboard_gets_every_logged_line(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_tiny(tiny_model_dir, tmp_path, report_to=["tensorboard"])
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("reward")] == [2, 4]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in events.Scalars("reward")] == pytest.approx([x["reward"] for x in lines])


@pytest.mark.trains
@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_wandb_and_trackio_receive_the_logged_lines(tiny_model_dir, tmp_path, monkeypatch, name):
    calls = []
    fake = types.ModuleType(name)

    class Run:
        def log(self, data, step=None):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    run = Run()
    fake.init = lambda **kw: calls.append(("init", kw)) or run
    fake.log, fake.finish = run.log, run.finish
    monkeypatch.setitem(sys.modules, name, fake)
    run_tiny(tiny_model_dir, tmp_path, report_to=[name])
    assert calls[0][0] == "init" and calls[0][1]["config"]["report_to"] == [name]
    assert [c[1] for c in calls if c[0] == "log"] == [2, 4]
    assert all("reward" in c[2] and "step" not in c[2] for c in calls if c[0] == "log")
    assert calls[-1] == ("finish",)


# --- alerts in a run -----------------------------------------------------------------------


@pytest.mark.trains
@pytest.mark.processes
def test_a_stop_alert_saves_and_exits_non_zero(tiny_model_dir, tmp_path, capsys):
    from rlvr.cli import main

    plugin = tmp_path / "const.py"
    plugin.write_text("def const(completions, **kw):\n    return [0.5] * len(completions)\n")
    out = tmp_path / "run"
    code = main(["train", f"model={tiny_model_dir}", "task_args.num_train=20", "num_generations=2",
                 "per_device_train_batch_size=4", "max_completion_length=4", "max_steps=20", "logging_steps=1",
                 f"reward_funcs=[{plugin}:const]", "eval_on_start=false", "eval_on_end=false", "report_steps=0",
                 "alert_window=3", "on_alert={reward_std_low: stop}", f"output_dir={out}"])
    assert code == 3
    err = capsys.readouterr().err
    assert "stopped by alert reward_std_low at step 3" in err
    alerts = [json.loads(x) for x in (out / "alerts.jsonl").read_text().splitlines()]
    alerts = [a for a in alerts if a["rule"] != "throughput_low"]  # timed: a loaded machine may add it
    assert alerts[0]["rule"] == "reward_std_low" and alerts[0]["severity"] == "stop" and alerts[0]["step"] == 3
    assert (out / "checkpoint-3").is_dir()  # nothing is lost: resume=true continues from here


@pytest.mark.trains
def test_evaluation_during_training_is_logged_with_the_step_metrics(tiny_model_dir, tmp_path):
    run_tiny(tiny_model_dir, tmp_path, eval_strategy="steps", eval_steps=2, logging_steps=1)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "eval/accuracy" in x] == [2, 4]
    assert all(0.0 <= x["eval/accuracy"] <= 1.0 and x["eval/mean_completion_length"] > 0 for x in lines if "eval/accuracy" in x)
