"""Trainer behaviour as transformers users know it: transformers' own TrainerState, every callback
event in transformers' order with the model being trained, the gradients at on_pre_optimizer_step,
transformers' PrinterCallback / ProgressCallback / EarlyStoppingCallback, load_best_model_at_end
with save_total_limit, TrainOutput's metrics and the summary row, evaluate()'s TRL names."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import EarlyStoppingCallback, PrinterCallback, ProgressCallback, TrainerCallback

from rlvr import GRPOConfig, GRPOTrainer
from rlvr.config import ConfigError, build_config
from rlvr.evaluate import trl_metrics
from rlvr.events import TrainerEvents, update_best

EVENTS = sorted(name for name in vars(TrainerCallback) if name.startswith("on_"))


class Recorder(TrainerCallback):
    """Every event, in order, with the step it came at."""

    def __init__(self):
        self.events: list[str] = []


for _name in EVENTS:
    setattr(Recorder, _name, lambda self, args, state, control, _name=_name, **kwargs: self.events.append(_name))


def spread(completions, **kwargs):
    """0, 1, 2, 3 in each group of four: every group carries signal, so every step updates."""
    return [float(i % 4) for i in range(len(completions))]


ROWS = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(4)]


def small_args(out, **settings) -> GRPOConfig:
    """2 prompts x 4 completions a step in micro-batches of 4 (gradient_accumulation_steps=2), logged,
    saved and evaluated after every step; nothing evaluated before or after training (TRL's way)."""
    return GRPOConfig(**{"output_dir": str(out), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                         "num_generations": 4, "max_completion_length": 4, "max_steps": 2, "logging_steps": 1, "save_steps": 1,
                         "eval_strategy": "steps", "eval_steps": 1, "eval_on_start": False, "eval_on_end": False,
                         "reward_isolation": "inline", "learning_rate": 1e-2, "report_to": "none", **settings})


def transformers_events(tmp_path) -> list[str]:
    """The events of transformers' own Trainer for the same schedule: 2 optimizer steps of 2
    micro-batches, one epoch, logging, evaluation and a checkpoint after each step.  (Its
    evaluation loop also fires on_prediction_step per eval batch; rlvr's evaluation samples
    without a DataLoader and has no such event.)"""
    from transformers import Trainer, TrainingArguments

    from conftest import make_tiny_model, make_tokenizer

    ids = torch.tensor([5, 6, 7, 8, 9])
    data = [{"input_ids": ids, "labels": ids} for _ in range(16)]  # 16 rows / (4 x 2) = 2 steps: one epoch
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             gradient_accumulation_steps=2, max_steps=2, logging_steps=1, eval_strategy="steps", eval_steps=1,
                             save_steps=1, use_cpu=True, report_to=[], disable_tqdm=True)
    recorder = Recorder()
    Trainer(model=make_tiny_model(len(make_tokenizer())), args=args, train_dataset=data, eval_dataset=data[:4],
            callbacks=[recorder]).train()
    return [e for e in recorder.events if e != "on_prediction_step"]


