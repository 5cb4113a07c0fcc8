"""transformers' callback protocol around rlvr's loop (loop.py): transformers' own TrainerState,
filled as its Trainer fills it, its TrainerControl, and the TrainerCallback objects of the Python
API, called at every event transformers has, in its order and with its keyword arguments (model,
processing_class, optimizer, lr_scheduler, train_dataloader and eval_dataloader, which are None:
rlvr reads its prompts without a DataLoader; `logs` and `metrics` where due).

One optimizer step of G micro-batches fires what transformers 5's Trainer._run_epoch fires:

    on_step_begin, on_substep_end (G - 1 times), on_pre_optimizer_step, on_optimizer_step,
    on_step_end, then on_log (a logged step), on_log + on_evaluate (an evaluation), on_save (a checkpoint)

and around the steps: on_init_end (the Python API's trainer made), on_train_begin, on_epoch_begin
and on_epoch_end around each pass over the train prompts, on_log with the summary row, and
on_train_end.  rlvr's own schedule (logging_steps, eval_strategy, save_strategy: what transformers'
DefaultFlowCallback decides) sets the step's control flags before on_step_end, where a callback reads
them and may change them; should_training_stop ends the run after the step, which is saved.  Every
process fires every event of a step (state.is_world_process_zero on rank 0 only); the evaluation
before training (eval_on_start, as TRL's) runs on rank 0 and fires there; rlvr's evaluation after
training (eval_on_end, which TRL does not have) fires nothing and leaves no log_history row.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TrainerEvents", "update_best", "best_checkpoint", "metric_key"]

# What an event clears before the callbacks see it, as transformers' CallbackHandler does.
RESETS = {"on_train_begin": ("should_training_stop",), "on_epoch_begin": ("should_epoch_stop",),
          "on_step_begin": ("should_log", "should_evaluate", "should_save"), "on_evaluate": ("should_evaluate",),
          "on_save": ("should_save",), "on_log": ("should_log",)}

# TrainerState fields a checkpoint keeps (in its extra state), so that a resumed run goes on with them.
KEPT = ("log_history", "best_metric", "best_global_step", "total_flos", "num_input_tokens_seen")


@dataclass
class RunState:
    """A run without callbacks (the command line) keeps its state here, under the names of transformers'
    TrainerState (the fields rlvr fills, and those reward functions read as `trainer_state`): importing
    transformers.trainer_callback imports peft, bitsandbytes and torch's compiler with it, about 4 s of
    every process's start on the CI machine (2026-12-07), which such a run never uses."""

    epoch: float | None = None
    global_step: int = 0
    max_steps: int = 0
    logging_steps: float = 500
    eval_steps: float = 500
    save_steps: float = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict | None = None
    stateful_callbacks: dict = field(default_factory=dict)


