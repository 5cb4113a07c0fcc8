"""The loop around a trainer's steps (trainer.RunCore.train_step), the same for every method:
each step recorded (evaluation every eval_steps, alerts, the metrics row and the loggers, the
callbacks of the Python API), checkpoints when due and when the run stops, the live report; and
after the last step the final model, the evaluation after training and the summary.  run.py
assembles the run it drives."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from rlvr import distributed, interrupts, methods
from rlvr.alerts import AlertEvent
from rlvr.checkpoint import DiskFull, checkpoints, is_disk_full
from rlvr.config import Config, EvalSettings
from rlvr.evaluate import EvalResult, evaluate, write_result
from rlvr.events import TrainerEvents, best_checkpoint
from rlvr.models import latest_checkpoint
from rlvr.monitor import format_log_line, make_progress
from rlvr.rollout.path import RolloutPath, in_process_sampler
from rlvr.tasks import build_rewards, verifier_name
from rlvr.trainer import RunCore, RunData



def evaluate_run(sampler, tokenizer, examples: list, rewards, verifier: str, cfg: Config, generator=None, on_batch=None,
                 shot_pool: list | None = None) -> EvalResult:
    """evaluate() with a run's settings: its path (tools, environment or rollout_func) around
    `sampler`, `rewards` (with the verifier), its evaluation and sampling settings and its seed."""
    path = RolloutPath.of(cfg, tokenizer, sampler, rewards)
    return evaluate(path, examples, verifier, cfg.section(EvalSettings), cfg.rollout_settings, cfg.seed, generator,
                    on_batch, shot_pool)


def evaluate_model(model, tokenizer, examples: list, cfg: Config, shot_pool: list | None = None) -> EvalResult:
    """evaluate_run of a loaded model outside a run (`rlvr eval`, GRPOTrainer.evaluate): its own
    in-process sampler, the configured rewards with the verifier, the config's seed."""
    import torch

    sampler = in_process_sampler(model, tokenizer, cfg.bf16, cfg.cuda_graphs, max_batch_size=cfg.eval_batch_size)
    rewards = build_rewards(cfg.reward_settings, cfg.data_settings, with_verifier=True)
    return evaluate_run(sampler, tokenizer, examples, rewards, verifier_name(cfg.data_settings), cfg,
                        generator=torch.Generator().manual_seed(cfg.seed), shot_pool=shot_pool)

class AlertStop(RuntimeError):
    """A rule marked `stop` in on_alert started; the run was saved and stopped."""

    def __init__(self, event: AlertEvent):
        super().__init__(f"stopped by alert {event.rule} at step {event.step}: {event.message}")
        self.event = event