@pytest.mark.trains
def test_the_events_of_a_run_are_transformers_events_in_its_order(tiny_model_dir, tmp_path, capsys):
    """A 2-step run with gradient accumulation fires exactly what transformers' Trainer fires for
    the same schedule; PrinterCallback and ProgressCallback run on the way."""
    recorder = Recorder()
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=spread, args=small_args(tmp_path / "run"),
                          train_dataset=ROWS, eval_dataset=ROWS[:2], callbacks=[recorder, PrinterCallback, ProgressCallback()])
    trainer.train()
    printed = capsys.readouterr().out  # PrinterCallback prints each log as a dict (floats as %.4g strings)
    step = ["on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end",
            "on_log", "on_log", "on_evaluate", "on_save"]  # the logged row, then the evaluation's, then the checkpoint
    expected = ["on_init_end", "on_train_begin", "on_epoch_begin", *step, *step, "on_epoch_end", "on_log", "on_train_end"]
    assert recorder.events == expected
    assert transformers_events(tmp_path) == expected
    assert "'eval_reward'" in printed and "'train_runtime'" in printed and "'loss'" in printed
    state = trainer.state
    assert (state.global_step, state.max_steps, state.num_train_epochs, state.epoch) == (2, 2, 1, 1.0)
    assert (state.logging_steps, state.eval_steps, state.save_steps, state.train_batch_size) == (1, 1, 1, 4)
    assert state.is_world_process_zero and state.is_local_process_zero and not state.is_hyper_param_search
    assert state.total_flos > 0 and state.stateful_callbacks["TrainerControl"]["args"]["should_training_stop"] is True
    state.save_to_json(tmp_path / "trainer_state.json")  # transformers' own format, and back
    assert type(state).load_from_json(tmp_path / "trainer_state.json").log_history == state.log_history


@pytest.mark.trains
def test_the_gradients_at_on_pre_optimizer_step_are_the_clipped_ones_the_optimizer_applies(tiny_model_dir, tmp_path):
    """kwargs["model"] is the model being trained (a loaded model: the object given); its .grad at
    on_pre_optimizer_step are clipped to max_grad_norm, and the first AdamW step applies exactly them:
    each weight moves by -lr * (weight_decay * w + g / (|g| + eps))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    class Grads(TrainerCallback):
        seen: list = []

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            self.seen.append(model)
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            self.before = {n: p.detach().clone() for n, p in model.named_parameters()}
            self.lr, self.groups = lr_scheduler.get_last_lr()[0], optimizer.param_groups

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0:  # the first step: AdamW's moments are the gradient itself
                self.moved = {n: p.detach() - self.before[n] for n, p in model.named_parameters()}

    grads = Grads()
    args = small_args(tmp_path / "run", max_steps=1, max_grad_norm=0.01, eval_strategy="no", weight_decay=0.1)
    trainer = GRPOTrainer(model=model, reward_funcs=spread, args=args, train_dataset=ROWS, callbacks=[grads])
    trainer.train()
    assert grads.seen == [model]
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.grads.values()])).item()
    assert trainer.state.log_history[0]["grad_norm"] > 0.01 and norm == pytest.approx(0.01, rel=1e-4)  # clipped
    decay = {id(p): group["weight_decay"] for group in grads.groups for p in group["params"]}
    eps = grads.groups[0]["eps"]
    for name, p in model.named_parameters():
        g, w = grads.grads[name], grads.before[name]
        expected = -grads.lr * (decay[id(p)] * w + g / (g.abs() + eps))
        torch.testing.assert_close(grads.moved[name], expected, rtol=1e-3, atol=1e-7)


def constant(completions, **kwargs):
    return [0.5] * len(completions)


@pytest.mark.trains
def test_early_stopping_ends_a_run_whose_metric_does_not_improve(tiny_model_dir, tmp_path):
    """A constant reward never improves eval_reward: with patience 1, transformers' EarlyStoppingCallback
    stops the run after the second evaluation (step 2 of 4), which is saved; the best is step 1's."""
    args = small_args(tmp_path / "run", max_steps=4, metric_for_best_model="reward", load_best_model_at_end=True)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=constant, args=args, train_dataset=ROWS,
                          eval_dataset=ROWS[:2], callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
    out = trainer.train()
    assert out.global_step == 2 and trainer.state.global_step == 2
    assert trainer.state.best_metric == 0.5 and trainer.state.best_global_step == 1
    assert trainer.state.best_model_checkpoint == str(tmp_path / "run" / "checkpoint-1")
    assert [r["eval_reward"] for r in trainer.state.log_history if "eval_reward" in r] == [0.5, 0.5]