@dataclass
class RunControl:
    """TrainerControl's flags, for a run without callbacks (see RunState)."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class TrainerEvents:
    """The callbacks of a run with transformers' TrainerState and TrainerControl: `fire(event)`
    calls each callback's method of that name as transformers' CallbackHandler does; `log` and
    `evaluated` are transformers' Trainer.log and the end of Trainer.evaluate.  A run without
    callbacks (the command line) keeps its state all the same, in rlvr's RunState and RunControl
    (transformers' names, without their imports): the best checkpoint is tracked there."""

    def __init__(self, callbacks=(), args=None):
        self.plain = not callbacks and args is None  # the command line's: RunState, RunControl
        if self.plain:
            TrainerControl, TrainerState = RunControl, RunState
        else:
            from transformers.trainer_callback import TrainerControl, TrainerState

        self.callbacks: list = []
        for callback in callbacks:
            self.add(callback)
        self.args = args  # the GRPOConfig (or SFTConfig, DPOConfig) the callbacks are given
        self.control = TrainerControl()  # before train(), this process's place as the launcher says (torchrun's RANK)
        self.state = TrainerState(is_world_process_zero=os.environ.get("RANK", "0") == "0",
                                  is_local_process_zero=os.environ.get("LOCAL_RANK", "0") == "0")
        self.model = self.processing_class = self.optimizer = self.lr_scheduler = None
        self.train_dataloader = self.eval_dataloader = None
        self.loss_sum = 0.0

    # --- the callbacks, by class or by instance (transformers' CallbackHandler) -------------

    def add(self, callback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop(self, callback):
        """Remove the first callback of this class (or this callback) and return it; None if there is none."""
        found = self._find(callback)
        if found is not None:
            self.callbacks.remove(found)
        return found

    def remove(self, callback) -> None:
        """Remove the first callback of this class, or this callback (a ValueError if it is not there, as in transformers)."""
        found = self._find(callback)
        if found is None and not isinstance(callback, type):
            raise ValueError(f"{callback!r} is not among the callbacks")
        if found is not None:
            self.callbacks.remove(found)

    def _find(self, callback):
        if isinstance(callback, type):
            return next((c for c in self.callbacks if isinstance(c, callback)), None)
        return next((c for c in self.callbacks if c == callback), None)

    @property
    def callback_list(self) -> str:
        return "\n".join(type(c).__name__ for c in self.callbacks)

    # --- events --------------------------------------------------------------------------------

    def fire(self, event: str, **kwargs) -> None:
        """Call `event` on every callback (one without that method is skipped); a callback that
        returns a TrainerControl replaces the run's, as in transformers."""
        for flag in RESETS.get(event, ()):
            setattr(self.control, flag, False)
        for callback in list(self.callbacks):
            method = getattr(callback, event, None)
            if method is None:
                continue
            result = method(self.args, self.state, self.control, model=self.model, processing_class=self.processing_class,
                            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                            train_dataloader=self.train_dataloader, eval_dataloader=self.eval_dataloader, **kwargs)
            if result is not None:
                self.control = result

    def log(self, logs: dict) -> None:
        """transformers' Trainer.log: `logs` gets the epoch, log_history a row of it with the step,
        and on_log the logs (one copy for all callbacks: PrinterCallback pops total_flos from it)."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.fire("on_log", logs=dict(logs))

    def evaluated(self, metrics: dict) -> None:
        """An evaluation's metrics (eval_ names): logged, then on_evaluate, as Trainer.evaluate does."""
        self.log(metrics)
        self.fire("on_evaluate", metrics=metrics)

    # --- the state of a train() call ---------------------------------------------------------

    def bind(self, model, processing_class, optimizer, lr_scheduler) -> None:
        """What the callbacks are given: the model being trained (with fsdp the sharded one, whose
        parameters hold the gradients), the tokenizer, the optimizer and its schedule."""
        self.model, self.processing_class, self.optimizer, self.lr_scheduler = model, processing_class, optimizer, lr_scheduler

    def begin(self, schedule: dict, rank: int, local_rank: int, kept: dict | None = None) -> None:
        """A new TrainerState for this train() call, as transformers makes one: `schedule` (max_steps,
        num_train_epochs, logging_steps, eval_steps, save_steps, train_batch_size, global_step,
        epoch), this process's place, and what a resumed run's checkpoint kept (`kept`, see KEPT)."""
        if self.plain:
            state = RunState(is_world_process_zero=rank == 0, is_local_process_zero=local_rank == 0)
        else:
            from transformers.trainer_callback import ExportableState, TrainerState

            stateful = [c for c in [*self.callbacks, self.control] if isinstance(c, ExportableState)]
            state = TrainerState(stateful_callbacks=stateful, is_world_process_zero=rank == 0,
                                 is_local_process_zero=local_rank == 0, is_hyper_param_search=False)
        for name, value in {**schedule, **(kept or {})}.items():
            setattr(state, name, value)
        state.log_history = list(state.log_history)
        self.state = state
        self.loss_sum = 0.0  # the losses of this call's steps, for train_loss

    def kept(self) -> dict:
        """The TrainerState fields a checkpoint keeps (KEPT); state.stateful_callbacks brought up to
        date, as transformers does when it saves (restoring them is off there by default, and here)."""
        if self.plain:
            return {name: getattr(self.state, name) for name in KEPT}
        from transformers.trainer_callback import ExportableState

        states: dict[str, list] = {}
        for callback in [*self.callbacks, self.control]:
            if isinstance(callback, ExportableState):
                states.setdefault(type(callback).__name__, []).append(callback.state())
        self.state.stateful_callbacks = {name: found[0] if len(found) == 1 else found for name, found in states.items()}
        return {name: getattr(self.state, name) for name in KEPT}

    # --- a step's record (loop.Run.record) -------------------------------------------------------

    def step_end(self, step: int, epoch: float | None, log: bool, evaluate: bool, save: bool) -> None:
        """The state after the optimizer step, the control flags the run's schedule sets (what
        transformers' DefaultFlowCallback sets, should_training_stop at max_steps included; a
        callback may have set more), then on_step_end."""
        self.state.global_step = step
        self.state.epoch = epoch if epoch is not None else self.state.epoch
        control = self.control
        control.should_log, control.should_evaluate = control.should_log or log, control.should_evaluate or evaluate
        control.should_save = control.should_save or save
        control.should_training_stop = control.should_training_stop or step >= self.state.max_steps
        self.fire("on_step_end")

    def tell(self, metrics: dict, line: dict | None, counted: bool, best: tuple | None = None) -> None:
        """A step's rows: its metrics row when one was written (`line`: on_log), its evaluation
        (metrics' eval/ keys: on_log and on_evaluate under eval_ names, then the best metric,
        transformers' order; `best`: (metric_for_best_model, greater_is_better, checkpoints are
        saved)).  `counted`: a step of this train() call, whose loss counts for train_loss."""
        loss = metrics.get("loss")
        if counted and loss is not None and math.isfinite(loss):
            self.loss_sum += loss
        self.state.total_flos += metrics.get("update_flops", 0.0)
        if line is not None:
            self.log({k: v for k, v in line.items() if k != "step" and not k.startswith("eval/")})
        evaluation = {f"eval_{k[5:]}": v for k, v in metrics.items() if k.startswith("eval/")}
        if evaluation:
            self.evaluated(evaluation)
            if best is not None and best[0]:
                update_best(self.state, evaluation, *best)

    def train_metrics(self, runtime: float, steps: int, samples: int) -> dict:
        """transformers' TrainOutput metrics of a train() call of `steps` steps and `samples` samples
        in `runtime` seconds (rounded as its speed_metrics rounds them): total_flos over the whole
        run, train_loss the mean loss of those steps."""
        metrics = {"train_runtime": round(runtime, 4)}
        if runtime > 0:
            metrics.update(train_samples_per_second=round(samples / runtime, 3), train_steps_per_second=round(steps / runtime, 3))
        return {**metrics, "total_flos": self.state.total_flos, "train_loss": self.loss_sum / max(steps, 0.001)}


def metric_key(name: str) -> str:
    """metric_for_best_model as the evaluation's metrics name it: with eval_ before it, as transformers does."""
    return name if name.startswith("eval_") else f"eval_{name}"


def update_best(state, metrics: dict, metric: str, greater_is_better: bool, saves: bool) -> bool:
    """transformers' Trainer._determine_best_metric: True when metrics[metric] beats state.best_metric
    (then it is the best, and with checkpoints (`saves`) its step state.best_global_step).  A metric
    the evaluation does not have is a KeyError naming those it has."""
    key = metric_key(metric)
    if key not in metrics:
        raise KeyError(f"metric_for_best_model={metric!r}: the evaluation has no {key!r}; it has {', '.join(sorted(metrics))}")
    value = metrics[key]
    if state.best_metric is None:
        state.best_metric = -math.inf if greater_is_better else math.inf
    if not (value > state.best_metric if greater_is_better else value < state.best_metric):
        return False  # also a nan: it never beats anything
    state.best_metric = value
    if saves:
        state.best_global_step = state.global_step
    return True


def best_checkpoint(state, output_dir: Path) -> Path | None:
    """checkpoint-<best_global_step> of output_dir, if it was saved (transformers' best_model_checkpoint)."""
    if not state.best_global_step:
        return None
    path = Path(output_dir) / f"checkpoint-{state.best_global_step}"
    return path if path.is_dir() else None