class Run:
    """Drives a trainer's steps (trainer.RunCore.train_step) and records each: evaluation every
    eval_steps, alerts, the metrics row and the loggers, transformers' callback events (events.py);
    saves checkpoints when due, and when the run stops; and, after the last step, the final model
    (the best checkpoint's with load_best_model_at_end), the evaluation after training and the summary."""

    def __init__(self, cfg: Config, method: methods.Method, trainer: RunCore, data: RunData, model_path, console, say,
                 loggers: list, callbacks: TrainerEvents | None = None):
        self.cfg, self.method, self.trainer, self.data, self.model_path = cfg, method, trainer, data, model_path
        self.console, self.say, self.loggers = console, say, loggers
        self.callbacks = callbacks if callbacks is not None else TrainerEvents()  # the Python API's, or none
        trainer.events = self.callbacks  # the events inside a step (update.py)
        self.callbacks.bind(trainer.model, trainer.tokenizer, trainer.optimizer, trainer.scheduler)
        self.world, self.output_dir = trainer.world, trainer.output_dir
        self.verifier = verifier_name(cfg.data_settings)
        self.scorer = build_rewards(cfg.reward_settings, cfg.data_settings, with_verifier=True)
        self.report = LiveReport(self.output_dir, console)
        self.events: list = []  # the alerts that started or cleared at the last step
        self.stop_asked: list = []  # a callback's control.should_training_stop, or max_train_seconds
        self.progress = self.bar = None
        self.epoch_begins = True  # on_epoch_begin is due before the next step

    def held_out(self, label: str | None = None, out=None) -> EvalResult:
        out, trainer, test_examples = out or self.console, self.trainer, self.data.test_examples
        if label:
            out.print(f"held-out evaluation ({label}, {len(test_examples)} problems)...")
        result = evaluate_run(trainer.rollout.sampler, trainer.tokenizer, test_examples, self.scorer, self.verifier, self.cfg,
                              shot_pool=self.data.train_examples)
        if label:
            write_result(result, self.output_dir / f"eval_{label}.json", {"model": str(self.model_path), "step": trainer.step})
        out.print(f"  {'' if label else f'step {trainer.step}: '}held-out accuracy {result.accuracy:.1%}  "
                  f"mean length {result.mean_completion_length:.1f} tokens")
        return result

    def seconds(self) -> float:
        """Training time over every run of this directory, evaluation before training left out."""
        return self.seconds_before + time.perf_counter() - self.started

    def train(self) -> None:
        cfg, trainer = self.cfg, self.trainer
        self.started, self.seconds_before = time.perf_counter(), trainer.extra_state.get("train_seconds", 0.0)
        self.saved_step = self.first_step = trainer.step
        trainer.extra_state.pop("stopped_by", None)  # a resumed run may go on past an earlier budget
        trainer.log.on_error = trainer.alerts.on_error = _log_write_failed(cfg.on_save_error, self.say)
        for logger in self.loggers:  # from the first step this run records (TensorBoard drops later ones written before)
            logger.start(trainer.unrecorded["step"] if trainer.unrecorded else trainer.step + 1)
        self.callbacks.begin(self._schedule(), self.world.rank, self.world.local_rank, trainer.extra_state.get("trainer_state"))
        self._note_best()  # a resumed run's best checkpoint, if it is still there
        try:
            self.callbacks.fire("on_train_begin")
            if cfg.eval_on_start and "eval_before" not in trainer.extra_state:
                with trainer.whole_weights():  # every rank gathers (fsdp), rank 0 evaluates
                    if self.world.is_main:
                        before = self.held_out("before")
                        trainer.extra_state["eval_before"] = _brief(before)
                        self.callbacks.evaluated(_prefixed(before))
                self.started = time.perf_counter()  # the evaluation before training is not training time
            with interrupts.handling(self.say), make_progress(self.console) as self.progress:
                self.bar = self.progress.add_task("train", total=trainer.total_steps, completed=trainer.step,
                                                  shown=f"{self.method.progress} -")
                trainer.finish_record(self.record)  # a step the stopped run counted but did not finish recording
                while trainer.step < trainer.total_steps and not self.stop_asked:
                    self._step()
                if not self.epoch_begins:  # the pass over the prompts the run ends in (transformers ends it too)
                    self._end_epoch()
        except BaseException as e:
            self._stopped(e)
            raise
        finally:
            for logger in self.loggers:
                logger.close()
            trainer.close()  # the rollout workers, if any

    def _schedule(self) -> dict:
        """The TrainerState of this train() call, as transformers fills it at its start."""
        cfg, trainer = self.cfg, self.trainer
        return {"max_steps": trainer.total_steps, "num_train_epochs": math.ceil(trainer.total_steps / max(trainer.steps_per_epoch, 1)),
                "logging_steps": cfg.logging_steps, "eval_steps": cfg.eval_steps or cfg.logging_steps, "save_steps": cfg.save_steps,
                "train_batch_size": cfg.per_device_train_batch_size, "global_step": trainer.step, "epoch": trainer.prompts.epochs_done}

    def _step(self) -> None:
        """One step, then what is due after it: the time budget, a checkpoint, the end of a pass over
        the prompts, the report, a stop by an alert."""
        cfg, trainer = self.cfg, self.trainer
        epochs = trainer.prompts.epochs_completed
        if self.epoch_begins:
            self.callbacks.fire("on_epoch_begin")
            self.epoch_begins = False
        trainer.train_step(on_step=self.record)
        if cfg.max_train_seconds and self.seconds() >= cfg.max_train_seconds:
            self.console.print(f"max_train_seconds={cfg.max_train_seconds:g} reached at step {trainer.step}")
            trainer.extra_state["stopped_by"] = "max_train_seconds"
            self.stop_asked.append(trainer.step)
        if self.stop_asked or self.callbacks.control.should_save:  # the schedule's (record) or a callback's
            self._checkpoint()
        if trainer.prompts.epochs_completed > epochs:
            self._end_epoch()
        if cfg.report_steps and trainer.step % cfg.report_steps == 0 and self.world.is_main:
            self.report.refresh()
        fatal = [e for e in self.events if e.event == "start" and e.severity == "stop"]
        if fatal:
            raise AlertStop(fatal[0])

    def _end_epoch(self) -> None:
        """on_epoch_end, after the step whose generation completed a pass over the train prompts (with
        max_staleness=1 the next generation is sampled during the step, so one generation early) and
        when the run ends; with save_strategy=epoch a checkpoint then, as transformers' DefaultFlowCallback asks."""
        control = self.callbacks.control
        control.should_save = control.should_save or self.cfg.save_strategy == "epoch"
        self.callbacks.fire("on_epoch_end")
        if control.should_save and self.saved_step != self.trainer.step:
            self._checkpoint()
        self.epoch_begins = True
        if self.callbacks.control.should_training_stop and self.trainer.step < self.trainer.total_steps:
            self.stop_asked.append(self.trainer.step)

    def record(self, metrics: dict) -> None:
        """The step's record, with the step itself (trainer.StepRecord): on_step_end, the evaluation
        when due, alerts, the metrics row, the loggers; then on_log and on_evaluate (_tell)."""
        cfg, trainer, world, progress = self.cfg, self.trainer, self.world, self.progress
        step, total = trainer.step, trainer.total_steps
        evaluates = cfg.eval_strategy == "steps" and (step % (cfg.eval_steps or cfg.logging_steps) == 0 or step == total)
        self.callbacks.step_end(step, metrics.get("epoch"), log=step % cfg.logging_steps == 0 or step == total,
                                evaluate=evaluates, save=checkpoint_due(cfg, step, total))
        if self.callbacks.control.should_evaluate and self.data.test_examples:
            with trainer.whole_weights():  # every rank gathers (fsdp), rank 0 evaluates
                if world.is_main:
                    metrics.update({f"eval/{k}": v for k, v in self.held_out(out=progress.console).logged().items()})
        if world.enabled:  # rank 0's metrics (with its evaluation), so every rank's alerts agree
            main_metrics = dict(distributed.broadcast(metrics, world))  # rank 0 gets its own dict back
            metrics.clear()
            metrics.update(main_metrics)
        self.events[:] = trainer.alerts.update(step, metrics, trainer.last_samples)
        force = step == total or self.callbacks.control.should_log
        line = trainer.log.add(step, metrics, force=force) if world.is_main else None
        shown = f"reward {metrics['reward']:.3f}" if "reward" in metrics else f"loss {metrics.get('loss', math.nan):.4f}"
        progress.update(self.bar, completed=step, shown=shown)
        if line:
            progress.console.print(format_log_line(line, total))
            for logger in self.loggers:
                logger.log(line)
        for event in self.events:
            progress.console.print(f"[{'red' if event.event == 'start' else 'green'}]{event.format()}[/]")
        best = (cfg.metric_for_best_model, cfg.greater_is_better, cfg.save_strategy != "no")
        self.callbacks.tell(metrics, distributed.broadcast(line, world) if world.enabled else line, step > self.first_step, best)
        if self.callbacks.control.should_training_stop and step < total:  # a callback's; the last step ends the run anyway
            self.stop_asked.append(step)

    def save(self, collective: bool = True) -> Path | None:  # every rank calls it; rank 0 writes
        state = self.callbacks.state
        self.trainer.extra_state["train_seconds"] = self.seconds()
        self.trainer.extra_state["trainer_state"] = self.callbacks.kept()
        best = self.output_dir / f"checkpoint-{state.best_global_step}" if state.best_global_step else None
        return self.trainer.save(collective, keep=best)  # save_total_limit never removes the best checkpoint

    def _checkpoint(self) -> None:
        """A checkpoint now, then on_save; with on_save_error=continue, a full disk is said and training goes on."""
        with interrupts.deferred(f"checkpoint-{self.trainer.step} is being written"):
            try:
                path = self.save()
                self.saved_step = self.trainer.step
                self._note_best()
                if path is not None or not (self.world.is_main or self.trainer.poisoned):
                    self.callbacks.fire("on_save")
            except DiskFull as e:
                if self.cfg.on_save_error == "stop":
                    raise
                self.say(f"{e}; training goes on without it (on_save_error=continue)")

    def _note_best(self) -> None:
        """state.best_model_checkpoint: the best step's checkpoint once it is saved (transformers' rule)."""
        best = best_checkpoint(self.callbacks.state, self.output_dir)
        if best is not None:
            self.callbacks.state.best_model_checkpoint = str(best)

    def _stopped(self, e: BaseException) -> None:
        """The run stops on `e`: the steps since the last checkpoint are saved, and how to continue said."""
        step, output_dir = self.trainer.step, self.output_dir
        if step > self.saved_step and not isinstance(e, DiskFull):
            path = None
            with interrupts.handling(self.say), interrupts.deferred(f"checkpoint-{step} is being written"):
                try:
                    path = self.save(collective=False)  # the other ranks may not be here: no collective
                except (DiskFull, OSError) as failed:  # reported; the error that stopped the run is the one raised
                    self.say(f"could not save checkpoint-{step}: {failed}; the last checkpoint stays")
            how = "SIGTERM" if isinstance(e, interrupts.Terminated) else "stopped"
            if path is not None:
                self.console.print(f"[red]{how} at step {step}[/]; saved {path}. Continue with: rlvr train resume=true output_dir={output_dir}")
        elif isinstance(e, AlertStop):
            self.console.print(f"[red]stopped at step {step}[/]: checkpoint {latest_checkpoint(output_dir)}")
        if self.world.is_main:
            self.report.refresh()

    def finish(self, objects=None) -> dict:
        """The final model (with load_best_model_at_end the best checkpoint's), the evaluation after
        training, summary.json and the report, the summary row (on_log) and on_train_end; pushed to
        the Hub if asked.  The summary's train_metrics are transformers' TrainOutput metrics."""
        cfg, trainer, console = self.cfg, self.trainer, self.console
        train_seconds, runtime = self.seconds(), time.perf_counter() - self.started
        if cfg.load_best_model_at_end:
            self._load_best()
        summary = {"output_dir": str(self.output_dir), "steps": trainer.step, "train_seconds": round(train_seconds, 1)}
        if objects is not None:  # the trained model handed back whole (with fsdp: gathered, and kept so)
            trainer.hold_whole_weights()
            objects.model, objects.tokenizer = trainer.full_model, trainer.tokenizer
        trainer.save_final(self.output_dir, cfg.lora_save)  # every rank (fsdp: streamed from the shards), rank 0 writes
        after = None
        if cfg.eval_on_end:  # rlvr's own (TRL has none): no event, no log_history row
            with trainer.whole_weights():  # every rank gathers (fsdp), rank 0 evaluates
                after = self.held_out("after") if self.world.is_main else None
        if self.world.is_main:
            summary.update({
                "device": self.world.device,
                **({"stopped_by": trainer.extra_state["stopped_by"]} if "stopped_by" in trainer.extra_state else {}),
                "eval_before": trainer.extra_state.get("eval_before"),
                "eval_after": _brief(after) if after is not None else None,
            })
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.report.refresh()
            print_summary(console, summary)
        steps = trainer.step - self.first_step  # samples: completions (sft, dpo: units) of every process
        samples = steps * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * self.world.world_size
        summary["train_metrics"] = self.callbacks.train_metrics(runtime, steps, samples)
        self.callbacks.log(summary["train_metrics"])  # TRL's last log_history row
        self.callbacks.fire("on_train_end")
        if cfg.push_to_hub and self.world.is_main:  # last, so the repository gets the evaluations, summary and report too
            from rlvr.hub import push

            console.print(f"pushing {self.output_dir} (without its checkpoints) to the Hugging Face Hub...")
            summary["hub_url"] = push(cfg.run_settings, self.output_dir)  # HubPushError: the run stays whole on disk
            console.print(f"pushed to {summary['hub_url']}")
        return summary

    def _load_best(self) -> None:
        """load_best_model_at_end: the best checkpoint's weights into the model, on every process; with
        save_total_limit=1 the other checkpoints are removed then, as transformers does."""
        state, trainer = self.callbacks.state, self.trainer
        best = best_checkpoint(state, self.output_dir)
        if best is None:
            return
        self.console.print(f"load_best_model_at_end: the final model is {best.name} "
                           f"({self.cfg.metric_for_best_model} {state.best_metric:.4g})")
        trainer.load_checkpoint_weights(best)
        if self.cfg.save_total_limit == 1 and self.world.is_main:
            for path in checkpoints(self.output_dir):
                if path.name != best.name:
                    shutil.rmtree(path, ignore_errors=True)