@pytest.mark.trains
def test_the_best_checkpoint_survives_save_total_limit_1_and_is_the_final_model(tiny_model_dir, tmp_path):
    """eval_reward is 1 at the first evaluation and 0 after: checkpoint-1 is the best, kept beside
    the newest while training (transformers' rotation), the only one left at the end, and the final
    model is its weights, not those of the last step."""
    from safetensors.torch import load_file

    evaluations = []

    def first_best(completions, **kwargs):
        if len(completions) == 2:  # an evaluation: 2 problems, greedy
            evaluations.append(1)
            return [1.0 if len(evaluations) == 1 else 0.0] * 2
        return spread(completions)

    class Watch(TrainerCallback):
        on_disk, last = [], None

        def on_save(self, args, state, control, **kwargs):
            self.on_disk.append(sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.last = {n: p.detach().clone() for n, p in model.named_parameters()}

    watch = Watch()
    args = small_args(tmp_path / "run", max_steps=3, save_total_limit=1, metric_for_best_model="eval_reward",
                      load_best_model_at_end=True)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=first_best, args=args, train_dataset=ROWS,
                          eval_dataset=ROWS[:2], callbacks=[watch])
    out = trainer.train()
    assert watch.on_disk == [["checkpoint-1"], ["checkpoint-1", "checkpoint-2"], ["checkpoint-1", "checkpoint-3"]]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "run" / "checkpoint-1") and trainer.state.best_metric == 1.0
    best, final = load_file(tmp_path / "run" / "checkpoint-1" / "model.safetensors"), load_file(tmp_path / "run" / "model.safetensors")
    assert best.keys() == final.keys() and all(torch.equal(best[k], final[k]) for k in best)
    live = dict(trainer.model.named_parameters())
    assert all(torch.equal(live[k].detach(), best[k]) for k in best if k in live)  # trainer.model is the best one too
    assert any(not torch.equal(watch.last[k], best[k]) for k in best if k in live)  # and not the last step's weights
    # TrainOutput and the summary row, as transformers' Trainer gives them
    keys = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss", "epoch"}
    assert set(out.metrics) == keys and out.training_loss == out.metrics["train_loss"] and out.global_step == 3
    assert trainer.state.log_history[-1] == {**out.metrics, "step": 3}
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 3 and out.training_loss == pytest.approx(sum(losses) / 3)
    assert out.metrics["train_steps_per_second"] == pytest.approx(3 / out.metrics["train_runtime"], rel=0.01)
    assert out.metrics["train_samples_per_second"] == pytest.approx(8 * 3 / out.metrics["train_runtime"], rel=0.01)


