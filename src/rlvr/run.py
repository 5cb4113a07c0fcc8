"""The whole run around the steps: evaluation before, during and after training, metrics and
loggers, alerts, the live report, checkpoints, the final model and the summary."""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from pathlib import Path

from rlvr import distributed, fsdp, interrupts, lora
from rlvr.alerts import AlertEvent
from rlvr.checkpoint import DiskFull, is_disk_full
from rlvr.config import Config, save_config
from rlvr.evaluate import EvalResult, evaluate, write_result
from rlvr.hub import without_secrets
from rlvr.models import disable_dropout, latest_checkpoint, load_model, load_tokenizer, make_reference
from rlvr.monitor import build_loggers, format_log_line, make_console, make_progress
from rlvr.rundir import prepare_output_dir_once, save_final_model
from rlvr.runtime import slow_bf16_note
from rlvr.settings import check_runnable
from rlvr.tasks import build_rewards, load_splits, verifier_name
from rlvr.trainer import Trainer, total_steps_for


class AlertStop(RuntimeError):
    """A rule marked `stop` in on_alert started; the run was saved and stopped."""

    def __init__(self, event: AlertEvent):
        super().__init__(f"stopped by alert {event.rule} at step {event.step}: {event.message}")
        self.event = event


def train(cfg: Config, console=None, objects=None) -> dict:
    """Train as configured: before/after evaluation, checkpoints, final model. Returns the summary.
    Under torchrun / accelerate launch, each process trains on its share of the groups
    (distributed.py); only rank 0 prints, evaluates and writes files.  `objects` (api.RunObjects):
    the model, tokenizer, examples and callbacks given to GRPOTrainer as objects; the trained
    model and tokenizer are left in it."""
    world = distributed.init(use_cpu=cfg.use_cpu)
    try:
        summary = _train(cfg, console, world, objects)
        distributed.wait_for_all(world)  # rank 0 is still writing the final model when the others finish
        return summary
    finally:
        distributed.shutdown(world)


def _train(cfg: Config, console, world: distributed.World, objects=None) -> dict:
    console = console or make_console()
    if not world.is_main:
        from rich.console import Console

        console = Console(quiet=True)
    check_runnable(cfg, world)  # settings, launch and environment, before any directory is made or model loaded
    say = lambda text: console.print(f"[yellow]{text}[/]")  # noqa: E731
    cfg, output_dir, checkpoint, lock = prepare_output_dir_once(cfg, world, say=say)
    try:
        return _train_in(cfg, output_dir, checkpoint, console, say, world, objects)
    except Exception:  # an error before anything was written (a bad dataset row) leaves no directory behind;
        # an interrupted run keeps its directory, so that resume=true can start it over
        if lock is not None:
            lock.close()
            lock = None
        if world.is_main and output_dir.is_dir() and {p.name for p in output_dir.iterdir()} <= {".lock"}:
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.close()