def _log_write_failed(on_save_error: str, say):
    """What a failed write of metrics.jsonl, completions.jsonl or alerts.jsonl does (jsonl.append_rows):
    a full disk stops the run with one line, or with on_save_error=continue is said once while the
    rows wait in memory (and in checkpoints) for the next write; any other error is raised."""
    said = []

    def on_error(path: Path, error: OSError) -> None:
        if not is_disk_full(error):
            raise error
        message = f"disk full: could not write {path.name} in {path.parent} ({shutil.disk_usage(path.parent).free / 1e6:.1f} MB free)"
        if on_save_error == "stop":
            raise DiskFull(f"{message}. Free some space, then continue with resume=true (on_save_error=continue trains on, "
                           "keeping the rows until they can be written)") from None
        if not said:
            say(f"{message}; its rows are kept in memory and written once there is space (on_save_error=continue)")
            said.append(path)

    return on_error


def checkpoint_due(cfg: Config, step: int, total: int) -> bool:
    """Whether the schedule saves a checkpoint after `step` (TRL's save_strategy).  steps: every
    save_steps; steps and epoch: after the last step, so that resume=true with a larger max_steps can
    continue; epoch's others come at the end of each pass over the train prompts (Run._end_epoch).
    no: never (the final model is still saved, and a stopped run still saves a checkpoint)."""
    if cfg.save_strategy == "no":
        return False
    return step == total or cfg.save_strategy == "steps" and step % cfg.save_steps == 0