def test_evaluate_reports_trls_metrics_beside_rlvrs(tiny_model_dir, tmp_path):
    """Two problems, one greedy completion each, two reward functions with known outputs (from columns)."""
    def first(completions, score1, **kwargs):
        return score1

    def second(completions, score2, **kwargs):
        return score2

    rows = [{"prompt": "1+1=", "answer": "2", "score1": 1.0, "score2": 2.0}, {"prompt": "2+2=", "answer": "4", "score1": 0.0, "score2": 4.0}]
    events = Recorder()
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[first, second], train_dataset=rows, eval_dataset=rows,
                          args=small_args(tmp_path / "run"), callbacks=[events])
    metrics = trainer.evaluate()
    assert metrics["eval_rewards/first/mean"] == 0.5 and metrics["eval_rewards/first/std"] == pytest.approx(math.sqrt(0.5))
    assert metrics["eval_rewards/second/mean"] == 3.0 and metrics["eval_rewards/second/std"] == pytest.approx(math.sqrt(2))
    assert metrics["eval_reward"] == 3.5 and metrics["eval_reward_std"] == pytest.approx(math.sqrt(0.5))  # 1+2, 0+4
    assert metrics["eval_completions/mean_length"] == metrics["eval_mean_completion_length"]
    assert metrics["eval_completions/min_length"] <= metrics["eval_completions/mean_length"] <= metrics["eval_completions/max_length"]
    assert metrics["eval_completions/clipped_ratio"] == metrics["eval_truncated_fraction"]
    assert {"eval_accuracy", "eval_pass@1", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"} <= set(metrics)
    assert trainer.state.log_history == [{**metrics, "step": 0}] and events.events == ["on_init_end", "on_log", "on_evaluate"]


def test_trl_metrics_by_hand():
    """4 completions of 2 problems (k = 2); None: the function did not score it."""
    out = trl_metrics({"a": [1.0, None, 0.0, 1.0], "b": [None, None, 2.0, 0.0]}, [1.0, 0.5], [3, 5, 5, 2],
                      [False, True, True, False], k=2)
    # weighted sums: 1 (b None), unscorable, 0 + 0.5 x 2 = 1, 1 + 0 = 1
    assert out["reward"] == 1.0 and out["reward_std"] == 0.0
    assert out["rewards/a/mean"] == pytest.approx(2 / 3) and out["rewards/a/std"] == pytest.approx(math.sqrt(1 / 3))
    assert out["rewards/b/mean"] == 1.0 and out["rewards/b/std"] == pytest.approx(math.sqrt(2))
    assert out["frac_reward_zero_std"] == 0.5  # problem 1 has one scored completion (no spread counted), problem 2 two equal
    assert (out["completions/mean_length"], out["completions/min_length"], out["completions/max_length"]) == (3.75, 2, 5)
    assert out["completions/clipped_ratio"] == 0.5 and out["completions/mean_terminated_length"] == 2.5
    assert (out["completions/min_terminated_length"], out["completions/max_terminated_length"]) == (2, 3)
    one = trl_metrics({"a": [1.0]}, [1.0], [4], [True], k=1)
    assert "frac_reward_zero_std" not in one and math.isnan(one["reward_std"]) and one["completions/mean_terminated_length"] == 0


def test_callbacks_are_added_and_removed_by_class_or_instance_and_flags_reset_as_transformers():
    printer = PrinterCallback()
    events = TrainerEvents([Recorder, printer])
    assert events.callback_list == "Recorder\nPrinterCallback"
    assert events.pop(Recorder).__class__ is Recorder and events.pop(Recorder) is None
    events.add(EarlyStoppingCallback)
    events.remove(printer)
    with pytest.raises(ValueError):
        events.remove(printer)
    events.remove(EarlyStoppingCallback)
    assert events.callbacks == []

    class Replaces(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            new = type(control)()
            new.should_save = True
            return new

    events.add(Replaces)
    events.control.should_log = events.control.should_save = True
    events.fire("on_step_begin")  # clears should_log, should_evaluate, should_save
    assert not (events.control.should_log or events.control.should_save)
    events.fire("on_step_end")
    assert events.control.should_save  # a returned TrainerControl replaces the run's


def test_the_best_metric_is_transformers():
    from transformers import TrainerState

    state = TrainerState(global_step=1)
    assert update_best(state, {"eval_reward": 0.5}, "reward", True, saves=True) and state.best_global_step == 1
    state.global_step = 2
    assert not update_best(state, {"eval_reward": 0.5}, "eval_reward", True, saves=True)  # equal is not better
    assert update_best(state, {"eval_reward": 0.7}, "reward", True, saves=False) and state.best_global_step == 1
    state = TrainerState()
    assert update_best(state, {"eval_loss": 2.0}, "loss", False, saves=True) and state.best_metric == 2.0
    with pytest.raises(KeyError, match="has no 'eval_accuracy'; it has eval_loss"):
        update_best(state, {"eval_loss": 2.0}, "accuracy", True, saves=True)


def test_best_model_settings_are_checked_before_anything_loads():
    assert build_config({"metric_for_best_model": "reward"}).greater_is_better is True  # transformers' default
    assert build_config({"metric_for_best_model": "reward_std", "greater_is_better": False}).greater_is_better is False
    with pytest.raises(ConfigError, match="computes no eval_loss"):
        build_config({"load_best_model_at_end": True, "eval_strategy": "steps"})  # metric: transformers' default, loss
    with pytest.raises(ConfigError, match="save and eval strategies to match"):
        build_config({"load_best_model_at_end": True, "metric_for_best_model": "reward"})
    with pytest.raises(ConfigError, match="save_steps to be a multiple of eval_steps"):
        build_config({"load_best_model_at_end": True, "metric_for_best_model": "reward", "eval_strategy": "steps",
                      "eval_steps": 3, "save_steps": 10})
    with pytest.raises(ConfigError, match="not a metric rlvr's evaluation reports"):
        build_config({"metric_for_best_model": "bleu"})
    assert build_config({"metric_for_best_model": "eval_rewards/my_reward/mean"}).metric_for_best_model


def test_the_metric_names_the_settings_accept_are_those_an_evaluation_reports():
    from rlvr.config.run import EVAL_METRICS
    from rlvr.evaluate import EvalResult

    result = EvalResult(accuracy=1.0, n=2, mean_completion_length=3.0, truncated_fraction=0.0, num_samples=2, seconds=1.0,
                        trl=trl_metrics({"a": [1.0, 0.0, 1.0, 1.0]}, [1.0], [3, 3, 3, 3], [False] * 4, k=2))
    assert set(EVAL_METRICS) <= set(result.logged())


def test_rotation_keeps_the_newest_and_the_best(tmp_path):
    from rlvr.checkpoint import _rotate

    for step in (1, 2, 3, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    _rotate(tmp_path, 2, keep=tmp_path / "checkpoint-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-4"]
    _rotate(tmp_path, 1, keep=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


@pytest.mark.trains
def test_sft_fires_the_same_step_events(tiny_model_dir, tmp_path):
    """SFT's step (finetune/trainer.py) has the same points: 2 micro-batches of 2 examples a step."""
    from rlvr import SFTConfig, SFTTrainer

    recorder = Recorder()
    rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(8)]
    args = SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                     logging_steps=1, save_steps=1, report_to="none")
    SFTTrainer(model=str(tiny_model_dir), train_dataset=rows, args=args, callbacks=[recorder]).train()
    step = ["on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_save"]
    assert recorder.events == ["on_init_end", "on_train_begin", "on_epoch_begin", *step, *step, "on_epoch_end", "on_log",
                               "on_train_end"]


TWO_RANKS = '''
import json, os, sys
from transformers import TrainerCallback
from rlvr import GRPOConfig, GRPOTrainer

class Recorder(TrainerCallback):
    def __init__(self):
        self.events, self.zero, self.evaluations = [], None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append("on_train_begin")
        self.zero = state.is_world_process_zero

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append("on_evaluate")
        self.evaluations.append(metrics["eval_reward"])

for name in [n for n in vars(TrainerCallback) if n.startswith("on_") and n not in ("on_train_begin", "on_evaluate")]:
    setattr(Recorder, name, lambda self, args, state, control, _name=name, **kwargs: self.events.append(_name))

def distinct(completions, **kwargs):
    return [len(set(c)) / 4 for c in completions]

recorder = Recorder()
rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)]
args = GRPOConfig(output_dir=sys.argv[2], num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                  max_completion_length=4, max_steps=2, logging_steps=1, save_steps=1, eval_strategy="steps", eval_steps=1,
                  eval_on_start=False, eval_on_end=False, use_cpu=True, reward_isolation="inline", report_to="none")
trainer = GRPOTrainer(model=sys.argv[1], reward_funcs=distinct, args=args, train_dataset=rows, eval_dataset=rows[:2],
                      callbacks=[recorder])
trainer.train()
with open(os.path.join(sys.argv[3], f"events-{os.environ['RANK']}.json"), "w") as f:
    json.dump({"events": recorder.events, "zero": recorder.zero, "evaluations": recorder.evaluations,
               "history": trainer.state.log_history}, f)
'''


@pytest.mark.trains
@pytest.mark.processes
def test_every_process_fires_every_event_and_only_rank_0_is_process_zero(tiny_model_dir, tmp_path):
    """Two gloo processes (started as torchrun starts them: conftest.launch_ranks): both ranks fire the
    same events, the evaluations (run on rank 0) reach both with the same metrics, and
    state.is_world_process_zero is rank 0's alone."""
    import json

    from conftest import launch_ranks

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    out = launch_ranks([str(script), str(tiny_model_dir), str(tmp_path / "run"), str(tmp_path)], 2, 240, env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"events-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["events"] == ranks[1]["events"] and ranks[0]["events"].count("on_evaluate") == 2
    assert ranks[0]["events"].count("on_pre_optimizer_step") == 2 and ranks[0]["events"].count("on_save") == 2
    assert (ranks[0]["zero"], ranks[1]["zero"]) == (True, False)
    assert ranks[0]["evaluations"] == ranks[1]["evaluations"] and ranks[0]["history"][:-1] == ranks[1]["history"][:-1]
    timed = ("train_runtime", "train_samples_per_second", "train_steps_per_second")  # each process's own clock
    assert [{k: v for k, v in r["history"][-1].items() if k not in timed} for r in ranks] == \
        [{k: v for k, v in ranks[0]["history"][-1].items() if k not in timed}] * 2


@pytest.mark.trains
def test_a_resumed_run_goes_on_with_the_state_its_checkpoint_kept(tiny_model_dir, tmp_path):
    """log_history, the best metric and its checkpoint, and total_flos come back with the checkpoint."""
    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = (state.global_step, state.best_metric, state.best_global_step, state.best_model_checkpoint,
                          [r["step"] for r in state.log_history], state.total_flos)

    def half_in_evaluation(completions, **kwargs):  # 2 completions: an evaluation; else training, with signal
        return [0.5] * 2 if len(completions) == 2 else spread(completions)

    def make(callbacks):
        args = small_args(tmp_path / "run", max_steps=3, metric_for_best_model="reward")
        return GRPOTrainer(model=str(tiny_model_dir), reward_funcs=half_in_evaluation, args=args, train_dataset=ROWS,
                           eval_dataset=ROWS[:2], callbacks=callbacks)

    first = make([StopAtTwo()])
    first.train()
    flos = first.state.total_flos
    assert flos > 0 and first.state.global_step == 2
    seen = Seen()
    make([seen]).train(resume_from_checkpoint=True)
    assert seen.begin == (2, 0.5, 1, str(tmp_path / "run" / "checkpoint-1"), [1, 1, 2, 2], flos)


def test_a_run_without_callbacks_keeps_its_state_without_importing_transformers_trainer():
    """The command line's runs have no callbacks: their state is rlvr's RunState under transformers' names,
    and transformers.trainer_callback (which imports peft, bitsandbytes and torch's compiler) stays unloaded."""
    import subprocess
    import sys

    code = ("import sys\nfrom rlvr.events import TrainerEvents\nevents = TrainerEvents()\n"
            "events.begin({'max_steps': 3, 'global_step': 0, 'epoch': 0.0}, 0, 0)\n"
            "events.step_end(1, 0.5, log=True, evaluate=False, save=True)\n"
            "events.tell({'loss': 0.5, 'eval/accuracy': 0.25}, {'step': 1, 'loss': 0.5}, True, ('accuracy', True, True))\n"
            "s = events.state\n"
            "print(s.global_step, s.epoch, s.best_metric, s.best_global_step, len(s.log_history), events.control.should_save,"
            " sorted(events.kept()), 'transformers.trainer_callback' in sys.modules, 'peft' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0.5", "0.25", "1", "2", "True", "['best_global_step',", "'best_metric',", "'log_history',",
                                  "'num_input_tokens_seen',", "'total_flos']", "False", "False"]