def _train_in(cfg: Config, output_dir: Path, checkpoint: Path | None, console, say, world: distributed.World, objects=None) -> dict:
    """The run in its (locked) directory; `say` prints a warning."""
    given = objects is not None and objects.train_examples is not None
    data = None  # sft / dpo: demonstrations or preference pairs (finetune/data.py)
    if cfg.method != "grpo":
        from rlvr.finetune.data import load_data

        rows = objects.train_rows if objects is not None else None
        data, train_examples, test_examples = load_data(cfg, cfg.method, rows)
        if objects is not None and objects.test_examples is not None:
            test_examples = objects.test_examples
    else:
        train_examples, test_examples = (objects.train_examples, objects.test_examples) if given else load_splits(cfg)
    test_examples = test_examples[: cfg.eval_max_examples or None]
    loggers = build_loggers(cfg, output_dir) if world.is_main else []  # a missing logger package fails before the model loads
    given_model, given_tokenizer = (objects.model, objects.tokenizer) if objects is not None else (None, None)
    if given_model is not None:  # a loaded model given to GRPOTrainer
        model, model_path, tokenizer = given_model.to(world.device), cfg.model, None
    else:
        model, tokenizer, model_path = load_model(cfg.model, cfg.dtype, world.device, cfg.model_init_kwargs, cfg.trust_remote_code,
                                                  cfg.trust_unverified_checkpoint)
    tokenizer = given_tokenizer or tokenizer or load_tokenizer(model.name_or_path, trust_remote_code=cfg.trust_remote_code)
    callbacks = objects.callbacks if objects is not None else None
    if cfg.disable_dropout:
        disable_dropout(model)  # before LoRA: lora_dropout is the adapter's own setting
    if cfg.use_peft:
        model = lora.wrap(model, cfg, model_path)
    if cfg.gradient_checkpointing:  # on each decoder layer, for the Hugging Face forward and rlvr's own (llama.py)
        # Non-reentrant (transformers 5's default): parameters inside a checkpointed layer get their
        # gradients even when its input needs none (LoRA's frozen embeddings).
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    full_model = model
    if cfg.method != "grpo":
        from rlvr.finetune.trainer import FinetuneTrainer

        reference = make_reference(model, cfg.dpo_beta) if cfg.method == "dpo" else None
        trainer = FinetuneTrainer(cfg, model, tokenizer, data, train_examples, output_dir, reference, world)
        total = trainer.total_steps
    else:
        total = total_steps_for(cfg, len(train_examples))
        if cfg.fsdp:  # the trained model is sharded; the full copy samples, evaluates and is saved (fsdp.py)
            model = fsdp.shard(copy.deepcopy(full_model), world.device, world.world_size)
        trainer = Trainer(cfg, model, tokenizer, train_examples, output_dir, total, make_reference(full_model, cfg.beta),
                          world=world, full_model=full_model)
    if checkpoint is not None:
        trainer.resume(checkpoint)
        console.print(f"resumed from {checkpoint} at step {trainer.step}")
    if world.is_main:
        save_config(without_secrets(cfg), output_dir / "config.yaml")  # no hub_token on disk, nor on the Hub
    console.print(f"[bold]rlvr {cfg.command}[/] -> {output_dir}  model: {model_path} on {world.device}  train/test: {len(train_examples)}/{len(test_examples)}  steps: {total}")
    if (note := slow_bf16_note(cfg.bf16, world.device)) is not None:
        console.print(f"[yellow]{note}[/]")

    verifier = verifier_name(cfg)
    scorer = build_rewards(cfg, with_verifier=True)

    def held_out(label: str | None = None, out=console) -> EvalResult:
        if label:
            out.print(f"held-out evaluation ({label}, {len(test_examples)} problems)...")
        result = evaluate(trainer.rollout.sampler, tokenizer, test_examples, scorer, verifier, cfg, shot_pool=train_examples)
        if label:
            write_result(result, output_dir / f"eval_{label}.json", {"model": str(model_path), "step": trainer.step})
        out.print(f"  {'' if label else f'step {trainer.step}: '}held-out accuracy {result.accuracy:.1%}  "
                  f"mean length {result.mean_completion_length:.1f} tokens")
        return result

    if cfg.eval_on_start and "eval_before" not in trainer.extra_state and world.is_main:
        trainer.extra_state["eval_before"] = _brief(held_out("before"))
    started, seconds_before = time.perf_counter(), trainer.extra_state.get("train_seconds", 0.0)
    trainer.extra_state.pop("stopped_by", None)  # a resumed run may go on past an earlier budget
    saved_step = trainer.step
    eval_every = cfg.eval_steps or cfg.logging_steps
    report = LiveReport(output_dir, console)
    trainer.log.on_error = trainer.alerts.on_error = _log_write_failed(cfg.on_save_error, say)
    for logger in loggers:  # from the first step this run records (TensorBoard drops later ones written before)
        logger.start(trainer.unrecorded["step"] if trainer.unrecorded else trainer.step + 1)

    def save(collective: bool = True) -> Path | None:  # every rank calls it; rank 0 writes
        trainer.extra_state["train_seconds"] = seconds_before + time.perf_counter() - started
        return trainer.save(collective)

    try:
        with interrupts.handling(say), make_progress(console) as progress:
            bar = progress.add_task("train", total=total, completed=trainer.step, shown="reward -" if cfg.method == "grpo" else "loss -")
            events: list = []
            stop_asked = []  # a callback's control.should_training_stop (api.py)
            if callbacks is not None:
                callbacks.begin(trainer.step, total)

            def record(metrics: dict) -> None:  # the step's evaluation, alerts and metrics row, with the step itself
                if cfg.eval_strategy == "steps" and trainer.step % eval_every == 0 and test_examples and world.is_main:
                    result = held_out(out=progress.console)
                    metrics.update({f"eval/{k}": v for k, v in result.metrics().items()})
                if world.enabled:  # rank 0's metrics (with its evaluation), so every rank's alerts agree
                    main_metrics = dict(distributed.broadcast(metrics, world))  # rank 0 gets its own dict back
                    metrics.clear()
                    metrics.update(main_metrics)
                events[:] = trainer.alerts.update(trainer.step, metrics, trainer.last_samples)
                line = trainer.log.add(trainer.step, metrics, force=trainer.step == total) if world.is_main else None
                shown = f"reward {metrics['reward']:.3f}" if "reward" in metrics else f"loss {metrics.get('loss', math.nan):.4f}"
                progress.update(bar, completed=trainer.step, shown=shown)
                if line:
                    progress.console.print(format_log_line(line, total))
                    for logger in loggers:
                        logger.log(line)
                for event in events:
                    progress.console.print(f"[{'red' if event.event == 'start' else 'green'}]{event.format()}[/]")
                if callbacks is not None and callbacks.step_end(trainer.step, metrics.get("epoch", 0.0), line):
                    stop_asked.append(trainer.step)

            trainer.finish_record(record)  # a step the stopped run counted but did not finish recording
            while trainer.step < total and not stop_asked:
                epochs = trainer.prompts.epochs_completed
                trainer.train_step(on_step=record)
                if cfg.max_train_seconds and seconds_before + time.perf_counter() - started >= cfg.max_train_seconds:
                    console.print(f"max_train_seconds={cfg.max_train_seconds:g} reached at step {trainer.step}")
                    trainer.extra_state["stopped_by"] = "max_train_seconds"
                    stop_asked.append(trainer.step)
                if stop_asked or checkpoint_due(cfg, trainer.step, total, epoch_ended=trainer.prompts.epochs_completed > epochs):
                    with interrupts.deferred(f"checkpoint-{trainer.step} is being written"):
                        try:
                            path = save()
                            saved_step = trainer.step
                            if callbacks is not None and path is not None:
                                callbacks.saved(path)
                        except DiskFull as e:
                            if cfg.on_save_error == "stop":
                                raise
                            say(f"{e}; training goes on without it (on_save_error=continue)")
                if cfg.report_steps and trainer.step % cfg.report_steps == 0 and world.is_main:
                    report.refresh()
                fatal = [e for e in events if e.event == "start" and e.severity == "stop"]
                if fatal:
                    raise AlertStop(fatal[0])
    except BaseException as e:
        if trainer.step > saved_step and not isinstance(e, DiskFull):
            path = None
            with interrupts.handling(say), interrupts.deferred(f"checkpoint-{trainer.step} is being written"):
                try:
                    path = save(collective=False)  # the other ranks may not be here: no collective
                except (DiskFull, OSError) as failed:  # reported; the error that stopped the run is the one raised
                    say(f"could not save checkpoint-{trainer.step}: {failed}; the last checkpoint stays")
            how = "SIGTERM" if isinstance(e, interrupts.Terminated) else "stopped"
            if path is not None:
                console.print(f"[red]{how} at step {trainer.step}[/]; saved {path}. Continue with: rlvr train resume=true output_dir={output_dir}")
        elif isinstance(e, AlertStop):
            console.print(f"[red]stopped at step {trainer.step}[/]: checkpoint {latest_checkpoint(output_dir)}")
        if world.is_main:
            report.refresh()
        raise
    finally:
        for logger in loggers:
            logger.close()
        trainer.close()  # the rollout workers, if any
    train_seconds = seconds_before + time.perf_counter() - started
    if not world.is_main:
        return {"output_dir": str(output_dir), "steps": trainer.step, "train_seconds": round(train_seconds, 1)}
    save_final_model(full_model, tokenizer, output_dir, cfg.lora_save)
    if objects is not None:
        objects.model, objects.tokenizer = full_model, tokenizer
    after = _brief(held_out("after")) if cfg.eval_on_end else None
    summary = {
        "output_dir": str(output_dir),
        "steps": trainer.step,
        "train_seconds": round(train_seconds, 1),
        "device": world.device,
        **({"stopped_by": trainer.extra_state["stopped_by"]} if "stopped_by" in trainer.extra_state else {}),
        "eval_before": trainer.extra_state.get("eval_before"),
        "eval_after": after,
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report.refresh()
    print_summary(console, summary)
    if callbacks is not None:
        callbacks.end()
    if cfg.push_to_hub:  # last, so the repository gets the evaluations, summary and report too
        from rlvr.hub import push

        console.print(f"pushing {output_dir} (without its checkpoints) to the Hugging Face Hub...")
        summary["hub_url"] = push(cfg, output_dir)  # HubPushError: the run stays whole on disk
        console.print(f"pushed to {summary['hub_url']}")
    return summary


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


def checkpoint_due(cfg: Config, step: int, total: int, epoch_ended: bool) -> bool:
    """Whether a checkpoint is saved after `step` (TRL's save_strategy).  steps: every save_steps;
    epoch: after the step whose generation completed a pass over the train prompts (with
    max_staleness=1 the next generation is sampled during the step, so one generation early);
    both also after the last step, so that resume=true with a larger max_steps can continue.
    no: never (the final model is still saved, and a stopped run still saves a checkpoint)."""
    if cfg.save_strategy == "no":
        return False
    if step == total:
        return True
    return epoch_ended if cfg.save_strategy == "epoch" else step % cfg.save_steps == 0


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