class LiveReport:
    """report.html and its plots, redrawn during training.  A failure to draw is reported once
    and never stops training: the report is a view of files that are already safe on disk."""

    def __init__(self, output_dir: Path, console):
        self.output_dir, self.console, self.failed = output_dir, console, False

    def refresh(self) -> None:
        try:
            from rlvr.report import write_report

            write_report(self.output_dir)
        except Exception as e:  # noqa: BLE001 - see the class docstring
            if not self.failed:
                self.console.print(f"[yellow]could not draw the report ({e.__class__.__name__}: {e}); training goes on[/]")
            self.failed = True


def _brief(result: EvalResult) -> dict:
    return {k: v for k, v in result.to_dict().items() if k != "samples"}


def _prefixed(result: EvalResult) -> dict:
    """An evaluation's metrics as transformers names them (eval_reward, eval_accuracy, ...)."""
    return {f"eval_{k}": v for k, v in result.logged().items()}


def print_summary(console, summary: dict) -> None:
    from rich.table import Table

    table = Table(title="rlvr run summary", show_header=False)
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before or after:
        n = (after or before)["n"]
        b = f"{before['accuracy']:.1%}" if before else "-"
        a = f"{after['accuracy']:.1%}" if after else "-"
        delta = f"  ({(after['accuracy'] - before['accuracy']) * 100:+.1f} points)" if before and after else ""
        table.add_row(f"held-out accuracy (n={n})", f"before {b}  ->  after {a}{delta}")
    table.add_row("steps", str(summary["steps"]))
    minutes, seconds = divmod(int(summary["train_seconds"]), 60)
    table.add_row("training wall time", f"{minutes}m {seconds:02d}s")
    table.add_row("output", summary["output_dir"])
    console.print(table)
